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
    m.block_pool.null_block.block_hash = next(iter(m.block_pool.cached_block_hash_to_block))


def _negative_count(m: KVCacheManager) -> None:
    block = next(iter(m.block_pool.free_block_queue))
    block.ref_cnt = -1


CORRUPTIONS: list[Callable[[KVCacheManager], None]] = [
    _corrupt_ref_count,
    _zero_held_count,
    _hold_a_free_block,
    _drop_from_queue,
    _null_in_full_table,
    _null_after_real_block,
    _block_in_two_groups,
    _cache_entry_wrong_key,
    _hash_without_entry,
    _hashed_null_block,
    _negative_count,
]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=[c.__name__.strip("_") for c in CORRUPTIONS])
def test_check_invariants_reports_the_corruption(corrupt: Callable[[KVCacheManager], None]) -> None:
    manager = _live_manager()
    corrupt(manager)
    with pytest.raises(InvariantError):
        manager.check_invariants()


def test_the_live_state_is_what_the_corruptions_assume() -> None:
    manager = _live_manager()
    assert manager.get_block_ids("run")[1][0] == 0
    assert manager.block_pool.cached_block_hash_to_block
    assert manager.num_free_blocks > 0
