"""The differential machine's scheduler actions: each one a scheduler's move (look up, allocate
a chunk, admit, continue a prefill, one batched step, preempt, free) made on every
implementation through the ``Lockstep`` and compared, with the token budgets and chunk sizes
a scheduler picks. ``SchedulerSteps`` adds them to ``MachineState``; ``machine_rules`` draws
which to take."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from hybridkv.conformance.adapters import Lookup
from hybridkv.conformance.machine_state import LiveRequest, MachineState
from hybridkv.conformance.strategies import SYSTEM_PROMPTS

USUAL = 3

"""The deployment's usual system prompt (``SYSTEM_PROMPTS[USUAL]``, 26 tokens: a block or more
at every block size drawn, the lcm of mixed ones included)."""


class SchedulerSteps(MachineState):
    """The scheduler's actions, for the rules of ``machine_rules.DifferentialMachine``."""

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

    def _chunk_size(self, data: st.DataObject, req: LiveRequest) -> int:
        """A running request's next chunk within a token budget (0: nothing to schedule)."""
        budget = self._budget(data)
        n = min(len(req.tokens) - req.computed, budget, self.lay.max_model_len - req.computed - 1)
        if n > 0 and data.draw(st.integers(0, 3)):
            n = self._align_chunk(req, 0, n)
        return n

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
