"""The python half of ``scripts/gpu-check.sh``: the optimized backend on a device, with figures.

``python scripts/gpu_check.py --device cuda`` prints and checks:

1. golden traces: every packaged trace replayed on ``TorchKVCacheManager(..., device=...)``
   with the invariants checked after every operation (which compare the device tables with the
   host's); the count matched;
2. residency: every group's ``block_table(g)`` is on the device;
3. copies per step: decode steps (``allocate_slots_batch``) on the bench's Gemma-3-like layout,
   large and small batches, with requests crossing block boundaries and sliding windows
   releasing blocks; per step, the flushes that wrote changed entries (``BlockTables.copies``)
   and on CUDA the host→device memcpys that ``torch.profiler`` saw
   (``ProfilerActivity.CPU`` + ``CUDA``); each must be at most one, and the device tables must
   equal the host's after every step.

``--device cpu`` is a dry run for machines without a GPU: the tables then live on the host, so
each manager gets a separate "device" copy of them (a CPU tensor), which exercises the same
dirty-entry bookkeeping and flush; the profiler part is skipped. Exit status 0 when every check
passed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from hybridkv.bench import BLOCK, gemma_like, tokens
from hybridkv.conformance.adapters import manager_backend
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import Request
from hybridkv.spec import KVCacheConfig

failures: list[str] = []


def check(ok: bool, what: str) -> None:
    print(("  ok    " if ok else "  FAIL  ") + what, flush=True)
    if not ok:
        failures.append(what)


def make_manager(
    device: str,
    config: KVCacheConfig,
    max_model_len: int,
    caching: bool = True,
    max_num_reqs: int = 256,
    **engine: Any,
) -> TorchKVCacheManager:
    m = TorchKVCacheManager(
        config, max_model_len, caching, device=device, max_num_reqs=max_num_reqs, **engine
    )
    if device == "cpu":
        # Dry run: a separate "device" copy of the tables, kept up to date by the flushes.
        m.state.tables.on_device = m.state.tables.on_host.clone()
    return m


def golden(device: str) -> None:
    names = trace_names()
    print(f"[1] golden traces on {device} (invariants after every operation)", flush=True)
    start = time.perf_counter()
    matched = 0

    def build(
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        **engine: Any,
    ) -> TorchKVCacheManager:
        # The engine traces pass their engine keywords (use_eagle, lookahead hashes, …).
        return make_manager(device, config, max_model_len, enable_caching, **engine)

    _, factory = manager_backend(f"optimized[{device}]", build)

    for name in names:
        try:
            _, divergence = replay_trace(name, factory, check_invariants=True)
        except Exception as error:  # report and go on: the count is the figure
            print(f"  {name}: {type(error).__name__}: {error}")
            continue
        if divergence is None:
            matched += 1
        else:
            print(f"  {divergence}")
    took = time.perf_counter() - start
    check(matched == len(names), f"golden traces matched: {matched}/{len(names)} ({took:.1f} s)")


def residency(device: str) -> None:
    print(f"[2] block tables resident on {device}", flush=True)
    m = TorchKVCacheManager(gemma_like(512), 4096, device=device, max_num_reqs=8)
    r = Request("r0", list(range(300)), hash_block_size=BLOCK)
    assert m.allocate_slots(r, r.num_tokens) is not None
    where = {str(m.block_table(g).device) for g in range(m.num_groups)}
    want = torch.device(device).type
    check(
        all(m.block_table(g).device.type == want for g in range(m.num_groups)),
        f"block_table(g).device for all {m.num_groups} groups: {sorted(where)}",
    )
    row = m.row_of("r0")
    assert row is not None
    same = all(
        m.block_table(g)[row, : len(ids)].cpu().tolist() == ids
        for g, ids in enumerate(m.get_block_ids("r0"))
    )
    check(same, "device rows equal get_block_ids after one allocate_slots")


def h2d_copies(step: Callable[[], object]) -> tuple[int, Counter[str]]:
    """Host→device memcpys the CUDA profiler sees while ``step`` runs (and all memcpy names)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names: Counter[str] = Counter()
    for event in prof.events():
        if "memcpy" in event.name.lower():
            names[event.name] += 1
    h2d = sum(
        count
        for name, count in names.items()
        if "htod" in name.lower() and not name.lower().startswith("cuda")
    )
    return h2d, names


def copies_per_step(device: str, batch: int, steps: int, stagger: int, profiled: bool) -> None:
    """Prompt lengths staggered over ``stagger`` tokens: ``batch / stagger`` requests enter a
    new block together every few steps."""
    prompt, max_model_len = 300, 300 + steps + 64
    rng = random.Random(batch)
    per_request = 7 * ((prompt + steps) // BLOCK + 2)
    m = make_manager(
        device, gemma_like(batch * per_request + 64), max_model_len, max_num_reqs=batch + 8
    )
    requests = []
    for i in range(batch):
        r = Request(f"r{i}", tokens(rng, prompt - i % stagger), hash_block_size=BLOCK)
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
        requests.append(r)
    per_step_flushes, per_step_h2d = [], []
    names: Counter[str] = Counter()
    tables_ok = True
    for _ in range(steps):
        for r, t in zip(requests, tokens(rng, batch), strict=True):
            r.append_output_token_ids(t)
        before = m.state.tables.copies

        def step() -> None:
            results = m.allocate_slots_batch(requests, 1)
            assert all(x is not None for x in results)

        if profiled:
            h2d, seen = h2d_copies(step)
            per_step_h2d.append(h2d)
            names.update(seen)
        else:
            step()
        per_step_flushes.append(m.state.tables.copies - before)
        for r in requests:
            r.num_computed_tokens += 1
        tables_ok &= torch.equal(m.state.tables.on_device.cpu(), m.state.tables.on_host)
    m.check_invariants()
    print(f"  B={batch}, {steps} steps, up to {-(-batch // stagger)} requests enter a new block:")
    check(
        max(per_step_flushes) <= 1,
        f"B={batch}: flushes with changes per step {per_step_flushes} "
        f"(max {max(per_step_flushes)})",
    )
    if profiled:
        check(
            max(per_step_h2d) <= 1,
            f"B={batch}: host→device memcpys per step (profiler) {per_step_h2d} "
            f"(max {max(per_step_h2d)})",
        )
        print(f"    memcpy events over all steps: {dict(names)}")
    check(tables_ok, f"B={batch}: device tables equal the host's after every step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--skip-golden", action="store_true", help="skip the trace replay")
    args = parser.parse_args(argv)
    device: str = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        return 2
    print(f"gpu_check: torch {torch.__version__}, device {device}", flush=True)
    if not args.skip_golden:
        golden(device)
    residency(device)
    print(f"[3] host→device copies per decode step on {device}", flush=True)
    profiled = torch.device(device).type == "cuda"
    for batch, steps, stagger in ((256, 20, BLOCK), (64, 20, BLOCK), (8, 20, 2)):
        copies_per_step(device, batch, steps, stagger, profiled)
    print(f"gpu_check: {'FAILED: ' + '; '.join(failures) if failures else 'all checks passed'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
