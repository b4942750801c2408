"""The optimized backend gives the same results on CUDA as on CPU (skipped without CUDA).

With ``device="cuda"`` the pool's bookkeeping stays on the host and the block tables live on
the GPU, updated in place after every call; results, state and the tables must match a CPU
manager driven identically.
"""

from __future__ import annotations

import random

import pytest
import torch

from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_golden_traces_replay_identically_on_cuda() -> None:
    def on_cuda(config: KVCacheConfig, max_model_len: int, caching: bool) -> TorchKVCacheManager:
        return TorchKVCacheManager(config, max_model_len, caching, device="cuda")

    for name in trace_names()[::12]:
        _, divergence = replay_trace(name, on_cuda, check_invariants=True)
        assert divergence is None, str(divergence)


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
