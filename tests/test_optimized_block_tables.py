"""``BlockTables``: flat indexing, the device mirror and its one copy per step."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridkv.optimized.block_tables import BlockTables


def _mirrored(groups: int = 2, rows: int = 3, width: int = 4) -> BlockTables:
    tables = BlockTables(groups, rows, width, torch.device("cpu"))
    tables.on_device = tables.on_host.clone()  # a separate "device" copy, as on CUDA
    return tables


def test_position_p_of_row_r_of_group_g_sits_at_g_times_r_plus_r_times_w_plus_p() -> None:
    tables = BlockTables(2, 3, 4, torch.device("cpu"))
    assert tables.base(1, 2) == (1 * 3 + 2) * 4 == 20
    tables.host.a[tables.base(1, 2) + 3] = 7
    assert int(tables.on_host[1, 2, 3]) == 7
    assert tables.table(1, 2, 4) == [0, 0, 0, 7]


def test_a_cpu_device_shares_the_host_tables_and_records_nothing() -> None:
    tables = BlockTables(2, 3, 4, torch.device("cpu"))
    assert tables.on_device is tables.on_host
    assert not tables.mirrored
    tables.touched(0, 1, 0, 2)
    tables.touched_at(np.array([5], dtype=np.int64))
    assert not tables.unflushed
    tables.flush()
    assert tables.copies == 0


def test_a_flush_copies_ranges_and_index_arrays_in_one_copy() -> None:
    tables = _mirrored()
    base = tables.base(0, 1)
    tables.host.n[base : base + 2] = [3, 4]
    tables.touched(0, 1, 0, 2)
    tables.host.a[tables.base(1, 2) + 1] = 9
    tables.touched_at(np.array([tables.base(1, 2) + 1], dtype=np.int64))
    assert (tables.unflushed, int(tables.on_device[0, 1, 0])) == (True, 0)  # not yet copied
    tables.flush()
    assert (tables.copies, tables.unflushed) == (1, False)
    assert torch.equal(tables.on_device, tables.on_host)
    assert tables.on_device[0, 1, :2].tolist() == [3, 4]
    assert int(tables.on_device[1, 2, 1]) == 9


def test_an_empty_range_or_a_clean_flush_makes_no_copy() -> None:
    tables = _mirrored()
    tables.touched(0, 0, 2, 2)
    assert not tables.unflushed
    tables.flush()
    assert tables.copies == 0


def _state(tables: BlockTables) -> tuple[int, bool]:
    """Copies made and whether flushes are held (read through a call: no narrowing)."""
    return tables.copies, tables.held


def test_one_copy_holds_every_flush_to_the_end_of_the_outermost_block() -> None:
    tables = _mirrored()
    with tables.one_copy():
        for row in range(3):
            tables.host.a[tables.base(0, row)] = row + 1
            tables.touched(0, row, 0, 1)
            tables.flush()  # held
            with tables.one_copy():
                tables.flush()  # nested: still held
        assert _state(tables) == (0, True)
    assert _state(tables) == (1, False)
    assert tables.on_device[0, :, 0].tolist() == [1, 2, 3]


def _fail_inside_one_copy(tables: BlockTables) -> None:
    with tables.one_copy():
        tables.host.a[0] = 5
        tables.touched(0, 0, 0, 1)
        raise RuntimeError("a request failed")


def test_one_copy_flushes_even_when_its_block_raises() -> None:
    tables = _mirrored()
    with pytest.raises(RuntimeError, match="a request failed"):
        _fail_inside_one_copy(tables)
    assert _state(tables) == (1, False)
    assert int(tables.on_device[0, 0, 0]) == 5


def test_across_reads_one_position_of_a_row_in_every_group_and_clear_across_nulls_it() -> None:
    tables = _mirrored(groups=3, rows=2, width=4)
    for g in range(3):
        tables.host.a[tables.base(g, 1) + 2] = 10 + g
    assert tables.across(0, 3, 1, 2) == [10, 11, 12]
    assert tables.clear_across(1, 3, 1, 2) == [11, 12]
    assert tables.across(0, 3, 1, 2) == [10, 0, 0]
    tables.flush()  # the two nulled entries were recorded, and travel in one copy
    assert tables.copies == 1
    assert tables.on_device[:, 1, 2].tolist() == [0, 0, 0]  # group 0's 10 was never touched
