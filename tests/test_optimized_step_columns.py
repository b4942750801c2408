"""``StepColumns``: requests whose computed-token counts live in one numpy column.

A column request is a ``Request`` in every call; its count is its slot of the column, written
and read through the attribute or the column alike. A batch of column requests of one column
reads their counts with one gather, and must give what the single calls give.
"""

from __future__ import annotations

import copy
import gc
import pickle
import random

import numpy as np
import pytest
from batch_layouts import layout
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import ColumnRequest, StepColumns, TorchKVCacheManager, path_counts
from hybridkv.reference import KVCacheManager, Request


def test_a_column_requests_count_is_its_slot_of_the_column() -> None:
    columns = StepColumns(4)
    request = columns.request("a", [1, 2, 3, 4, 5], hash_block_size=4)
    assert isinstance(request, ColumnRequest)
    assert isinstance(request, Request)
    assert request.num_computed_tokens == 0
    request.num_computed_tokens = 3
    assert columns.computed[request.slot] == 3
    columns.computed[request.slot] += 2
    assert request.num_computed_tokens == 5
    assert request.num_tokens == 5
    assert len(request.block_hashes) == 1


def test_the_column_grows_keeping_every_count() -> None:
    columns = StepColumns(1)
    made = []
    for i in range(9):
        request = columns.request(f"r{i}", [i], hash_block_size=4)
        request.num_computed_tokens = 10 * i
        made.append(request)
    assert columns.computed.shape[0] == 16
    assert [r.num_computed_tokens for r in made] == [10 * i for i in range(9)]
    assert columns.computed[[r.slot for r in made]].tolist() == [10 * i for i in range(9)]
    assert sorted(r.slot for r in made) == list(range(9))


def test_a_collected_requests_slot_is_zeroed_and_reused() -> None:
    columns = StepColumns(4)
    keep = columns.request("keep", [1], hash_block_size=4)
    gone = columns.request("gone", [1], hash_block_size=4)
    slot = gone.slot
    gone.num_computed_tokens = 7
    del gone
    gc.collect()
    assert columns.computed[slot] == 0
    again = columns.request("again", [1], hash_block_size=4)
    assert again.slot == slot
    assert again.num_computed_tokens == 0
    assert keep.slot != slot


def test_a_bad_count_is_an_error_that_names_the_field_and_changes_nothing() -> None:
    columns = StepColumns(2)
    request = columns.request("a", [1, 2], hash_block_size=4)
    request.num_computed_tokens = 2
    for bad in (1.5, "3", None, 1 << 64):
        with pytest.raises(ValueError, match="num_computed_tokens"):
            request.num_computed_tokens = bad  # type: ignore[assignment]
        assert request.num_computed_tokens == 2


def test_a_request_that_cannot_be_built_gives_its_slot_back_once() -> None:
    columns = StepColumns(2)
    with pytest.raises(ValueError, match="request_id"):
        columns.request(5, [1], hash_block_size=4)  # type: ignore[arg-type]
    gc.collect()
    assert columns.free == [0]
    first = columns.request("a", [1], hash_block_size=4)
    second = columns.request("b", [1], hash_block_size=4)
    assert (first.slot, second.slot) == (0, 1)
    with pytest.raises(ValueError, match="capacity"):
        StepColumns(0)


def test_a_column_request_is_not_copied_or_pickled_as_a_copy_would_share_its_slot() -> None:
    columns = StepColumns(2)
    request = columns.request("a", [1], hash_block_size=4)
    for copier in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="ColumnRequest"):
            copier(request)
    gc.collect()
    assert columns.free == []


def test_slots_name_only_a_columns_own_requests() -> None:
    columns, other = StepColumns(2), StepColumns(2)
    a = columns.request("a", [1], hash_block_size=4)
    b = columns.request("b", [1], hash_block_size=4)
    c = other.request("c", [1], hash_block_size=4)
    slots = columns.slots([b, a])
    assert slots is not None
    assert slots.tolist() == [b.slot, a.slot]
    assert columns.slots([a, c]) is None
    assert columns.slots([a, Request("d", [1], hash_block_size=4)]) is None


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**16), st.booleans())
def test_batches_of_column_requests_equal_plain_requests_in_single_calls(
    seed: int, caching: bool
) -> None:
    """24 column requests batched on the optimized backend against the same requests, plain, in
    single calls on the reference: decode steps with a few longer ones, the counts advanced
    through the column (one numpy operation) or the attribute, requests finished and new ones
    admitted on the way; every result and state equal, the column path taken."""
    rng = random.Random(seed)
    batched = TorchKVCacheManager(layout(1200, fused=True), 160, caching, max_num_reqs=32)
    batched.batch_min = batched.busy_batch_min = 2
    reference = KVCacheManager(layout(1200, fused=True), 160, caching)
    columns = StepColumns(8)
    running: list[tuple[ColumnRequest, Request]] = []

    def admit(i: int) -> None:
        prompt = [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
        mine = columns.request(f"r{i}", prompt, hash_block_size=4)
        theirs = Request(f"r{i}", prompt, hash_block_size=4)
        assert isinstance(mine, ColumnRequest)
        got = batched.allocate_slots(mine, mine.num_tokens)
        assert got == reference.allocate_slots(theirs, theirs.num_tokens)
        if got is not None:
            mine.num_computed_tokens = theirs.num_computed_tokens = theirs.num_tokens
            running.append((mine, theirs))

    for i in range(24):
        admit(i)
    before = batched.fast_paths[path_counts.BATCH_COLUMNS]
    for step in range(24):
        counts = [1 + (rng.random() < 0.1) * rng.randrange(1, 6) for _ in running]
        for (mine, theirs), count in zip(running, counts, strict=True):
            tokens = [rng.randrange(40) for _ in range(count)]
            mine.append_output_token_ids(tokens)
            theirs.append_output_token_ids(tokens)
        got = batched.allocate_slots_batch([m for m, _ in running], counts)
        assert got == [
            reference.allocate_slots(t, c) for (_, t), c in zip(running, counts, strict=True)
        ]
        advanced = [c if new is not None else 0 for c, new in zip(counts, got, strict=True)]
        slots = np.array([m.slot for m, _ in running], dtype=np.int64)
        if step % 2:
            columns.computed[slots] += np.array(advanced, dtype=np.int64)
        else:
            for (mine, _), count in zip(running, advanced, strict=True):
                mine.num_computed_tokens += count
        for (_, theirs), count in zip(running, advanced, strict=True):
            theirs.num_computed_tokens += count
        assert batched.snapshot() == reference.snapshot()
        batched.check_invariants()
        if step % 8 == 7:
            for mine, theirs in running[::4]:
                batched.free(mine)
                reference.free(theirs)
            del running[::4]
            for i in range(3):
                admit(100 * step + i)
    assert batched.fast_paths[path_counts.BATCH_COLUMNS] > before
