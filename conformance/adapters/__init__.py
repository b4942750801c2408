"""How an implementation joins the conformance suite: a small adapter protocol, and backends.

The golden replay (``golden``), the stateful differential machine
(``hybridkv.conformance.stateful``) and the adapter hit oracle never call a manager directly;
they call a ``ManagerAdapter``, which speaks plain values (block ids as tuples of ints,
hit lengths, snapshots as tuples), so managers of other engines, or mutated copies of the
reference, compare equal whenever they behave the same. ``hybridkv.reference.KVCacheManager``
and ``hybridkv.optimized.TorchKVCacheManager`` already have the scheduler API of
``KVCacheManagerLike``; ``ProtocolAdapter`` wraps either.

Plugging in another implementation
----------------------------------
``python -m hybridkv.conformance --adapter my_module:make_adapter`` runs the whole suite (golden
traces, differential machine, longest-hit oracle) on an ``AdapterFactory`` (``load_backend``);
the README's "Check your own implementation" documents every value's format.

Write a class with the methods of ``ManagerAdapter`` (most are one line), and a factory
``(config, max_model_len, enable_caching, enable_kv_cache_events, engine) -> adapter``, where
``engine`` is an ``EngineOptions`` (the engine's keywords: ``max_in_flight_tokens``,
``use_eagle``, ``num_hash_lookahead_tokens``) that the implementation must honour; requests are
hashed at ``hash_block_size_of(config, enable_caching)`` with ``engine``'s lookahead. From
Python, each part alone::

    from hybridkv.conformance.adapters import reference_backend
    from hybridkv.conformance.golden import check_trace
    from hybridkv.conformance.machine import run_differential

    result = check_trace("gen_s101_0000", my_factory)  # TraceResult: pass, fail or skipped
    stats = run_differential([reference_backend(), ("mine", my_factory)], max_examples=200)

``run_differential`` raises on the first difference and prints the shortest sequence of
scheduler calls that shows it. ``ProtocolAdapter`` is the example adapter, used on the reference
itself. An adapter may return ``None`` from ``snapshot``, ``take_events`` or ``take_stats`` when
its implementation cannot show them: those observables are then not compared for it.

Batched calls (optional)
------------------------
An adapter whose implementation serves a whole scheduler step at once may also have
``allocate_batch(requests, num_new_tokens, num_lookahead_tokens, delay_cache_blocks)`` (running
requests, no new hits; one count per request; the new blocks or ``None`` per request, in order)
and ``free_batch(requests)`` (``BatchAllocating``, ``BatchFreeing``). The machine then drives
them as a scheduler does; their results must equal the single calls made one by one in order
(the model's adapter, ``ProtocolAdapter``, makes them by looping where its manager has no batched
calls). An adapter without them is driven through ``allocate`` and ``free`` one by one.

An implementation that does not implement a drawn layout or engine setting yet raises, from its
factory, a ``ValueError`` whose message contains ``NOT_IMPLEMENTED`` ("does not implement"): the
machine then skips that example for that backend only (the run summary counts the skips), and
the golden replay counts the trace as skipped, by name (also when an operation raises it).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hybridkv.conformance.protocol import KVCacheManagerLike
from hybridkv.reference.request import Request
from hybridkv.spec import KVCacheConfig, KVCacheSpec, rules

BlockIds = tuple[tuple[int, ...], ...]
"""Block ids per KV cache group, positions in order (null positions hold block 0)."""


NOT_IMPLEMENTED = "does not implement"
"""The words of a ``ValueError`` that refuses a feature an implementation lacks (by name)."""


@dataclass(frozen=True)
class EngineOptions:
    """An engine's keywords of ``KVCacheManager`` (vLLM's names; see its docstring).

    ``max_in_flight_tokens`` sizes a window's reservation in a full-prompt admission;
    ``use_eagle`` drops the last block of a hit; ``num_hash_lookahead_tokens`` hashes each block
    with the tokens after it (requests are built with the same value).
    """

    max_in_flight_tokens: int | None = None
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0

    def kwargs(self) -> dict[str, Any]:
        """The keywords that differ from the defaults, for a manager's constructor."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default
        }


@dataclass(frozen=True)
class Lookup:
    """A lookup's result: what every implementation must agree on, plus the adapter's own
    opaque value to hand back to ``allocate`` (``new_computed_blocks`` of the scheduler API)."""

    block_ids: BlockIds
    num_hit_tokens: int
    handle: Any
    shared_prefix_boundary: int = 0


@dataclass(frozen=True)
class Snapshot:
    """The pool's observable state as plain values (``PoolSnapshot``, whatever its class)."""

    free_block_ids: tuple[int, ...]
    ref_counts: tuple[tuple[int, int], ...]
    cached_block_ids: tuple[tuple[int, ...], ...]
    num_cached_keys: int


class ManagerAdapter(Protocol):
    """What the differential machine needs from an implementation under test.

    Two methods are optional capabilities, not part of this protocol (an adapter may leave
    them out; ``batch_allocator`` and ``batch_freer`` find them): ``allocate_batch`` of
    ``BatchAllocating`` and ``free_batch`` of ``BatchFreeing``, an implementation's whole-step
    calls. When present, the differential machine calls them for a scheduler step of several
    running requests and for a batch of frees, and compares their results with the model's
    (the same calls made one by one, in order).
    """

    name: str

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
    ) -> Any:
        """A request object this implementation accepts (hashed at the pool's block size).

        ``skip_reading_prefix_cache``: the request never reads the prefix cache (its lookups
        hit nothing) but still caches what it computes; some golden traces set it, and pass the
        keyword only then."""
        ...

    def append_tokens(self, request: Any, tokens: Sequence[int]) -> None: ...

    def set_num_computed_tokens(self, request: Any, num_computed_tokens: int) -> None: ...

    def set_shared_prefix_boundary(self, request: Any, boundary: int) -> None:
        """The scheduler stores a lookup's third result on the request."""
        ...

    def lookup(self, request: Any) -> Lookup: ...

    def new_step(self) -> None:
        """``new_step_starts()``: the scheduler begins a step."""
        ...

    def allocate(
        self,
        request: Any,
        num_new_tokens: int,
        hit: Lookup | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        *,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None: ...

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None: ...

    def free(self, request: Any) -> None: ...

    def block_table(self, request_id: str) -> BlockIds: ...

    def reset_prefix_cache(self) -> bool: ...

    def num_free_blocks(self) -> int: ...

    def usage(self) -> float: ...

    def snapshot(self) -> Snapshot | None: ...

    def take_events(self) -> tuple[tuple[object, ...], ...] | None: ...

    def take_stats(self) -> tuple[int, int, int, bool] | None: ...

    def check_invariants(self) -> None: ...


class BatchAllocating(Protocol):
    """The optional whole-step allocation of an adapter."""

    def allocate_batch(
        self,
        requests: Sequence[Any],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> Sequence[BlockIds | None]:
        """One step of running requests (each listed once, no new cache hits): exactly
        ``[allocate(r, n, None, num_lookahead_tokens, delay_cache_blocks) for r, n in
        zip(requests, num_new_tokens)]``, one result per request (its new blocks, or ``None``
        when the pool could not hold them; later requests still get theirs if they fit)."""
        ...


class BatchFreeing(Protocol):
    """The optional batched free of an adapter."""

    def free_batch(self, requests: Sequence[Any]) -> None:
        """Exactly ``for r in requests: free(r)`` (a request listed twice, or holding
        nothing, is freed once or not at all, as the single calls do)."""
        ...


@dataclass(frozen=True)
class PlanFacts:
    """What a planner decided for a model, as plain values every planner can state.

    ``groups``: one entry per KV cache group, in the plan's order: the group's spec (after
    Case 4's page unification) and the names of the layers it allocates memory for (KV-sharing
    layers excluded: they read another layer's memory, Case 5). ``num_padding_slots``: group
    slots, over all groups, that hold no layer (Case 3's padding)."""

    num_blocks: int
    block_size: int
    page_size_bytes: int
    groups: tuple[tuple[KVCacheSpec, tuple[str, ...]], ...]
    num_padding_slots: int


MODEL_REFUSED = "refused"
"""What ``plan_model`` stands for when a planner refuses a model (raises ``ValueError``)."""


class Planning(Protocol):
    """The optional planner of an adapter: layers → KV cache groups → memory → blocks."""

    def plan_model(
        self,
        layers: Mapping[str, KVCacheSpec],
        available_memory: int,
        max_model_len: int,
        kv_sharing: Mapping[str, str],
    ) -> PlanFacts:
        """The plan for ``layers`` (name → spec) in ``available_memory`` bytes per device,
        with ``kv_sharing`` (layer → the layer whose memory it reads); raises ``ValueError`` for
        a model it refuses (the machine then expects every planner to refuse it)."""
        ...


def batch_allocator(adapter: object) -> BatchAllocating | None:
    """The adapter itself if it offers ``allocate_batch``, else ``None``."""
    return adapter if callable(getattr(adapter, "allocate_batch", None)) else None  # type: ignore[return-value]


def batch_freer(adapter: object) -> BatchFreeing | None:
    """The adapter itself if it offers ``free_batch``, else ``None``."""
    return adapter if callable(getattr(adapter, "free_batch", None)) else None  # type: ignore[return-value]


def planner(adapter: object) -> Planning | None:
    """The adapter itself if it offers ``plan_model``, else ``None``."""
    return adapter if callable(getattr(adapter, "plan_model", None)) else None  # type: ignore[return-value]


AdapterFactory = Callable[[KVCacheConfig, int, bool, bool, EngineOptions], ManagerAdapter]
"""Builds an adapter from (config, max_model_len, enable_caching, enable_kv_cache_events,
engine options)."""

Backend = tuple[str, AdapterFactory]
"""A name for reports, and the factory."""


def _as_ids(blocks: Any) -> BlockIds:
    return tuple(tuple(ids) for ids in blocks.get_block_ids())


def _plain_event(event: object) -> tuple[object, ...]:
    """A core event as the protocol's tuple (the README's "Events"), the shape every adapter
    gives (the vLLM adapter's too): ``("BlockStored", block_hashes, parent_block_hash,
    token_ids, block_size, group_idx)``, ``("BlockRemoved", block_hashes, group_idx)``,
    ``("AllBlocksCleared",)``. The core's other fields (vLLM's schema: medium, extra keys, spec
    kind, session, lookahead tokens) are left out, so adapters of managers without them compare
    equal; the backends' tests compare them whole. Anything else: (class name, fields…).

    Events are told apart by class name, so a patched copy of the reference (its own event
    classes) projects the same way."""
    kind = type(event).__name__
    if kind == "BlockStored":
        stored: Any = event
        return (
            kind,
            stored.block_hashes,
            stored.parent_block_hash,
            stored.token_ids,
            stored.block_size,
            stored.group_idx,
        )
    if kind == "BlockRemoved":
        removed: Any = event
        return (kind, removed.block_hashes, removed.group_idx)
    if dataclasses.is_dataclass(event) and not isinstance(event, type):
        return (type(event).__name__, *dataclasses.astuple(event))
    return (type(event).__name__, repr(event))


class ProtocolAdapter:
    """The example adapter: any manager with the scheduler API of ``KVCacheManagerLike``.

    Requests are ``hybridkv.reference.Request`` objects, one per implementation, so nothing is
    shared between the implementations under test by accident.
    """

    def __init__(
        self,
        name: str,
        manager: KVCacheManagerLike,
        block_size: int,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self.name = name
        self.manager = manager
        self.block_size = block_size
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens

    def new_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        cache_salt: str | None,
        *,
        skip_reading_prefix_cache: bool = False,
    ) -> Request:
        return Request(
            request_id,
            prompt,
            hash_block_size=self.block_size,
            cache_salt=cache_salt,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
        )

    def append_tokens(self, request: Request, tokens: Sequence[int]) -> None:
        request.append_output_token_ids(tokens)

    def set_num_computed_tokens(self, request: Request, num_computed_tokens: int) -> None:
        request.num_computed_tokens = num_computed_tokens

    def set_shared_prefix_boundary(self, request: Request, boundary: int) -> None:
        request.shared_prefix_boundary = boundary

    def lookup(self, request: Request) -> Lookup:
        blocks, num_hit_tokens, boundary = self.manager.get_computed_blocks(request)
        # Each lookup counts as an admission (as the vLLM adapter counts it): the statistics
        # then compare every lookup the machine makes.
        self.manager.record_prefix_cache_stats(request, num_hit_tokens)
        return Lookup(_as_ids(blocks), num_hit_tokens, blocks, boundary)

    def new_step(self) -> None:
        self.manager.new_step_starts()

    def allocate(
        self,
        request: Request,
        num_new_tokens: int,
        hit: Lookup | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        *,
        full_sequence_must_fit: bool = False,
    ) -> BlockIds | None:
        new = self.manager.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens=0 if hit is None else hit.num_hit_tokens,
            new_computed_blocks=None if hit is None else hit.handle,
            num_lookahead_tokens=num_lookahead_tokens,
            delay_cache_blocks=delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
        )
        return None if new is None else _as_ids(new)

    def allocate_batch(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> list[BlockIds | None]:
        """The manager's ``allocate_slots_batch`` when it has one, else ``allocate_slots`` per
        request in order."""
        batched = getattr(self.manager, "allocate_slots_batch", None)
        results: Sequence[Any]
        if batched is not None:
            results = batched(
                list(requests), list(num_new_tokens), num_lookahead_tokens, delay_cache_blocks
            )
        else:
            results = [
                self.manager.allocate_slots(
                    request,
                    count,
                    num_lookahead_tokens=num_lookahead_tokens,
                    delay_cache_blocks=delay_cache_blocks,
                )
                for request, count in zip(requests, num_new_tokens, strict=True)
            ]
        return [None if new is None else _as_ids(new) for new in results]

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        self.manager.cache_blocks(request, num_computed_tokens)

    def free(self, request: Request) -> None:
        self.manager.free(request)

    def free_batch(self, requests: Sequence[Request]) -> None:
        """The manager's ``free_batch`` when it has one, else ``free`` per request in order."""
        batched = getattr(self.manager, "free_batch", None)
        if batched is not None:
            batched(list(requests))
            return
        for request in requests:
            self.manager.free(request)

    def block_table(self, request_id: str) -> BlockIds:
        return tuple(tuple(ids) for ids in self.manager.get_block_ids(request_id))

    def reset_prefix_cache(self) -> bool:
        return self.manager.reset_prefix_cache()

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def usage(self) -> float:
        return self.manager.usage

    def snapshot(self) -> Snapshot:
        snap = self.manager.snapshot()
        return Snapshot(
            tuple(snap.free_block_ids),
            tuple(sorted(snap.ref_counts.items())),
            tuple(tuple(ids) for ids in snap.cached_block_ids),
            snap.num_cached_keys,
        )

    def take_events(self) -> tuple[tuple[object, ...], ...]:
        return tuple(_plain_event(event) for event in self.manager.take_events())

    def take_stats(self) -> tuple[int, int, int, bool] | None:
        stats = self.manager.make_prefix_cache_stats()
        if stats is None:
            return None
        return (stats.requests, stats.queries, stats.hits, stats.reset)

    def check_invariants(self) -> None:
        self.manager.check_invariants()


class PlanningAdapter(ProtocolAdapter):
    """``ProtocolAdapter`` with a planner: ``plan_report`` of ``hybridkv.reference`` (or of a
    patched copy), stated as ``PlanFacts``."""

    def __init__(
        self,
        name: str,
        manager: KVCacheManagerLike,
        block_size: int,
        num_hash_lookahead_tokens: int,
        plan_report: Callable[..., Any],
    ) -> None:
        super().__init__(name, manager, block_size, num_hash_lookahead_tokens)
        self.plan_report = plan_report

    def plan_model(
        self,
        layers: Mapping[str, KVCacheSpec],
        available_memory: int,
        max_model_len: int,
        kv_sharing: Mapping[str, str],
    ) -> PlanFacts:
        report = self.plan_report(
            dict(layers),
            available_memory,
            max_model_len=max_model_len,
            max_num_batched_tokens=512,
            kv_sharing=dict(kv_sharing),
        )
        shared = set(kv_sharing)
        return PlanFacts(
            num_blocks=report.num_blocks,
            block_size=report.block_size,
            page_size_bytes=report.page_size_bytes,
            groups=tuple(
                (group.spec, tuple(n for n in group.layer_names if n not in shared))
                for group in report.config.groups
            ),
            num_padding_slots=report.num_padding_slots,
        )


def block_size_of(config: KVCacheConfig) -> int:
    """The first group's block size (every group's, when they share one)."""
    return config.groups[0].spec.block_size


def hash_block_size_of(config: KVCacheConfig, enable_caching: bool = True) -> int:
    """The hash block size a manager resolves by default (requests are hashed at it): one
    group's block size; else the gcd of the block sizes, or their lcm with caching off or a
    Mamba group in ``"none"`` mode."""
    sizes = [group.spec.block_size for group in config.groups]
    if len(sizes) == 1:
        return sizes[0]
    lcm_hashing = not enable_caching or any(g.spec.lcm_hashing for g in config.groups)
    return rules.hash_block_size(sizes, lcm_hashing=lcm_hashing)


def manager_backend(
    name: str,
    manager_class: Callable[..., KVCacheManagerLike],
    *,
    configure: Callable[[Any, KVCacheConfig], None] | None = None,
    plan_report: Callable[..., Any] | None = None,
    **kw: Any,
) -> Backend:
    """A backend for any class constructed like ``KVCacheManager(config, max_model_len,
    enable_caching=..., enable_kv_cache_events=..., **engine_keywords, **kw)``; ``configure``
    adjusts each new manager for its layout; with ``plan_report`` (the reference's, or a
    patched copy's) its adapters also plan models (``Planning``)."""

    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ManagerAdapter:
        manager = manager_class(
            config,
            max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=events,
            **engine.kwargs(),
            **kw,
        )
        if configure is not None:
            configure(manager, config)
        block_size = hash_block_size_of(config, enable_caching)
        if plan_report is not None:
            return PlanningAdapter(
                name, manager, block_size, engine.num_hash_lookahead_tokens, plan_report
            )
        return ProtocolAdapter(name, manager, block_size, engine.num_hash_lookahead_tokens)

    return name, factory


def reference_backend() -> Backend:
    """``hybridkv.reference.KVCacheManager``: the model every other backend is compared with
    (its planner too, ``plan_report``)."""
    from hybridkv.reference import KVCacheManager, plan_report

    return manager_backend("reference", KVCacheManager, plan_report=plan_report)


def reference_stand_in() -> Backend:
    """An independent second reference: it stands in for a backend that refuses a layout."""
    from hybridkv.reference import KVCacheManager

    return manager_backend("reference-again", KVCacheManager)


SMALL_THRESHOLDS = {"batch_min": 2, "busy_batch_min": 2, "vector_min": 1}
"""The optimized backend's size thresholds on half the layouts (an odd pool): every batch of two
requests or more, and every lookup, takes the vectorised path. Each is a manager attribute that
starts at its constant in ``hybridkv.optimized.thresholds``; the constants stay as they are."""


def optimized_backend(
    device: str = "cpu", max_num_reqs: int = 32, manager_class: Any = None
) -> Backend | None:
    """``hybridkv.optimized.TorchKVCacheManager`` (or ``manager_class``, a patched copy) when it
    (and torch) can be imported.

    Its batched calls take the vectorised paths only from ``batch_min`` requests (16) with
    ``busy_batch_min`` (64) needing work, and its lookups from ``vector_min`` probes: more
    than the differential machine's few live requests. So on layouts with an odd ``num_blocks``
    the thresholds are ``SMALL_THRESHOLDS`` (the vectorised paths), on the others the
    production ones (the single-request paths below them)."""
    if manager_class is None:
        try:
            module = importlib.import_module("hybridkv.optimized")
        except ImportError:
            return None
        manager_class = getattr(module, "TorchKVCacheManager", None)
        if manager_class is None:
            return None

    def small_thresholds_on_odd_pools(manager: Any, config: KVCacheConfig) -> None:
        if config.num_blocks % 2:
            for attribute, value in SMALL_THRESHOLDS.items():
                setattr(manager, attribute, value)

    return manager_backend(
        f"optimized[{device}]",
        manager_class,
        configure=small_thresholds_on_odd_pools,
        device=device,
        max_num_reqs=max_num_reqs,
    )


def backends_named(choice: str, device: str = "cpu") -> list[Backend]:
    """``reference``, ``optimized`` or ``both`` (the reference first: it is the model).

    A lone ``optimized`` is still compared with the reference. ``ValueError`` if the optimized
    backend was asked for and cannot be imported.
    """
    if choice not in ("reference", "optimized", "both"):
        raise ValueError(f"backend must be reference, optimized or both, got {choice!r}")
    chosen = [reference_backend()]
    if choice != "reference":
        optimized = optimized_backend(device)
        if optimized is None:
            raise ValueError("backend optimized: hybridkv.optimized.TorchKVCacheManager is missing")
        chosen.append(optimized)
    return chosen


class AdapterLoadError(ValueError):
    """``--adapter MODULE:FACTORY`` names nothing usable (the message is one line)."""


def load_backend(spec: str) -> Backend:
    """The backend ``MODULE:FACTORY`` names: ``FACTORY`` an ``AdapterFactory`` (called as
    ``factory(config, max_model_len, enable_caching, enable_kv_cache_events, engine)``) in the
    importable module ``MODULE`` (dots allowed in both; the current directory is searched too,
    as ``python -m`` does, also under the ``hybridkv`` script). The backend's name is ``spec``.

    ``AdapterLoadError`` with a one-line message when ``spec`` is not ``MODULE:FACTORY``, the
    module does not import, or the attribute is missing or not callable.
    """
    module_name, colon, attribute = spec.partition(":")
    if not colon or not module_name or not attribute or ":" in attribute:
        raise AdapterLoadError(
            f"--adapter must be MODULE:FACTORY (e.g. my_module:make_adapter), got {spec!r}"
        )
    # ``python -m`` puts the current directory on the path; the ``hybridkv`` script does not.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else ""
        raise AdapterLoadError(
            f"--adapter {spec!r}: module {module_name!r} does not import: "
            f"{type(error).__name__}: {reason}"
        ) from error
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise AdapterLoadError(
                f"--adapter {spec!r}: module {module_name!r} has no attribute {attribute!r}"
            )
        target = getattr(target, part)
    if not callable(target):
        raise AdapterLoadError(
            f"--adapter {spec!r}: {module_name}.{attribute} is not callable (got "
            f"{type(target).__name__}); it must be an AdapterFactory"
        )
    factory: AdapterFactory = target
    return spec, factory
