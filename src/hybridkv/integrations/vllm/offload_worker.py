"""A stand-in for vLLM's GPU worker under the ``OffloadingConnector`` with its CPU spec (for
``connector_check``): numpy arrays for the GPU blocks (one array per group) and the CPU chunks,
and a fake model whose KV bytes can be checked wherever they travel.

Computing token ``p`` of a request writes, in each attention group ``g``, a value that depends
on ``g`` and on every token up to ``p`` (a running hash, so requests sharing a prefix write the
same bytes); a Mamba group's block at index ``j`` gets the state of the tokens up to the end of
that block (or up to the last computed token, while the block is the request's last). Every
block a store job reads and a load job writes is checked against what computing it writes.

The order within a step is vLLM 0.33's worker's (``offloading/worker.py``,
``gpu_model_runner.execute_model``): the previous step's deferred stores and the store jobs
the step flushes are copied first (``handle_preemptions``), then the new attention blocks are
zeroed, the model computes the scheduled tokens, the loads are copied (async loads start after
the forward), the step's store jobs wait for the next step (``wait_for_save``), and the reply
holds every job done (``OffloadingWorkerMetadata.completed_jobs``) and the requests whose load
finished (``finished_recving``); stores never set ``finished_sending``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

_MASK = (1 << 63) - 1


def _mix(a: int, b: int) -> int:
    """A 63-bit hash of two integers (splitmix64's finaliser)."""
    x = (a * 0x9E3779B97F4A7C15 + b + 1) & _MASK
    x ^= x >> 29
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
    return x ^ (x >> 32)


class TransferMismatch(AssertionError):
    """A block a store read or a load wrote does not hold what computing it writes."""


@dataclass
class TransferCounts:
    """What the worker did: jobs and blocks copied, each block checked."""

    store_jobs: int = 0
    stored_blocks: int = 0
    load_jobs: int = 0
    loaded_blocks: int = 0


@dataclass
class OffloadWorker:
    """The worker half: ``execute(output)`` runs one scheduled step and returns the
    ``KVConnectorOutput`` vLLM's worker would send back."""

    num_blocks: int
    num_chunks: int
    block_size: int
    state_groups: frozenset[int]
    """Groups holding states (Mamba) rather than per-token KV."""
    offloaded_groups: Sequence[int]
    """The connector's groups, in its order (``GPULoadStoreSpec.group_sizes``' order)."""
    token: Callable[[str, int], int]
    """A request's token at a position (its prompt's, then what the fake model samples)."""
    num_groups: int
    counts: TransferCounts = field(default_factory=TransferCounts)

    def __post_init__(self) -> None:
        shape = (self.num_blocks, self.block_size)
        self.gpu = [np.zeros(shape, dtype=np.int64) for _ in range(self.num_groups)]
        self.cpu = np.zeros((self.num_chunks, self.block_size), dtype=np.int64)
        self._tables: dict[str, list[list[int]]] = {}
        # Per group, block id -> the request whose table last received it, and where.
        self._owner: list[dict[int, tuple[str, int]]] = [{} for _ in range(self.num_groups)]
        self._running: dict[str, list[int]] = {}
        self._deferred_stores: list[tuple[int, Any]] = []

    # --- what computing writes ------------------------------------------------------------

    def _hash(self, request_id: str, position: int) -> int:
        """The running hash of a request's tokens ``0..position``."""
        hashes = self._running.setdefault(request_id, [])
        while len(hashes) <= position:
            previous = hashes[-1] if hashes else 0
            hashes.append(_mix(previous, self.token(request_id, len(hashes))))
        return hashes[position]

    def expected(
        self, request_id: str, group: int, index: int, end: int | None = None
    ) -> NDArray[np.int64]:
        """Block ``index`` of ``group`` as computing the request's tokens up to ``end`` (by
        default the block's end) writes it."""
        start = index * self.block_size
        stop = start + self.block_size if end is None else min(end, start + self.block_size)
        if group in self.state_groups:
            state = _mix(self._hash(request_id, stop - 1), group)
            return np.full(self.block_size, state, dtype=np.int64)
        values = np.zeros(self.block_size, dtype=np.int64)
        for p in range(start, stop):
            values[p - start] = _mix(self._hash(request_id, p), group)
        return values

    def _compute(self, request_id: str, start: int, stop: int) -> None:
        """The model computes tokens ``start..stop-1``: each group's blocks get their bytes."""
        table = self._tables[request_id]
        for group in range(self.num_groups):
            ids = table[group]
            for index in range(start // self.block_size, (stop - 1) // self.block_size + 1):
                block = ids[index] if index < len(ids) else 0
                if group in self.state_groups:
                    if block:
                        self.gpu[group][block] = self.expected(request_id, group, index, stop)
                    continue
                if not block:
                    raise TransferMismatch(
                        f"{request_id}: group {group} has no block at index {index} for "
                        f"tokens {start}..{stop - 1} (table {ids})"
                    )
                lo = max(start, index * self.block_size) - index * self.block_size
                hi = min(stop, (index + 1) * self.block_size) - index * self.block_size
                fresh = self.expected(request_id, group, index, stop)
                self.gpu[group][block][lo:hi] = fresh[lo:hi]

    # --- the step --------------------------------------------------------------------------

    def _update_tables(self, output: Any) -> None:
        """The block tables, as the model runner keeps them from the scheduler's output."""
        for request_id in output.preempted_req_ids or ():
            self._tables.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            self._tables[new.req_id] = [[] for _ in range(self.num_groups)]
            self._extend(new.req_id, new.block_ids)
        cached = output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                self._tables[request_id] = [[] for _ in range(self.num_groups)]
            if ids is not None:
                self._extend(request_id, ids)

    def _extend(self, request_id: str, groups: Sequence[Sequence[int]]) -> None:
        for group, (table, ids) in enumerate(zip(self._tables[request_id], groups, strict=True)):
            for block in ids:
                if block:
                    self._owner[group][block] = (request_id, len(table))
                table.append(block)

    def _groups(self, spec: Any, chunks: Any) -> list[tuple[int, int, list[int], list[int]]]:
        """A job's blocks per group: (group, first block index, GPU block ids, chunk ids)."""
        ids = [int(b) for b in spec.block_ids]
        chunk_ids = [int(c) for c in chunks.block_ids]
        if len(ids) != len(chunk_ids):
            raise TransferMismatch(f"{len(ids)} GPU blocks for {len(chunk_ids)} CPU chunks")
        out = []
        offset = 0
        for group, size, first in zip(
            self.offloaded_groups, spec.group_sizes, spec.block_indices, strict=True
        ):
            out.append(
                (group, int(first), ids[offset : offset + size], chunk_ids[offset : offset + size])
            )
            offset += size
        return out

    def _check(self, what: str, job: Any, group: int, index: int, block: int) -> None:
        if not np.array_equal(self.gpu[group][block], self.expected(job.req_id, group, index)):
            owner, at = self._owner[group].get(block, ("no request", -1))
            raise TransferMismatch(
                f"{what} of {job.req_id}: group {group} block {block} (index {index}) does not "
                f"hold what computing it writes (the block went last to {owner}, index {at})"
            )

    def _store(self, job: Any) -> None:
        """Copy a store job's blocks to its chunks. A store may skip chunks inside a group (out
        of a window, unreachable), so each block's index is where the tables last put it."""
        for group, _, blocks, chunks in self._groups(job.src_spec, job.dst_spec):
            for block, chunk in zip(blocks, chunks, strict=True):
                _, index = self._owner[group].get(block, ("", -1))
                if index < 0:
                    raise TransferMismatch(
                        f"a store of {job.req_id}: group {group} block {block} is in no table"
                    )
                self._check("a store", job, group, index, block)
                self.cpu[chunk] = self.gpu[group][block]
                self.counts.stored_blocks += 1
        self.counts.store_jobs += 1

    def _load(self, job: Any) -> None:
        for group, first, blocks, chunks in self._groups(job.dst_spec, job.src_spec):
            for k, (block, chunk) in enumerate(zip(blocks, chunks, strict=True)):
                if not block:
                    raise TransferMismatch(f"a load of {job.req_id} into the null block")
                self.gpu[group][block] = self.cpu[chunk]
                self._check("a load", job, group, first + k, block)
                self.counts.loaded_blocks += 1
        self.counts.load_jobs += 1

    def execute(self, output: Any) -> Any:
        """Run one scheduled step; the ``KVConnectorOutput`` of vLLM's worker."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        meta = output.kv_connector_metadata
        store_jobs = dict(meta.store_jobs)
        done: dict[int, int] = {}
        for job_id in sorted(meta.jobs_to_flush or ()):  # handle_preemptions
            job = store_jobs.pop(job_id, None)
            if job is not None:
                self._deferred_stores.append((job_id, job))
        for job_id, job in self._deferred_stores:
            self._store(job)
            done[job_id] = 1
        self._deferred_stores.clear()
        self._update_tables(output)
        for block in output.new_block_ids_to_zero or ():
            for group in range(self.num_groups):
                if group not in self.state_groups:
                    self.gpu[group][block] = 0
        for new in output.scheduled_new_reqs:
            n = output.num_scheduled_tokens[new.req_id]
            self._compute(new.req_id, new.num_computed_tokens, new.num_computed_tokens + n)
        cached = output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            start = cached.num_computed_tokens[i]
            self._compute(request_id, start, start + output.num_scheduled_tokens[request_id])
        received: set[str] = set()
        for job_id, job in meta.load_jobs.items():
            self._load(job)
            done[job_id] = 1
            if not job.sync:
                received.add(job.req_id)
        self._deferred_stores.extend(store_jobs.items())  # wait_for_save
        for request_id in output.finished_req_ids:
            self._tables.pop(request_id, None)
        return KVConnectorOutput(
            finished_recving=received,
            kv_connector_worker_meta=OffloadingWorkerMetadata(completed_jobs=done)
            if done
            else None,
        )
