"""The optimized block pool's own checks catch each corruption, and name it: the free queue, the
prefix cache's chains, duplicates, keys and extra keys, sources and the hash memo.

Each test corrupts one piece of the live state of ``optimized_live_state`` and expects that
check's ``InvariantError``, naming the offender (block, bucket or source).
"""

from __future__ import annotations

from optimized_live_state import FULL, WINDOW, Live, live_state  # noqa: F401 (the fixture)


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


def test_a_waiting_duplicate_whose_source_is_not_marked_waiting_is_named(live: Live) -> None:
    """A twin waits to be marked until the next settle; the memo's run settles only where its
    source is marked waiting (``settle_for``), so a twin waiting under an unmarked source
    could be read unmarked."""
    pool = live.pool
    block = live.state.table(FULL, live.row("b"))[0]
    twin = _uncached_free_block(live)
    src = pool.src.a[block]
    pool.insert(twin, pool.block_hash(block), FULL, pool.hash_index(block), src)
    assert twin in pool.unsettled
    assert pool.source(src).waiting == pool.settles
    pool.source(src).waiting = -1
    live.check(rf"duplicate entries \[{twin}\] waited, their sources unmarked")


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
