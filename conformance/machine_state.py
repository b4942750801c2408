"""The differential machine's scheduler bookkeeping: ``LiveRequest`` (a request as the
scheduler sees it) and ``MachineState``, the state every rule reads (the layout drawn, the
implementations in lockstep, the live requests, the finished conversations) with the questions
the rules' preconditions ask of it. ``machine_steps`` builds the scheduler's actions on it and
``machine_rules`` the rules; ``machine`` runs them."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from hybridkv.conformance.adapters import (
    MODEL_REFUSED,
    NOT_IMPLEMENTED,
    AdapterFactory,
    Backend,
    ManagerAdapter,
)
from hybridkv.conformance.lockstep import Lockstep
from hybridkv.conformance.run_stats import RunStats
from hybridkv.conformance.strategies import Layout, document_models, random_models

MAX_LIVE_REQUESTS = 8


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


class MachineState(RuleBasedStateMachine):
    """What the scheduler knows, shared by its steps and rules; the rules live in
    ``machine_rules.DifferentialMachine`` (subclass that via ``machine.machine_for``)."""

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

    # --- Questions and bookkeeping ------------------------------------------------------------

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

    def _pick_where(self, data: st.DataObject, prefilling: bool) -> LiveRequest:
        candidates = sorted(
            rid
            for rid, req in self.live.items()
            if req.running and (req.computed < len(req.tokens)) == prefilling
        )
        return self.live[data.draw(st.sampled_from(candidates))]

    def _prefilling(self) -> bool:
        return any(r.running and r.computed < len(r.tokens) for r in self.live.values())

    def _decoding(self) -> bool:
        return any(r.running and r.computed >= len(r.tokens) for r in self.live.values())

    def _new_request(self, prompt: Sequence[int], salt: str | None) -> None:
        rid = f"r{self.counter}"
        self.counter += 1
        self.ms.new_request(rid, prompt, salt)
        self.live[rid] = LiveRequest(rid, list(prompt), salt)

    def _append(self, req: LiveRequest, tokens: list[int]) -> None:
        req.tokens.extend(tokens)
        self.ms.append_tokens(req.rid, tokens)

    def _forget(self, req: LiveRequest) -> None:
        """The request leaves the scheduler (after its blocks were freed)."""
        del self.live[req.rid]
        self.ms.forget(req.rid)

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
