"""The differential machine's rules: ``DifferentialMachine``, a Hypothesis
``RuleBasedStateMachine`` (see ``hybridkv.conformance.stateful`` for what it draws and
compares) whose rules are a scheduler's moves, each with the precondition under which a
scheduler makes it, and the invariant checked after every one. ``machine.machine_for``
subclasses it over chosen backends; ``machine.run_differential`` runs it."""

from __future__ import annotations

import random

from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from hybridkv.conformance.lockstep import Lockstep
from hybridkv.conformance.machine_steps import USUAL, SchedulerSteps
from hybridkv.conformance.strategies import SYSTEM_PROMPTS, layouts


class DifferentialMachine(SchedulerSteps):
    """Drives ``backends`` in lockstep; the first is the model. Subclass via ``machine_for``."""

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

    # --- Rules --------------------------------------------------------------------------------

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
