"""The step loop both ``vllm-check`` drivers share (``scheduler_drive.drive`` and
``offload_drive.drive_with_worker``): vLLM 0.33's real scheduler fed a workload step by step,
with a fake model answering each scheduled step, and one record per step.

``DriveLoop`` holds what the two runs do alike, so a fix to one is a fix to both: arrivals
admitted at their step, aborts at theirs, the next turn of a conversation queued when a request
that ``continues`` finishes, the steps in flight (two under async scheduling, where a step's
output is processed a step late, as an engine's model runner returns it), the manager's KV
events taken per step, and a ``RunResult`` that keeps the records made before an error.

What the runs record and do differently is a hook that each driver's subclass overrides:
``open_step`` (the token run resets the prefix cache at its steps; the offloading run holds the
arrivals until the engine is idle and resets then), ``accepted_tokens`` and ``draft_tokens``
(speculative decoding), ``runner_extra`` (the connector's worker output), ``stats_of``,
``output_record`` and ``close_record`` (what a record holds), ``continuation_order`` and
``busy``. The defaults are the plain token run's; each hook keeps the order of the calls the
scheduler and the seeded ``rng`` see, so the records stay those of the drivers before the loop
was shared.
"""

from __future__ import annotations

import dataclasses
import random
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from hybridkv.integrations.vllm.run_config import (
    EOS_TOKEN_ID,
    Arrival,
    RunConfig,
    RunResult,
    Workload,
)
from hybridkv.integrations.vllm.step_records import (
    engine_output_record,
    output_record,
    recording,
    runner_output,
    sampled_token,
)


def error_text(error: BaseException) -> str:
    """An error as a run's result names it: its class, then its message."""
    return f"{type(error).__name__}: {error}"


def refusal(manager: str, error: BaseException) -> RunResult:
    """The result of a run whose scheduler could not be built (a setting the backend refuses,
    by name): no records."""
    return RunResult(manager, [], 0.0, error_text(error))


def request_hasher(cfg: RunConfig) -> Any:
    """vLLM's block hasher for the run's requests (sha256, as an engine's). Made before the
    scheduler is built: it sets vLLM's hash of the empty parent first."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(cfg.block_size, sha256)


@dataclass
class Processed:
    """What ``update_from_output`` returned for the steps processed during one loop step."""

    finished: list[str] = field(default_factory=list)
    """The requests that finished, in the order the scheduler reported them."""
    outputs: list[Any] = field(default_factory=list)
    """Every request's engine output (``engine_output_record``)."""
    stats: list[Any] = field(default_factory=list)
    """What ``stats_of`` kept of the engine outputs' statistics."""


class DriveLoop(ABC):
    """One run of ``workload`` through ``scheduler``, the manager's ``take_events`` recorded
    from construction until ``run`` returns (a subclass wraps what else it records the same
    way and unwraps it in ``restore``)."""

    def __init__(self, cfg: RunConfig, scheduler: Any, workload: Workload, hasher: Any) -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self.workload = workload
        self.hasher = hasher
        self.kv = scheduler.kv_cache_manager
        self.events: list[Any] = []
        self.kv_take_events = self.kv.take_events
        self.kv.take_events = recording(self.kv_take_events, self.events)
        self.rng = random.Random(cfg.seed + 1)
        self.pending: deque[Arrival] = deque(sorted(workload.arrivals, key=lambda a: a.step))
        self.followups: deque[Arrival] = deque()
        self.abort_at: dict[str, int] = {}
        self.continuations: dict[str, Arrival] = {}
        self.in_flight: deque[tuple[Any, set[str]]] = deque()
        self.records: list[dict[str, Any]] = []
        self.depth = 2 if cfg.run == "async" else 1

    # --- The loop --------------------------------------------------------------------------

    def run(self, manager: str) -> RunResult:
        """Step until the workload is done and the engine idle (or ``cfg.max_steps``); an error
        ends the run with the records so far. The wrapped methods are restored either way."""
        start = time.perf_counter()
        step = 0
        try:
            while step < self.cfg.max_steps:
                self.run_step(step)
                step += 1
                if not (self.pending or self.followups or self.in_flight or self.busy()):
                    break
        except Exception as error:  # the record so far, and what went wrong
            return RunResult(manager, self.records, time.perf_counter() - start, error_text(error))
        finally:
            self.restore()
        return RunResult(manager, self.records, time.perf_counter() - start)

    def run_step(self, step: int) -> None:
        """Schedule one step, process the steps whose outputs are due, record the step and
        queue the turns that follow the requests it finished."""
        reset = self.open_step(step)
        output = self.scheduler.schedule()
        record = self.output_record(output)
        record["step"], record["reset"] = step, reset
        chunks = {
            r for r in output.num_scheduled_tokens if self.scheduler.requests[r].is_prefill_chunk
        }
        self.in_flight.append((output, chunks))
        processed = Processed()
        while self.in_flight and (
            len(self.in_flight) >= self.depth or not output.num_scheduled_tokens
        ):
            done, done_chunks = self.in_flight.popleft()
            self.process(done, done_chunks, processed)
        self.close_record(record, processed)
        self.records.append(record)
        self.follow_up(processed.finished, step)

    def process(self, output: Any, chunks: set[str], processed: Processed) -> None:
        """The fake model runs ``output``'s step now (outputs are computed at processing time)
        and the scheduler takes its reply."""
        reply = self.model_output(output, chunks)
        for engine_output in self.scheduler.update_from_output(output, reply).values():
            stats = self.stats_of(engine_output)
            if stats is not None:
                processed.stats.append(stats)
            for out in engine_output.outputs:
                processed.outputs.append(engine_output_record(out))
                if out.finish_reason is not None:
                    processed.finished.append(out.request_id)
        drafts = self.draft_tokens(reply)
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)

    def model_output(self, output: Any, chunks: set[str]) -> Any:
        """The fake model's reply: a token per request (more with accepted draft tokens), none
        for a request gone or a prefill chunk that does not end the prompt."""
        extra = self.runner_extra(output)
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = self.scheduler.requests.get(req_id)
            if request is None or req_id in chunks:
                sampled.append([])
                continue
            accepted = self.accepted_tokens(output, req_id)
            base = request.num_tokens
            sampled.append([sampled_token(req_id, base + k) for k in range(accepted + 1)])
        return runner_output(req_ids, sampled, **extra)

    # --- Arrivals, aborts and continuations --------------------------------------------------

    def add(self, arrival: Arrival, step: int) -> None:
        """``arrival`` as vLLM's ``Request`` into the scheduler, its abort and its next turn
        noted."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=arrival.request_id,
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(step),
            cache_salt=arrival.cache_salt,
            priority=arrival.priority,
            block_hasher=self.hasher,
            **{"prompt_token_ids": arrival.prompt, **self.request_kwargs(arrival)},
        )
        self.scheduler.add_request(request)
        if arrival.abort_after is not None:
            self.abort_at[arrival.request_id] = step + arrival.abort_after
        if arrival.continues is not None:
            self.continuations[arrival.request_id] = arrival

    def admit_due(self, step: int) -> None:
        """The arrivals due by ``step``, then the continuations due."""
        while self.pending and self.pending[0].step <= step:
            self.add(self.pending.popleft(), step)
        while self.followups and self.followups[0].step <= step:
            self.add(self.followups.popleft(), step)

    def abort_due(self, step: int) -> None:
        """Abort the requests whose ``abort_after`` ends at ``step`` (in request-id order)."""
        from vllm.v1.request import RequestStatus

        to_abort = sorted(r for r, s in self.abort_at.items() if s == step)
        if to_abort:
            self.scheduler.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)

    def delay_arrivals(self, shift: int) -> None:
        """Every arrival and continuation not yet admitted ``shift`` steps later."""
        self.pending = deque(dataclasses.replace(a, step=a.step + shift) for a in self.pending)
        self.followups = deque(dataclasses.replace(a, step=a.step + shift) for a in self.followups)

    def follow_up(self, finished: list[str], step: int) -> None:
        """The next turn of each finished request that ``continues``: its prompt, three answer
        tokens and a new user turn of seeded length, due at the next step."""
        for request_id in self.continuation_order(finished):
            arrival = self.continuations.pop(request_id, None)
            if arrival is None:
                continue
            answer = [sampled_token(request_id, len(arrival.prompt) + k) for k in range(3)]
            turn = [sampled_token(request_id + "u", k) for k in range(self.rng.randrange(4, 40))]
            self.followups.append(
                Arrival(
                    step=step + 1,
                    request_id=f"{request_id}.next",
                    prompt=(list(arrival.prompt) + answer + turn)[: self.cfg.max_model_len // 2],
                    max_tokens=self.rng.randrange(1, 20),
                    priority=arrival.priority,
                    cache_salt=arrival.cache_salt,
                )
            )

    def take_events(self) -> list[Any]:
        """The manager's KV events since the last call (as ``step_records.event_record``)."""
        events = list(self.events)
        self.events.clear()
        return events

    # --- Hooks -------------------------------------------------------------------------------

    def request_kwargs(self, arrival: Arrival) -> dict[str, Any]:
        """``Request`` arguments beyond the tokens: the arrival's images, adapter, embeddings."""
        return arrival.request_kwargs

    def open_step(self, step: int) -> Any:
        """Before ``schedule()``: admit and abort what is due; the step's reset (none here)."""
        self.admit_due(step)
        self.abort_due(step)
        return None

    def output_record(self, output: Any) -> dict[str, Any]:
        """The record of the scheduled step (``step_records.output_record``)."""
        return output_record(output)

    def runner_extra(self, output: Any) -> dict[str, Any]:
        """More fields of the fake model's ``ModelRunnerOutput`` for ``output``'s step."""
        return {}

    def accepted_tokens(self, output: Any, req_id: str) -> int:
        """How many of the request's scheduled draft tokens the fake model accepts."""
        return 0

    def stats_of(self, engine_output: Any) -> Any | None:
        """What the step's record keeps of ``engine_output``'s statistics (``None``: nothing)."""
        return None

    def draft_tokens(self, reply: Any) -> Any | None:
        """The ``DraftTokenIds`` the scheduler takes after the fake model's ``reply`` (``None``:
        no drafter)."""
        return None

    @abstractmethod
    def close_record(self, record: dict[str, Any], processed: Processed) -> None:
        """Complete the step's ``record`` with what processing its due steps gave."""

    def continuation_order(self, finished: list[str]) -> list[str]:
        """The order the finished requests' next turns are made in (the rng draws follow it)."""
        return finished

    def busy(self) -> bool:
        """Whether the scheduler has requests left (the run goes on until it has none)."""
        return bool(self.scheduler.has_unfinished_requests())

    def restore(self) -> None:
        """Put back the methods wrapped to record the run."""
        self.kv.take_events = self.kv_take_events
