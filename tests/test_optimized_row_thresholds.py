"""``RowThresholds``: a row's next take, release and caching points from its counters."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized.group_columns import GroupColumns
from hybridkv.optimized.group_rules import (
    CHUNKED,
    FULL,
    NEVER,
    SLIDING,
    GroupRule,
    one_window,
    release_columns,
)
from hybridkv.optimized.row_thresholds import RowThresholds
from hybridkv.optimized.rows import RowTables

BLOCK = 4
FULL_RULE = GroupRule(FULL, BLOCK)
WINDOW_RULE = GroupRule(SLIDING, BLOCK, span=8)  # a window of 8 tokens
CHUNK_RULE = GroupRule(CHUNKED, BLOCK, span=16)  # chunks of 16 tokens


def _thresholds(rules: list[GroupRule], caching: bool = True) -> tuple[RowTables, RowThresholds]:
    rows = RowTables(4, len(rules))
    columns = GroupColumns.build(
        4,
        [r.span if r.kind == SLIDING else NEVER for r in rules],
        [r.span if r.kind == CHUNKED else 0 for r in rules],
        releases=any(r.releases for r in rules),
        sparse_groups=[],
        vectorisable=True,
    )
    thresholds = RowThresholds(
        rows,
        rules,
        columns,
        block_size=BLOCK,
        caching=caching,
        uniform=True,
        general=False,
    )
    return rows, thresholds


def _set(rows: RowTables, row: int, length: int, nulls: list[int], cached: int) -> None:
    for g, held in enumerate(nulls):
        i = rows.index(row, g)
        rows.length[i], rows.nulls[i], rows.cached[i] = length, held, cached


def test_a_full_and_a_window_group_row_takes_releases_and_caches_where_its_rules_say() -> None:
    rows, thresholds = _thresholds([FULL_RULE, WINDOW_RULE])
    row = rows.take("r")
    # 5 blocks (20 tokens) each, the window's first 2 positions null, 4 blocks cached.
    _set(rows, row, 5, [0, 2], 4)
    thresholds.refresh(row)
    assert rows.capacity[row] == 5 * BLOCK == 20
    # The window's next block (position 2, tokens 8 … 11) leaves once 11 + 8 = 19 tokens are
    # processed: (nulls + 1) × block + window − 1.
    assert rows.release_at[row] == (2 + 1) * BLOCK + 8 - 1 == 19
    assert rows.cache_at[row] == (4 + 1) * BLOCK == 20
    assert rows.quiet_below[row] == min(20 + 1, 19 + 1, 20) == 20


def test_a_chunked_group_releases_at_the_start_of_the_chunk_after_its_next_block() -> None:
    rows, thresholds = _thresholds([FULL_RULE, CHUNK_RULE])
    row = rows.take("r")
    _set(rows, row, 6, [0, 0], 0)
    thresholds.refresh(row)
    # Block 0 (tokens 0 … 3) leaves when the chunk of tokens 16 … 31 starts.
    assert rows.release_at[row] == 16
    _set(rows, row, 6, [0, 4], 0)
    thresholds.refresh(row)
    assert rows.release_at[row] == 32  # block 4 (tokens 16 … 19): the chunk from 32


def test_without_caching_the_quiet_threshold_ignores_full_blocks() -> None:
    rows, thresholds = _thresholds([FULL_RULE, WINDOW_RULE], caching=False)
    row = rows.take("r")
    _set(rows, row, 5, [0, 2], 0)
    thresholds.refresh(row)
    assert rows.quiet_below[row] == min(20, 19) + 1 == 20


def test_a_full_attention_only_row_never_releases() -> None:
    rows, thresholds = _thresholds([FULL_RULE, FULL_RULE])
    row = rows.take("r")
    _set(rows, row, 3, [0, 0], 1)
    thresholds.refresh(row)
    assert rows.release_at[row] == NEVER
    assert rows.quiet_below[row] == min(12 + 1, (1 + 1) * BLOCK) == 8


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(0, 40), st.integers(0, 40)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from([[FULL_RULE, WINDOW_RULE, WINDOW_RULE], [FULL_RULE, CHUNK_RULE, WINDOW_RULE]]),
)
def test_refreshing_many_rows_at_once_equals_refreshing_each(
    counters: list[tuple[int, int, int, int]], rules: list[GroupRule]
) -> None:
    one_rows, one = _thresholds(rules)
    many_rows, many = _thresholds(rules)
    taken = []
    for i, (length, null_a, null_b, cached) in enumerate(counters):
        row = one_rows.take(f"r{i}")
        assert many_rows.take(f"r{i}") == row
        nulls = [0, min(null_a, length), min(null_b, length)]
        _set(one_rows, row, length, nulls, cached)
        _set(many_rows, row, length, nulls, cached)
        one.refresh(row)
        taken.append(row)
    picked = np.array(taken, dtype=np.int64)
    length_now, nulls_now, cached_now = many_rows.gather(many_rows.pair_index(picked))
    many.refresh_rows(picked, length_now, nulls_now, cached_now)
    assert many_rows.thresholds[:, taken].tolist() == one_rows.thresholds[:, taken].tolist()


def test_neighbouring_groups_of_one_sliding_window_rule_release_as_one_slice() -> None:
    assert one_window([FULL_RULE, WINDOW_RULE, WINDOW_RULE]) == (1, 3, BLOCK, 8)
    assert one_window([WINDOW_RULE, FULL_RULE, WINDOW_RULE]) is None  # not neighbours
    assert one_window([FULL_RULE, WINDOW_RULE, GroupRule(SLIDING, BLOCK, span=16)]) is None
    assert one_window([FULL_RULE, CHUNK_RULE]) is None
    assert one_window([FULL_RULE]) is None
    assert release_columns([FULL_RULE, CHUNK_RULE, WINDOW_RULE]) == [
        (1, BLOCK, 16, True),
        (2, BLOCK, 8, False),
    ]
