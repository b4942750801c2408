"""The differential machine: a scheduler driving implementations in lockstep (see
``hybridkv.conformance.stateful`` for what it draws and compares), ``RunStats`` (what a run
covered), ``machine_for`` and ``run_differential``.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

from hybridkv.conformance.adapters import (
    MODEL_REFUSED,
    NOT_IMPLEMENTED,
    AdapterFactory,
    Backend,
    Lookup,
    ManagerAdapter,
    reference_stand_in,
)
from hybridkv.conformance.lockstep import Lockstep, repro
from hybridkv.conformance.strategies import (
    FAMILIES,
    SYSTEM_PROMPTS,
    Layout,
    document_models,
    layouts,
    random_models,
)

MAX_LIVE_REQUESTS = 8
USUAL = 3
"""The deployment's usual system prompt (``SYSTEM_PROMPTS[USUAL]``, 26 tokens: a block or more
at every block size drawn, the lcm of mixed ones included)."""


# --- What a run covered ----------------------------------------------------------------------


@dataclass
class RunStats:
    """Counts for the report: what the machine did and checked."""

    examples: int = 0
    steps: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    invariant_checks: int = 0
    comparisons: int = 0
    type_mixes: Counter[str] = field(default_factory=Counter)
    group_counts: Counter[int] = field(default_factory=Counter)
    allocations: int = 0
    failed_allocations: int = 0
    hits: int = 0
    lookups: int = 0
    cached_lookups: int = 0
    """Lookups with prefix caching on (the others cannot hit)."""
    evictions: int = 0
    caching_off: int = 0
    backends: tuple[str, ...] = ()
    features: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    stand_ins: int = 0
    shared_prefix_boundaries: int = 0
    full_prompt_admissions: int = 0
    full_prompt_refusals: int = 0
    speculative_steps: int = 0
    accepted_drafts: int = 0
    batch_steps: int = 0
    """Scheduler steps of several running requests (``allocate_batch`` where offered)."""
    batch_requests: int = 0
    batch_frees: int = 0
    last_run: tuple[Layout, list[str], list[str]] | None = None
    """The layout, the calls (``Lockstep.script``) and the backends' names of the latest
    example: after a failure, the shortest failing one."""
    plans: int = 0
    """Models planned by every implementation that plans (``Planning``) and compared."""
    plans_refused: int = 0
    batched_calls: Counter[str] = field(default_factory=Counter)
    """Per backend: the batched calls it served through its own ``allocate_batch`` or
    ``free_batch`` (a backend without them is driven one request at a time)."""

    WORK_RULES: ClassVar[tuple[str, ...]] = (
        "warm_up",
        "admit",
        "admit_whole_prompt",
        "prefill",
        "decode",
        "speculative_decode",
        "step_batch",
        "step_all",
    )
    """The rules that schedule tokens: an admission's first prefill chunk (the set-up's warm-up
    admits a whole prompt), later chunks, decode steps (one request, several, or every running
    one)."""

    @staticmethod
    def _percent(part: int, whole: int) -> str:
        return f"{100 * part / whole:.0f}%" if whole else "n/a"

    def shares(self) -> dict[str, float]:
        """The traffic's shares, in percent: lookups with a hit, steps that prefill or decode,
        allocations that returned ``None``."""

        def share(part: int, whole: int) -> float:
            return 100 * part / whole if whole else 0.0

        work = sum(self.rules[name] for name in self.WORK_RULES)
        return {
            "hits": share(self.hits, self.cached_lookups),
            "prefill_decode": share(work, self.steps),
            "failed_allocations": share(self.failed_allocations, self.allocations),
        }

    def lines(self) -> list[str]:
        mixes = ", ".join(f"{mix} ×{n}" for mix, n in sorted(self.type_mixes.items()))
        groups = ", ".join(f"{k} groups ×{n}" for k, n in sorted(self.group_counts.items()))
        rule_counts = ", ".join(f"{name} {n}" for name, n in sorted(self.rules.items()))
        features = ", ".join(f"{name} ×{n}" for name, n in sorted(self.features.items()))
        skipped = ", ".join(f"{name} {self.skipped[name]}" for name in self.backends) or "none"
        work = sum(self.rules[name] for name in self.WORK_RULES)
        batched = ", ".join(f"{n} {self.batched_calls[n]}" for n in self.backends) or "none"
        return [
            f"  backends: {' vs '.join(self.backends)}",
            f"  examples {self.examples}, steps {self.steps} "
            f"(operations on each backend: {sum(self.rules.values())})",
            f"  rules: {rule_counts}",
            f"  lookups {self.lookups} ({self.hits} with a hit), allocations {self.allocations} "
            f"({self.failed_allocations} returned None), cache evictions {self.evictions}",
            f"  shares: {self._percent(self.hits, self.cached_lookups)} of lookups with caching "
            f"on hit ({self.cached_lookups}), "
            f"{self._percent(work, self.steps)} of steps prefill or decode, "
            f"{self._percent(self.failed_allocations, self.allocations)} of allocations fail",
            f"  batched: {self.batch_steps} steps of several requests ({self.batch_requests} "
            f"requests), {self.batch_frees} batches of frees; served by the backends' own "
            f"batched calls: {batched}",
            f"  observables compared {self.comparisons}, invariant checks {self.invariant_checks}",
            f"  models planned and compared {self.plans} ({self.plans_refused} refused by "
            "every planner)",
            f"  layouts: {groups}; caching off in {self.caching_off}",
            f"  type mixes: {mixes}",
            f"  engine features (layouts): {features or 'none'}",
            f"  shared-prefix boundaries stored {self.shared_prefix_boundaries}, full-prompt "
            f"admissions {self.full_prompt_admissions} ({self.full_prompt_refusals} returned "
            f"None), speculative decode steps {self.speculative_steps} "
            f"({self.accepted_drafts} accepted drafts)",
            f"  skipped examples (layout not implemented): {skipped}"
            + (f"; reference-again stood in {self.stand_ins}×" if self.stand_ins else ""),
        ]


# --- The machine -----------------------------------------------------------------------------


@dataclass
class LiveRequest:
    """A request as the scheduler sees it, with each implementation's own request object."""

    rid: str
    tokens: list[int]
    salt: str | None
    computed: int = 0
    running: bool = False
    delayed: bool = False
    drafts: int = 0
    """Draft tokens the last speculative decode step scheduled (0: none pending)."""
    looked: bool = False
    """Looked up since it last became waiting (a scheduler looks again when it admits)."""


class DifferentialMachine(RuleBasedStateMachine):
    """Drives ``backends`` in lockstep; the first is the model. Subclass via ``machine_for``."""

    backends: ClassVar[Sequence[Backend]] = ()
    stats: ClassVar[RunStats] = RunStats()
    family: ClassVar[str] = "hybrid"
    roomy: ClassVar[bool] = False
    big: ClassVar[bool] = False
    stand_in: ClassVar[Backend | None] = None

    def __init__(self) -> None:
        super().__init__()
        self.layout: Layout | None = None
        self.impls: list[ManagerAdapter] = []
        self.backend_names: list[str] = []
        """The backend each implementation came from (a stand-in by its own name)."""
        self.m: Lockstep | None = None
        """The implementations in lockstep; its ``script`` is this example's calls."""
        self.live: dict[str, LiveRequest] = {}
        self.history: list[tuple[tuple[int, ...], str | None]] = []
        """Finished conversations (tokens and cache salt): follow-ups continue them."""
        self.since_reset = 0
        self.counter = 0
        self.last_rule = ""
        self.allocated_in_step = False
        self.blocked = False
        """An admission failed for want of blocks: a scheduler admits no more until blocks
        are released (a request finishes or is preempted)."""

    # --- Set-up -------------------------------------------------------------------------------

    @initialize(data=st.data())
    def set_up(self, data: st.DataObject) -> None:
        """The layout, and one to three waiting requests (a scheduler rarely starts empty)."""
        layout = data.draw(layouts(self.family, roomy=self.roomy, big=self.big), label="layout")
        self.layout = layout
        self.impls = self._build(layout)
        self.m = Lockstep(layout, self.impls, self.stats)
        self.stats.last_run = (layout, self.m.script, self.backend_names)
        stats = self.stats
        stats.examples += 1
        stats.features.update(layout.features())
        stats.type_mixes["+".join(sorted(set(layout.kinds)))] += 1
        stats.group_counts[len(layout.specs)] += 1
        stats.caching_off += not layout.enable_caching
        self._compare_plans(data)
        if layout.enable_caching and data.draw(st.integers(0, 3)):
            self._warm_up(data)
        for _ in range(data.draw(st.integers(1, 3))):
            self.add_request(data)

    def _warm_up(self, data: st.DataObject) -> None:
        """A server that has run a while: one request with the usual system prompt was
        computed whole and finished (admitted without reading the cache), so its blocks are
        cached when the first lookups come."""
        question = data.draw(st.lists(st.integers(0, 50), min_size=1, max_size=8))
        prompt = [*SYSTEM_PROMPTS[USUAL], *question][: self.lay.max_model_len - 1]
        self._count("warm_up")
        self._new_request(prompt, None)
        req = self.live[f"r{self.counter - 1}"]
        # In chunks ending on Mamba "align" blocks (states cached there), then the rest.
        while req.computed < len(prompt):
            n = self._align_chunk(req, 0, len(prompt) - req.computed)
            if not self._allocate(req, n, None, 0, False):
                break
        if req.running:
            self._free(req)
            self._remember(req)
        self._forget(req)

    def _compare_plans(self, data: st.DataObject) -> None:
        """The implementations that plan (``Planning``: layers → KV cache groups → memory →
        blocks) plan one drawn model (the document's or a random one) alike: the planner
        decides the layout every manager then runs on."""
        if not self.ms.plans:
            return
        seed = data.draw(st.integers(0, 2**32 - 1), label="model seed")
        # One in eight a model of the document; else a random one (whose draw may leave no
        # layer of its own: then the document's first).
        models = document_models()
        drawn = random_models(random.Random(seed), 1) if seed % 8 else []
        layers, sharing = drawn[0] if drawn else models[seed % len(models)]
        memory = random.Random(seed).choice([10**6, 10**8, 10**9])
        plan = self.ms.plan_model(layers, memory, 4096, sharing)
        self.stats.plans += 1
        self.stats.plans_refused += plan == MODEL_REFUSED

    def _build(self, layout: Layout) -> list[ManagerAdapter]:
        """One implementation per backend. A backend that refuses the layout by name (a
        ``ValueError`` saying it does not implement it) sits this example out; the model may
        not. If fewer than two remain, the stand-in (an independent reference) joins, so the
        example is still checked differentially."""
        config = layout.config()
        impls: list[ManagerAdapter] = []
        self.backend_names = []

        def make(factory: AdapterFactory) -> ManagerAdapter:
            return factory(
                config,
                layout.max_model_len,
                layout.enable_caching,
                layout.enable_events,
                layout.engine,
            )

        for index, (name, factory) in enumerate(self.backends):
            try:
                impls.append(make(factory))
                self.backend_names.append(name)
            except ValueError as error:
                if index == 0 or NOT_IMPLEMENTED not in str(error):
                    raise
                self.stats.skipped[name] += 1
        if len(impls) < min(2, len(self.backends)) and self.stand_in is not None:
            impls.append(make(self.stand_in[1]))
            self.backend_names.append(self.stand_in[0])
            self.stats.stand_ins += 1
        return impls

    # --- Helpers ------------------------------------------------------------------------------

    @property
    def lay(self) -> Layout:
        assert self.layout is not None
        return self.layout

    @property
    def ms(self) -> Lockstep:
        assert self.m is not None
        return self.m

    def _count(self, name: str) -> None:
        self.last_rule = name
        self.since_reset += 1
        self.stats.steps += 1
        self.stats.rules[name] += 1

    def _pick(self, data: st.DataObject, running: bool) -> LiveRequest:
        candidates = sorted(r for r, req in self.live.items() if req.running == running)
        return self.live[data.draw(st.sampled_from(candidates))]

    def _has(self, running: bool) -> bool:
        return any(req.running == running for req in self.live.values())

    def _set_computed(self, req: LiveRequest, value: int) -> None:
        req.computed = value
        self.ms.set_num_computed_tokens(req.rid, value)

    def _allocate(
        self,
        req: LiveRequest,
        n: int,
        hits: list[Lookup] | None,
        lookahead: int,
        delay: bool,
        full: bool = False,
    ) -> bool:
        """``allocate_slots`` on every implementation, compared (a failure must change nothing
        but window releases). Returns whether it succeeded."""
        results = self.ms.allocate(req.rid, n, hits, lookahead, delay, full)
        self.stats.allocations += 1
        self.stats.full_prompt_admissions += full
        self.allocated_in_step = True
        if results[0] is None:
            self.stats.failed_allocations += 1
            self.stats.full_prompt_refusals += full
            return False
        hit = 0 if hits is None else hits[0].num_hit_tokens
        self._set_computed(req, min(req.computed + hit + n, len(req.tokens)))
        req.running = True
        req.delayed = req.delayed or delay
        return True

    def _lookup(self, req: LiveRequest) -> list[Lookup]:
        found = self.ms.lookup(req.rid)
        req.looked = True
        self.stats.lookups += 1
        self.stats.cached_lookups += self.lay.enable_caching
        self.stats.hits += found[0].num_hit_tokens > 0
        # The scheduler stores the boundary on the request: sparse groups cache there too.
        self.ms.set_shared_prefix_boundary(req.rid, found)
        self.stats.shared_prefix_boundaries += found[0].shared_prefix_boundary > 0
        return found

    def _free(self, req: LiveRequest) -> None:
        self.blocked = self.blocked and not req.running
        self.ms.free(req.rid)

    def _forget(self, req: LiveRequest) -> None:
        """The request leaves the scheduler (after its blocks were freed)."""
        del self.live[req.rid]
        self.ms.forget(req.rid)

    def _new_request(self, prompt: Sequence[int], salt: str | None) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        self.ms.new_request(rid, prompt, salt)
        self.live[rid] = LiveRequest(rid, list(prompt), salt)

    def _append(self, req: LiveRequest, tokens: list[int]) -> None:
        req.tokens.extend(tokens)
        self.ms.append_tokens(req.rid, tokens)

    # --- Rules --------------------------------------------------------------------------------

    def _remember(self, req: LiveRequest) -> None:
        self.history = [*self.history[-7:], (tuple(req.tokens), req.salt)]

    def _has_source(self) -> bool:
        return bool(self.history) or any(r.computed for r in self.live.values())

    def _may_admit(self) -> bool:
        """Not after a failed admission while requests run (their release makes room)."""
        return not self.blocked or not self._has(running=True)

    def _waiting(self) -> int:
        return sum(not r.running for r in self.live.values())

    def _can_add(self) -> bool:
        return len(self.live) < MAX_LIVE_REQUESTS and self._waiting() < 3

    @precondition(lambda self: self._can_add() and self._waiting() < 1)
    @rule(data=st.data())
    def add_request(self, data: st.DataObject) -> None:
        """A fresh prompt, or (mostly) a shared system prompt followed by a short question;
        once conversations exist, half the new arrivals continue one (``add_follow_up``)."""
        if self._has_source() and data.draw(st.booleans()):
            self._follow_up(data, "add_request")
            return
        limit = self.lay.max_model_len - 1
        small = data.draw(st.booleans())
        alphabet = st.integers(0, 3) if small else st.integers(0, 50)
        system: list[int] = []
        if data.draw(st.integers(0, 3)) >= 1:  # the first is the deployment's usual one
            usual = [USUAL, USUAL, USUAL]
            system = list(SYSTEM_PROMPTS[data.draw(st.sampled_from([*usual, 0, 1, 2, 4]))])
        size = data.draw(st.sampled_from([None, None, None, limit, limit - 1]))
        if self.big:  # thousands of tokens: drawn from a seed, not token by token
            length = size if size is not None and size > 0 else data.draw(st.integers(1, limit))
            rng = random.Random(data.draw(st.integers(0, 2**32 - 1)))
            prompt = [rng.randint(0, 3 if small else 50) for _ in range(length)]
        elif size is None or size < 1:
            longest = limit if not system or data.draw(st.booleans()) else min(limit, 16)
            prompt = data.draw(st.lists(alphabet, min_size=1, max_size=longest))
        else:  # as long as the model allows: lookahead slots then reach max_model_len
            prompt = data.draw(st.lists(alphabet, min_size=size, max_size=size))
        prompt = system + prompt
        # Mostly no salt (one user's traffic); a salted prompt must not hit another's cache.
        salt = data.draw(st.sampled_from([None] * 6 + ["a", "b"]))
        self._count("add_request")
        self._new_request(prompt[:limit], salt)

    @precondition(lambda self: self._can_add() and self._has_source())
    @rule(data=st.data())
    def add_follow_up(self, data: st.DataObject) -> None:
        """The next turn of an earlier conversation, the exact same prompt again, or a prompt
        sharing a prefix with a live request (what it computed is cached already)."""
        self._follow_up(data, "add_follow_up")

    def _follow_up(self, data: st.DataObject, rule_name: str) -> None:
        limit = self.lay.max_model_len - 1
        sources = [
            *self.history,
            *(
                (tuple(r.tokens[: r.computed]), r.salt)
                for _, r in sorted(self.live.items())
                if r.computed
            ),
        ]
        tokens, source_salt = data.draw(st.sampled_from(sources))
        earlier = list(tokens)
        if data.draw(st.integers(0, 3)) == 0:
            earlier = earlier[: data.draw(st.integers(1, len(earlier)))]
        turn = data.draw(st.lists(st.integers(0, 50), max_size=8))
        # The same conversation keeps its salt (a user's cache isolation); sometimes another
        # user sends the same text, whose salt must keep it from hitting.
        salt = (
            source_salt
            if data.draw(st.integers(0, 4))
            else data.draw(st.sampled_from([None, "a", "b"]))
        )
        self._count(rule_name)
        self._new_request((earlier + turn)[:limit], salt)

    @precondition(lambda self: any(not r.running and not r.looked for r in self.live.values()))
    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        """A waiting request's cache hit, before the scheduler decides on it."""
        candidates = sorted(r for r, q in self.live.items() if not q.running and not q.looked)
        req = self.live[data.draw(st.sampled_from(candidates))]
        self._count("lookup")
        self._lookup(req)

    @precondition(lambda self: self._has(running=False) and self._may_admit())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """Look up, then allocate the first chunk (with or without the hit) as a scheduler does."""
        self._admit(data, self._pick(data, running=False))

    def _admit(self, data: st.DataObject, req: LiveRequest) -> None:
        self._count("admit")
        found = self._lookup(req)
        use_hit = data.draw(st.booleans() | st.just(True))
        hit = found[0].num_hit_tokens if use_hit else 0
        budget = self._budget(data)
        n = min(len(req.tokens) - req.computed - hit, budget)
        if n <= 0:
            return
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 3]))
        delay = self.lay.enable_caching and data.draw(st.integers(0, 4)) == 0
        # An engine with full-prompt admission admits (nearly) every request that way.
        full = self.lay.full_prompt_admission and data.draw(st.integers(0, 3)) > 0
        n = self._align_chunk(req, hit, n)
        hits = found if use_hit else None
        self.blocked = not self._allocate(req, n, hits, lookahead, delay, full)

    def _budget(self, data: st.DataObject) -> int:
        """A step's token budget for one request: never more than the engine's in-flight
        budget (``max_in_flight_tokens``), which bounds what one step schedules."""
        budget = data.draw(st.integers(1, self.lay.max_model_len))
        in_flight = self.lay.engine.max_in_flight_tokens
        return budget if in_flight is None else min(budget, in_flight)

    def _align_chunk(self, req: LiveRequest, hit: int, n: int) -> int:
        """With a Mamba ``"align"`` group a scheduler ends a prefill chunk on a block boundary
        (but the prompt's last chunk), so that the state there is cached; mostly do the same."""
        block = self.lay.mamba_align_block
        start = req.computed + hit
        if block is None or start + n >= len(req.tokens):
            return n
        aligned = (start + n) // block * block - start
        return aligned if aligned > 0 else n

    def _prefilling(self) -> bool:
        return any(r.running and r.computed < len(r.tokens) for r in self.live.values())

    def _decoding(self) -> bool:
        return any(r.running and r.computed >= len(r.tokens) for r in self.live.values())

    def _pick_where(self, data: st.DataObject, prefilling: bool) -> LiveRequest:
        candidates = sorted(
            rid
            for rid, req in self.live.items()
            if req.running and (req.computed < len(req.tokens)) == prefilling
        )
        return self.live[data.draw(st.sampled_from(candidates))]

    def _continue(self, data: st.DataObject, req: LiveRequest) -> None:
        budget = self._budget(data)
        n = min(len(req.tokens) - req.computed, budget, self.lay.max_model_len - req.computed - 1)
        if n <= 0:
            return
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        if data.draw(st.integers(0, 3)):
            n = self._align_chunk(req, 0, n)
        if self._allocate(req, n, None, lookahead, False) or not data.draw(st.booleans()):
            return
        # Out of blocks: preempt the most recently admitted other request, then retry once.
        others = [r for r in self.live.values() if r.running and r is not req]
        if others:
            self._preempt(others[-1])
            self._allocate(req, n, None, lookahead, False)

    def _preempt(self, req: LiveRequest) -> None:
        self._free(req)
        self._set_computed(req, 0)
        req.running = False
        req.delayed = False
        # Drafts scheduled before the preemption are gone: the next step accepts none of them.
        req.drafts = 0
        req.looked = False

    @precondition(lambda self: self._prefilling())
    @rule(data=st.data())
    def prefill(self, data: st.DataObject) -> None:
        """A running request's next prefill chunk, within a token budget."""
        req = self._pick_where(data, prefilling=True)
        self._count("prefill")
        self._continue(data, req)

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        """Append one token (or a few, as speculative decoding does) and allocate them."""
        req = self._pick_where(data, prefilling=False)
        self._count("decode")
        req.drafts = 0
        room = self.lay.max_model_len - len(req.tokens)
        if room > 0:
            tokens = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=min(3, room)))
            self._append(req, tokens)
        self._continue(data, req)

    def _chunk_size(self, data: st.DataObject, req: LiveRequest) -> int:
        """A running request's next chunk within a token budget (0: nothing to schedule)."""
        budget = self._budget(data)
        n = min(len(req.tokens) - req.computed, budget, self.lay.max_model_len - req.computed - 1)
        if n > 0 and data.draw(st.integers(0, 3)):
            n = self._align_chunk(req, 0, n)
        return n

    @precondition(lambda self: sum(r.running for r in self.live.values()) >= 2)
    @rule(data=st.data())
    def step_batch(self, data: st.DataObject) -> None:
        """One scheduler step of several running requests at once: a decoding request gets its
        next token(s), a prefilling one its next chunk, then one ``allocate_batch`` (where an
        implementation offers it; else ``allocate`` per request, in order). The results must
        equal the model's, request by request."""
        running = sorted(rid for rid, req in self.live.items() if req.running)
        chosen = data.draw(
            st.lists(st.sampled_from(running), min_size=2, max_size=len(running), unique=True)
        )
        self._count("step_batch")
        self._step(data, chosen)

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def step_all(self, data: st.DataObject) -> None:
        """The step a scheduler takes most: every running request advances (its next prefill
        chunk or decode token), in admission order, as one batch; then, half the time, the
        same step admits a waiting request, often one that just arrived sharing what a live
        request computed (so what the running requests' step changed is read before anything
        is compared)."""
        self._count("step_all")
        self._step(data, [rid for rid, req in self.live.items() if req.running])
        if not self._may_admit() or not data.draw(st.booleans()):
            return
        if self._can_add() and self._has_source() and data.draw(st.booleans()):
            self._follow_up(data, "step_all_arrival")
        if self._has(running=False):
            self._admit(data, self._pick(data, running=False))

    def _step(self, data: st.DataObject, chosen: Sequence[str]) -> None:
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
        delay = self.lay.enable_caching and data.draw(st.integers(0, 5)) == 0
        reqs: list[LiveRequest] = []
        counts: list[int] = []
        for rid in chosen:
            req = self.live[rid]
            if req.computed >= len(req.tokens):
                req.drafts = 0
                room = self.lay.max_model_len - len(req.tokens)
                if room > 0:
                    tokens = data.draw(
                        st.lists(st.integers(0, 3), min_size=1, max_size=min(2, room))
                    )
                    self._append(req, tokens)
            n = self._chunk_size(data, req)
            if n > 0:
                reqs.append(req)
                counts.append(n)
        if not reqs:
            return
        results = self.ms.allocate_batch([req.rid for req in reqs], counts, lookahead, delay)
        self.stats.batch_steps += 1
        self.stats.batch_requests += len(reqs)
        self.stats.allocations += len(reqs)
        self.allocated_in_step = True
        for req, n, new in zip(reqs, counts, results, strict=True):
            if new is None:
                self.stats.failed_allocations += 1
                continue
            self._set_computed(req, min(req.computed + n, len(req.tokens)))
            req.delayed = req.delayed or delay

    @precondition(lambda self: sum(r.running for r in self.live.values()) >= 2)
    @rule(data=st.data())
    def finish_batch(self, data: st.DataObject) -> None:
        """Several requests finish in one step: one ``free_batch`` (where offered), sometimes
        with a waiting request (it holds nothing) or a request listed twice."""
        running = sorted(rid for rid, req in self.live.items() if req.running)
        chosen = data.draw(
            st.lists(st.sampled_from(running), min_size=2, max_size=len(running), unique=True)
        )
        waiting = sorted(rid for rid, req in self.live.items() if not req.running)
        if waiting and data.draw(st.integers(0, 3)) == 0:
            chosen.insert(data.draw(st.integers(0, len(chosen))), waiting[0])
        if data.draw(st.integers(0, 3)) == 0:
            chosen.append(chosen[0])
        self._count("finish_batch")
        self.blocked = False
        self.ms.free_batch(chosen)
        self.stats.batch_frees += 1
        for rid in dict.fromkeys(chosen):
            req = self.live[rid]
            if req.running:
                self._remember(req)
            self._forget(req)

    @precondition(lambda self: any(r.delayed and r.running for r in self.live.values()))
    @rule(data=st.data())
    def cache_delayed(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.live.items() if q.delayed)))
        req = self.live[rid]
        if not req.running:
            return
        self._count("cache_delayed")
        upto = data.draw(st.integers(0, req.computed))
        self.ms.cache_blocks(req.rid, upto)

    @precondition(lambda self: self._has(running=False) and self._may_admit())
    @rule(data=st.data())
    def admit_whole_prompt(self, data: st.DataObject) -> None:
        """Look up and admit a whole prompt at once with its hit (no chunking), as far as the
        engine's step budget (``max_in_flight_tokens``) reaches."""
        req = self._pick(data, running=False)
        self._count("admit_whole_prompt")
        found = self._lookup(req)
        n = len(req.tokens) - req.computed - found[0].num_hit_tokens
        in_flight = self.lay.engine.max_in_flight_tokens
        n = n if in_flight is None else min(n, in_flight)
        lookahead = data.draw(st.sampled_from([0, 3]))
        full = self.lay.full_prompt_admission and data.draw(st.booleans())
        if n > 0:
            self.blocked = not self._allocate(req, n, found, lookahead, False, full)

    @precondition(lambda self: self.allocated_in_step)
    @rule()
    def new_step(self) -> None:
        """``new_step_starts()``: a Mamba state cached before it may now be adopted (a step
        begins after some allocation; until then the same-step rule refuses such a hit)."""
        self._count("new_step")
        self.allocated_in_step = False
        self.ms.new_step()

    @precondition(lambda self: self._decoding())
    @rule(data=st.data())
    def speculative_decode(self, data: st.DataObject) -> None:
        """A decode step with drafts: settle the previous step (its first ``k`` drafts accepted,
        appended with the bonus token; ``num_computed_tokens += k``), then schedule the known
        token plus ``d`` drafts: ``allocate_slots(1 + d, num_lookahead_tokens=d)``."""
        req = self._pick_where(data, prefilling=False)
        self._count("speculative_decode")
        accepted = data.draw(st.integers(0, req.drafts)) if req.drafts else 0
        room = self.lay.max_model_len - 1 - len(req.tokens)
        accepted = min(accepted, room - 1)
        if accepted < 0:
            return
        tokens = data.draw(
            st.lists(st.integers(0, 3), min_size=accepted + 1, max_size=accepted + 1)
        )
        self._append(req, tokens)
        self._set_computed(req, req.computed + accepted)
        self.stats.accepted_drafts += accepted
        req.drafts = 0
        drafts = min(data.draw(st.integers(1, 3)), self.lay.max_model_len - 1 - len(req.tokens))
        if drafts < 1:
            return
        self.stats.speculative_steps += 1
        if self._allocate(req, 1 + drafts, None, drafts, False):
            req.drafts = drafts

    @precondition(lambda self: self._has(running=True))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        req = self._pick(data, running=True)
        self._count("finish")
        self._free(req)
        self._remember(req)
        self._forget(req)

    @precondition(lambda self: self._waiting() >= 3 and not self._may_admit())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """A waiting request is aborted (a client gives up while the queue is stuck): freeing
        a request that holds no blocks is a no-op."""
        req = self._pick(data, running=False)
        self._count("abort")
        self._free(req)
        self._forget(req)

    @precondition(lambda self: sum(r.running for r in self.live.values()) >= 2)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        """A running request is preempted to make room for another (its blocks freed, its
        progress lost: it waits to be admitted again)."""
        req = self._pick(data, running=True)
        self._count("preempt")
        self._preempt(req)

    @precondition(lambda self: bool(self.history) and self.since_reset >= 20)
    @rule()
    def reset_prefix_cache(self) -> None:
        """Rare in serving (a weight update, an operator's call): at most every 20 steps, so
        that the cache it empties has had time to fill."""
        self._count("reset_prefix_cache")
        self.since_reset = 0
        self.ms.reset_prefix_cache()

    @precondition(lambda self: len(self.live) >= 3)
    @rule(reset=st.sampled_from([False, False, False, True]))
    def drain(self, reset: bool) -> None:
        """Free every request: nothing may stay in use, and a prefix-cache reset must succeed
        (done when ``reset``; otherwise the cache is kept for the requests that follow)."""
        self._count("drain")
        for req in list(self.live.values()):
            self._free(req)
            if req.running:
                self._remember(req)
            self._forget(req)
        self.ms.check_drained(reset)

    # --- After every rule ---------------------------------------------------------------------

    @invariant()
    def everything_agrees(self) -> None:
        if self.layout is None:
            return
        events = self.ms.check()
        if events is not None:
            self.stats.evictions += sum(1 for e in events if e[0] == "BlockRemoved")


def machine_for(
    backends: Sequence[Backend],
    stats: RunStats,
    family: str = "hybrid",
    stand_in: Backend | None = None,
    roomy: bool = False,
    big: bool = False,
) -> type[DifferentialMachine]:
    """A ``DifferentialMachine`` over these backends and one layout family, counting into
    ``stats``; ``stand_in`` joins an example in which a backend refuses the layout by name;
    ``roomy`` draws pools of two to twelve longest requests (prefills and decodes succeed);
    ``big`` serving sizes (``layouts``: prompts of thousands of tokens, pools of hundreds of
    blocks)."""
    stats.backends = tuple(name for name, _ in backends)
    attrs = {
        "backends": tuple(backends),
        "stats": stats,
        "family": family,
        "stand_in": stand_in,
        "roomy": roomy,
        "big": big,
    }
    return type(f"DifferentialMachine_{family}", (DifferentialMachine,), attrs)


def run_differential(
    backends: Sequence[Backend],
    *,
    max_examples: int = 100,
    steps: int = 50,
    seed: int | None = None,
    stats: RunStats | None = None,
    shrink: bool = True,
    families: Sequence[str] = FAMILIES,
    hypothesis_backend: str = "hypothesis",
    stand_in: Backend | None = None,
    roomy: bool = False,
    big: bool = False,
    adapter_specs: Mapping[str, str] | None = None,
) -> RunStats:
    """Run the machine over ``backends``; raise on the first difference or broken invariant.

    ``max_examples`` is split evenly between the layout ``families``. With ``seed=None`` the run
    is derandomized (the same examples every time, as CI needs); with a seed, that seed picks
    the examples. Hypothesis shrinks a failure; the error then carries (``repro`` attribute,
    and a note) the shortest failing example as a program of scheduler calls
    (``lockstep.repro``), naming each backend as ``adapter_specs`` maps its name (an outside
    adapter's ``MODULE:FACTORY``). ``shrink=False``: raise at once, quietly, as the mutant
    hunt wants.
    ``hypothesis_backend="crosshair"`` (with the ``hypothesis-crosshair`` package) draws the
    choices symbolically: about 18× slower, an advisory extra lane, not the main one.

    A backend whose factory refuses a drawn layout by name (``adapters.NOT_IMPLEMENTED``) skips
    that example (``RunStats.skipped``); ``stand_in`` (default: an independent reference,
    ``reference-again``) then joins so that the example still compares two implementations.
    ``roomy`` draws pools large enough that most allocations succeed; ``big`` draws serving
    sizes (model lengths of 512–4,096 tokens, pools of hundreds of blocks).
    """
    stats = RunStats() if stats is None else stats
    adapter_specs = {} if adapter_specs is None else adapter_specs
    run_settings = settings(
        max_examples=max(1, max_examples // len(families)),
        stateful_step_count=steps,
        deadline=None,
        derandomize=seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])],
        report_multiple_bugs=False,
        verbosity=Verbosity.normal if shrink else Verbosity.quiet,
        backend=hypothesis_backend,
    )
    for family in families:
        machine = machine_for(
            backends,
            stats,
            family,
            reference_stand_in() if stand_in is None else stand_in,
            roomy,
            big,
        )
        # Hypothesis types this helper only in recent releases: call it through Any.
        make_test: Any = get_state_machine_test
        test: Any = make_test(machine, settings=run_settings)
        if seed is not None:
            test._hypothesis_internal_use_seed = seed
        try:
            test()
        except Exception as error:
            if stats.last_run is not None:
                layout, script, names = stats.last_run
                loadable = [adapter_specs.get(name, name) for name in names]
                text = repro(layout, loadable, script)
                error.add_note("The failing example as scheduler calls (paste into Python):")
                error.add_note(text)
                error.repro = text  # type: ignore[attr-defined]
            raise
    return stats


def run_command_machine(
    backends: Sequence[Backend],
    *,
    examples: int,
    steps: int,
    seed: int | None = None,
    stats: RunStats | None = None,
    shrink: bool = True,
    adapter_specs: Mapping[str, str] | None = None,
) -> RunStats:
    """The machine as ``python -m hybridkv.conformance`` runs it (and the kill table measures
    it): ``examples`` on small pools (allocations fail, caches evict), as many on roomy pools
    (prefills, decodes and batched steps succeed; hits stay cached), then a fourteenth of them,
    at least one per family, at serving sizes (prompts of thousands of tokens, pools of
    hundreds of blocks, the vectorised paths' sizes)."""
    stats = RunStats() if stats is None else stats
    for roomy, big in ((False, False), (True, False), (False, True)):
        run_differential(
            backends,
            max_examples=max(len(FAMILIES), examples // 14) if big else examples,
            steps=steps,
            seed=seed,
            stats=stats,
            shrink=shrink,
            roomy=roomy,
            big=big,
            adapter_specs=adapter_specs,
        )
    return stats
