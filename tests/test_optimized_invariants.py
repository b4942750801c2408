"""The optimized backend's invariant checker catches each corruption, and names it.

``TorchKVCacheManager.check_invariants`` decides most of its checks in numpy calls over whole
arrays (``hybridkv.optimized.table_scan`` for the tables, the pool's own checks for its queue,
chains, keys and sources); each test here builds a small live manager, corrupts the one piece of
state a check guards and expects that check's ``InvariantError``, naming the offender (block,
request, group or source).
"""

from __future__ import annotations

import pytest
from optimized_live_state import FULL, WINDOW, Live, live_state  # noqa: F401 (the fixture)

from hybridkv.optimized import TorchKVCacheManager, table_scan
from hybridkv.optimized.invariants import estimate_by_scan
from hybridkv.reference import Request
from hybridkv.spec import (
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
)
from hybridkv.spec.errors import InvariantError


def test_the_live_state_passes_every_check(live: Live) -> None:
    live.manager.check_invariants()
    assert live.pool.dups == set()


def test_the_scan_of_all_tables_at_once_gives_each_requests_scan(live: Live) -> None:
    scan = table_scan.scan_tables(live.state)
    by_request = [estimate_by_scan(live.state, request_id) for request_id in scan.request_ids]
    assert table_scan.estimates_by_scan(live.state, scan) == by_request
    assert dict(zip(scan.request_ids, by_request, strict=True)) == {"b": 20, "c": 24}


# --- Rows and tables --------------------------------------------------------------------------


def test_a_row_both_held_and_free_is_shared(live: Live) -> None:
    live.state.rows._free.append(live.row("b"))
    live.check("table rows are lost or shared")


def test_a_table_longer_than_its_row_is_named(live: Live) -> None:
    width = live.state.tables.width
    live.state.rows.length[live.counter("b", WINDOW)] = width + 1
    live.check(f"request 'b' group {WINDOW} has a table of {width + 1} positions, beyond")


def test_a_null_after_a_real_block_is_outside_the_leading_nulls(live: Live) -> None:
    live.state.tab.a[live.at("c", WINDOW, 3)] = 0
    live.check(f"request 'c' group {WINDOW} has nulls outside positions 0 … 1")


def test_a_real_block_among_the_leading_nulls_is_named(live: Live) -> None:
    live.state.tab.a[live.at("c", WINDOW, 0)] = next(
        b for b in live.pool.free_queue() if live.pool.src.a[b] < 0
    )
    live.check(f"request 'c' group {WINDOW} has nulls outside positions 0 … 1")


def test_a_full_attention_table_holding_a_null_is_named(live: Live) -> None:
    live.state.tab.a[live.at("b", FULL, 0)] = 0
    live.state.rows.nulls[live.counter("b", FULL)] = 1
    live.check("request 'b' of a full-attention group holds null blocks")


def test_tables_of_one_row_differing_in_length_are_named(live: Live) -> None:
    assert live.state.layout.uniform_columns
    live.state.rows.length[live.counter("b", WINDOW)] -= 1
    live.check("request 'b''s tables differ in length")


def test_a_table_entry_past_the_pool_is_named(live: Live) -> None:
    beyond = live.state.layout.config.num_blocks + 3
    live.state.tab.a[live.at("b", WINDOW, 1)] = beyond
    live.check(f"request 'b' group {WINDOW} holds block {beyond}, which is not a block")


def test_a_block_in_two_groups_is_named_with_both(live: Live) -> None:
    block = live.state.table(FULL, live.row("b"))[0]
    live.state.tab.a[live.at("c", WINDOW, 2)] = block
    live.check(f"block {block} is in groups {FULL} and {WINDOW}")


def test_a_reference_count_above_its_holders_is_named(live: Live) -> None:
    block = live.state.table(FULL, live.row("b"))[2]
    live.pool.ref.a[block] += 1
    live.check(f"block {block} has ref_cnt 2 but 1 holders")


def test_an_adopted_block_counts_only_its_live_holders(live: Live) -> None:
    """A block of freed "a"'s prefix adopted by "c": one holder left, whatever it had."""
    block = live.state.table(FULL, live.row("c"))[0]
    live.pool.ref.a[block] = 3
    live.check(f"block {block} has ref_cnt 3 but 1 holders")


def test_a_stale_device_copy_of_a_mirrored_table_is_named(live: Live) -> None:
    """A CPU tensor of its own stands in for the device copy, mirrored as a GPU's would be."""
    tables = live.state.tables
    tables.on_device = tables.on_host.clone()
    assert tables.mirrored
    live.manager.check_invariants()
    tables.on_device[WINDOW, live.row("c"), 3] += 1
    live.check("device table of 'c' is stale")


def test_a_stale_threshold_names_its_request(live: Live) -> None:
    live.state.rows.capacity[live.row("b")] += 4
    live.check("thresholds of 'b' are stale")


def test_a_wrong_row_count_of_a_source_is_named(live: Live) -> None:
    src = live.state.row_src[live.row("b")]
    live.pool.source(src).row_refs += 1
    live.check(f"source {src} has a wrong row count")


def test_an_estimate_off_from_the_scan_of_the_tables_is_named(live: Live) -> None:
    """Two cached blocks swapped in "c"'s full table: the estimate reads the last position,
    now the lower hash index; the scan still finds the longest prefix."""
    tab = live.state.tab.a
    last, before = live.at("c", FULL, 5), live.at("c", FULL, 4)
    tab[last], tab[before] = tab[before], tab[last]
    live.check("request 'c': estimate_cached_tokens 20 but its tables hold a prefix of 24")


def test_a_mamba_table_with_too_many_real_blocks_is_named() -> None:
    mamba = MambaSpec(block_size=2, state_bytes=16, mamba_cache_mode="align")
    manager = TorchKVCacheManager(
        KVCacheConfig(30, (KVCacheGroup(("m",), mamba),)), max_model_len=64, max_num_reqs=4
    )
    request = Request("r", list(range(16)), hash_block_size=2, block_hasher=manager.block_hasher)
    assert manager.allocate_slots(request, 16) is not None
    manager.check_invariants()
    state = manager.state
    row = state.rows.row_of("r")
    assert row is not None
    table = state.table(0, row)
    nulls = [pos for pos, block in enumerate(table) if block == 0]
    free = state.pool.free_queue()
    for pos, block in zip(nulls[:3], free, strict=False):
        state.tab.a[state.tables.base(0, row) + pos] = block
    real = sum(1 for block in state.table(0, row) if block)
    assert real > 3
    with pytest.raises(InvariantError, match=f"request 'r' holds {real} Mamba blocks"):
        manager.check_invariants()
