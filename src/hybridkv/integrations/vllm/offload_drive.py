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

The steps run in ``drive_loop``'s loop, shared with ``scheduler_drive.drive``; ``OffloadDrive``
adds the worker, the held reset and this record.
"""

from __future__ import annotations

import mmap
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.integrations.vllm.drive_loop import DriveLoop, Processed, refusal, request_hasher
from hybridkv.integrations.vllm.run_config import VOCAB, Arrival, RunConfig, RunResult, Workload
from hybridkv.integrations.vllm.scheduler_drive import build_scheduler
from hybridkv.integrations.vllm.step_records import output_record, recording, sampled_token

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
    hasher = request_hasher(run.cfg)
    try:
        scheduler = build(run, manager)
    except Exception as error:  # a setting the backend refuses, by name
        return refusal(manager, error), None
    loop = OffloadDrive(run, scheduler, workload or offload_workload(run.cfg), hasher)
    return loop.run(manager), loop.worker


def make_worker(run: OffloadRun, scheduler: Any, token: Callable[[str, int], int]) -> OffloadWorker:
    """The worker stand-in for ``scheduler``'s groups: its Mamba groups hold a state, the
    connector's offloaded groups are those its jobs name; ``token`` is a request's token at a
    position (what computing a block writes)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    from hybridkv.integrations.vllm.offload_worker import OffloadWorker

    groups = scheduler.kv_cache_config.kv_cache_groups
    offloaded = scheduler.connector.connector_scheduler.config.kv_group_configs
    return OffloadWorker(
        num_blocks=run.cfg.num_blocks,
        num_chunks=run.cpu_chunks,
        block_size=run.cfg.block_size,
        state_groups=frozenset(
            i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)
        ),
        offloaded_groups=[c.group_idx for c in offloaded],
        token=token,
        num_groups=len(groups),
    )


class OffloadDrive(DriveLoop):
    """The offloading run's loop: the worker stand-in executes every step (its connector output
    goes back with the fake model's reply), a reset waits for an idle engine, and a record holds
    the connector's jobs, its KV events and the engine's statistics of both tiers."""

    def __init__(self, run: OffloadRun, scheduler: Any, workload: Workload, hasher: Any) -> None:
        super().__init__(run.cfg, scheduler, workload, hasher)
        self.connector = scheduler.connector
        self.cpu_events: list[Any] = []
        self.connector_take_events = self.connector.take_events
        self.connector.take_events = recording(self.connector_take_events, self.cpu_events)
        self.prompts: dict[str, list[int]] = {}
        self.paused: int | None = None  # a reset's step, its arrivals held until the engine is idle
        self.worker = make_worker(run, scheduler, self.token)

    def token(self, request_id: str, position: int) -> int:
        """A request's token at ``position``: its prompt's, then the fake model's."""
        prompt = self.prompts[request_id]
        return prompt[position] if position < len(prompt) else sampled_token(request_id, position)

    def add(self, arrival: Arrival, step: int) -> None:
        """The arrival's prompt noted for ``token``, then the request added."""
        self.prompts[arrival.request_id] = list(arrival.prompt)
        super().add(arrival, step)

    def request_kwargs(self, arrival: Arrival) -> dict[str, Any]:
        """None: the worker computes blocks from the prompt's tokens alone."""
        return {}

    def open_step(self, step: int) -> Any:
        """At a reset's step, hold the arrivals until nothing runs or waits; then reset the GPU
        prefix cache (the documents come back from the CPU tier alone) and shift the arrivals
        by the steps held."""
        reset = None
        if self.paused is None and step in self.workload.reset_steps:
            self.paused = step
        if self.paused is not None and not self.in_flight and not self.scheduler.has_requests():
            reset = self.scheduler.reset_prefix_cache()
            self.delay_arrivals(step - self.paused)
            self.paused = None
        if self.paused is None:
            self.admit_due(step)
        self.abort_due(step)
        return reset

    def output_record(self, output: Any) -> dict[str, Any]:
        return _output_record(output)

    def runner_extra(self, output: Any) -> dict[str, Any]:
        """The worker runs the step's jobs; its connector output goes with the reply."""
        return {"kv_connector_output": self.worker.execute(output)}

    def stats_of(self, engine_output: Any) -> Any | None:
        """The engine's prefix-cache statistics of the GPU pool and of the connector."""
        s = engine_output.scheduler_stats
        if s is None:
            return None
        return (_cache_stats(s.prefix_cache_stats), _cache_stats(s.connector_prefix_cache_stats))

    def close_record(self, record: dict[str, Any], processed: Processed) -> None:
        """The engine outputs, statistics, both tiers' KV events and the usage of the step."""
        record["outputs"], record["stats"] = processed.outputs, processed.stats
        record["events"], record["cpu_events"] = self.take_events(), list(self.cpu_events)
        self.cpu_events.clear()
        record["usage"] = round(float(self.kv.usage), 9)

    def continuation_order(self, finished: list[str]) -> list[str]:
        """In request-id order."""
        return sorted(finished)

    def busy(self) -> bool:
        """``has_requests``, as an engine keeps stepping: finished requests whose stores the
        connector has not yet completed (and their ids not yet sent to the worker) count."""
        return bool(self.scheduler.has_requests())

    def restore(self) -> None:
        super().restore()
        self.connector.take_events = self.connector_take_events
