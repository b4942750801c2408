"""Implementations driven call by call in lockstep, and the script that replays a run.

``Lockstep`` holds one adapter per implementation (the first is the model) and offers the
scheduler calls by request id: each call goes to every implementation, the results are compared
with the model's, and a difference raises ``ConformanceError`` with the values side by side.
``check()`` compares every observable (block tables, pool snapshot, free blocks, usage, events,
statistics) and runs the invariant checkers.

Every call is also written down as a line of Python (``script``). The differential machine
drives its implementations through a ``Lockstep``, so when it finds a difference the shortest
failing example's ``script`` is a program a person can paste: ``repro`` prints it with the
layout and the backends, and running it stops at the same call with the same values::

    from hybridkv.conformance.lockstep import Lockstep
    m = Lockstep.build(Layout(...), ["reference", "my_module:make_adapter"])
    m.new_request('r0', [7, 7, 1, 2], None)
    hit_r0 = m.lookup('r0')
    m.allocate('r0', 4, hit_r0, 0, False)
    m.check()
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hybridkv.conformance.adapters import (
    MODEL_REFUSED,
    Backend,
    BlockIds,
    Lookup,
    ManagerAdapter,
    PlanFacts,
    batch_allocator,
    batch_freer,
    load_backend,
    optimized_backend,
    planner,
    reference_backend,
)
from hybridkv.conformance.invariants import (
    ConformanceError,
    check_failed_allocation,
    check_observable_invariants,
    require,
)
from hybridkv.conformance.path_tally import PathTally
from hybridkv.conformance.strategies import Layout
from hybridkv.spec import KVCacheSpec


class Counting(Protocol):
    """Where a ``Lockstep`` counts its work (the machine's ``RunStats``)."""

    comparisons: int
    invariant_checks: int
    batched_calls: Counter[str]
    """Per implementation: the batched calls it served through its own ``allocate_batch`` or
    ``free_batch``."""
    fast_paths: dict[str, Counter[str]]
    """Per implementation that counts them (``fast_paths``): how often each path ran, and
    ``path_tally.QUIET_EXIT``: single ``allocate`` calls that changed no count."""


class _Counts:
    def __init__(self) -> None:
        self.comparisons = 0
        self.invariant_checks = 0
        self.batched_calls: Counter[str] = Counter()
        self.fast_paths: dict[str, Counter[str]] = {}


def backend_by_name(name: str) -> Backend:
    """A backend by the name a run reports it under: ``"reference"`` (or its stand-in
    ``"reference-again"``), ``"optimized"`` or ``"optimized[DEVICE]"``, or
    ``"MODULE:FACTORY"`` (an outside adapter)."""
    if name in ("reference", "reference-again"):
        return reference_backend()
    if name == "optimized" or (name.startswith("optimized[") and name.endswith("]")):
        device = name.removeprefix("optimized").strip("[]") or "cpu"
        backend = optimized_backend(device)
        if backend is None:
            raise ValueError(f"backend {name}: hybridkv.optimized.TorchKVCacheManager is missing")
        return backend
    return load_backend(name)


class Lockstep:
    """``impls`` driven together on ``layout``; the first is the model."""

    def __init__(
        self, layout: Layout, impls: Sequence[ManagerAdapter], counts: Counting | None = None
    ) -> None:
        self.layout = layout
        self.impls = list(impls)
        self.counts: Counting = _Counts() if counts is None else counts
        self.paths = PathTally(self.impls, self.counts.fast_paths)
        self.handles: dict[str, list[Any]] = {}
        """Request id → each implementation's own request object."""
        self.computed: dict[str, int] = {}
        self.script: list[str] = []
        """The calls so far, as Python lines against a ``Lockstep`` named ``m``."""

    @classmethod
    def build(cls, layout: Layout, backends: Sequence[str | Backend]) -> Lockstep:
        """A ``Lockstep`` over backends named as ``backend_by_name`` takes them (or given)."""
        chosen = [backend_by_name(b) if isinstance(b, str) else b for b in backends]
        impls = [
            factory(
                layout.config(),
                layout.max_model_len,
                layout.enable_caching,
                layout.enable_events,
                layout.engine,
            )
            for _, factory in chosen
        ]
        return cls(layout, impls)

    # --- Comparing ----------------------------------------------------------------------------

    def agree(self, what: str, values: Sequence[object]) -> None:
        """Every implementation's value equals the model's (``None`` means not shown)."""
        self.counts.comparisons += 1
        model = values[0]
        for impl, value in zip(self.impls[1:], values[1:], strict=True):
            if value is not None and model is not None and value != model:
                raise ConformanceError(
                    f"{what}: {impl.name} differs from {self.impls[0].name}:\n"
                    f"  {self.impls[0].name}: {model!r}\n  {impl.name}: {value!r}"
                )

    def _record(self, line: str) -> None:
        self.script.append(line)

    def _each(self, rid: str) -> list[tuple[ManagerAdapter, Any]]:
        return list(zip(self.impls, self.handles[rid], strict=True))

    def tables(self, impl: ManagerAdapter) -> dict[str, BlockIds]:
        return {rid: impl.block_table(rid) for rid in sorted(self.handles)}

    # --- Scheduler calls ----------------------------------------------------------------------

    def new_request(self, rid: str, prompt: Sequence[int], salt: str | None) -> None:
        self._record(f"m.new_request({rid!r}, {list(prompt)!r}, {salt!r})")
        self.handles[rid] = [impl.new_request(rid, prompt, salt) for impl in self.impls]
        self.computed[rid] = 0

    def append_tokens(self, rid: str, tokens: Sequence[int]) -> None:
        self._record(f"m.append_tokens({rid!r}, {list(tokens)!r})")
        for impl, handle in self._each(rid):
            impl.append_tokens(handle, tokens)

    def set_num_computed_tokens(self, rid: str, value: int) -> None:
        self._record(f"m.set_num_computed_tokens({rid!r}, {value})")
        self.computed[rid] = value
        for impl, handle in self._each(rid):
            impl.set_num_computed_tokens(handle, value)

    def set_shared_prefix_boundary(self, rid: str, found: Sequence[Lookup]) -> None:
        """The scheduler stores each implementation's boundary on its request."""
        self._record(f"m.set_shared_prefix_boundary({rid!r}, hit_{rid})")
        for (impl, handle), result in zip(self._each(rid), found, strict=True):
            impl.set_shared_prefix_boundary(handle, result.shared_prefix_boundary)

    def lookup(self, rid: str) -> list[Lookup]:
        """``get_computed_blocks``: the hit (block ids, tokens, shared-prefix boundary)."""
        self._record(f"hit_{rid} = m.lookup({rid!r})")
        paths = self.paths.read()
        found = [impl.lookup(handle) for impl, handle in self._each(rid)]
        self.paths.add(paths)
        self.agree(
            f"get_computed_blocks({rid})",
            [(f.block_ids, f.num_hit_tokens, f.shared_prefix_boundary) for f in found],
        )
        return found

    def allocate(
        self,
        rid: str,
        n: int,
        hits: Sequence[Lookup] | None,
        lookahead: int,
        delay: bool,
        full: bool = False,
    ) -> list[BlockIds | None]:
        """``allocate_slots`` (with the lookup's hit or none); a failure (``None``) must change
        nothing but window releases."""
        hit_arg = "None" if hits is None else f"hit_{rid}"
        self._record(f"m.allocate({rid!r}, {n}, {hit_arg}, {lookahead}, {delay}, {full})")
        before = [(impl.snapshot(), self.tables(impl)) for impl in self.impls]
        paths = self.paths.read()
        results = [
            impl.allocate(
                handle,
                n,
                None if hits is None else hits[i],
                lookahead,
                delay,
                # Only when set: an adapter written before full-prompt admission still works.
                **({"full_sequence_must_fit": True} if full else {}),
            )
            for i, (impl, handle) in enumerate(self._each(rid))
        ]
        self.paths.add(paths, single_allocate=True)
        self.agree(f"allocate_slots({rid}, {n}, lookahead={lookahead}, full={full})", results)
        if results[0] is None:
            for impl, (snap, tables) in zip(self.impls, before, strict=True):
                after = impl.snapshot()
                if snap is not None and after is not None:
                    check_failed_allocation(
                        self.layout, rid, snap, after, tables, self.tables(impl)
                    )
                    self.counts.invariant_checks += 1
        return results

    def allocate_batch(
        self, rids: Sequence[str], counts: Sequence[int], lookahead: int, delay: bool
    ) -> list[BlockIds | None]:
        """One scheduler step of running requests: ``allocate_batch`` where an implementation
        offers it, else ``allocate`` per request in order; the model's results per request."""
        self._record(f"m.allocate_batch({list(rids)!r}, {list(counts)!r}, {lookahead}, {delay})")
        paths = self.paths.read()
        results = []
        for index, impl in enumerate(self.impls):
            handles = [self.handles[rid][index] for rid in rids]
            batched = batch_allocator(impl)
            if batched is None:
                out = [
                    impl.allocate(handle, n, None, lookahead, delay)
                    for handle, n in zip(handles, counts, strict=True)
                ]
            else:
                out = list(batched.allocate_batch(handles, counts, lookahead, delay))
                self.counts.batched_calls[impl.name] += 1
            results.append(tuple(out))
        self.paths.add(paths)
        self.agree(
            f"allocate_batch({list(rids)}, {list(counts)}, lookahead={lookahead}, delay={delay})",
            results,
        )
        return list(results[0])

    def free(self, rid: str) -> None:
        self._record(f"m.free({rid!r})")
        for impl, handle in self._each(rid):
            impl.free(handle)

    def free_batch(self, rids: Sequence[str]) -> None:
        """``free_batch`` where offered, else ``free`` one by one (a request may repeat)."""
        self._record(f"m.free_batch({list(rids)!r})")
        paths = self.paths.read()
        for index, impl in enumerate(self.impls):
            handles = [self.handles[rid][index] for rid in rids]
            batched = batch_freer(impl)
            if batched is None:
                for handle in handles:
                    impl.free(handle)
            else:
                batched.free_batch(handles)
                self.counts.batched_calls[impl.name] += 1
        self.paths.add(paths)

    def forget(self, rid: str) -> None:
        """The request left the scheduler (finished or aborted after its ``free``)."""
        self._record(f"m.forget({rid!r})")
        del self.handles[rid]
        del self.computed[rid]

    def cache_blocks(self, rid: str, upto: int) -> None:
        self._record(f"m.cache_blocks({rid!r}, {upto})")
        paths = self.paths.read()
        for impl, handle in self._each(rid):
            impl.cache_blocks(handle, upto)
        self.paths.add(paths)

    def new_step(self) -> None:
        self._record("m.new_step()")
        for impl in self.impls:
            impl.new_step()

    def reset_prefix_cache(self) -> None:
        self._record("m.reset_prefix_cache()")
        self.agree("reset_prefix_cache()", [impl.reset_prefix_cache() for impl in self.impls])

    @property
    def plans(self) -> bool:
        """Whether the model and at least one other implementation plan (``Planning``): only
        then is there a plan to compare."""
        planners = [planner(impl) is not None for impl in self.impls]
        return planners[0] and sum(planners) >= 2

    def plan_model(
        self,
        layers: Mapping[str, KVCacheSpec],
        memory: int,
        max_model_len: int,
        kv_sharing: Mapping[str, str],
    ) -> PlanFacts | str | None:
        """The model planned by every implementation that plans (``Planning``), compared
        (``MODEL_REFUSED`` for a refusal); ``None`` unless ``plans``."""
        if not self.plans:
            return None
        planners = [planner(impl) for impl in self.impls]
        self._record(
            f"m.plan_model({dict(layers)!r}, {memory}, {max_model_len}, {dict(kv_sharing)!r})"
        )
        plans: list[PlanFacts | str | None] = []
        for plan in planners:
            if plan is None:
                plans.append(None)
                continue
            try:
                plans.append(plan.plan_model(layers, memory, max_model_len, kv_sharing))
            except ValueError:
                plans.append(MODEL_REFUSED)
        self.agree(
            f"plan_model({len(layers)} layers, {memory} bytes, kv_sharing={dict(kv_sharing)})",
            plans,
        )
        return plans[0]

    # --- Checks -------------------------------------------------------------------------------

    def check_drained(self, reset: bool) -> None:
        """With every request freed nothing may stay in use, and (``reset``) a prefix-cache
        reset must succeed and leave no key."""
        self._record(f"m.check_drained({reset})")
        for impl in self.impls:
            require(impl.usage() == 0.0, f"{impl.name}: usage {impl.usage()} after freeing all")
            free = impl.num_free_blocks()
            require(free == self.layout.num_blocks - 1, f"{impl.name}: {free} free after draining")
            if not reset:
                continue
            require(impl.reset_prefix_cache(), f"{impl.name}: reset refused with nothing in use")
            snap = impl.snapshot()
            if snap is not None:
                require(snap.num_cached_keys == 0, f"{impl.name}: cache keys survive a reset")
            self.counts.invariant_checks += 1

    def check(self) -> tuple[tuple[object, ...], ...] | None:
        """Every observable compared, every invariant checked; returns the model's events."""
        self._record("m.check()")
        snaps = [impl.snapshot() for impl in self.impls]
        tables = [self.tables(impl) for impl in self.impls]
        self.agree("block tables", tables)
        self.agree("pool snapshot", snaps)
        self.agree("num_free_blocks", [impl.num_free_blocks() for impl in self.impls])
        self.agree("usage", [impl.usage() for impl in self.impls])
        events = [impl.take_events() for impl in self.impls]
        self.agree("events", events)
        self.agree("prefix cache stats", [impl.take_stats() for impl in self.impls])
        for impl, snap, table in zip(self.impls, snaps, tables, strict=True):
            if snap is not None:
                check_observable_invariants(
                    self.layout, snap, impl.num_free_blocks(), impl.usage(), table, self.computed
                )
            impl.check_invariants()
            self.counts.invariant_checks += 2
        return events[0]


def repro(layout: Layout, backends: Sequence[str], script: Sequence[str]) -> str:
    """The program that replays ``script`` on ``backends`` (names ``backend_by_name`` takes):
    paste it into Python; it raises at the call that differs, with the values side by side."""
    names = ", ".join(repr(b) for b in backends)
    return "\n".join(
        [
            "from hybridkv.conformance.adapters import EngineOptions",
            "from hybridkv.conformance.lockstep import Lockstep",
            "from hybridkv.conformance.strategies import Layout",
            "from hybridkv.spec import (",
            "    ChunkedLocalAttentionSpec,",
            "    FullAttentionSpec,",
            "    MambaSpec,",
            "    SlidingWindowSpec,",
            ")",
            "",
            f"m = Lockstep.build({layout!r}, [{names}])",
            *script,
        ]
    )
