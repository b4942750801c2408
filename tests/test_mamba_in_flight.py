"""Mamba "align" edge cases found by a long random hunt, pinned on both backends: a prompt
boundary whose hash lags behind, and states kept while a step is in flight."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.reference import Request
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:
    from conftest import ManagerFactory

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


def _config(num_blocks: int, *specs: object) -> KVCacheConfig:
    groups = tuple(KVCacheGroup((f"l{i}",), spec) for i, spec in enumerate(specs))  # type: ignore[arg-type]
    return KVCacheConfig(num_blocks, groups)


def test_a_prompt_boundary_whose_hash_lags_behind_caches_nothing(
    make_manager: ManagerFactory,
) -> None:
    """The prompt's last hash boundary is where an "align" state is cached; while that hash is
    still in flight (lookahead hashing) there is no key: the allocation succeeds, nothing is
    cached (it raised IndexError before)."""
    mamba = MambaSpec(block_size=2, state_bytes=16, mamba_cache_mode="align")
    m = make_manager(_config(3, mamba), 48, True)
    r = Request("r", [0, 0, 0], hash_block_size=2)
    assert len(r.block_hashes) == 1  # hashed when read
    del r._block_hashes[:]
    assert m.get_computed_blocks(r)[1] == 0
    out = m.allocate_slots(r, 2)
    assert out is not None
    assert out.get_block_ids() == ([1],)
    assert m.snapshot().num_cached_keys == 0
    m.check_invariants()


def test_states_of_tokens_in_flight_stay_until_their_step_is_processed(
    make_manager: ManagerFactory,
) -> None:
    """Async scheduling releases on the processed count: with one token in flight an "align"
    table holds one state block more than the settled bound of three, and the invariant
    checker allows exactly that."""
    specs = (
        ChunkedLocalAttentionSpec(block_size=1, attention_chunk_size=1, **SIZES),
        SlidingWindowSpec(block_size=1, sliding_window=2, **SIZES),
        MambaSpec(
            block_size=1,
            state_bytes=16,
            mamba_cache_mode="align",
            num_prefill_checkpoint_blocks=1,
            prefill_checkpoint_alignment=1,
        ),
    )
    m = make_manager(_config(15, *specs), 48, True)
    r0 = Request("r0", [0, 0, 0, 0], hash_block_size=1)
    r1 = Request("r1", [0], hash_block_size=1)
    for _ in range(3):
        m.new_step_starts()
    m.get_computed_blocks(r0)
    assert m.allocate_slots(r0, 1) is not None
    r0.num_computed_tokens = 1
    m.new_step_starts()
    m.new_step_starts()
    m.get_computed_blocks(r1)
    assert m.allocate_slots(r1, 1) is not None
    r1.num_computed_tokens = 1
    m.new_step_starts()
    r0.append_output_token_ids(0)
    vars(r0)["num_in_flight_tokens"] = 0
    assert m.allocate_slots(r0, 3) is not None
    r0.num_computed_tokens = 4
    m.new_step_starts()
    r0.append_output_token_ids(0)
    vars(r0)["num_in_flight_tokens"] = 1
    assert m.allocate_slots(r0, 2) is not None
    r0.num_computed_tokens = 6
    mamba_table = m.get_block_ids("r0")[2]
    assert sum(1 for b in mamba_table if b) == 4
    m.check_invariants()
