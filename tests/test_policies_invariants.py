"""Every shipped policy under random traffic: the pool's invariants hold after every operation,
and every victim a policy names is free (the guard raises otherwise, so a run that completes
proves it)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from policy_workload import OPS, Op, chunked_config, document_config, run_ops

from hybridkv.policies import POLICIES
from hybridkv.reference import KVCacheManager


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=40, deadline=None)
@given(ops=OPS, chunked=st.booleans())
def test_every_policy_keeps_the_pool_consistent(name: str, ops: list[Op], chunked: bool) -> None:
    config = chunked_config(21) if chunked else document_config(17)
    sizes: list[int] = []

    def free_count(manager: KVCacheManager) -> None:
        sizes.append(manager.block_pool.num_free_blocks)

    run_ops(config, POLICIES[name](), ops, free_count)
    assert len(sizes) == len(ops)
    assert all(0 <= size <= 20 for size in sizes)
