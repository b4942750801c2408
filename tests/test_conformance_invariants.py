"""The reference's invariant checker has teeth: every corruption of its state is reported.

``check_invariants()`` runs after every step of the golden replays and the state machine; a
checker that never fires would let every other check pass vacuously. Each test builds a small
live state through the public API, corrupts one piece of bookkeeping, and expects an error.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridkv.spec.errors import InvariantError

SIZES = {"block_size": 2, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


def _live_manager() -> KVCacheManager:
    """Two groups (full, sliding window 3), one running request past its window, one finished
    request whose blocks wait cached in the free queue."""
    config = KVCacheConfig(
        num_blocks=24,
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(**SIZES)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=3, **SIZES)),
        ),
    )
    manager = KVCacheManager(config, 64)
    done = Request("done", list(range(8)), hash_block_size=2)
    assert manager.allocate_slots(done, 8) is not None
    manager.free(done)
    running = Request("run", list(range(20, 30)), hash_block_size=2)
    assert manager.allocate_slots(running, 6) is not None
    running.num_computed_tokens = 6
    assert manager.allocate_slots(running, 4) is not None
    manager.check_invariants()
    return manager


def _corrupt_ref_count(m: KVCacheManager) -> None:
    m.coordinator.managers[0].req_to_blocks["run"][0].ref_cnt += 1


def _zero_held_count(m: KVCacheManager) -> None:
    m.coordinator.managers[0].req_to_blocks["run"][0].ref_cnt = 0


def _hold_a_free_block(m: KVCacheManager) -> None:
    free = next(iter(m.block_pool.free_block_queue))
    m.coordinator.managers[0].req_to_blocks["run"].append(free)


def _drop_from_queue(m: KVCacheManager) -> None:
    block = next(iter(m.block_pool.free_block_queue))
    m.block_pool.free_block_queue.remove(block)


def _null_in_full_table(m: KVCacheManager) -> None:
    table = m.coordinator.managers[0].req_to_blocks["run"]
    table[1].ref_cnt -= 1
    m.block_pool.free_block_queue.append_n([table[1]])
    table[1] = m.block_pool.null_block


def _null_after_real_block(m: KVCacheManager) -> None:
    table = m.coordinator.managers[1].req_to_blocks["run"]
    last = table[-1]
    last.ref_cnt -= 1
    table[-1] = m.block_pool.null_block
    if last.ref_cnt == 0:
        m.block_pool.free_block_queue.append_n([last])


def _block_in_two_groups(m: KVCacheManager) -> None:
    full = m.coordinator.managers[0].req_to_blocks["run"]
    sliding = m.coordinator.managers[1].req_to_blocks["run"]
    old = sliding[-1]
    old.ref_cnt -= 1
    if old.ref_cnt == 0:
        m.block_pool.free_block_queue.append_n([old])
    sliding[-1] = full[0]
    full[0].ref_cnt += 1


def _cache_entry_wrong_key(m: KVCacheManager) -> None:
    entries = m.block_pool.cached_block_hash_to_block
    first, second = list(entries)[:2]
    block = next(iter(entries[first].values()))
    block.block_hash = second


def _hash_without_entry(m: KVCacheManager) -> None:
    key = next(iter(m.block_pool.cached_block_hash_to_block))
    del m.block_pool.cached_block_hash_to_block[key]


def _hashed_null_block(m: KVCacheManager) -> None:
    key = next(iter(m.block_pool.cached_block_hash_to_block))
    m.block_pool.null_block.block_hash = key
    m.block_pool.cached_block_hash_to_block[key][0] = m.block_pool.null_block


def _negative_count(m: KVCacheManager) -> None:
    block = next(iter(m.block_pool.free_block_queue))
    m.block_pool.free_block_queue.remove(block)
    block.ref_cnt = -1


def _null_block_in_queue(m: KVCacheManager) -> None:
    m.block_pool.free_block_queue.append_n([m.block_pool.null_block])


def _estimate_below_the_scan(m: KVCacheManager) -> None:
    """Longer prefixes at positions the estimate does not read (it reads positions 4 and 5)."""
    m.coordinator.managers[0].req_to_blocks["run"][0].block_hash_num_tokens = 12
    m.coordinator.managers[1].req_to_blocks["run"][2].block_hash_num_tokens = 12


def _empty_cache_entry(m: KVCacheManager) -> None:
    key = next(iter(m.block_pool.cached_block_hash_to_block))
    m.block_pool.cached_block_hash_to_block[(key[0], 1)] = {}


FREE = [1, 2, 3, 4, 5, 6, 7, 8, 12, 13, 19, 20, 21, 22, 23]
"""The free queue of ``_live_manager()``, in order."""

CORRUPTIONS: list[tuple[Callable[[KVCacheManager], None], str]] = [
    (_corrupt_ref_count, "block 9 has ref_cnt 2 but 1 holders"),
    (_zero_held_count, f"free queue {FREE} != count-0 blocks {sorted([*FREE, 9])}"),
    (_hold_a_free_block, "block 19 has ref_cnt 0 but 1 holders"),
    (_drop_from_queue, f"free queue {FREE[:10] + FREE[11:]} != count-0 blocks {FREE}"),
    (_null_in_full_table, "request 'run' of a full-attention group holds null blocks"),
    (_null_after_real_block, "request 'run' has null positions [0, 1, 4] after a real block"),
    (_block_in_two_groups, "block 9 is in groups 0 and 1"),
    (_cache_entry_wrong_key, "cache entry of group 0 points at block 1 holding another key"),
    (_hash_without_entry, "18 blocks hold a hash but 17 are in the cache"),
    (_hashed_null_block, "the null block holds a hash"),
    (_negative_count, "a negative reference count"),
    (_null_block_in_queue, "the null block is in the free queue"),
    (_empty_cache_entry, "an empty cache entry for group 1"),
    (
        _estimate_below_the_scan,
        "request 'run': estimate_cached_tokens 10 but its tables hold a prefix of 12 cached tokens",
    ),
]


@pytest.mark.parametrize(
    ("corrupt", "message"), CORRUPTIONS, ids=[c.__name__.strip("_") for c, _ in CORRUPTIONS]
)
def test_check_invariants_reports_the_corruption(
    corrupt: Callable[[KVCacheManager], None], message: str
) -> None:
    """Each corruption is reported by the check written for it, in words that name it."""
    manager = _live_manager()
    corrupt(manager)
    with pytest.raises(InvariantError) as raised:
        manager.check_invariants()
    assert str(raised.value) == message


def test_the_live_state_is_what_the_corruptions_assume() -> None:
    manager = _live_manager()
    assert manager.get_block_ids("run")[1][0] == 0
    assert manager.block_pool.cached_block_hash_to_block
    assert manager.num_free_blocks > 0


def test_an_align_mamba_table_holding_too_many_real_blocks_is_reported() -> None:
    """An ``"align"`` Mamba table may hold nulls anywhere but at most 3 real blocks here (no
    speculative blocks, no tokens in flight): two more than the one state are reported."""
    sizes = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    config = KVCacheConfig(
        num_blocks=14,
        groups=(
            KVCacheGroup(("full",), FullAttentionSpec(block_size=4, **sizes)),
            KVCacheGroup(
                ("mamba",), MambaSpec(block_size=4, state_bytes=16, mamba_cache_mode="align")
            ),
        ),
    )
    manager = KVCacheManager(config, 64)
    assert manager.allocate_slots(Request("r", list(range(10)), hash_block_size=4), 10)
    table = manager.coordinator.managers[1].req_to_blocks["r"]
    assert [block.block_id for block in table] == [0, 0, 4]
    manager.check_invariants()
    table.extend(list(manager.block_pool.free_block_queue)[:3])
    with pytest.raises(InvariantError) as raised:
        manager.check_invariants()
    assert str(raised.value) == "request 'r' holds 4 Mamba blocks (> 3)"
