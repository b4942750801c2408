"""A small but real scheduler loop that drives a KV cache manager with requests.

The loop is vLLM v1's in miniature, so the manager sees the calls a serving engine makes:

* each step has a budget of ``max_num_batched_tokens`` tokens;
* running requests go first, in admission order: a decode needs one token, an unfinished
  prefill its next chunk (chunked prefill); when ``allocate_slots`` returns ``None`` the
  latest-admitted running request is preempted (freed, ``num_computed_tokens = 0``, put back at
  the front of the queue) and the allocation is retried;
* waiting requests are admitted first come, first served, while budget and ``max_num_seqs``
  allow and no request was preempted this step: ``get_computed_blocks`` finds the cached prefix,
  ``allocate_slots`` adopts it and takes blocks for the first chunk;
* a request whose tokens are all computed produces its next output token; one that has all its
  output tokens is finished and freed.

Workloads are synthetic (``make_workload``, from ``hybridkv.workloads``) or read from a JSONL
trace (``load_trace``, from ``hybridkv.workload_trace``); this module re-exports both. Both are
seeded, so the same seed gives the same requests and the same numbers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

from hybridkv.reference import Request
from hybridkv.scheduling import Manager, mamba_aligned_chunk
from hybridkv.workload_trace import Trace, TraceError, load_trace
from hybridkv.workloads import WORKLOADS, RequestSpec, make_workload

_P = ParamSpec("_P")
_T = TypeVar("_T")

__all__ = [
    "WORKLOADS",
    "RequestSpec",
    "Scheduler",
    "SchedulerConfig",
    "SimulationResult",
    "Trace",
    "TraceError",
    "load_trace",
    "make_workload",
]


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits: tokens per step, running requests, longest request."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    max_model_len: int = 16384
    full_prompt_admission: bool = False
    """Admit a request only if its whole sequence fits (``full_sequence_must_fit``), as a vLLM
    0.33 engine does; off: only the first chunk must fit, as vLLM's unit tests admit."""


@dataclass
class SimulationResult:
    """What a run measured. Everything but the ``manager_*`` times is a function of the seed."""

    num_requests: int
    num_finished: int = 0
    num_rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    first_prompt_tokens: int = 0
    """Prompt tokens of each request at its first admission only (a preempted request admitted
    again counts in ``prompt_tokens`` once more, not here)."""
    first_hit_tokens: int = 0
    computed_tokens: int = 0
    usage_per_step: list[float] = field(default_factory=list)
    hit_rate_per_step: list[float] = field(default_factory=list)
    manager_seconds_per_step: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache at admission / prompt tokens admitted."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache at each request's first admission / those
        requests' prompt tokens (re-admissions after a preemption left out)."""
        if not self.first_prompt_tokens:
            return 0.0
        return self.first_hit_tokens / self.first_prompt_tokens

    @property
    def peak_usage(self) -> float:
        return max(self.usage_per_step, default=0.0)

    @property
    def mean_usage(self) -> float:
        steps = self.usage_per_step
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def manager_seconds(self) -> float:
        return sum(self.manager_seconds_per_step)

    def summary(self, *, timing: bool = True) -> dict[str, Any]:
        """The numbers as a flat dict with stable keys (``timing=False``: deterministic only)."""
        numbers: dict[str, Any] = {
            "requests": self.num_requests,
            "finished": self.num_finished,
            "rejected": self.num_rejected,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "computed_tokens": self.computed_tokens,
            "saved_tokens": self.hit_tokens,
            "peak_usage": round(self.peak_usage, 6),
            "mean_usage": round(self.mean_usage, 6),
        }
        if timing:
            per_step = self.manager_seconds / self.steps if self.steps else 0.0
            numbers["manager_seconds"] = round(self.manager_seconds, 6)
            numbers["manager_ms_per_step"] = round(per_step * 1e3, 6)
        return numbers


class Scheduler:
    """FCFS admission, chunked prefill, decode, preemption and freeing around one manager."""

    def __init__(
        self,
        manager: Manager,
        requests: Sequence[RequestSpec],
        *,
        block_size: int,
        config: SchedulerConfig,
        mamba_block_size: int | None = None,
    ) -> None:
        self.manager = manager
        self.config = config
        self.block_size = block_size
        # With a Mamba "align" group a state is cached only where a chunk ends on its block
        # boundary, so prefill chunks end there (as an engine's scheduler ends them).
        self.mamba_block_size = mamba_block_size
        self.specs = {spec.request_id: spec for spec in requests}
        self.pending = list(requests)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_at: dict[str, int] = {}
        self.admitted_once: set[str] = set()
        self.result = SimulationResult(num_requests=len(requests))
        self.step = 0
        self._clock = 0.0

    @property
    def done(self) -> bool:
        return len(self.finished_at) == len(self.specs)

    def run(self, on_step: Callable[[SimulationResult], None] | None = None) -> SimulationResult:
        """Step until every request has finished (or was rejected as too large for the pool)."""
        while not self.done:
            self._arrive()
            if not self.running and not self.waiting:
                self.step = self._next_arrival_step()
                continue
            self._clock = 0.0
            self._timed(self.manager.new_step_starts)
            scheduled = self._schedule()
            self._advance(scheduled)
            self._record()
            if on_step is not None:
                on_step(self.result)
        return self.result

    # --- One step ---------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        """The requests that compute this step and how many tokens each computes."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(
                request,
                request.num_computed_tokens,
                min(request.num_tokens - request.num_computed_tokens, budget),
            )
            allocated, preempted_now = self._allocate_or_preempt(request, num_new)
            preempted = preempted or preempted_now
            if not allocated:
                break
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        if not preempted:
            scheduled += self._admit(budget)
        return scheduled

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        return mamba_aligned_chunk(request, start, num_new, self.mamba_block_size)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[bool, bool]:
        """Slots for a running request, preempting the latest-admitted ones until they fit.

        Returns (allocated, preempted any). A request that must preempt itself while it runs
        alone can never fit in this pool: it is rejected rather than retried forever.
        """
        preempted = False
        while self._timed(self.manager.allocate_slots, request, num_new) is None:
            victim = self.running.pop()
            self._timed(self.manager.free, victim)
            victim.num_computed_tokens = 0
            self.result.preemptions += 1
            preempted = True
            if victim is request:
                if not self.running:
                    self._finish(victim, rejected=True)
                else:
                    self.waiting.appendleft(victim)
                return False, preempted
            self.waiting.appendleft(victim)
        return True, preempted

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests in order while the budget, the seat limit and the pool allow."""
        admitted: list[tuple[Request, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            blocks, num_hits, boundary = self._timed(self.manager.get_computed_blocks, request)
            request.shared_prefix_boundary = boundary
            num_new = self._chunk(request, num_hits, min(request.num_tokens - num_hits, budget))
            new_blocks = self._timed(
                self.manager.allocate_slots,
                request,
                num_new,
                num_hits,
                blocks,
                full_sequence_must_fit=self.config.full_prompt_admission,
            )
            if new_blocks is None:
                if self.running or admitted:
                    break
                self.waiting.popleft()  # it needs more than the whole pool: it can never run
                self._timed(self.manager.free, request)
                self._finish(request, rejected=True)
                continue
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_hits
            self.result.prompt_tokens += request.num_tokens
            self.result.hit_tokens += num_hits
            if request.request_id not in self.admitted_once:
                self.admitted_once.add(request.request_id)
                self.result.first_prompt_tokens += request.num_tokens
                self.result.first_hit_tokens += num_hits
            admitted.append((request, num_new))
            budget -= num_new
        return admitted

    def _advance(self, scheduled: list[tuple[Request, int]]) -> None:
        """The "model" runs: computed tokens advance; complete requests emit their next token."""
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            self.result.computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no output yet
            spec = self.specs[request.request_id]
            emitted = request.num_tokens - len(spec.prompt_token_ids)
            request.append_output_token_ids(spec.output_token_ids[emitted])
            if emitted + 1 == len(spec.output_token_ids):
                self.running.remove(request)
                self._timed(self.manager.free, request)
                self._finish(request, rejected=False)

    def _record(self) -> None:
        """Per-step series: usage, cumulative hit rate, manager time."""
        self.result.steps += 1
        self.result.usage_per_step.append(self.manager.usage)
        self.result.hit_rate_per_step.append(self.result.hit_rate)
        self.result.manager_seconds_per_step.append(self._clock)
        self.step += 1

    # --- Arrivals and bookkeeping -----------------------------------------------------------

    def _arrive(self) -> None:
        """Move the requests that have arrived by this step to the waiting queue, in order."""
        still_pending = []
        for spec in self.pending:
            arrival = self._arrival_step(spec)
            if arrival is not None and arrival <= self.step:
                request = Request(
                    spec.request_id, spec.prompt_token_ids, hash_block_size=self.block_size
                )
                self.waiting.append(request)
            else:
                still_pending.append(spec)
        self.pending = still_pending

    def _arrival_step(self, spec: RequestSpec) -> int | None:
        """When ``spec`` arrives; ``None`` while its parent has not finished."""
        if spec.parent is None:
            return spec.arrival_step
        parent_done = self.finished_at.get(spec.parent)
        return None if parent_done is None else parent_done + spec.arrival_step

    def _next_arrival_step(self) -> int:
        """The idle loop skips ahead to the next arrival instead of counting empty steps."""
        arrivals = [step for spec in self.pending if (step := self._arrival_step(spec)) is not None]
        return max(self.step + 1, min(arrivals, default=self.step + 1))

    def _finish(self, request: Request, *, rejected: bool) -> None:
        self.finished_at[request.request_id] = self.step
        if rejected:
            self.result.num_rejected += 1
        else:
            self.result.num_finished += 1

    def _timed(self, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one manager call and add its wall time to this step's manager time."""
        start = time.perf_counter()
        value = call(*args, **kwargs)
        self._clock += time.perf_counter() - start
        return value
