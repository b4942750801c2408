"""Replay a block-hash trace through a KV cache manager, on a clock.

The loop is vLLM v1's scheduler in miniature, on simulated time:

* a request arrives at its trace timestamp (``time_scale`` stretches or compresses them) and
  waits, first come first served;
* each step has ``max_num_batched_tokens`` tokens: running requests first, in admission order
  (a decode needs one token, an unfinished prefill its next chunk); when ``allocate_slots``
  returns ``None`` the latest-admitted running request is preempted (freed, back to the front
  of the queue, to be admitted again from its cached prefix);
* waiting requests are admitted while the budget and ``max_num_seqs`` allow and no request was
  preempted this step;
* the step lasts what the ``CostModel`` says; requests whose prompt is computed emit one output
  token per step until they have ``output_length`` of them.

What is measured is what the field reports: the prompt tokens hit at a request's *first*
admission (a re-admission after preemption hits its own earlier blocks, and is counted apart,
as vLLM's ``PrefixCacheStats`` splits preempted requests), beside the infinite-cache bound of
the same requests computed from the trace's ids in the same pass; TTFT, end-to-end latency and
queueing time per request; preemptions; tokens per second of simulated time.

A request of ``input_length + output_length > max_model_len`` is skipped at arrival and
counted, never an abort of the run.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from hybridkv.block_trace import (
    BlockTraceRequest,
    cover_prefix,
    covered_prefix_tokens,
)
from hybridkv.lab.hit_profile import EvictionLedger, add_group_hit_tokens
from hybridkv.lab.host_tier import HostTier
from hybridkv.lab.replay_config import ReplayConfig
from hybridkv.lab.result import ReplayResult
from hybridkv.reference import KVCacheBlocks, Request
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.events import BlockRemoved
from hybridkv.scheduling import Manager, mamba_aligned_chunk

_P = ParamSpec("_P")
_T = TypeVar("_T")

OUTPUT_TOKEN_BASE = 1 << 40
"""Output tokens are ``OUTPUT_TOKEN_BASE + (request index << 20) + k``: no trace token (``hash id ×
block tokens + offset``) and no other request's output is ever equal to one."""


EventSource = Callable[[], Sequence[object]]
"""The manager's ``take_events`` (built with ``enable_kv_cache_events=True``): each
``BlockRemoved`` names the cached keys (hash, group) whose blocks were reused for new tokens."""


@dataclass
class _Live:
    """A request in the replay: its trace line, its manager request and its clock."""

    trace: BlockTraceRequest
    request: Request
    arrival_ms: float
    admitted: bool = False
    first_token_ms: float | None = None
    queue_ms: float | None = None
    emitted: int = 0
    loaded_until: int = 0
    """Prompt tokens below this (past the GPU hit) come from the host tier, not prefill."""
    bound_tokens: int = 0
    """This request's share of the infinite-cache bound (earlier arrivals' prompts)."""


RequestMaker = Callable[[str, Sequence[int]], Request]


class Replay:
    """One replay of ``trace`` through ``manager``; ``run`` returns the ``ReplayResult``."""

    def __init__(
        self,
        manager: Manager,
        trace: Iterable[BlockTraceRequest],
        make_request: RequestMaker,
        *,
        block_size: int,
        config: ReplayConfig | None = None,
        mamba_block_size: int | None = None,
        group_block_sizes: Sequence[int] = (),
        events: EventSource | None = None,
        host: HostTier | None = None,
        walked_groups: Sequence[bool] = (),
    ) -> None:
        self.manager = manager
        self.trace = iter(trace)
        self.make_request = make_request
        self.block_size = block_size
        self.config = ReplayConfig() if config is None else config
        self.mamba_block_size = mamba_block_size
        self.group_block_sizes = tuple(group_block_sizes)
        self.events = events
        self.host = host
        self.result = ReplayResult(group_hit_tokens=[0] * len(self.group_block_sizes))
        walked = list(walked_groups)
        self.ledger = EvictionLedger(walked) if events and any(walked) else None
        """Which evicted keys later first admissions reached again (with ``events`` only)."""
        self.now_ms = 0.0
        self.waiting: deque[_Live] = deque()
        self.running: list[_Live] = []
        self._next: BlockTraceRequest | None = None
        self._covered: dict[int, int] = {}
        self._scheduled: dict[int, int] = {}
        """How far the prompts' scheduled tokens reach into each trace block: what any cache
        could hold at an admission (a manager caches a step's blocks when it allocates them)."""
        self._manager_seconds = 0.0

    def run(self, on_step: Callable[[ReplayResult], None] | None = None) -> ReplayResult:
        """Step until the trace is exhausted and every request has finished or been refused."""
        start = time.perf_counter()
        self._next = next(self.trace, None)
        while True:
            self._arrive()
            if not self.running and not self.waiting:
                if self._next is None:
                    break
                self.now_ms = max(self.now_ms, self._arrival_ms(self._next))
                continue
            self._step()
            if on_step is not None:
                on_step(self.result)
        self.result.simulated_ms = self.now_ms
        self.result.wall_seconds = time.perf_counter() - start
        self.result.manager_seconds = self._manager_seconds
        if self.ledger is not None:
            self.result.group_reached_again = list(self.ledger.reached_again)
        return self.result

    # --- Arrivals ---------------------------------------------------------------------------

    def _arrival_ms(self, trace: BlockTraceRequest) -> float:
        return trace.timestamp_ms * self.config.time_scale

    def _arrive(self) -> None:
        """Requests whose arrival time has come join the queue (too long ones are skipped)."""
        while self._next is not None and self._arrival_ms(self._next) <= self.now_ms:
            trace = self._next
            self._next = next(self.trace, None)
            bound = self.result.count_arrival(
                trace, self._covered, self.block_size, self.config.max_model_len
            )
            if bound is None:
                continue
            request = self.make_request(f"r{trace.index}", trace.prompt_tokens())
            self.waiting.append(_Live(trace, request, self._arrival_ms(trace), bound_tokens=bound))

    # --- One step ---------------------------------------------------------------------------

    def _step(self) -> None:
        self._call(self.manager.new_step_starts)
        scheduled = self._schedule()
        self.result.steps += 1
        prefill, decode, context, loaded = self._work(scheduled)
        self.now_ms += self.config.cost_model.step_ms(prefill, decode, context)
        host = self.host
        if host is not None and loaded:
            self.now_ms += host.load_ms(loaded)
        starts = [] if host is None else [live.request.num_computed_tokens for live, _ in scheduled]
        self._advance(scheduled)
        if self.events is not None:
            events = self._call(self.events)
            self._count_evictions(events)
            if self.ledger is not None:
                self.ledger.observe(events)
            if host is not None:
                host.observe(events, lambda: self._block_keys(host, scheduled, starts))
        if host is not None:
            for (live, num_new), start in zip(scheduled, starts, strict=True):
                if start < live.trace.input_length:
                    host.computed(live.trace, start, start + num_new)

    def _block_keys(
        self, host: HostTier, scheduled: list[tuple[_Live, int]], starts: list[int]
    ) -> dict[object, int]:
        """Block hash → the host tier's key token, for the blocks this step's requests may
        have cached: from a window before their first computed block to their last."""
        keys: dict[object, int] = {}
        size = self.block_size
        margin = host.margin_blocks()
        for (live, num_new), start in zip(scheduled, starts, strict=True):
            hashes = live.request.block_hashes
            last = min(len(hashes), (start + num_new) // size, live.trace.input_length // size)
            for j in range(max(0, start // size - margin), last):
                keys[hashes[j]] = host.key_token(live.trace, j)
        return keys

    def _count_evictions(self, events: Sequence[object]) -> None:
        """Each ``BlockRemoved`` is one cached (hash, group) key whose block new tokens took."""
        for event in events:
            if isinstance(event, BlockRemoved):
                self.result.evictions += len(event.block_hashes)

    def _schedule(self) -> list[tuple[_Live, int]]:
        """The requests that compute this step and how many tokens each computes."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[_Live, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            live = self.running[index]
            request = live.request
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk(request, request.num_computed_tokens, min(remaining, budget))
            allocated, preempted_now = self._allocate_or_preempt(live, num_new)
            preempted = preempted or preempted_now
            if not allocated:
                break
            self._cover_scheduled(live, num_new)
            scheduled.append((live, num_new))
            budget -= num_new
            index += 1
        if not preempted:
            scheduled += self._admit(budget)
        return scheduled

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        return mamba_aligned_chunk(request, start, num_new, self.mamba_block_size)

    def _allocate_or_preempt(self, live: _Live, num_new: int) -> tuple[bool, bool]:
        """Slots for a running request, preempting the latest-admitted until they fit."""
        preempted = False
        while self._call(self.manager.allocate_slots, live.request, num_new) is None:
            victim = self.running.pop()
            self._call(self.manager.free, victim.request)
            victim.request.num_computed_tokens = 0
            self.result.preemptions += 1
            preempted = True
            if victim is live and not self.running:
                self._refuse(victim)
                return False, preempted
            self.waiting.appendleft(victim)
            if victim is live:
                return False, preempted
        return True, preempted

    def _admit(self, budget: int) -> list[tuple[_Live, int]]:
        """Admit waiting requests in order while the budget, the seats and the pool allow."""
        admitted: list[tuple[_Live, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            live = self.waiting[0]
            request = live.request
            reachable = covered_prefix_tokens(live.trace, self._scheduled, self.block_size)
            reached = self._reached(live)
            blocks, num_hits, boundary = self._call(self.manager.get_computed_blocks, request)
            request.shared_prefix_boundary = boundary
            num_new = self._chunk(request, num_hits, min(request.num_tokens - num_hits, budget))
            new = self._call(
                self.manager.allocate_slots,
                request,
                num_new,
                num_hits,
                blocks,
                full_sequence_must_fit=self.config.full_prompt_admission,
            )
            if new is None:
                if self.running or admitted:
                    break
                self.waiting.popleft()  # more than the whole pool: it can never run
                self._call(self.manager.free, request)
                self._refuse(live)
                continue
            self.waiting.popleft()
            self.running.append(live)
            request.num_computed_tokens = num_hits
            self._host_hit(live, num_hits)
            if reached is not None and self.ledger is not None:
                self.ledger.count(reached)
            self._count_admission(live, num_hits, blocks, reachable)
            self._cover_scheduled(live, num_new)
            admitted.append((live, num_new))
            budget -= num_new
        return admitted

    def _reached(self, live: _Live) -> list[list[BlockHash]] | None:
        """The evicted keys ``live``'s first admission would reach (None when re-admitted or
        without events)."""
        if self.ledger is None or live.admitted:
            return None
        hashes = live.request.block_hashes
        return self.ledger.reached(hashes, live.trace.input_length // self.block_size)

    def _host_hit(self, live: _Live, num_hits: int) -> None:
        """The host tier continues the GPU hit: those tokens are loaded, not prefilled."""
        if self.host is None:
            return
        loaded = self.host.hit_tokens(live.trace, num_hits)
        live.loaded_until = num_hits + loaded
        if not live.admitted:
            self.result.host_hit_tokens += loaded

    def _cover_scheduled(self, live: _Live, num_new: int) -> None:
        """The prompt tokens this step schedules for ``live`` become hittable by later
        admissions (full manager blocks only)."""
        start = live.request.num_computed_tokens
        if start < live.trace.input_length:
            cover_prefix(live.trace, self._scheduled, self.block_size, start + num_new, start)

    def _count_admission(
        self, live: _Live, num_hits: int, blocks: KVCacheBlocks, reachable: int
    ) -> None:
        if live.admitted:
            self.result.readmissions += 1
            self.result.readmission_hit_tokens += num_hits
            self.result.readmission_prompt_tokens += live.request.num_tokens
            return
        live.admitted = True
        live.queue_ms = self.now_ms - live.arrival_ms
        self.result.prompt_tokens += live.trace.input_length
        self.result.hit_tokens += num_hits
        self.result.in_flight_bound_tokens += max(0, live.bound_tokens - reachable)
        if num_hits:
            self._count_group_hits(blocks)

    def _count_group_hits(self, blocks: KVCacheBlocks) -> None:
        add_group_hit_tokens(self.result.group_hit_tokens, blocks, self.group_block_sizes)

    def _work(self, scheduled: list[tuple[_Live, int]]) -> tuple[int, int, int, int]:
        """Prefill tokens, decoding requests, attended context tokens and tokens loaded from
        the host tier this step."""
        prefill = decode = loaded = 0
        context = 0.0
        for live, num_new in scheduled:
            request = live.request
            start = request.num_computed_tokens
            if start < request.num_prompt_tokens:
                from_host = max(0, min(start + num_new, live.loaded_until) - start)
                loaded += from_host
                prefill += num_new - from_host
            else:
                decode += 1
            context += self.config.attended(start + num_new)
        return prefill, decode, int(context), loaded

    def _advance(self, scheduled: list[tuple[_Live, int]]) -> None:
        """The "model" runs: computed tokens advance; complete requests emit their next token."""
        for live, num_new in scheduled:
            request = live.request
            request.num_computed_tokens += num_new
            self.result.computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no output yet
            if live.first_token_ms is None:
                live.first_token_ms = self.now_ms
            live.emitted += 1
            if live.emitted >= max(1, live.trace.output_length):
                self.running.remove(live)
                self._call(self.manager.free, request)
                self._finish(live)
                continue
            token = OUTPUT_TOKEN_BASE + (live.trace.index << 20) + live.emitted
            request.append_output_token_ids(token)

    def _finish(self, live: _Live) -> None:
        assert live.first_token_ms is not None
        assert live.queue_ms is not None
        self.result.finished += 1
        self.result.output_tokens += live.emitted
        self.result.ttft_ms.append(live.first_token_ms - live.arrival_ms)
        self.result.e2e_ms.append(self.now_ms - live.arrival_ms)
        self.result.queue_ms.append(live.queue_ms)

    def _refuse(self, live: _Live) -> None:
        self.result.refused += 1

    def _call(self, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """One manager call, its wall time added to the run's manager time."""
        start = time.perf_counter()
        value = call(*args, **kwargs)
        self._manager_seconds += time.perf_counter() - start
        return value
