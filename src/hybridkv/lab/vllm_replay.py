"""Replay a block-hash trace through vLLM 0.33's own ``Scheduler``, on the replay's clock.

``Replay`` is a scheduler in miniature; ``VllmReplay`` runs the real one (``AsyncScheduler``
under the engine defaults) with a fake model, so chunked prefill, admission (the whole sequence
must fit under the engine defaults: ``scheduler_reserve_full_isl``), FCFS order, preemption and
async scheduling's two steps in flight are vLLM's. The manager is vLLM's own or a hybridkv
backend behind vLLM's manager API (``integrations.vllm.install``). The contract is
``Replay``'s: the same trace, the same ``ReplayConfig`` (limits, cost model, clock) and a
``ReplayResult`` whose every field means what it means there.

How each figure is read from vLLM:

* first-admission hits and re-admission hits: vLLM's ``PrefixCacheStats``
  (``make_prefix_cache_stats`` wrapped): ``requests/queries/hits`` and ``preempted_*`` apart;
  ``prompt_tokens`` is the first admissions' queries;
* per-group hits: a request's first ``NewRequestData``, its non-null block ids (vLLM's null
  block is 0) within its ``num_computed_tokens`` in each group, × the group's block size;
* preemptions: ``SchedulerOutput.preempted_req_ids``; evictions: the block hashes of the
  ``BlockRemoved`` events (``take_events`` wrapped);
* a step's time: the cost model on the step's prefill tokens (a request whose computed tokens
  before the step are below its prompt length prefills), decoding requests and attended
  context; a token sampled by a step is stamped at the step's end (TTFT, end-to-end), a
  request's first scheduling at the step's start (queueing);
* refused: a request vLLM would wait on forever: a ``schedule()`` that schedules nothing while
  no request runs and no step is in flight (or the only running request preempted itself)
  means the head of the waiting queue cannot fit the whole pool; it is aborted and counted;
* manager time: every method call on the scheduler's manager, timed (``ManagerClock``).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from hybridkv.block_trace import (
    BlockTraceRequest,
    cover_prefix,
    covered_prefix_tokens,
)
from hybridkv.integrations.vllm.bench import ManagerClock
from hybridkv.integrations.vllm.check import RunConfig, build_scheduler
from hybridkv.lab.hit_profile import add_group_hit_tokens
from hybridkv.lab.replay import OUTPUT_TOKEN_BASE
from hybridkv.lab.replay_config import ReplayConfig
from hybridkv.lab.result import ReplayResult
from hybridkv.lab.vllm_engine import MANAGERS, VllmEngine
from hybridkv.reference import KVCacheBlocks

__all__ = ["MANAGERS", "VllmEngine", "VllmReplay"]

EOS_TOKEN_ID = 50256


@dataclass
class _Live:
    """A request in the replay: its trace line and its clock."""

    trace: BlockTraceRequest
    arrival_ms: float
    bound_tokens: int
    first_token_ms: float | None = None
    queue_ms: float | None = None
    emitted: int = 0
    sampled: int = 0


@dataclass
class _Flight:
    """A scheduled step whose model output is not processed yet."""

    output: Any
    chunks: set[str]
    end_ms: float


class VllmReplay:
    """One replay of ``trace`` through vLLM's scheduler; ``run`` returns the ``ReplayResult``."""

    def __init__(
        self,
        trace: Iterable[BlockTraceRequest],
        engine: VllmEngine,
        *,
        config: ReplayConfig | None = None,
    ) -> None:
        self.trace = iter(trace)
        self.engine = engine
        self.config = ReplayConfig() if config is None else config
        if self.config.full_prompt_admission != engine.reserves_full_sequence:
            raise ValueError(
                "ReplayConfig.full_prompt_admission must be the engine's "
                f"({engine.reserves_full_sequence}: vLLM's scheduler_reserve_full_isl), got "
                f"{self.config.full_prompt_admission}"
            )
        groups = engine.layout.config.groups
        self.group_block_sizes = tuple(group.spec.block_size for group in groups)
        self.block_size = engine.layout.block_size
        self.result = ReplayResult(group_hit_tokens=[0] * len(groups))
        self.now_ms = 0.0
        self.live: dict[str, _Live] = {}
        self.in_flight: deque[_Flight] = deque()
        self._next: BlockTraceRequest | None = None
        self._covered: dict[int, int] = {}
        """The arrived prompts, for the infinite-cache bound."""
        self._idle_empty = 0
        """``schedule()`` calls in a row that scheduled nothing with no step in flight."""
        self._preempted: set[str] = set()
        """Requests preempted and not yet scheduled again (counted without prefix caching)."""
        self._scheduled: dict[int, int] = {}
        """How far the prompts' scheduled tokens reach into each trace block (``Replay``'s)."""
        self.scheduler = self._build()
        self.clock = ManagerClock(self.scheduler.kv_cache_manager)

    # --- Set-up -----------------------------------------------------------------------------

    def _build(self) -> Any:
        """vLLM's scheduler with the engine's manager, its events and statistics counted."""
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request, RequestStatus

        self._vllm = (SamplingParams, Request, ModelRunnerOutput, RequestStatus)
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        engine, config = self.engine, self.config
        cfg = RunConfig(
            run="async" if engine.is_async else "sync",
            defaults=engine.defaults,
            retention=engine.retention,
            full_prompt_admission=engine.full_prompt_admission,
            prefix_caching=engine.prefix_caching,
            num_blocks=engine.num_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            model=engine.layout,
        )
        scheduler = build_scheduler(
            cfg,
            engine.manager,
            eviction_policy=None if engine.manager == "vllm" else engine.eviction_policy,
            device=engine.device,
            policy="fcfs",
        )
        self._count_from(scheduler.kv_cache_manager)
        return scheduler

    def _count_from(self, kv: Any) -> None:
        """Wrap the manager's ``take_events`` and ``make_prefix_cache_stats`` (the scheduler
        calls both each processed step) to count evictions and the admissions' hits."""
        from vllm.distributed.kv_events import BlockRemoved

        take_events, make_stats = kv.take_events, kv.make_prefix_cache_stats

        def counted_events() -> list[Any]:
            events = list(take_events())
            for event in events:
                if isinstance(event, BlockRemoved):
                    self.result.evictions += len(event.block_hashes)
            return events

        def counted_stats() -> Any:
            stats = make_stats()
            if stats is not None:
                result = self.result
                result.prompt_tokens += stats.queries
                result.hit_tokens += stats.hits
                result.readmissions += stats.preempted_requests
                result.readmission_prompt_tokens += stats.preempted_queries
                result.readmission_hit_tokens += stats.preempted_hits
            return stats

        kv.take_events, kv.make_prefix_cache_stats = counted_events, counted_stats

    # --- The run ----------------------------------------------------------------------------

    def run(self, on_step: Callable[[ReplayResult], None] | None = None) -> ReplayResult:
        """Step until the trace is exhausted and every request has finished or been refused."""
        start = time.perf_counter()
        self._next = next(self.trace, None)
        while True:
            self._arrive()
            if not (self.in_flight or self.scheduler.has_unfinished_requests()):
                if self._next is None:
                    break
                self.now_ms = max(self.now_ms, self._arrival_ms(self._next))
                continue
            self._step()
            if on_step is not None:
                on_step(self.result)
        kv = self.scheduler.kv_cache_manager
        kv.take_events()  # what the last processed step left
        kv.make_prefix_cache_stats()
        self.result.simulated_ms = self.now_ms
        self.result.wall_seconds = time.perf_counter() - start
        self.result.manager_seconds = self.clock.seconds
        return self.result

    def _arrival_ms(self, trace: BlockTraceRequest) -> float:
        return trace.timestamp_ms * self.config.time_scale

    def _arrive(self) -> None:
        """Requests whose arrival time has come are added (too long ones are skipped)."""
        SamplingParams, Request, _, _ = self._vllm
        while self._next is not None and self._arrival_ms(self._next) <= self.now_ms:
            trace = self._next
            self._next = next(self.trace, None)
            bound = self.result.count_arrival(
                trace, self._covered, self.block_size, self.config.max_model_len
            )
            if bound is None:
                continue
            params = SamplingParams(max_tokens=max(1, trace.output_length), ignore_eos=True)
            params.update_from_generation_config({}, EOS_TOKEN_ID)
            request_id = f"r{trace.index}"
            arrival = self._arrival_ms(trace)
            self.live[request_id] = _Live(trace, arrival, bound)
            self.scheduler.add_request(
                Request(
                    request_id=request_id,
                    prompt_token_ids=trace.prompt_tokens(),
                    sampling_params=params,
                    pooling_params=None,
                    arrival_time=arrival / 1e3,
                    block_hasher=self._hasher,
                )
            )

    # --- One step ---------------------------------------------------------------------------

    def _step(self) -> None:
        """``schedule()``; the step's time; its model output processed when it leaves the
        pipeline (at once without async scheduling)."""
        was_idle = not self.in_flight
        output = self.scheduler.schedule()
        self.result.preemptions += len(output.preempted_req_ids or ())
        self._preempted.update(output.preempted_req_ids or ())
        if not output.num_scheduled_tokens:
            stuck = not self.scheduler.running and (was_idle or bool(output.preempted_req_ids))
            self.in_flight.append(_Flight(output, set(), self.now_ms))
            while self.in_flight:
                self._process(self.in_flight.popleft())
            if stuck:
                self._refuse_head()
            self._idle_empty = self._idle_empty + 1 if was_idle and not stuck else 0
            if self._idle_empty > 2:
                raise RuntimeError("vLLM's scheduler makes no progress with requests running")
            return
        self._idle_empty = 0
        requests = self.scheduler.requests
        chunks = {r for r in output.num_scheduled_tokens if requests[r].is_prefill_chunk}
        self.result.steps += 1
        start_ms = self.now_ms
        prefill, decode, context = self._work(output)
        self.now_ms += self.config.cost_model.step_ms(prefill, decode, context)
        self._count_scheduled(output, start_ms)
        self.in_flight.append(_Flight(output, chunks, self.now_ms))
        while len(self.in_flight) >= self.engine.depth:
            self._process(self.in_flight.popleft())

    def _starts(self, output: Any) -> list[tuple[str, int]]:
        """Each scheduled request and its computed tokens before the step, running requests
        first (vLLM schedules them first), then the newly admitted ones."""
        cached = output.scheduled_cached_reqs
        starts = list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        starts += [(new.req_id, new.num_computed_tokens) for new in output.scheduled_new_reqs]
        return starts

    def _work(self, output: Any) -> tuple[int, int, int]:
        """Prefill tokens, decoding requests and attended context tokens of the step."""
        prefill = decode = 0
        context = 0.0
        for request_id, start in self._starts(output):
            num_new = output.num_scheduled_tokens[request_id]
            if start < self.live[request_id].trace.input_length:
                prefill += num_new
            else:
                decode += 1
            context += self.config.attended(start + num_new)
        return prefill, decode, int(context)

    def _count_scheduled(self, output: Any, start_ms: float) -> None:
        """Computed tokens; first admissions' queueing, group hits and in-flight bound; the
        prompt tokens scheduled become hittable by later admissions."""
        self.result.computed_tokens += output.total_num_scheduled_tokens
        first = {new.req_id: new for new in output.scheduled_new_reqs}
        for request_id, start in self._starts(output):
            live = self.live[request_id]
            new = first.get(request_id)
            if not self.engine.prefix_caching:
                self._count_uncached_admission(request_id, live, new is not None)
            if new is not None and live.queue_ms is None:
                live.queue_ms = start_ms - live.arrival_ms
                reachable = covered_prefix_tokens(live.trace, self._scheduled, self.block_size)
                self.result.in_flight_bound_tokens += max(0, live.bound_tokens - reachable)
                self._count_group_hits(new.block_ids, new.num_computed_tokens)
            if start < live.trace.input_length:
                end = start + output.num_scheduled_tokens[request_id]
                cover_prefix(live.trace, self._scheduled, self.block_size, end, start)

    def _count_uncached_admission(self, request_id: str, live: _Live, new: bool) -> None:
        """Without prefix caching vLLM keeps no ``PrefixCacheStats``: a first admission's
        prompt and a re-admission after preemption are counted here, as the built-in loop
        counts them (with no hits)."""
        if new and live.queue_ms is None:
            self.result.prompt_tokens += live.trace.input_length
        elif request_id in self._preempted:
            self._preempted.discard(request_id)
            self.result.readmissions += 1
            self.result.readmission_prompt_tokens += self.scheduler.requests[request_id].num_tokens

    def _count_group_hits(self, block_ids: tuple[list[int], ...], num_computed: int) -> None:
        """The hit's blocks of each group: those within the computed tokens."""
        hit = tuple(
            tuple(ids[: num_computed // size])
            for ids, size in zip(block_ids, self.group_block_sizes, strict=False)
        )
        add_group_hit_tokens(
            self.result.group_hit_tokens, KVCacheBlocks(hit), self.group_block_sizes
        )

    # --- The model's output -----------------------------------------------------------------

    def _process(self, flight: _Flight) -> None:
        """The fake model's output of a step: one token per request that is not mid-prefill;
        the engine's outputs stamp first tokens and finishes at the step's end."""
        _, _, ModelRunnerOutput, _ = self._vllm
        output = flight.output
        req_ids = list(output.num_scheduled_tokens)
        sampled = [self._sample(r) if r not in flight.chunks else [] for r in req_ids]
        runner = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            logprobs=None,
            prompt_logprobs_dict={},
            pooler_output=[],
        )
        engine_outputs = self.scheduler.update_from_output(output, runner)
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                live = self.live.get(out.request_id)
                if live is None:
                    continue
                if out.new_token_ids:
                    if live.first_token_ms is None:
                        live.first_token_ms = flight.end_ms
                    live.emitted += len(out.new_token_ids)
                if out.finish_reason is not None:
                    self._finish(out.request_id, flight.end_ms)

    def _sample(self, request_id: str) -> list[int]:
        """The next output token: never a trace token nor another request's (``Replay``'s)."""
        live = self.live.get(request_id)
        if live is None or request_id not in self.scheduler.requests:
            return []
        live.sampled += 1
        return [OUTPUT_TOKEN_BASE + (live.trace.index << 20) + live.sampled]

    def _finish(self, request_id: str, end_ms: float) -> None:
        live = self.live.pop(request_id)
        assert live.first_token_ms is not None
        assert live.queue_ms is not None
        self.result.finished += 1
        self.result.output_tokens += live.emitted
        self.result.ttft_ms.append(live.first_token_ms - live.arrival_ms)
        self.result.e2e_ms.append(end_ms - live.arrival_ms)
        self.result.queue_ms.append(live.queue_ms)

    def _refuse_head(self) -> None:
        """The waiting request vLLM cannot fit into the whole pool is aborted, and counted."""
        _, _, _, RequestStatus = self._vllm
        scheduler = self.scheduler
        queue = scheduler.kv_holding_waiting or scheduler.waiting
        if not queue:
            raise RuntimeError("vLLM scheduled nothing, and no request waits or runs")
        request_id = queue.peek_request().request_id
        scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self.live.pop(request_id, None)
        self.result.refused += 1
