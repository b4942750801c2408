"""Caching for layouts of several block sizes or with a Mamba ``"align"`` group.

With one block size, ``hybridkv.optimized.caching.cache_uniform`` keys a block at position p
by hash p. Here each group caches its full blocks at its own block size, keyed by the hash at
the block's last hash boundary, one block at a time (``cache_general``); a full-attention block
larger than the hash block also keeps the prompt's tail entry (``cache_prompt_tail``), and a
Mamba ``"align"`` group caches its states, its prompt-tail and checkpoint entries
(``cache_mamba_group``, as ``MambaManager.cache_blocks``). ``cache`` chooses between the two.

Data layout
-----------
The same as ``caching``'s: a row's cached positions per group in ``RowTables.cached``, one pool
source per row. A Mamba group's keys cached in the current scheduler step are
``MambaState.cached_this_step[g]`` (the same-step rule: such a state is still being written),
as (block hash, group id) pairs, ``Key``.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.optimized.caching import (
    cache_uniform,
    reachable_boundaries,
    retention_mask,
    source_of,
    store_full_blocks,
)
from hybridkv.optimized.group_rules import FULL, MAMBA
from hybridkv.optimized.state import Key, ManagerState
from hybridkv.reference.events import EventBuilder
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_managers import prompt_tokens
from hybridkv.spec import rules


def cache_blocks(s: ManagerState, request: RequestLike, num_computed_tokens: int) -> None:
    """``cache_blocks`` after its checks, the pool settled: ``KeyError`` for a request that
    holds no row but has a full block to cache."""
    row = s.rows.row_of(request.request_id)
    if row is None:
        num_hashed = len(request.block_hashes) * s.layout.hash_block_size
        if any(
            min(cacheable(s, num_computed_tokens, g), num_hashed) // rule.block_size > 0
            for g, rule in enumerate(s.layout.rules)
        ):
            raise KeyError(request.request_id)
        return
    cache(s, request, row, num_computed_tokens)
    s.thresholds.refresh(row)


def cache(
    s: ManagerState, request: RequestLike, row: int, num_tokens: int, defer: bool = False
) -> None:
    """Enter the row's full blocks covered by ``num_tokens`` into the prefix cache (with
    ``defer``, a running step's: into the pool's pending work)."""
    if s.layout.general:
        cache_general(s, request, row, num_tokens)
    else:
        cache_uniform(s, request, row, num_tokens, defer)


def cacheable(s: ManagerState, num_tokens: int, g: int) -> int:
    """``HybridCoordinator.num_cacheable_tokens``: hits land on scheduler blocks, so a
    hybrid caches up to the last one (an EAGLE group one block past it)."""
    reprefill = s.layout.settings.num_reprefillable_tokens
    if s.layout.num_groups == 1:
        return max(0, num_tokens - reprefill)
    sb = s.layout.block_size
    aligned = num_tokens // sb * sb
    if s.layout.group_eagle[g] and aligned > 0:
        final = max(0, num_tokens - reprefill)
        return min(final, final // sb * sb + s.layout.rules[g].block_size)
    return aligned


def cache_general(s: ManagerState, request: RequestLike, row: int, num_tokens: int) -> None:
    """``_cache`` for groups with different block sizes: each group caches its full blocks
    at its block size (keyed by the hash at the block's last hash boundary), one by one; a
    full-attention block larger than the hash block also keeps the prompt's tail entry."""
    hbs = s.layout.hash_block_size
    num_hashed = len(request.block_hashes) * hbs
    boundaries: list[int] | None = None
    for g, rule in enumerate(s.layout.rules):
        b = rule.block_size
        scale = b // hbs
        tokens = cacheable(s, num_tokens, g)
        if rule.kind == MAMBA:
            if boundaries is None:
                boundaries = reachable_boundaries(s, request)
            cache_mamba_group(s, request, row, g, tokens, boundaries)
            continue
        start = s.rows.cached[s.rows.index(row, g)]
        num_full = min(tokens, num_hashed) // b
        if start < num_full:
            src = source_of(s, request, row, num_full * scale, num_full * b)
            mask: Sequence[bool] | None = None
            if g in s.layout.columns.sparse_groups:
                if boundaries is None:
                    boundaries = reachable_boundaries(s, request)
                mask = retention_mask(s, request, g, start, num_full, boundaries)
            store_full_blocks(s, request, row, g, start, num_full, mask, src)
        if rule.kind == FULL and b != hbs:
            cache_prompt_tail(s, request, row, g, tokens)


def cache_prompt_tail(
    s: ManagerState, request: RequestLike, row: int, g: int, num_tokens: int
) -> None:
    """``FullAttentionManager._cache_prompt_tail``: the block holding the prompt's last hash
    boundary also answers for it (an extra key beside a full-block key)."""
    pool, hbs = s.pool, s.layout.hash_block_size
    b = s.layout.rules[g].block_size
    hashes = request.block_hashes
    limit = prompt_tokens(request) - (0 if s.layout.group_eagle[g] else 1)
    boundary = min(limit // hbs, len(hashes)) * hbs
    if boundary == 0 or boundary > num_tokens or boundary % b == 0:
        return
    index = boundary // b
    if index >= s.rows.length[s.rows.index(row, g)]:
        return
    block = s.tab.a[s.tables.base(g, row) + index]
    if block == 0:
        return
    hidx = boundary // hbs - 1
    src = source_of(s, request, row, hidx + 1, boundary)
    already = pool.holds_key(block, src, hidx, g)
    if not already and pool.src.a[block] >= 0 and (pool.hash_index(block) + 1) < hidx + 1:
        pool.remove_keys(block)  # a shorter entry gives way
    pool.insert_key(block, src, hidx, g)
    if pool.event_builder is not None and not already:
        start = boundary - hbs
        parent = hashes[hidx - 1] if start else None
        pool.events.append(
            pool.event_builder.stored(
                request, (hashes[hidx],), (hidx,), parent, start, boundary, hbs, g
            )
        )


def cache_mamba_group(
    s: ManagerState,
    request: RequestLike,
    row: int,
    g: int,
    num_tokens: int,
    boundaries: Sequence[int],
) -> None:
    """``MambaManager.cache_blocks`` of group ``g`` (``num_tokens``: its cacheable tokens)."""
    hbs, tab = s.layout.hash_block_size, s.tables.host.a
    rule = s.layout.rules[g]
    b = rule.block_size
    hashes = request.block_hashes
    i = s.rows.index(row, g)
    base = s.tables.base(g, row)
    start = s.rows.cached[i]
    num_full = min(num_tokens, len(hashes) * hbs) // b
    this_step = s.mamba.cached_this_step.setdefault(g, set())
    if start < num_full:
        src = source_of(s, request, row, num_full, num_full * b)
        eagle = s.layout.group_eagle[g]
        reach = list(boundaries)
        shared = request.shared_prefix_boundary
        if shared and eagle:
            reach.append(shared - b)
        mask = rules.mamba_retention_mask(
            start,
            num_full,
            alignment_tokens=s.layout.block_size,
            block_size=b,
            retention_interval=s.layout.retention_interval,
            reachable_boundaries=reach,
        )
        # A Mamba block is one hash block: the shared loop's hash index is the position.
        store_full_blocks(s, request, row, g, start, num_full, mask, src)
    after = s.rows.cached[i]
    key = _cache_partial_tail(s, request, row, g, num_tokens)
    if key is not None:
        this_step.add(key)
    offloads = s.mamba.offloads.setdefault(g, [])
    for pos in range(start, after):
        found = primary_key(s, tab[base + pos])
        if found is not None:
            this_step.add(found)
            offloads.append((request.request_id, tab[base + pos], (pos + 1) * b))


def _cache_partial_tail(
    s: ManagerState, request: RequestLike, row: int, g: int, num_tokens: int
) -> Key | None:
    """``MambaManager._cache_partial_tail``."""
    request_id = request.request_id
    b = s.layout.rules[g].block_size
    hbs = s.layout.hash_block_size
    length = s.rows.length[s.rows.index(row, g)]
    base = s.tables.base(g, row)
    checkpoint = s.mamba.checkpoints.get((request_id, g))
    if checkpoint is not None:
        position, index = checkpoint
        if index >= length:
            return None  # reserved by an allocation that failed (see the reference)
        return _cache_checkpoint(s, request, row, g, position, s.tables.host.a[base + index])
    if num_tokens <= 0 or num_tokens % hbs:
        return None
    boundary = rules.mamba_prefill_checkpoint_position(
        prompt_tokens(request), hbs, s.layout.settings.use_eagle, s.layout.lookahead
    )
    if num_tokens != boundary or num_tokens > len(request.block_hashes) * hbs:
        return None  # not the boundary, or its hash lags behind (see the reference)
    index = rules.cdiv(num_tokens, b) - 1
    if index >= length or s.tables.host.a[base + index] == 0:
        return None
    block = s.tables.host.a[base + index]
    if _primary_tokens(s, block) == num_tokens:
        return None
    return _cache_partial_block(s, request, row, block, num_tokens, g, replace=False)


def _primary_tokens(s: ManagerState, block: int) -> int | None:
    """``block_hash_num_tokens``: the tokens the block's primary key covers."""
    if s.pool.src.a[block] < 0:
        return None
    return (s.pool.hash_index(block) + 1) * s.layout.hash_block_size


def _cache_checkpoint(
    s: ManagerState,
    request: RequestLike,
    row: int,
    g: int,
    position: int,
    block: int,
) -> Key | None:
    """``MambaManager._cache_checkpoint``."""
    b = s.layout.rules[g].block_size
    is_prompt_checkpoint = position == rules.mamba_prefill_checkpoint_position(
        prompt_tokens(request), s.layout.block_size, s.layout.settings.use_eagle, s.layout.lookahead
    )
    is_retained = False
    if position % b == 0:
        state_index = position // b - 1
        mask = rules.mamba_retention_mask(
            state_index,
            state_index + 1,
            alignment_tokens=s.layout.block_size,
            block_size=b,
            retention_interval=s.layout.retention_interval,
            reachable_boundaries=(),
        )
        is_retained = mask is None or mask[0]
    shared = request.shared_prefix_boundary
    # A checkpoint past the request's hashes has no key yet: transient (see the reference).
    hashed = position <= len(request.block_hashes) * s.layout.hash_block_size
    if not hashed or not (is_prompt_checkpoint or is_retained or position == shared):
        if block:
            s.pool.remove_keys(block)
        return None
    if block == 0 or _primary_tokens(s, block) == position:
        return None
    return _cache_partial_block(s, request, row, block, position, g, replace=True)


def _cache_partial_block(
    s: ManagerState,
    request: RequestLike,
    row: int,
    block: int,
    num_tokens: int,
    g: int,
    *,
    replace: bool,
) -> Key:
    """``BlockPool.cache_partial_block`` (``block`` is not the null block)."""
    pool, hbs = s.pool, s.layout.hash_block_size
    hashes = request.block_hashes
    hidx = num_tokens // hbs - 1
    src = source_of(s, request, row, hidx + 1, num_tokens)
    already = pool.holds_key(block, src, hidx, g)
    if replace:
        pool.remove_keys(block)
        already = False
    elif not already:
        tokens = _primary_tokens(s, block)
        if tokens is not None and tokens < num_tokens:
            pool.remove_keys(block)
    pool.insert_key(block, src, hidx, g)
    builder: EventBuilder | None = pool.event_builder
    if builder is not None and not already:
        start = num_tokens - hbs
        parent = hashes[hidx - 1] if start else None
        pool.events.append(
            builder.stored(request, (hashes[hidx],), (hidx,), parent, start, num_tokens, hbs, g)
        )
    return hashes[hidx], g


def primary_key(s: ManagerState, block: int) -> Key | None:
    """The block's primary cache key, or ``None`` if it holds none."""
    pool = s.pool
    if block == 0 or pool.src.a[block] < 0:
        return None
    return pool.block_hash(block), (pool.hk.a[block] & 0xFFFFFFFF) % pool.num_groups
