"""Where a cold admission's time goes: each part taken out in turn, measured side by side.

docs/optimized-history.md ("Commits 18039e5 → 0f1b0ff") holds its output.

``python scripts/admission_parts.py [PART ...] [--count N]`` runs the benchmark's admission
scenario (a 4,096-token system prompt cached by one request, then requests of it and 256 tokens
of their own) on two optimized managers, their admissions alternating (which goes first swaps
every time), with one of vLLM's own admissions before each (as the benchmark runs them, so each
admission starts as cold); vLLM's run between them when it imports, else other work that
evicts the caches. Around the second manager's admissions one part of the work is made a no-op;
the output is each manager's median µs and the difference. The part ``none`` takes nothing out:
its difference is the harness's own spread. A part taken out changes what the manager holds
(no entries cached, say), so only the time means anything; the shared prefix's hit is the same
in every admission either way.

Parts: ``validate`` (the prompt packed with ``fromlist`` alone: no check of each id's type),
``enter`` (the new full blocks not cached), ``links`` (cached, but not linked into the hash
table's chains), ``record`` (linked, but not recorded in the source's run), ``checks`` (the
call's checks of its counts and hit), ``thresholds`` (the row's thresholds not recomputed),
``memo`` (the request not registered with the memo), ``hold`` (the hit's blocks not touched),
``write`` (the row's tables not written), ``result`` (the new blocks not turned into tuples).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch  # noqa: TID251 (one intra-op thread, as the benchmark runs)
from bench_bounds import other_work, vllm_admissions

from hybridkv.bench import BLOCK, gemma_like, tokens
from hybridkv.bench_backends import vllm_version
from hybridkv.optimized import (
    TorchKVCacheManager,
    allocation,
    block_pool,
    bulk_inserts,
    memo_tree,
    one_pass_admission,
    row_thresholds,
    sources,
)
from hybridkv.reference import Request
from hybridkv.reference import request as request_module
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks


def _pack_unchecked(field: str, token_ids: Sequence[int]) -> tuple[list[int], array[int]]:
    tokens_ = list(token_ids)
    packed = array("Q")
    packed.fromlist(tokens_)
    return tokens_, packed


def _checks_skipped(s: Any, request: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    hit = args[2]
    return s.layout.no_hits, hit.group_hits


PARTS: dict[str, list[tuple[Any, str, Any]]] = {
    "none": [],
    "validate": [(request_module, "pack_token_ids", _pack_unchecked)],
    "enter": [(one_pass_admission, "enter", lambda *a: None)],
    "links": [(bulk_inserts.BulkInserts, "_link", lambda self, *a: False)],
    "record": [(sources.Source, "record_positions", lambda self, *a: None)],
    "checks": [(allocation, "checked_hits", _checks_skipped)],
    "thresholds": [(row_thresholds.RowThresholds, "refresh", lambda self, row: None)],
    "memo": [(memo_tree.BranchTree, "remember", lambda self, src, source: None)],
    "hold": [(block_pool.TorchBlockPool, "touch_array", lambda self, b, r=None: True)],
    "write": [(one_pass_admission, "write_row", lambda *a: None)],
    "result": [(one_pass_admission, "KVCacheBlocks", lambda ids: KVCacheBlocks(((),)))],
}


@contextmanager
def taken_out(part: str) -> Iterator[None]:
    """The part's functions replaced by no-ops while inside."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in PARTS[part]]
    for owner, name, stub in PARTS[part]:
        setattr(owner, name, stub)
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def measure(part: str, count: int, between: Callable[[], object]) -> tuple[float, float]:
    """Median µs per admission of the manager as is and of the one without ``part``."""
    shared, own = 4096, 256
    rng = random.Random(11)
    system = tokens(rng, shared)
    per_request = 7 * ((shared + own) // BLOCK + 1)
    managers = []
    for _ in range(2):
        manager = TorchKVCacheManager(
            gemma_like((count + 2) * per_request), shared + own + 1, max_num_reqs=count + 8
        )
        warm = Request("warm", system + tokens(random.Random(5), own), hash_block_size=BLOCK)
        manager.allocate_slots(warm, warm.num_tokens)
        managers.append(manager)
    times: list[list[float]] = [[], []]
    for i in range(count):
        own_ids = tokens(rng, own)
        for k in (0, 1) if i % 2 else (1, 0):
            prompt = system + own_ids
            between()
            with taken_out(part if k else "none"):
                start = time.perf_counter()
                r = Request(f"r{i}", prompt, hash_block_size=BLOCK)
                blocks, hit, _ = managers[k].get_computed_blocks(r)
                managers[k].allocate_slots(r, r.num_tokens - hit, hit, blocks)
                times[k].append(time.perf_counter() - start)
            if hit < shared:
                raise RuntimeError(f"admission {i} hit {hit} tokens")
    base, without = (statistics.median(t) * 1e6 for t in times)
    return base, without


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", default=list(PARTS), help=", ".join(PARTS))
    parser.add_argument("--count", type=int, default=200, help="admissions per manager")
    args = parser.parse_args()
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}: choose from {', '.join(PARTS)}")
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    torch.set_num_threads(1)
    with_vllm = vllm_version() is not None
    label = "one of vLLM's admissions" if with_vllm else "other work (vLLM does not import)"
    print(f"each admission after {label}; median µs of {args.count} admissions each")
    for part in args.parts:
        between = vllm_admissions(2 * args.count + 4) if with_vllm else other_work()
        base, without = measure(part, args.count, between)
        change = (without - base) / base * 100
        print(f"  {part:<10} as is {base:6.0f}  without it {without:6.0f}  ({change:+.1f} %)")


if __name__ == "__main__":
    main()
