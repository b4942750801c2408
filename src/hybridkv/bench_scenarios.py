"""The benchmark's timed scenarios, each checked once before it is timed: a decode step
(per request or batched), hashing a long prompt and looking it up once cached, admitting requests
that share a system prompt, and the host memory of an empty pool. The backends are interleaved
inside each repetition, and the garbage collector is off while one is timed (``no_gc``).
``Sizes``: how big each is, in full (``FULL``) and with ``--quick`` (``QUICK``).
"""

from __future__ import annotations

import contextlib
import gc
import random
import statistics
import time
import tracemalloc
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from hybridkv.bench_backends import (
    BLOCK,
    GROUPS,
    SCALING_BATCHES,
    SCALING_POOLS,
    Backend,
    BenchRequest,
    Blocks,
    Manager,
    Way,
    block_ids,
    check_same,
    gemma_like,
    tokens,
)
from hybridkv.bench_floor import AdmissionFloor
from hybridkv.optimized import StepColumns, TorchKVCacheManager
from hybridkv.spec import KVCacheConfig


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def decode_blocks(batch: int, steps: int, prompt: int) -> int:
    """Blocks a decode run needs: each group holds the prompt (one prefill call), plus slack."""
    return batch * GROUPS * ((prompt + steps) // BLOCK + 2) + 64


@dataclass
class _Decoding:
    way: Way
    manager: Manager
    requests: list[BenchRequest]
    steps: list[float] = field(default_factory=list)
    allocs: list[float] = field(default_factory=list)


def _decode_step(state: _Decoding, new_tokens: list[int]) -> list[Blocks]:
    requests, manager = state.requests, state.manager
    with no_gc():
        start = time.perf_counter()
        for r, t in zip(requests, new_tokens, strict=True):
            r.append_output_token_ids(t)
        mid = time.perf_counter()
        manager.new_step_starts()  # as vLLM's scheduler begins every step
        if state.way.batched:
            assert isinstance(manager, TorchKVCacheManager)
            results: Sequence[Blocks | None] = manager.allocate_slots_batch(requests, 1)
        else:
            results = [manager.allocate_slots(r, 1) for r in requests]
        end = time.perf_counter()
    state.steps.append(end - start)
    state.allocs.append(end - mid)
    done = [x for x in results if x is not None]
    if len(done) != len(requests):
        raise RuntimeError(f"{state.way.label}: a decode step ran out of blocks")
    for r in requests:
        r.num_computed_tokens += 1
    return done


def decode(
    ways: Sequence[Way], batch: int, steps: int, prompt: int, num_blocks: int | None = None
) -> dict[str, tuple[float, float]]:
    """Median µs per decode step (append + allocate) and of its allocation calls alone, per way.

    The first step is untimed; its results and the prefill's are checked against the first way.
    """
    rng = random.Random(batch)
    prompts = [array("q", tokens(rng, prompt - i % BLOCK)) for i in range(batch)]
    config = gemma_like(num_blocks or decode_blocks(batch, steps, prompt))
    max_model_len = prompt + steps + 64
    states, prefills = [], []
    for way in ways:
        manager = way.backend.make(config, max_model_len, batch + 8)
        requests: list[BenchRequest] = []
        allocated = []
        columns = StepColumns(batch)
        for i, ids in enumerate(prompts):
            r: BenchRequest = (
                columns.request(f"r{i}", ids.tolist(), hash_block_size=BLOCK)
                if way.columns
                else way.backend.request(f"r{i}", ids.tolist())
            )
            out = manager.allocate_slots(r, r.num_tokens)
            if out is None:
                raise RuntimeError(f"{way.label}: {batch} prompts do not fit in the pool")
            allocated.append(block_ids(out))
            r.num_computed_tokens = r.num_tokens
            requests.append(r)
        states.append(_Decoding(way, manager, requests))
        prefills.append((way.label, allocated))
    check_same(f"decode B={batch}: the prefill's block ids", prefills)
    for step in range(steps + 1):
        new_tokens = array("q", tokens(rng, batch))
        firsts = [
            (s.way.label, [block_ids(b) for b in _decode_step(s, new_tokens.tolist())])
            for s in states
        ]
        if step == 0:
            check_same(f"decode B={batch}: the first step's new block ids", firsts)
    result = {}
    for s in states:
        del s.steps[0], s.allocs[0]
        result[s.way.label] = (statistics.median(s.steps) * 1e6, statistics.median(s.allocs) * 1e6)
    return result


def lookup(
    backends: Sequence[Backend], length: int, repeat: int
) -> tuple[dict[str, tuple[float, float, float | None]], int]:
    """Median µs to hash a ``length``-token prompt (the hash function alone, then building a
    request of it that hashes as its manager would, when the backend says how), and to look it
    up once fully cached, per backend; and the hit length (checked equal, with the hashes and
    the hit's block ids)."""
    rng = random.Random(7)
    prompt = array("q", tokens(rng, length))
    managers, hashes, hit = cached_prompt(backends, prompt)
    times: dict[str, tuple[list[float], list[float], list[float]]] = {
        b.name: ([], [], []) for b in backends
    }
    for i in range(repeat):
        hashed = []
        for backend, manager in zip(backends, managers, strict=True):
            copy = prompt.tolist()
            job = backend.hash_job(copy)
            with no_gc():
                start = time.perf_counter()
                out = job()
                times[backend.name][0].append(time.perf_counter() - start)
            hashed.append((backend.name, [bytes(h) for h in out]))
            if backend.request_job is not None:
                job = backend.request_job(prompt.tolist())
                with no_gc():
                    start = time.perf_counter()
                    out = job()
                    times[backend.name][2].append(time.perf_counter() - start)
                hashed.append((f"{backend.name}, request", [bytes(h) for h in out]))
            r = backend.request_of(manager, f"b{i}", copy)
            with no_gc():
                start = time.perf_counter()
                manager.get_computed_blocks(r)
                times[backend.name][1].append(time.perf_counter() - start)
        if i == 0:
            check_same("hash: the hash function's results", [hashes, *hashed])
    medians = {
        name: (
            statistics.median(h) * 1e6,
            statistics.median(g) * 1e6,
            statistics.median(r) * 1e6 if r else None,
        )
        for name, (h, g, r) in times.items()
    }
    return medians, hit


def cached_prompt(
    backends: Sequence[Backend], prompt: array[int]
) -> tuple[list[Manager], tuple[str, list[bytes]], int]:
    """A manager per backend with ``prompt`` cached (allocated, then freed) and looked up once;
    the block hashes and the hit (tokens and block ids) checked equal across backends. Returns
    the managers, the first backend's hashes and the hit's length."""
    length = len(prompt)
    config = gemma_like(GROUPS * (length // BLOCK + 1) + 64)
    managers, hashes, hits = [], [], []
    for backend in backends:
        manager = backend.make(config, length + 1, 8)
        first = backend.request_of(manager, "a", prompt.tolist())
        if manager.allocate_slots(first, length) is None:
            raise RuntimeError(f"{backend.name}: the prompt does not fit in the pool")
        manager.free(first)
        probe = backend.request_of(manager, "probe", prompt.tolist())
        blocks, hit, _ = manager.get_computed_blocks(probe)
        managers.append(manager)
        hashes.append((backend.name, [bytes(h) for h in first.block_hashes]))
        hits.append((backend.name, (hit, block_ids(blocks))))
    check_same(f"lookup: the block hashes of a {length:,}-token prompt", hashes)
    check_same(f"lookup: the hit (tokens, block ids) of a {length:,}-token prompt", hits)
    return managers, hashes[0], hits[0][1][0]


FLOOR = "admission floor"
"""``admission``'s key of the floor's median, when it times the floor."""


def admission(
    backends: Sequence[Backend], count: int, shared: int, own: int, floor: bool = False
) -> dict[str, float]:
    """Median µs per request to build (hash), look up and admit a prompt sharing a system
    prompt, per backend; the first admission's hit and blocks are checked equal. With
    ``floor``, ``AdmissionFloor`` admits each prompt too, after the backends and after an
    untimed admission of the prompt by the first backend on a manager of its own, so that it
    starts as cold as the second backend's admission (which follows the first's); its median
    is under ``FLOOR``, and its hashes of the first prompt are checked equal to the backends'."""
    rng = random.Random(11)
    system = array("q", tokens(rng, shared))
    owns = [array("q", tokens(rng, own)) for _ in range(count + 1)]
    config = gemma_like((count + 2) * GROUPS * ((shared + own) // BLOCK + 1))
    first = system.tolist() + owns[0].tolist()
    managers = [admitting(backend, config, first, count) for backend in backends]
    times: dict[str, list[float]] = {b.name: [] for b in backends}
    if floor:
        times[FLOOR] = []
        filler, floor_admissions = (
            admitting(backends[0], config, first, count),
            AdmissionFloor(first, shared, count),
        )
    for i in range(count):
        admitted, hashes = [], []
        for backend, manager in zip(backends, managers, strict=True):
            prompt = system.tolist() + owns[i + 1].tolist()
            r, hit, hit_blocks, out, seconds = timed_admission(backend, manager, f"r{i}", prompt)
            times[backend.name].append(seconds)
            if out is None or hit < shared:
                raise RuntimeError(f"{backend.name}: admission {i} hit {hit} tokens or failed")
            if i == 0:
                admitted.append((backend.name, (hit, block_ids(hit_blocks), block_ids(out))))
                hashes.append((backend.name, [bytes(h) for h in r.block_hashes]))
        if floor:
            prompt = system.tolist() + owns[i + 1].tolist()
            timed_admission(backends[0], filler, f"f{i}", list(prompt))  # untimed: the caches
            with no_gc():
                start = time.perf_counter()
                floor_admissions.admit(prompt)
                times[FLOOR].append(time.perf_counter() - start)
            if i == 0:
                hashes.append((FLOOR, [bytes(h) for h in floor_admissions.last_hashes]))
        if i == 0:
            check_same("admission: the first request's hit and new blocks", admitted)
            check_same("admission: the first request's block hashes", hashes)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def admitting(backend: Backend, config: KVCacheConfig, first: list[int], count: int) -> Manager:
    """A manager of ``backend`` for ``count`` admissions, with ``first`` admitted (cached)."""
    manager = backend.make(config, len(first) + 1, count + 8)
    warm = backend.request_of(manager, "warm", list(first))
    if manager.allocate_slots(warm, warm.num_tokens) is None:
        raise RuntimeError(f"{backend.name}: the first prompt does not fit in the pool")
    return manager


def timed_admission(
    backend: Backend, manager: Manager, request_id: str, prompt: list[int]
) -> tuple[BenchRequest, int, Blocks, Blocks | None, float]:
    """Build the request, look it up and allocate the rest of it, timed (the collector off):
    the request, its hit in tokens and blocks, the new blocks and the seconds it took."""
    with no_gc():
        start = time.perf_counter()
        r = backend.request_of(manager, request_id, prompt)
        hit_blocks, hit, _ = manager.get_computed_blocks(r)
        out = manager.allocate_slots(r, r.num_tokens - hit, hit, hit_blocks)
        seconds = time.perf_counter() - start
    return r, hit, hit_blocks, out, seconds


def memory(backend: Backend, num_blocks: int) -> float:
    """Bytes of host memory per block that building an empty pool allocates."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        manager = backend.make(gemma_like(num_blocks), 8192, 256)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    del manager
    return used / num_blocks


def optimized_pool_bytes(num_blocks: int, device: str, max_num_reqs: int) -> tuple[float, float]:
    """The optimized manager's per-block tensors and its block tables, in bytes per block."""
    m = TorchKVCacheManager(gemma_like(num_blocks), 8192, device=device, max_num_reqs=max_num_reqs)
    return m.pool.nbytes / num_blocks, (m.host_nbytes - m.pool.nbytes) / num_blocks


# --- Sizes ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    batches: tuple[int, ...]
    steps: int
    prompt: int
    long_prompt: int
    repeat: int
    admitted: int
    shared: int
    own: int
    pool_blocks: int
    scaling_batches: tuple[int, ...]
    scaling_pools: tuple[int, ...]
    scaling_steps: int
    scaling_passes: int = 1
    """``--scaling`` sweeps every (pool, B) this many times, each figure the fastest of its
    passes: a slow phase of a shared machine slows some passes of a row, not all."""


FULL = Sizes(
    (64, 256, 1024), 32, 2000, 131_072, 5, 256, 4096, 256, 1_000_000,
    SCALING_BATCHES, SCALING_POOLS, 16, 3,
)  # fmt: skip
QUICK = Sizes((16, 32), 4, 200, 4096, 3, 8, 512, 256, 20_000, (4, 8, 16, 32), (10**3, 10**4), 3)
