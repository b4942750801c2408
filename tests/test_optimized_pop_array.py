"""``TorchBlockPool.pop_array``: ``pop_n`` as one int64 array, a consecutive run without the walk.

Where the free queue's next blocks are consecutive ids (a fresh pool's queue), ``pop_array``
finds them by one comparison of their links instead of walking the queue; anywhere else it
walks, as ``pop_n`` does. Either way the blocks, their order and the pool after the take are
``pop_n``'s.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized.block_pool import TorchBlockPool

NUM_BLOCKS = 160


def pools() -> tuple[TorchBlockPool, TorchBlockPool]:
    return tuple(TorchBlockPool(NUM_BLOCKS, 1, enable_caching=True) for _ in range(2))  # type: ignore[return-value]


def state(pool: TorchBlockPool) -> tuple[object, ...]:
    return (pool.free_queue(), pool.ref.n.tolist(), pool.num_free_blocks)


def test_a_fresh_pools_queue_hands_out_its_first_blocks_as_one_run() -> None:
    """A fresh pool's queue is blocks 1 … N − 1 in order: 40 blocks are 1 … 40, then the next
    40 are 41 … 80, each held once, as ``pop_n`` takes them."""
    ours, theirs = pools()
    for start in (1, 41):
        taken = ours.pop_array(40)
        assert taken.dtype.name == "int64"
        assert taken.tolist() == list(range(start, start + 40))
        assert theirs.pop_n(40) == taken.tolist()
        assert state(ours) == state(theirs)
    ours.check_invariants()


def test_a_queue_whose_blocks_changed_places_is_walked() -> None:
    """Blocks 1 … 50 taken, then 45 … 48 given back (uncached: to the head): the queue is 45,
    46, 47, 48, 51, 52, …. A take of 40 starts with a run of consecutive ids that breaks
    after 48: the walk takes them, in the queue's order."""
    ours, theirs = pools()
    for pool in (ours, theirs):
        pool.pop_n(50)
        pool.free_blocks([45, 46, 47, 48])
    assert ours.free_queue()[:6] == [45, 46, 47, 48, 51, 52]
    taken = ours.pop_array(40)
    assert taken.tolist() == [45, 46, 47, 48, *range(51, 87)]
    assert theirs.pop_n(40) == taken.tolist()
    assert state(ours) == state(theirs)
    ours.check_invariants()


def test_a_take_larger_than_the_free_queue_is_refused_and_changes_nothing() -> None:
    ours, _ = pools()
    before = state(ours)
    with pytest.raises(ValueError, match="cannot take 160 blocks from a free queue of 159"):
        ours.pop_array(NUM_BLOCKS)
    assert state(ours) == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.randoms(use_true_random=False)), max_size=12))
def test_takes_and_frees_in_any_order_leave_the_pool_as_pop_n_does(
    steps: list[tuple[int, object]],
) -> None:
    """Takes of any size (the walk's threshold on both sides) and frees of a random part of
    what is held, in a random order: every take's blocks and every pool state are
    ``pop_n``'s."""
    ours, theirs = pools()
    held: list[int] = []
    for count, rng in steps:
        count = min(count, ours.num_free_blocks)
        taken = ours.pop_array(count).tolist()
        assert theirs.pop_n(count) == taken
        held += taken
        rng.shuffle(held)  # type: ignore[attr-defined]
        back, held = held[: len(held) // 2], held[len(held) // 2 :]
        for pool in (ours, theirs):
            pool.free_blocks(back)
        assert state(ours) == state(theirs)
    ours.check_invariants()


def test_a_take_of_no_blocks_takes_none_whatever_the_threshold() -> None:
    """``pop_array(0)`` is empty and changes nothing, also with the walk's threshold at 0."""
    ours, theirs = pools()
    ours.insert_min = 0
    assert ours.pop_array(0).tolist() == []
    assert state(ours) == state(theirs)
    ours.check_invariants()
