"""A running request's step: release what left its windows or chunks, take new blocks, cache.

``step`` is ``allocate_slots`` of a request that holds a row (no new cache hit), as functions of
the manager's ``ManagerState``; admission (``hybridkv.optimized.admission``) shares ``extend``.
The row's thresholds (``RowTables.release_at``, ``capacity``, ``cache_at``) say which of the
three parts can do anything, so a decode step does only the comparisons.

Data layout
-----------
Everything is read and written in place in the state's flat buffers: the host tables
``tab[(g × R + row) × W + pos]`` (``layout.group_bases[g]`` is ``g × R × W``) and the row
counters at ``row × G + g`` (``length``, ``nulls``: a window's leading nulls). A step's released
blocks are one list in walk order, group after group (``sizes``: each group's count, once one
group releases several), handed to the pool in one pass; where the layout defers
(``columns.defers``) cached ones go to the pool's pending work instead.
"""

from __future__ import annotations

from array import array

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.caching import cache_uniform
from hybridkv.optimized.general_caching import cache_general
from hybridkv.optimized.layout import BlockIds
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.thresholds import PENDING_MAX
from hybridkv.policies.protocol import PolicyError
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike


def run(
    s: ManagerState,
    request: RequestLike,
    row: int,
    num_new_tokens: int,
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    kept_free: int,
) -> KVCacheBlocks | None:
    """``allocate_slots`` of a running request in ``row`` whose counts are plain and that
    crosses a threshold: ``step`` with its token counts capped at ``max_model_len``, then one
    flush of the table changes. The manager tries its own ``FusedStep`` first (the common
    crossing call, one block per group in each part), where the layout has one; this makes
    the calls it declines."""
    layout = s.layout
    s.pool.paths.ran(paths.RUNNING_STEP)
    computed = request.num_computed_tokens
    if computed > layout.max_model_len:
        computed = layout.max_model_len
    need = computed + num_new_tokens + num_lookahead_tokens
    if need > layout.max_model_len:
        need = layout.max_model_len
    cache_up_to = -1
    if layout.caching and not delay_cache_blocks:
        cache_up_to = computed + num_new_tokens
        if cache_up_to > request.num_tokens:
            cache_up_to = request.num_tokens
    try:
        blocks = step(s, request, row, computed, need, cache_up_to, kept_free)
    finally:
        s.tables.flush()
    if s.pool.policy is not None:
        s.raise_policy_error()  # a policy's notification error, raised once the step is made
    return blocks


def step(
    s: ManagerState,
    request: RequestLike,
    row: int,
    computed: int,
    need: int,
    cache_up_to: int,
    kept_free: int,
) -> KVCacheBlocks | None:
    """A running request's step (``allocate_slots`` of a request holding ``row``): release
    what left each window or chunk, take the blocks ``need`` tokens lack, cache the blocks
    full up to ``cache_up_to`` tokens (-1: none); the row's thresholds say which of these
    can do anything."""
    pool, rows, layout = s.pool, s.rows, s.layout
    # A step still in flight reads the window's blocks: only processed tokens count.
    processed = max(0, computed - request.num_in_flight_tokens)
    released = cached = False
    if processed >= rows.release_at[row]:
        pool.paths.ran(paths.STEP_RELEASE)
        release_skipped(s, row, processed)
        released = True
    new_blocks: tuple[tuple[int, ...], ...] | None = None
    took = need > rows.capacity[row]
    total = have = count = 0
    required: list[int] = []
    if took:
        total, have, count, required = _blocks_to_take(s, row, need)
    if (took or kept_free) and not fits(s, total + kept_free):
        if released:
            s.thresholds.after_step(row, True, False, False)
        return None
    if took:
        if layout.uniform_columns:
            pool.paths.ran(paths.STEP_UNIFORM_TAKE)
        try:
            new_blocks = (
                extend_uniform(s, row, have, count)
                if layout.uniform_columns
                else extend(s, row, required)
            )
        except PolicyError:
            s.thresholds.refresh(row)  # the blocks it released stay released
            raise
    if cache_up_to >= rows.cache_at[row]:
        if layout.general:
            pool.paths.ran(paths.CACHE_GENERAL)
            cache_general(s, request, row, cache_up_to)
        else:
            pool.paths.ran(paths.CACHE_UNIFORM)
            cache_uniform(s, request, row, cache_up_to, layout.columns.defers)
        cached = True
    if released or took or cached:
        s.thresholds.after_step(row, released, took, cached)
    if len(pool.pending) >= PENDING_MAX:
        s.settle()  # long without another call: bounded memory
    return layout.no_blocks if new_blocks is None else KVCacheBlocks(new_blocks)


def _blocks_to_take(s: ManagerState, row: int, need: int) -> tuple[int, int, int, list[int]]:
    """New blocks ``need`` tokens take for ``row``: (total, have, count per group) when every
    group of the row is as long (each allocation extends all of them to the same length, so
    each takes the same count), else (total, 0, 0, blocks each group needs)."""
    layout, rows = s.layout, s.rows
    g_count = layout.num_groups
    if layout.uniform_columns:
        have = rows.length[row * g_count]
        count = -(-need // layout.block_size) - have
        return count * g_count, have, count, []
    required = [rule.blocks_for_tokens(need) for rule in layout.rules]
    at, length = row * g_count, rows.length
    total = sum(max(c - length[at + g], 0) for g, c in enumerate(required))
    return total, 0, 0, required


def fits(s: ManagerState, blocks: int) -> bool:
    """Whether ``blocks`` blocks are free, counting those the pending releases free."""
    if blocks <= s.pool.num_free_blocks:
        return True
    if s.pool.pending:
        s.settle()
        return blocks <= s.pool.num_free_blocks
    return False


def extend(s: ManagerState, row: int, required: list[int]) -> BlockIds:
    """Take new blocks, group 0 first, until each group holds ``required`` positions: one
    take from the free queue for all groups, split in group order (the blocks, evictions
    and events of one take per group)."""
    length, at = s.rows.length, row * s.layout.num_groups
    counts = [c - length[at + g] for g, c in enumerate(required)]
    total = sum(c for c in counts if c > 0)
    if not total:
        return s.layout.no_hits
    if s.pool.policy is None:
        popped = s.pool.pop_n(total)
    else:
        popped = s.pool.pop_groups([c for c in counts if c > 0])
    tab, row_base, bases = s.tab.a, row * s.layout.max_blocks_per_req, s.layout.group_bases
    tracking = s.tables.mirrored
    new_blocks: list[tuple[int, ...]] = []
    taken = 0
    for g, count in enumerate(counts):
        if count <= 0:
            new_blocks.append(())
            continue
        have = length[at + g]
        base = bases[g] + row_base + have
        if count == 1:  # a decode step's new block
            block = popped[taken]
            tab[base] = block
            new_blocks.append((block,))
        else:
            part = popped[taken : taken + count]
            tab[base : base + count] = int_array(part)
            new_blocks.append(tuple(part))
        taken += count
        length[at + g] = have + count
        if tracking:
            s.tables.touched(g, row, have, have + count)
    return tuple(new_blocks)


def extend_uniform(s: ManagerState, row: int, have: int, count: int) -> BlockIds:
    """``_extend`` of a uniform layout's row, whose groups all hold ``have`` positions, by
    ``count`` positions each."""
    if count <= 0:
        return s.layout.no_hits
    g_count = s.layout.num_groups
    if s.pool.policy is None:
        popped = s.pool.pop_n(count * g_count)
    else:
        popped = s.pool.pop_groups([count] * g_count)
    tab, length, at = s.tab.a, s.rows.length, row * g_count
    offset = row * s.layout.max_blocks_per_req + have
    tracking = s.tables.mirrored
    length[at : at + g_count] = array("q", (have + count,)) * g_count
    if count == 1:  # a decode step's new block in every group
        for base, block in zip(s.layout.group_bases, popped, strict=True):
            tab[base + offset] = block
        if tracking:
            for g in range(g_count):
                s.tables.touched(g, row, have, have + 1)
        return tuple(zip(popped))
    new_blocks: list[tuple[int, ...]] = []
    for g, base in enumerate(s.layout.group_bases):
        part = popped[g * count : (g + 1) * count]
        tab[base + offset : base + offset + count] = int_array(part)
        new_blocks.append(tuple(part))
        if tracking:
            s.tables.touched(g, row, have, have + count)
    return tuple(new_blocks)


def release_skipped(s: ManagerState, row: int, computed: int) -> None:
    """Release the blocks that left each window or chunk (``remove_skipped_blocks``), every
    group's in one pass of the pool (as ``free_blocks`` group by group)."""
    released: list[int] = []  # every group's blocks in walk order, group after group
    sizes: list[int] | None = None  # each group's count, once one releases several
    # Equal rules skip as many positions: one target per distinct rule.
    window = s.layout.one_window
    if window is not None:
        # ``sliding_window_skipped_tokens``, then ``skipped_block_positions``, inline.
        skipped = computed - window[3] + 1
        target = skipped // window[2] if skipped > 0 else 0
        one = release_one_each(s, row, target, window[0], window[1])
        if one is not None:
            free_released(s, one, None)
            return
        targets = [target]
    else:
        targets = [rule.skipped_positions(computed) for rule in s.layout.release_rules]
    rows, tab = s.rows, s.tab.a
    length, nulls = rows.length, rows.nulls
    at, row_base = row * s.layout.num_groups, row * s.layout.max_blocks_per_req
    bases = s.layout.group_bases
    tracking = s.tables.mirrored
    for g, which in s.layout.release_plan:
        i = at + g
        target, held = targets[which], nulls[i]
        if target == held + 1 and target <= length[i]:
            # A decode step's one block leaving the window.
            pos = bases[g] + row_base + held
            released.append(tab[pos])
            tab[pos] = 0
            nulls[i] = target
            if sizes is not None:
                sizes.append(1)
            if tracking:
                s.tables.touched(g, row, held, target)
        elif target > held:
            walk = skip_positions(s, row, g, target)
            if walk:
                if sizes is None:
                    sizes = [1] * len(released)
                sizes.append(len(walk))
                released.extend(walk)
    if released:
        free_released(s, released, sizes)


def release_one_each(
    s: ManagerState, row: int, target: int, first: int, end: int
) -> list[int] | None:
    """A decode step's release under one sliding window (``_one_window``, groups ``first``
    … ``end − 1``): when every window group's leading nulls end at ``target − 1`` and its
    table reaches ``target``, each lets its block at ``target − 1`` go. Those blocks sit
    one group's table apart in the flat tables, so one strided read and one strided write
    release them all, in group order (``BlockTables.clear_across``). ``None`` (nothing
    changed) when that is not the case."""
    rows = s.rows
    at = row * s.layout.num_groups
    held = target - 1
    nulls = rows.nulls[at + first : at + end]
    if min(nulls) != held or max(nulls) != held:
        return None
    if min(rows.length[at + first : at + end]) < target:
        return None
    released = s.tables.clear_across(first, end, row, held)
    rows.nulls[at + first : at + end] = array("q", (target,)) * (end - first)
    return released


def free_released(s: ManagerState, released: list[int], sizes: list[int] | None) -> None:
    """Hand a step's released blocks (walk order; ``sizes``: each group's count where one
    released several) to the pool: deferred where they are cached, else freed at once."""
    pool = s.pool
    if s.layout.columns.defers:
        if min(map(pool.src.a.__getitem__, released)) >= 0:
            pool.pending.release(released)  # cached blocks: to the tail, made later
            return
        s.settle()  # an uncached block goes to the head: the pool must be current
    if sizes is None:
        pool.free_walks([[block] for block in released])
        return
    walks, start = [], 0
    for size in sizes:
        walks.append(released[start : start + size])
        start += size
    pool.free_walks(walks)


def release_skipped_group(s: ManagerState, row: int, g: int, computed: int) -> None:
    """``_release_skipped`` of one group (nothing unless a window or chunk)."""
    rule = s.layout.rules[g]
    if rule.releases:
        released = skip_positions(s, row, g, rule.skipped_positions(computed))
        if released:
            s.pool.free_blocks(released)


def skip_positions(s: ManagerState, row: int, g: int, target: int) -> list[int]:
    """Null the row's positions of group ``g`` before ``target``; the blocks they held, in
    the order they are freed (last first)."""
    rows, tab = s.rows, s.tab.a
    i = rows.index(row, g)
    skipped = min(target, rows.length[i])
    nulls = rows.nulls[i]
    if skipped <= nulls:
        return []
    at = s.tables.base(g, row) + nulls
    if skipped - nulls == 1:  # a decode step's one block leaving the window
        released = [tab[at]]
        tab[at] = 0
    else:
        released = tab[at : at + skipped - nulls].tolist()
        released.reverse()
        tab[at : at + skipped - nulls] = int_array([0] * (skipped - nulls))
    rows.nulls[i] = skipped
    s.tables.touched(g, row, nulls, skipped)
    return released


def int_array(values: list[int]) -> array[int]:
    """``values`` as an int32 array, for a slice assignment into the host tables."""
    return array("i", values)
