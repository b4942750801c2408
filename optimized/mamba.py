"""The per-request path of layouts with a Mamba ``"align"`` group, over the backend's own state.

A Mamba ``"align"`` table holds a real block only where a state lives (the running state, the
previous one, a prefill checkpoint, the speculative blocks) and nulls everywhere else, so its
nulls are no prefix and the row thresholds and the vectorised step of
``hybridkv.optimized.batch`` do not apply. A manager with such a group serves every allocation here,
one request at a time, step for step as ``KVCacheManager.allocate_slots`` does, with the same flat
state: the block tables (``BlockTables``, ``hybridkv.optimized.block_tables``), the row counters of
``hybridkv.optimized.rows`` (``length``, ``cached``; ``nulls`` is the leading nulls of an attention
group and, for a Mamba group, the positions already retired) and the ``TorchBlockPool``.

What the Mamba manager of the reference keeps besides a table lives in ``MambaState``, keyed by
(request id, group): the allocated flag, the previous state's position, the checkpoint this
allocation reserves, and the keys cached in the current step (the same-step rule).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.optimized.group_rules import MAMBA
from hybridkv.optimized.lookup import GroupHit
from hybridkv.reference.events import EventBuilder
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_managers import prompt_tokens
from hybridkv.spec import MambaSpec, rules

if TYPE_CHECKING:
    from collections.abc import Sequence

    from hybridkv.optimized.manager import BlockIds, TorchKVCacheManager


Key = tuple[bytes, int]
"""A cache key: (block hash, group id), ``BlockHashWithGroupId``."""


@dataclass
class MambaState:
    """``MambaManager``'s bookkeeping beside the tables, for every Mamba ``"align"`` group."""

    allocated: set[tuple[str, int]] = field(default_factory=set)
    last_state: dict[tuple[str, int], int] = field(default_factory=dict)
    checkpoints: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    cached_this_step: dict[int, set[Key]] = field(default_factory=dict)
    # (row, group) pairs tracked as running (``num_cached_block`` of the reference).
    running: set[tuple[int, int]] = field(default_factory=set)
    # The positions of the real blocks of each Mamba table as of its last allocation
    # (``state_positions`` of the reference): where its longest cached prefix can sit.
    positions: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # Tokens in flight at each request's last allocation (the reference's ``_in_flight``):
    # a table may hold their states' blocks too until that step is processed.
    in_flight: dict[str, int] = field(default_factory=dict)

    def forget(self, request_id: str, groups: Sequence[int]) -> None:
        self.in_flight.pop(request_id, None)
        for g in groups:
            self.allocated.discard((request_id, g))
            self.last_state.pop((request_id, g), None)
            self.checkpoints.pop((request_id, g), None)
            self.positions.pop((request_id, g), None)


def allocate(
    m: TorchKVCacheManager,
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    hits: BlockIds,
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    full_sequence_must_fit: bool,
    reserved_blocks: int = 0,
    watermark_blocks: int = 0,
) -> KVCacheBlocks | None:
    """``KVCacheManager.allocate_slots`` after validation."""
    request_id = request.request_id
    num_local_computed = request.num_computed_tokens + num_new_computed_tokens
    total_computed = min(num_local_computed, m.max_model_len)
    prefill_end = max(prompt_tokens(request), request.num_tokens - 1)
    if full_sequence_must_fit:
        full_length = min(request.num_tokens, m.max_model_len)
        needed = _num_blocks(
            m, request_id, full_length, hits, total_computed, full_length, True, prefill_end
        )
        if needed + watermark_blocks > m.pool.num_free_blocks:
            return None
    main = total_computed + num_new_tokens
    need_slot = min(main + num_lookahead_tokens, m.max_model_len)
    in_flight = int(getattr(request, "num_in_flight_tokens", 0))
    row = m.rows.row_of(request_id)
    if row is not None:
        _remove_skipped(m, request_id, row, max(0, total_computed - in_flight))
    if in_flight:
        m._mamba.in_flight[request_id] = in_flight
    else:
        m._mamba.in_flight.pop(request_id, None)
    needed = _num_blocks(
        m, request_id, need_slot, hits, num_local_computed, main, False, prefill_end
    )
    if needed + watermark_blocks > m.pool.num_free_blocks - reserved_blocks:
        if row is not None:
            m.thresholds.refresh(row)  # windows may have released blocks
        return None
    if row is None:
        row = m.rows.take(request_id)
        if any(hits):
            group_hits = [GroupHit.of(ids) for ids in hits]
            skipped = [rule.skipped_positions(num_local_computed) for rule in m.rules]
            m._adopt(row, group_hits, skipped, m._adopted_blocks(group_hits, skipped))
            for g, rule in enumerate(m.rules):
                m._mamba.running.add((row, g))
                if rule.kind == MAMBA:
                    m.rows.nulls[m.rows.index(row, g)] = 0
                    _record_adopted(m, request_id, row, g, hits[g], num_local_computed)
    new_blocks = tuple(
        _allocate_group(m, request_id, row, g, need_slot, main) for g in range(m.num_groups)
    )
    if not delay_cache_blocks:
        cache(m, request, row, min(total_computed + num_new_tokens, request.num_tokens))
    m.thresholds.refresh(row)
    return KVCacheBlocks(new_blocks)


def _num_evictable(m: TorchKVCacheManager, blocks: Sequence[int]) -> int:
    ref = m.pool.ref.a
    return sum(1 for b in blocks if b != 0 and ref[b] == 0)


def _num_blocks(
    m: TorchKVCacheManager,
    request_id: str,
    num_tokens: int,
    hits: BlockIds,
    total_computed: int,
    main: int,
    apply_cap: bool,
    prefill_end: int,
) -> int:
    """``KVCacheCoordinator.get_num_blocks_to_allocate`` (which also records each Mamba
    group's checkpoint reservation, unless it is a full-prompt admission's check)."""
    if m.retention_interval != 0:
        prefill_end = 0
    row = m.rows.row_of(request_id)
    total = 0
    for g, rule in enumerate(m.rules):
        group_hits = hits[g]
        held = m.rows.length[m.rows.index(row, g)] if row is not None else 0
        if rule.kind == MAMBA:
            total += _mamba_num_blocks(
                m, request_id, g, held, group_hits, total_computed, main, apply_cap, prefill_end
            )
            continue
        required = rule.blocks_for_tokens(num_tokens)
        cap = m._admission_caps[g]
        if apply_cap and cap is not None:
            required = min(required, cap)
        if row is not None and (row, g) in m._mamba.running:
            total += max(required - held, 0)
            continue
        skipped = rule.skipped_positions(total_computed)
        num_new = max(required - max(skipped, len(group_hits) + held), 0)
        total += num_new + _num_evictable(m, group_hits[max(0, skipped - held) :])
    return total


def _primary_key(m: TorchKVCacheManager, block: int) -> Key | None:
    pool = m.pool
    if block == 0 or pool.src.a[block] < 0:
        return None
    return pool.block_hash(block), (pool.hk.a[block] & 0xFFFFFFFF) % pool.num_groups


def _mamba_num_blocks(
    m: TorchKVCacheManager,
    request_id: str,
    g: int,
    held: int,
    group_hits: Sequence[int],
    total_computed: int,
    main: int,
    apply_cap: bool,
    prefill_end: int,
) -> int:
    """``MambaManager.get_num_blocks_to_allocate`` in ``"align"`` mode."""
    state = m._mamba
    if group_hits and _primary_key(m, group_hits[-1]) in state.cached_this_step.get(g, ()):
        # The same-step rule: a state cached in this step is still being written.
        return m.pool.num_blocks + 1
    spec = m.rules[g]
    b = spec.block_size
    required = rules.cdiv(main, b) + spec.spec_blocks
    num_new = required - len(group_hits) - held
    checkpoint = _checkpoint_position(m, request_id, g, total_computed, main, prefill_end)
    if not apply_cap:
        if checkpoint > 0:
            state.checkpoints[request_id, g] = (checkpoint, rules.cdiv(main, b) - 2)
        else:
            state.checkpoints.pop((request_id, g), None)
    if num_new > 0:
        cap = 1 + int(checkpoint > 0)
        if (request_id, g) not in state.allocated:
            cap += spec.spec_blocks
        num_new = min(num_new, cap)
    return num_new + _num_evictable(m, group_hits)


def _checkpoint_position(
    m: TorchKVCacheManager,
    request_id: str,
    g: int,
    query_start: int,
    query_end: int,
    prefill_end: int,
) -> int:
    """``MambaManager._checkpoint_position``: the prefill checkpoint this chunk reserves a
    block for, or 0."""
    spec = m.config.groups[g].spec
    assert isinstance(spec, MambaSpec)
    b = spec.block_size
    if not (spec.num_prefill_checkpoint_blocks > 0 and query_end >= prefill_end):
        return 0
    position = rules.mamba_prefill_checkpoint_position(
        query_end, m.block_size, m.settings.use_eagle, m.lookahead
    )
    if not rules.mamba_prefill_checkpoint_valid(
        query_start,
        query_end,
        position,
        m.hash_block_size,
        b,
        spec.prefill_checkpoint_alignment,
    ):
        return 0
    index = rules.cdiv(query_end, b) - 2
    if index < 0:
        return 0
    row = m.rows.row_of(request_id)
    length = m.rows.length[m.rows.index(row, g)] if row is not None else 0
    if (
        row is None
        or index >= length
        or m.tables.host.a[m.tables.base(g, row) + index] == 0
        or ((request_id, g) in m._mamba.allocated and index >= length - spec.num_speculative_blocks)
    ):
        return position
    return 0


def _allocate_group(
    m: TorchKVCacheManager, request_id: str, row: int, g: int, num_tokens: int, main: int
) -> tuple[int, ...]:
    """``allocate_new_blocks`` of one group: its new blocks (a Mamba group also returns the
    nulls and the speculative blocks it moved)."""
    rule = m.rules[g]
    tab, lengths = m.tables.host.a, m.rows.length
    i = m.rows.index(row, g)
    base = m.tables.base(g, row)
    length = lengths[i]
    if rule.kind != MAMBA:
        count = rule.blocks_for_tokens(num_tokens) - length
        if count <= 0:
            return ()
        blocks = m.pool.pop_n(count)
        _write(m, g, row, length, blocks)
        lengths[i] = length + count
        return tuple(blocks)
    state = m._mamba
    spec_blocks = rule.spec_blocks
    required = rules.cdiv(main, rule.block_size) + spec_blocks
    checkpoint = int((request_id, g) in state.checkpoints)
    if required <= length and not checkpoint:
        state.allocated.add((request_id, g))
        return ()
    table = tab[base : base + length].tolist()
    allocated_before = (request_id, g) in state.allocated
    if allocated_before:
        state.last_state[request_id, g] = length - 1 - spec_blocks
    elif length > 0:
        state.last_state[request_id, g] = length - 1
    state_position = required - spec_blocks - 1
    null_end = state_position - checkpoint
    if length < state_position:
        table.extend([0] * (null_end - length))
    moved_to = len(table)
    if allocated_before:
        for index in range(length - spec_blocks, length):
            if index >= null_end:
                break
            table.append(table[index])
            table[index] = 0
    new_blocks = m.pool.pop_n(max(required - len(table), 0))
    appended = table[length:] + new_blocks
    table.extend(new_blocks)
    if len(table) > m.max_blocks_per_req:
        raise ValueError(
            f"max_blocks_per_req {m.max_blocks_per_req} cannot hold the Mamba table of "
            f"{request_id!r} ({len(table)} positions)"
        )
    _write(m, g, row, 0, table)
    lengths[i] = len(table)
    state.allocated.add((request_id, g))
    # Real blocks: those still held from before, then the moved and the new ones.
    held = [pos for pos in state.positions.get((request_id, g), ()) if table[pos]]
    state.positions[request_id, g] = held + list(range(moved_to, len(table)))
    return tuple(appended)


def _record_adopted(
    m: TorchKVCacheManager,
    request_id: str,
    row: int,
    g: int,
    group_hits: Sequence[int],
    num_computed: int,
) -> None:
    """The positions of the real blocks of an admitted Mamba table: its adopted hit."""
    skipped = m.rules[g].skipped_positions(num_computed)
    base = m.tables.base(g, row)
    tab = m.tables.host.a
    m._mamba.positions[request_id, g] = [
        pos for pos in range(skipped, len(group_hits)) if tab[base + pos]
    ]


def _write(m: TorchKVCacheManager, g: int, row: int, lo: int, blocks: Sequence[int]) -> None:
    if not blocks:
        return  # an empty slice assignment would resize the array, which its views forbid
    base = m.tables.base(g, row)
    m.tables.host.a[base + lo : base + lo + len(blocks)] = _int_array(blocks)
    m.tables.touched(g, row, lo, lo + len(blocks))


def _int_array(values: Sequence[int]) -> array[int]:
    return array("i", values)


def _remove_skipped(m: TorchKVCacheManager, request_id: str, row: int, computed: int) -> None:
    """``remove_skipped_blocks`` of every group, in group order."""
    tab, rows = m.tables.host.a, m.rows
    for g, rule in enumerate(m.rules):
        if rule.kind != MAMBA:
            m._release_skipped_group(row, g, computed)
            continue
        i = rows.index(row, g)
        base = m.tables.base(g, row)
        length = rows.length[i]
        skipped = rules.mamba_skipped_tokens(computed) // rule.block_size
        if skipped > 0:
            first, last = rows.nulls[i], min(skipped, length)
            if first < last:
                released = []
                for index in range(last - 1, first - 1, -1):
                    block = tab[base + index]
                    if block:
                        released.append(block)
                        tab[base + index] = 0
                m.tables.touched(g, row, first, last)
                m.pool.free_blocks(released)
                rows.nulls[i] = last
        last_state = m._mamba.last_state.get((request_id, g))
        if last_state is not None and last_state < rules.cdiv(computed, rule.block_size) - 1:
            block = tab[base + last_state]
            if block:
                m.pool.free_blocks([block])
                tab[base + last_state] = 0
                m.tables.touched(g, row, last_state, last_state + 1)


def free(m: TorchKVCacheManager, request_id: str) -> None:
    """Forget a request's Mamba bookkeeping (its tables go with its row)."""
    m._mamba.forget(request_id, range(m.num_groups))


def release_row(m: TorchKVCacheManager, row: int) -> None:
    for g in range(m.num_groups):
        m._mamba.running.discard((row, g))


def new_step_starts(m: TorchKVCacheManager) -> None:
    m._mamba.cached_this_step.clear()


# --- Caching ------------------------------------------------------------------------------


def cache(m: TorchKVCacheManager, request: RequestLike, row: int, num_tokens: int) -> None:
    """``KVCacheCoordinator.cache_blocks`` for a layout with a Mamba ``"align"`` group: the
    attention groups as ``_cache_general`` does, the Mamba groups with their states, tail and
    checkpoint entries."""
    m._cache_general(request, row, num_tokens)


def cache_mamba_group(
    m: TorchKVCacheManager,
    request: RequestLike,
    row: int,
    g: int,
    num_tokens: int,
    boundaries: Sequence[int],
) -> None:
    """``MambaManager.cache_blocks`` of group ``g`` (``num_tokens``: its cacheable tokens)."""
    hbs, tab = m.hash_block_size, m.tables.host.a
    rule = m.rules[g]
    b = rule.block_size
    hashes = request.block_hashes
    i = m.rows.index(row, g)
    base = m.tables.base(g, row)
    start = m.rows.cached[i]
    num_full = min(num_tokens, len(hashes) * hbs) // b
    this_step = m._mamba.cached_this_step.setdefault(g, set())
    if start < num_full:
        src = m._source_of(request, row, num_full, num_full * b)
        eagle = m._group_eagle[g]
        reach = list(boundaries)
        shared = int(getattr(request, "shared_prefix_boundary", 0))
        if shared and eagle:
            reach.append(shared - b)
        mask = rules.mamba_retention_mask(
            start,
            num_full,
            alignment_tokens=m.block_size,
            block_size=b,
            retention_interval=m.retention_interval,
            reachable_boundaries=reach,
        )
        # A Mamba block is one hash block: the shared loop's hash index is the position.
        m._store_full_blocks(request, row, g, start, num_full, mask, src)
    after = m.rows.cached[i]
    key = _cache_partial_tail(m, request, row, g, num_tokens)
    if key is not None:
        this_step.add(key)
    for pos in range(start, after):
        found = _primary_key(m, tab[base + pos])
        if found is not None:
            this_step.add(found)


def _cache_partial_tail(
    m: TorchKVCacheManager, request: RequestLike, row: int, g: int, num_tokens: int
) -> Key | None:
    """``MambaManager._cache_partial_tail``."""
    request_id = request.request_id
    b = m.rules[g].block_size
    hbs = m.hash_block_size
    length = m.rows.length[m.rows.index(row, g)]
    base = m.tables.base(g, row)
    checkpoint = m._mamba.checkpoints.get((request_id, g))
    if checkpoint is not None:
        position, index = checkpoint
        if index >= length:
            return None  # reserved by an allocation that failed (see the reference)
        return _cache_checkpoint(m, request, row, g, position, m.tables.host.a[base + index])
    if num_tokens <= 0 or num_tokens % hbs:
        return None
    boundary = rules.mamba_prefill_checkpoint_position(
        prompt_tokens(request), hbs, m.settings.use_eagle, m.lookahead
    )
    if num_tokens != boundary or num_tokens > len(request.block_hashes) * hbs:
        return None  # not the boundary, or its hash lags behind (see the reference)
    index = rules.cdiv(num_tokens, b) - 1
    if index >= length or m.tables.host.a[base + index] == 0:
        return None
    block = m.tables.host.a[base + index]
    if _primary_tokens(m, block) == num_tokens:
        return None
    return _cache_partial_block(m, request, row, block, num_tokens, g, replace=False)


def _primary_tokens(m: TorchKVCacheManager, block: int) -> int | None:
    """``block_hash_num_tokens``: the tokens the block's primary key covers."""
    if m.pool.src.a[block] < 0:
        return None
    return (m.pool.hash_index(block) + 1) * m.hash_block_size


def _cache_checkpoint(
    m: TorchKVCacheManager,
    request: RequestLike,
    row: int,
    g: int,
    position: int,
    block: int,
) -> Key | None:
    """``MambaManager._cache_checkpoint``."""
    b = m.rules[g].block_size
    is_prompt_checkpoint = position == rules.mamba_prefill_checkpoint_position(
        prompt_tokens(request), m.block_size, m.settings.use_eagle, m.lookahead
    )
    is_retained = False
    if position % b == 0:
        state_index = position // b - 1
        mask = rules.mamba_retention_mask(
            state_index,
            state_index + 1,
            alignment_tokens=m.block_size,
            block_size=b,
            retention_interval=m.retention_interval,
            reachable_boundaries=(),
        )
        is_retained = mask is None or mask[0]
    shared = int(getattr(request, "shared_prefix_boundary", 0))
    # A checkpoint past the request's hashes has no key yet: transient (see the reference).
    hashed = position <= len(request.block_hashes) * m.hash_block_size
    if not hashed or not (is_prompt_checkpoint or is_retained or position == shared):
        if block:
            m.pool.remove_keys(block)
        return None
    if block == 0 or _primary_tokens(m, block) == position:
        return None
    return _cache_partial_block(m, request, row, block, position, g, replace=True)


def _cache_partial_block(
    m: TorchKVCacheManager,
    request: RequestLike,
    row: int,
    block: int,
    num_tokens: int,
    g: int,
    *,
    replace: bool,
) -> Key:
    """``BlockPool.cache_partial_block`` (``block`` is not the null block)."""
    pool, hbs = m.pool, m.hash_block_size
    hashes = request.block_hashes
    hidx = num_tokens // hbs - 1
    src = m._source_of(request, row, hidx + 1, num_tokens)
    already = pool.holds_key(block, src, hidx, g)
    if replace:
        pool.remove_keys(block)
        already = False
    elif not already:
        tokens = _primary_tokens(m, block)
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
