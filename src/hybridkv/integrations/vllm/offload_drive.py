"""The run behind ``hybridkv vllm-check --connector offloading`` (``connector_check``): vLLM
0.33's ``OffloadingConnector`` with its CPU spec attached to vLLM's real scheduler, over
vLLM's manager or a hybridkv backend, with the worker stand-in ``offload_worker.OffloadWorker``.

The connector's scheduler half runs as in an engine (``CPUOffloadingSpec``: its CPU manager and
LRU policy, ``cpu_bytes_to_use`` small enough that the CPU tier evicts too). The workload
(``offload_workload``) shares long documents between requests over a small GPU pool, so
prefixes leave the pool and come back from the CPU tier.

A step's record holds the scheduled tokens per request, the block ids handed to the worker per
group, the preemptions, the blocks to zero, the store and load jobs per group (first block
index, GPU block ids, CPU chunk ids) and the jobs to flush, the engine outputs (local and
connector hit tokens), the manager's and the connector's KV events, the prefix-cache statistics
of both and the usage.
"""

from __future__ import annotations

import dataclasses
import mmap
import random
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.integrations.vllm.run_config import (
    EOS_TOKEN_ID,
    VOCAB,
    Arrival,
    RunConfig,
    RunResult,
    Workload,
)
from hybridkv.integrations.vllm.scheduler_drive import build_scheduler
from hybridkv.integrations.vllm.step_records import (
    engine_output_record,
    output_record,
    recording,
    runner_output,
    sampled_token,
)

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.offload_worker import OffloadWorker

NUM_BLOCKS = {"gemma3": 64, "llama4": 80, "jamba": 40}
"""GPU pools small enough that shared documents leave them (one long request holds about half)."""
CPU_CHUNKS = 128


@dataclass(frozen=True)
class OffloadRun:
    cfg: RunConfig
    cpu_chunks: int = CPU_CHUNKS
    """CPU chunks (``cpu_bytes_to_use`` is this many chunks' bytes)."""

    @property
    def name(self) -> str:
        return f"{self.cfg.name}/offloading"


def chunk_bytes(kv_cache_config: Any) -> int:
    """One CPU chunk's bytes as ``CPUOffloadingSpec`` sizes it: a block of every group, rounded
    up to the page (``kv_cache_tensors=[]``: the groups' page sizes summed)."""
    per_block = sum(
        int(group.kv_cache_spec.page_size_bytes) * len(group.layer_names)
        for group in kv_cache_config.kv_cache_groups
    )
    return -(-per_block // mmap.PAGESIZE) * mmap.PAGESIZE


def offload_workload(cfg: RunConfig) -> Workload:
    """Three long documents shared by most requests, long distractors that push them out of the
    GPU pool, resends, salts, aborts, priorities, continuations; halfway, a reset of the GPU
    prefix cache (``drive`` holds the arrivals until the engine is idle, then resets: the
    documents come back from the CPU tier alone)."""
    rng = random.Random(cfg.seed)
    documents = [
        [rng.randrange(VOCAB) for _ in range(rng.choice((160, 208, 256)))] for _ in range(3)
    ]
    arrivals: list[Arrival] = []
    step = 0
    reset_steps: set[int] = set()
    for i in range(cfg.num_requests):
        step += rng.choice((1, 2, 3, 4))
        if i == cfg.num_requests // 2 and i >= 8:
            reset_steps.add(step)
        kind = rng.random()
        salt = rng.choice(("alice", "bob")) if rng.random() < 0.1 else None
        if kind < 0.15 and arrivals:
            old = rng.choice(arrivals)
            prompt, salt = list(old.prompt), old.cache_salt
        elif kind < 0.75:
            tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 48))]
            prompt = rng.choice(documents) + tail
        else:
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(120, 320))]
        arrivals.append(
            Arrival(
                step=step,
                request_id=f"r{i}",
                prompt=prompt[: cfg.max_model_len // 2],
                max_tokens=rng.randrange(1, 24),
                priority=rng.randrange(0, 3),
                cache_salt=salt,
                abort_after=rng.randrange(1, 12) if rng.random() < 0.08 else None,
                continues=f"t{i}" if rng.random() < 0.15 else None,
            )
        )
    return Workload(arrivals, reset_steps)


# --- Recording -----------------------------------------------------------------------------


def _job_groups(gpu: Any, cpu: Any) -> list[tuple[int, list[int], list[int]]]:
    """A job's blocks per group: (first block index, GPU block ids, CPU chunk ids)."""
    ids, chunks = [int(b) for b in gpu.block_ids], [int(c) for c in cpu.block_ids]
    groups, offset = [], 0
    for size, first in zip(gpu.group_sizes, gpu.block_indices, strict=True):
        groups.append((int(first), ids[offset : offset + size], chunks[offset : offset + size]))
        offset += size
    return groups


def _jobs(jobs: dict[int, Any], load: bool) -> list[Any]:
    return [
        (
            job_id,
            job.req_id,
            job.sync,
            _job_groups(*((job.dst_spec, job.src_spec) if load else (job.src_spec, job.dst_spec))),
        )
        for job_id, job in sorted(jobs.items())
    ]


def _output_record(output: Any) -> dict[str, Any]:
    """The check's record of the step (``step_records.output_record``) and the connector's
    jobs in it: loads, stores and jobs to flush."""
    meta = output.kv_connector_metadata
    return {
        **output_record(output),
        "loads": _jobs(meta.load_jobs, load=True),
        "stores": _jobs(meta.store_jobs, load=False),
        "flush": sorted(meta.jobs_to_flush or ()),
    }


def _cache_stats(stats: Any) -> Any:
    return None if stats is None else (stats.requests, stats.queries, stats.hits, stats.reset)


# --- Driving -------------------------------------------------------------------------------


def build(run: OffloadRun, manager: str) -> Any:
    """vLLM's scheduler for ``run`` with ``manager``'s KV cache manager and the connector."""
    from vllm.config import KVTransferConfig

    kv_cache_config = run.cfg.kv_cache_config()
    extra = {"cpu_bytes_to_use": run.cpu_chunks * chunk_bytes(kv_cache_config)}
    transfer = KVTransferConfig(
        kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
    )
    return build_scheduler(run.cfg, manager, kv_cache_config, kv_transfer_config=transfer)


def drive(run: OffloadRun, manager: str, workload: Workload | None = None) -> RunResult:
    """Run ``workload`` (by default ``offload_workload``) through vLLM's scheduler with
    ``manager`` and the offloading connector; one record per step. A block that a store read
    or a load wrote without the bytes computing it writes stops the run with an error."""
    return drive_with_worker(run, manager, workload)[0]


def drive_with_worker(
    run: OffloadRun, manager: str, workload: Workload | None = None
) -> tuple[RunResult, OffloadWorker | None]:
    """``drive``, and the worker stand-in as the run left it (its GPU blocks and CPU chunks;
    ``None`` if the scheduler could not be built)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.request import Request, RequestStatus

    from hybridkv.integrations.vllm.offload_worker import OffloadWorker

    cfg = run.cfg
    init_none_hash(sha256)
    hasher = get_request_block_hasher(cfg.block_size, sha256)
    try:
        scheduler = build(run, manager)
    except Exception as error:  # a setting the backend refuses, by name
        return RunResult(manager, [], 0.0, f"{type(error).__name__}: {error}"), None
    kv, connector = scheduler.kv_cache_manager, scheduler.connector
    events: list[Any] = []
    cpu_events: list[Any] = []
    take_events, take_cpu_events = kv.take_events, connector.take_events
    kv.take_events = recording(take_events, events)
    connector.take_events = recording(take_cpu_events, cpu_events)
    prompts: dict[str, list[int]] = {}

    def token(request_id: str, position: int) -> int:
        prompt = prompts[request_id]
        return prompt[position] if position < len(prompt) else sampled_token(request_id, position)

    groups = scheduler.kv_cache_config.kv_cache_groups
    offloaded = connector.connector_scheduler.config.kv_group_configs
    worker = OffloadWorker(
        num_blocks=cfg.num_blocks,
        num_chunks=run.cpu_chunks,
        block_size=cfg.block_size,
        state_groups=frozenset(
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        ),
        offloaded_groups=[c.group_idx for c in offloaded],
        token=token,
        num_groups=len(groups),
    )
    workload = workload or offload_workload(cfg)
    rng = random.Random(cfg.seed + 1)
    pending = deque(sorted(workload.arrivals, key=lambda a: a.step))
    followups: deque[Arrival] = deque()
    abort_at: dict[str, int] = {}
    continuations: dict[str, Arrival] = {}
    in_flight: deque[tuple[Any, set[str]]] = deque()
    records: list[dict[str, Any]] = []
    depth = 2 if cfg.run == "async" else 1
    start = time.perf_counter()

    def add(arrival: Arrival, step: int) -> None:
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        prompts[arrival.request_id] = list(arrival.prompt)
        scheduler.add_request(
            Request(
                request_id=arrival.request_id,
                prompt_token_ids=arrival.prompt,
                sampling_params=params,
                pooling_params=None,
                arrival_time=float(step),
                cache_salt=arrival.cache_salt,
                priority=arrival.priority,
                block_hasher=hasher,
            )
        )
        if arrival.abort_after is not None:
            abort_at[arrival.request_id] = step + arrival.abort_after
        if arrival.continues is not None:
            continuations[arrival.request_id] = arrival

    def model_output(output: Any, chunks: set[str], connector_output: Any) -> Any:
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            gone = request is None or req_id in chunks
            sampled.append([] if gone else [sampled_token(req_id, request.num_tokens)])
        return runner_output(req_ids, sampled, kv_connector_output=connector_output)

    step = 0
    paused: int | None = None  # a reset's step, its arrivals held until the engine is idle
    try:
        while step < cfg.max_steps:
            reset = None
            if paused is None and step in workload.reset_steps:
                paused = step
            if paused is not None and not in_flight and not scheduler.has_requests():
                reset = scheduler.reset_prefix_cache()
                shift = step - paused
                pending = deque(dataclasses.replace(a, step=a.step + shift) for a in pending)
                followups = deque(dataclasses.replace(a, step=a.step + shift) for a in followups)
                paused = None
            while paused is None and pending and pending[0].step <= step:
                add(pending.popleft(), step)
            while paused is None and followups and followups[0].step <= step:
                add(followups.popleft(), step)
            to_abort = sorted(r for r, s in abort_at.items() if s == step)
            if to_abort:
                scheduler.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)
            output = scheduler.schedule()
            record = _output_record(output)
            record["step"], record["reset"] = step, reset
            chunks = {
                r for r in output.num_scheduled_tokens if scheduler.requests[r].is_prefill_chunk
            }
            in_flight.append((output, chunks))
            finished: list[str] = []
            outputs: list[Any] = []
            stats: list[Any] = []
            while in_flight and (len(in_flight) >= depth or not output.num_scheduled_tokens):
                done, done_chunks = in_flight.popleft()
                reply = model_output(done, done_chunks, worker.execute(done))
                for engine_output in scheduler.update_from_output(done, reply).values():
                    if engine_output.scheduler_stats is not None:
                        s = engine_output.scheduler_stats
                        stats.append(
                            (
                                _cache_stats(s.prefix_cache_stats),
                                _cache_stats(s.connector_prefix_cache_stats),
                            )
                        )
                    for out in engine_output.outputs:
                        outputs.append(engine_output_record(out))
                        if out.finish_reason is not None:
                            finished.append(out.request_id)
            record["outputs"], record["stats"] = outputs, stats
            record["events"], record["cpu_events"] = list(events), list(cpu_events)
            events.clear()
            cpu_events.clear()
            record["usage"] = round(float(kv.usage), 9)
            records.append(record)
            for request_id in sorted(finished):
                arrival = continuations.pop(request_id, None)
                if arrival is None:
                    continue
                answer = [sampled_token(request_id, len(arrival.prompt) + k) for k in range(3)]
                turn = [sampled_token(request_id + "u", k) for k in range(rng.randrange(4, 40))]
                followups.append(
                    Arrival(
                        step=step + 1,
                        request_id=f"{request_id}.next",
                        prompt=(arrival.prompt + answer + turn)[: cfg.max_model_len // 2],
                        max_tokens=rng.randrange(1, 20),
                        priority=arrival.priority,
                        cache_salt=arrival.cache_salt,
                    )
                )
            step += 1
            if not (pending or followups or in_flight or scheduler.has_requests()):
                break
    except Exception as error:  # the record so far, and what went wrong
        elapsed = time.perf_counter() - start
        return RunResult(manager, records, elapsed, f"{type(error).__name__}: {error}"), worker
    finally:
        kv.take_events, connector.take_events = take_events, take_cpu_events
    return RunResult(manager, records, time.perf_counter() - start), worker
