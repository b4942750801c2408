"""The optimized backend gives the same results on CUDA as on CPU (skipped without CUDA).

With ``device="cuda"`` the pool's bookkeeping stays on the host and the block tables live on
the GPU, updated in place after every call; results, state and the tables must match a CPU
manager driven identically, and a scheduler step (``allocate_slots_batch``) writes its changed
entries to the device in at most one host→device copy. The last property is also checked
without a GPU, on a CPU manager given a separate "device" copy of its tables.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from hybridkv.conformance.adapters import manager_backend
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_golden_traces_replay_identically_on_cuda() -> None:
    _, on_cuda = manager_backend("optimized[cuda]", TorchKVCacheManager, device="cuda")

    # Every twelfth trace of both sets: engine features (Mamba tables, speculative blocks,
    # tables of different widths) included.
    for name in trace_names()[::12]:
        _, divergence = replay_trace(name, on_cuda, check_invariants=True)
        assert divergence is None, str(divergence)


@needs_cuda
def test_cuda_and_cpu_managers_agree_step_by_step() -> None:
    sizes = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    config = KVCacheConfig(
        600,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=9, **sizes)),
        ),
    )
    managers = [
        TorchKVCacheManager(config, 128, device=device, max_num_reqs=40)
        for device in ("cpu", "cuda")
    ]
    for m in managers:
        m.batch_min = m.busy_batch_min = 1
    rng = random.Random(0)
    prompts = [[rng.randrange(40) for _ in range(5 + i % 11)] for i in range(32)]
    twins = [
        [Request(f"r{i}", p, hash_block_size=4) for i, p in enumerate(prompts)] for _ in managers
    ]
    for m, requests in zip(managers, twins, strict=True):
        for r in requests:
            blocks, hit, _ = m.get_computed_blocks(r)
            assert m.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
    for _ in range(20):
        token = rng.randrange(40)
        results = []
        for m, requests in zip(managers, twins, strict=True):
            for r in requests:
                r.append_output_token_ids(token)
            results.append(m.allocate_slots_batch(requests, 1))
            for r in requests:
                r.num_computed_tokens += 1
        assert results[0] == results[1]
        assert managers[0].snapshot() == managers[1].snapshot()
        for g in range(2):
            assert torch.equal(managers[0].block_table(g), managers[1].block_table(g).cpu())
        managers[1].check_invariants()


def _decoding(device: str, batch: int, stagger: int) -> tuple[TorchKVCacheManager, list[Request]]:
    """A manager with ``batch`` prefilled requests on a full + sliding-window layout, prompt
    lengths staggered over ``stagger`` tokens (so ``batch / stagger`` cross a block together)."""
    sizes = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    config = KVCacheConfig(
        40 * batch,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=9, **sizes)),
        ),
    )
    m = TorchKVCacheManager(config, 128, device=device, max_num_reqs=batch)
    rng = random.Random(batch)
    requests = [
        Request(f"r{i}", [rng.randrange(40) for _ in range(40 - i % stagger)], hash_block_size=4)
        for i in range(batch)
    ]
    for r in requests:
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    return m, requests


def _decode_steps(
    m: TorchKVCacheManager, requests: list[Request], steps: int, run: Callable[[], None]
) -> None:
    rng = random.Random(0)
    for _ in range(steps):
        for r in requests:
            r.append_output_token_ids(rng.randrange(40))
        run()
        for r in requests:
            r.num_computed_tokens += 1
        assert torch.equal(m.state.tables.on_device.cpu(), m.state.tables.on_host)
    m.check_invariants()


# Big batches (vectorised, with a few busy requests served one by one) and a small one (below
# ``batch_min``: the single calls).
BATCHES = [(64, 4), (8, 2)]


@pytest.mark.parametrize(("batch", "stagger"), BATCHES)
def test_a_step_flushes_its_table_changes_once(batch: int, stagger: int) -> None:
    m, requests = _decoding("cpu", batch, stagger)
    m.state.tables.on_device = (
        m.state.tables.on_host.clone()
    )  # a separate "device" copy, kept by flushes
    writes: list[int] = []

    def step() -> None:
        before = m.state.tables.copies
        assert all(x is not None for x in m.allocate_slots_batch(requests, 1))
        writes.append(m.state.tables.copies - before)

    _decode_steps(m, requests, 12, step)
    assert max(writes) == 1  # some step changed the tables, and none wrote twice


@needs_cuda
def test_block_tables_are_resident_on_the_device() -> None:
    m, requests = _decoding("cuda", 4, 1)
    for g in range(m.num_groups):
        table = m.block_table(g)
        assert table.device.type == "cuda"
        assert table.shape == (m.max_num_reqs, m.max_blocks_per_req)
    row = m.row_of(requests[0].request_id)
    assert row is not None
    for g, ids in enumerate(m.get_block_ids(requests[0].request_id)):
        assert m.block_table(g)[row, : len(ids)].tolist() == ids


@needs_cuda
@pytest.mark.parametrize(("batch", "stagger"), BATCHES)
def test_a_step_copies_to_the_device_at_most_once(batch: int, stagger: int) -> None:
    m, requests = _decoding("cuda", batch, stagger)
    copies: list[int] = []

    def step() -> None:
        with warnings.catch_warnings():  # the profiler's own notices are not under test
            warnings.simplefilter("ignore")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                assert all(x is not None for x in m.allocate_slots_batch(requests, 1))
                torch.cuda.synchronize()
        names = [e.name for e in prof.events() if "memcpy htod" in e.name.lower()]
        copies.append(len(names))

    _decode_steps(m, requests, 12, step)
    assert max(copies) == 1, copies
