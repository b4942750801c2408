"""The optimized backend's invariant checker catches each corruption, and names it.

``TorchKVCacheManager.check_invariants`` decides most of its checks in numpy calls over whole
arrays (``hybridkv.optimized.table_scan`` for the tables, the pool's own checks for its queue,
chains, keys and sources); each test here builds a small live manager, corrupts the one piece of
state a check guards and expects that check's ``InvariantError``, naming the offender (block,
request, group or source).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hybridkv.optimized import TorchKVCacheManager, table_scan
from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.invariants import estimate_by_scan
from hybridkv.optimized.state import ManagerState
from hybridkv.reference import Request
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)
from hybridkv.spec.errors import InvariantError

KV = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
FULL, WINDOW = 0, 1


@dataclass
class Live:
    """A manager after a few requests: "b" (row 1) and "c" (row 0) hold blocks, "c" shares a
    cached prefix with the freed "a" and holds leading nulls in its sliding-window table."""

    manager: TorchKVCacheManager
    state: ManagerState
    pool: TorchBlockPool

    def row(self, request_id: str) -> int:
        row = self.state.rows.row_of(request_id)
        assert row is not None
        return row

    def at(self, request_id: str, group: int, pos: int) -> int:
        """The flat host-table index of a table position."""
        return self.state.tables.base(group, self.row(request_id)) + pos

    def counter(self, request_id: str, group: int) -> int:
        """The index of a (row, group) in the row counters."""
        return self.state.rows.index(self.row(request_id), group)

    def check(self, match: str) -> None:
        with pytest.raises(InvariantError, match=match):
            self.manager.check_invariants()


def _run(manager: TorchKVCacheManager, request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens, hash_block_size=4, block_hasher=manager.block_hasher)
    blocks, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, len(tokens) - hit, hit, blocks) is not None
    request.num_computed_tokens = len(tokens)
    return request


@pytest.fixture
def live() -> Live:
    window = SlidingWindowSpec(**KV, sliding_window=8)
    config = KVCacheConfig(
        40,
        (KVCacheGroup(("full",), FullAttentionSpec(**KV)), KVCacheGroup(("sw",), window)),
    )
    manager = TorchKVCacheManager(config, max_model_len=128, max_num_reqs=8)
    first = _run(manager, "a", list(range(24)))
    _run(manager, "b", list(range(100, 120)))
    manager.free(first)
    _run(manager, "c", list(range(16)) + [7] * 8)
    manager.check_invariants()
    state = manager.state
    assert state.table(WINDOW, state.rows.row_of("c") or 0)[:2] == [0, 0]
    return Live(manager, state, state.pool)


def _free_blocks(live: Live) -> list[int]:
    return live.pool.free_queue()


def _uncached_free_block(live: Live) -> int:
    return next(b for b in _free_blocks(live) if live.pool.src.a[b] < 0)


def _chain_of_two(live: Live) -> tuple[int, int, int]:
    """A bucket whose chain holds at least two blocks: (bucket, head, next)."""
    pool = live.pool
    for bucket in range(pool.mask + 1):
        head = pool.heads.a[bucket]
        if head != pool.end and pool.hnext.a[head] != pool.end:
            return bucket, head, pool.hnext.a[head]
    raise AssertionError("no chain of two blocks")


def _single_head(live: Live) -> tuple[int, int]:
    """A bucket whose chain holds exactly one block: (bucket, block)."""
    pool = live.pool
    for bucket in range(pool.mask + 1):
        head = pool.heads.a[bucket]
        if head != pool.end and pool.hnext.a[head] == pool.end:
            return bucket, head
    raise AssertionError("no chain of one block")


def _empty_bucket(live: Live) -> int:
    pool = live.pool
    return next(b for b in range(pool.mask + 1) if pool.heads.a[b] == pool.end)


def test_the_live_state_passes_every_check(live: Live) -> None:
    live.manager.check_invariants()
    assert live.pool.dups == set()


def test_the_scan_of_all_tables_at_once_gives_each_requests_scan(live: Live) -> None:
    scan = table_scan.scan_tables(live.state)
    by_request = [estimate_by_scan(live.state, request_id) for request_id in scan.request_ids]
    assert table_scan.estimates_by_scan(live.state, scan) == by_request
    assert dict(zip(scan.request_ids, by_request, strict=True)) == {"b": 20, "c": 24}


# --- The free queue ---------------------------------------------------------------------------


def test_a_free_count_off_by_one_is_named(live: Live) -> None:
    live.pool.num_free_blocks += 1
    live.check("free queue length != num_free_blocks")


def test_a_queue_that_loops_holds_a_block_twice(live: Live) -> None:
    free = _free_blocks(live)
    live.pool.next.a[free[-1]] = free[0]
    live.pool.num_free_blocks = live.pool.num_blocks  # the walk's limit
    live.check(r"free queue holds a block twice: \[" + str(free[0]))


def test_the_null_block_in_the_queue_is_named(live: Live) -> None:
    pool = live.pool
    first = pool.next.a[pool.head]
    pool.next.a[pool.head] = 0
    pool.next.a[0] = first
    pool.num_free_blocks += 1
    live.check("the null block is in the free queue")


def test_a_queued_block_with_holders_is_not_a_count_0_block(live: Live) -> None:
    block = _free_blocks(live)[3]
    live.pool.ref.a[block] = 1
    live.check(r"free queue \[.*\] != count-0 blocks")


def test_a_held_block_at_count_0_is_missing_from_the_queue(live: Live) -> None:
    held = live.state.table(FULL, live.row("b"))[0]
    live.pool.ref.a[held] = 0
    live.check(rf"!= count-0 blocks \[.*\b{held}\b")


def test_a_broken_back_link_names_its_block(live: Live) -> None:
    free = _free_blocks(live)
    live.pool.prev.a[free[2]] = free[5]
    live.check(f"free queue back link of block {free[2]} is broken")


def test_a_broken_tail_link_is_named(live: Live) -> None:
    free = _free_blocks(live)
    live.pool.prev.a[live.pool.tail] = free[0]
    live.check("free queue tail link is broken")


def test_a_negative_reference_count_is_named(live: Live) -> None:
    held = live.state.table(FULL, live.row("b"))[0]
    live.pool.ref.a[held] = -1
    live.check("a negative reference count")


def test_a_linked_null_block_was_used(live: Live) -> None:
    live.pool.next.a[0] = _free_blocks(live)[0]
    live.check("the null block was used")


def test_a_held_block_still_linked_is_named(live: Live) -> None:
    held = live.state.table(FULL, live.row("b"))[1]
    live.pool.prev.a[held] = _free_blocks(live)[0]
    live.check(f"held block {held} is linked")


# --- The prefix cache's chains ----------------------------------------------------------------


def test_a_written_chain_end_is_named(live: Live) -> None:
    live.pool.hnext.a[live.pool.end] = 3
    live.check("the chain end was written")


def test_a_chain_looping_back_to_its_head_puts_the_head_on_two_chains(live: Live) -> None:
    _, head, following = _chain_of_two(live)
    pool = live.pool
    tail = following
    while pool.hnext.a[tail] != pool.end:
        tail = pool.hnext.a[tail]
    pool.hnext.a[tail] = head
    live.check(f"block {head} is on two cache chains")


def test_an_uncached_block_on_a_chain_is_named(live: Live) -> None:
    _, head = _single_head(live)
    uncached = _uncached_free_block(live)
    live.pool.hnext.a[head] = uncached
    live.check(f"chain holds uncached block {uncached}")


def test_a_block_on_another_buckets_chain_is_named(live: Live) -> None:
    bucket, block = _single_head(live)
    pool = live.pool
    pool.heads.a[bucket] = pool.end
    pool.heads.a[_empty_bucket(live)] = block
    live.check(f"block {block} is on the chain of another bucket")


def test_a_cached_block_on_no_chain_is_counted(live: Live) -> None:
    bucket, _ = _single_head(live)
    live.pool.heads.a[bucket] = live.pool.end
    cached = int((live.pool.src.n[: live.pool.end] >= 0).sum())
    live.check(f"{cached} blocks hold a hash but {cached - 1} are cached")


def test_a_loop_of_cached_blocks_cut_off_from_its_bucket_is_found(live: Live) -> None:
    """Every cached block is still led to exactly once, each link stays in its bucket: only
    following the chains from their heads finds the two blocks unreachable."""
    bucket, head, following = _chain_of_two(live)
    pool = live.pool
    pool.heads.a[bucket] = pool.hnext.a[following]  # the rest of the chain, if any
    pool.hnext.a[following] = head
    cached = int((pool.src.n[: pool.end] >= 0).sum())
    live.check(f"{cached} blocks hold a hash but {cached - 2} are cached")


def test_a_key_on_a_block_without_a_source_disagrees(live: Live) -> None:
    uncached = _uncached_free_block(live)
    live.pool.hk.a[uncached] = 5 << 32
    live.check("src and hk disagree")


# --- Duplicates, keys and extra keys -----------------------------------------------------------


def test_an_unmarked_duplicate_entry_is_named(live: Live) -> None:
    pool = live.pool
    block = live.state.table(FULL, live.row("b"))[0]
    twin = _uncached_free_block(live)
    src = pool.src.a[block]
    pool.insert(twin, pool.block_hash(block), FULL, pool.hash_index(block), src)
    pool.settle_duplicates()
    assert twin in pool.dups
    pool.dups.discard(twin)
    live.check(rf"duplicate entries \[{twin}\] unmarked")


def test_an_uncached_block_marked_duplicate_is_named(live: Live) -> None:
    live.pool.dups.add(_uncached_free_block(live))
    live.check("an uncached block is marked duplicate")


def test_a_cached_block_naming_no_source_is_named(live: Live) -> None:
    block = live.state.table(FULL, live.row("b"))[0]
    live.pool.src.a[block] = len(live.pool.sources) + 3
    live.check(f"cached block {block} has no source")


def test_a_key_its_source_does_not_give_is_named(live: Live) -> None:
    """Another position of the same group keeps the block in its bucket: only the source's
    hash there tells the key is wrong."""
    pool = live.pool
    block = live.state.table(FULL, live.row("b"))[0]
    groups = live.state.layout.num_groups
    pool.hk.a[block] = pool.hk.a[block] + groups  # the key at the next position
    live.check(f"cached block {block} has a key its source does not give")


def test_extras_on_a_block_without_a_key_are_named(live: Live) -> None:
    uncached = _uncached_free_block(live)
    live.pool.extras[uncached] = {(1, FULL, 0): 0}
    live.check(f"block {uncached} has extras but no key")


def test_an_extra_key_missing_from_its_index_is_stale(live: Live) -> None:
    block = live.state.table(FULL, live.row("b"))[0]
    live.pool.extras[block] = {(1, WINDOW, 0): live.pool.src.a[block]}
    live.check("extra index is stale")


# --- Sources and the hash memo ----------------------------------------------------------------


def test_a_lost_source_index_is_named(live: Live) -> None:
    lost = len(live.pool.sources)
    live.pool.sources.append(None)
    live.check(f"source {lost} is lost")


def test_a_source_counting_one_entry_too_many_is_named(live: Live) -> None:
    live.pool.source(0).refs += 1
    live.check("source 0 has a wrong count")


def test_a_source_kept_for_no_block_and_no_row_is_named(live: Live) -> None:
    index = live.pool.new_source([1, 2, 3, 4], [], None)
    live.check(f"source {index} is kept for nothing")


def test_a_stale_record_of_a_source_names_block_and_tag(live: Live) -> None:
    source = live.pool.source(0)
    tag = next(t for t, b in enumerate(source.blocks) if b != live.pool.end)
    wrong = _uncached_free_block(live)
    source.blocks[tag] = wrong
    live.check(f"source 0 records block {wrong} under tag {tag}, which it does not hold")


def test_a_memo_registration_without_a_cached_block_is_named(live: Live) -> None:
    memo = live.pool.memo
    assert memo is not None
    memo.registered[99] = (live.pool.source(0), None)
    live.check("the hash memo registers source 99 without a cached block")


def test_an_unsound_memo_tree_is_named(live: Live) -> None:
    memo = live.pool.memo
    assert memo is not None
    branch = next(iter(memo.branches.values()))
    memo.branches[(None, b"elsewhere", None)] = branch
    live.check("more branches than sources|a branch under another key")


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
    live.state.tab.a[live.at("c", WINDOW, 0)] = _uncached_free_block(live)
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
