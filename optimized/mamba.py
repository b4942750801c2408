"""The per-request path of layouts with a Mamba ``"align"`` group, over the manager's state.

A Mamba ``"align"`` table holds a real block only where a state lives (the running state, the
previous one, a prefill checkpoint, the speculative blocks) and nulls everywhere else, so its
nulls are no prefix and the row thresholds and the vectorised step of
``hybridkv.optimized.batch`` do not apply. A manager with such a group serves every allocation here,
one request at a time, step for step as ``KVCacheManager.allocate_slots`` does, with the same flat
state: the block tables (``BlockTables``, ``hybridkv.optimized.block_tables``), the row counters of
``hybridkv.optimized.rows`` (``length``, ``cached``; ``nulls`` is the leading nulls of an attention
group and, for a Mamba group, the positions already retired) and the ``TorchBlockPool``.

What the Mamba manager of the reference keeps besides a table lives in ``MambaState``
(``hybridkv.optimized.state``), keyed by (request id, group): the allocated flag, the previous
state's position, the checkpoint this allocation reserves, and the keys cached in the current
step (the same-step rule). Its caching is ``hybridkv.optimized.general_caching``'s.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from hybridkv.optimized import admission, step
from hybridkv.optimized.general_caching import cache_general, primary_key
from hybridkv.optimized.group_rules import MAMBA
from hybridkv.optimized.layout import BlockIds
from hybridkv.optimized.lookup import GroupHit
from hybridkv.optimized.state import ManagerState
from hybridkv.policies.protocol import PolicyError
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_managers import prompt_tokens
from hybridkv.spec import MambaSpec, rules


def allocate(
    s: ManagerState,
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    hits: BlockIds,
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    full_sequence_must_fit: bool,
    reserved_blocks: int = 0,
    watermark_blocks: int = 0,
    num_external: int = 0,
) -> KVCacheBlocks | None:
    """``KVCacheManager.allocate_slots`` after validation (``num_external``: tokens a KV
    connector supplies after the hit)."""
    request_id = request.request_id
    num_local_computed = request.num_computed_tokens + num_new_computed_tokens
    num_computed = num_local_computed + num_external
    total_computed = min(num_computed, s.layout.max_model_len)
    prefill_end = max(prompt_tokens(request), request.num_tokens - 1)
    if full_sequence_must_fit:
        full_length = min(request.num_tokens, s.layout.max_model_len)
        needed = num_blocks_to_allocate(
            s,
            request_id,
            full_length,
            hits,
            total_computed,
            full_length,
            True,
            prefill_end,
            num_external,
        )
        if needed + watermark_blocks > s.pool.num_free_blocks:
            return None
    main = total_computed + num_new_tokens
    need_slot = min(main + num_lookahead_tokens, s.layout.max_model_len)
    in_flight = request.num_in_flight_tokens
    row = s.rows.row_of(request_id)
    if row is not None:
        remove_skipped(s, request_id, row, max(0, total_computed - in_flight))
    if in_flight:
        s.mamba.in_flight[request_id] = in_flight
    else:
        s.mamba.in_flight.pop(request_id, None)
    needed = num_blocks_to_allocate(
        s, request_id, need_slot, hits, num_computed, main, False, prefill_end, num_external
    )
    if needed + watermark_blocks > s.pool.num_free_blocks - reserved_blocks:
        if row is not None:
            s.thresholds.refresh(row)  # windows may have released blocks
        return None
    if row is None:
        row = s.rows.take(request_id)
        if any(hits) or num_external:
            _adopt(s, request_id, row, hits, num_local_computed, num_external)
    try:
        if num_external:
            _take_external(s, request_id, row, num_local_computed, num_external)
        new_blocks = tuple(
            _allocate_group(s, request_id, row, g, need_slot, main)
            for g in range(s.layout.num_groups)
        )
    except PolicyError:
        s.thresholds.refresh(row)  # the earlier groups keep their blocks, as the reference's
        raise
    if not delay_cache_blocks:
        cache_general(s, request, row, min(total_computed + num_new_tokens, request.num_tokens))
    s.thresholds.refresh(row)
    return KVCacheBlocks(new_blocks)


def _adopt(
    s: ManagerState,
    request_id: str,
    row: int,
    hits: BlockIds,
    num_computed: int,
    num_external: int = 0,
) -> None:
    """Admit a request with a hit (or external tokens) into its new row: the attention groups
    as ``admission.adopt`` does, a Mamba group's table with nulls anywhere."""
    group_hits = [GroupHit.of(ids) for ids in hits]
    total = num_computed + num_external
    skipped = s.layout.skipped_positions(total)
    admission.adopt(s, row, group_hits, skipped, admission.adopted_blocks(group_hits, skipped))
    for g, rule in enumerate(s.layout.rules):
        s.mamba.running.add((row, g))
        if rule.kind == MAMBA:
            s.rows.nulls[s.rows.index(row, g)] = 0
            _record_adopted(s, request_id, row, g, hits[g], total)


def _take_external(
    s: ManagerState, request_id: str, row: int, num_local: int, num_external: int
) -> None:
    """``admission.take_external``; a Mamba group records where its new state sits."""
    lengths = s.rows.length
    before = [lengths[s.rows.index(row, g)] for g in range(s.layout.num_groups)]
    admission.take_external(s, row, num_local, num_external)
    for g, rule in enumerate(s.layout.rules):
        after = lengths[s.rows.index(row, g)]
        if rule.kind == MAMBA and after > before[g]:
            s.mamba.positions.setdefault((request_id, g), []).extend(range(before[g], after))


def _num_evictable(s: ManagerState, blocks: Sequence[int]) -> int:
    ref = s.pool.ref.a
    return sum(1 for b in blocks if b != 0 and ref[b] == 0)


def num_blocks_to_allocate(
    s: ManagerState,
    request_id: str,
    num_tokens: int,
    hits: BlockIds,
    total_computed: int,
    main: int,
    apply_cap: bool,
    prefill_end: int,
    num_external: int = 0,
) -> int:
    """``KVCacheCoordinator.get_num_blocks_to_allocate`` (which also records each Mamba
    group's checkpoint reservation, unless it is a full-prompt admission's check)."""
    if s.layout.retention_interval != 0:
        prefill_end = 0
    row = s.rows.row_of(request_id)
    total = 0
    for g, rule in enumerate(s.layout.rules):
        group_hits = hits[g]
        held = s.rows.length[s.rows.index(row, g)] if row is not None else 0
        if rule.kind == MAMBA:
            # The full-sequence check counts no external state, as vLLM's does.
            external = (
                num_external > 0
                and not apply_cap
                and (row is None or (row, g) not in s.mamba.running)
            )
            total += _mamba_num_blocks(
                s,
                request_id,
                g,
                held,
                group_hits,
                total_computed,
                main,
                apply_cap,
                prefill_end,
                external,
            )
            continue
        required = rule.blocks_for_tokens(num_tokens)
        cap = s.layout.admission_caps[g]
        if apply_cap and cap is not None:
            required = min(required, cap)
        if row is not None and (row, g) in s.mamba.running:
            total += max(required - held, 0)
            continue
        skipped = rule.skipped_positions(total_computed)
        num_new = max(required - max(skipped, len(group_hits) + held), 0)
        total += num_new + _num_evictable(s, group_hits[max(0, skipped - held) :])
    return total


def _mamba_num_blocks(
    s: ManagerState,
    request_id: str,
    g: int,
    held: int,
    group_hits: Sequence[int],
    total_computed: int,
    main: int,
    apply_cap: bool,
    prefill_end: int,
    external: bool = False,
) -> int:
    """``MambaManager.get_num_blocks_to_allocate`` in ``"align"`` mode (``external``: an
    admission with external tokens, whose last state takes a block of its own)."""
    state = s.mamba
    if group_hits and primary_key(s, group_hits[-1]) in state.cached_this_step.get(g, ()):
        # The same-step rule: a state cached in this step is still being written.
        return s.pool.num_blocks + 1
    spec = s.layout.rules[g]
    b = spec.block_size
    required = rules.cdiv(main, b) + spec.spec_blocks
    num_new = required - len(group_hits) - held
    if external:
        num_new = required - rules.cdiv(total_computed, b)
    checkpoint = _checkpoint_position(s, request_id, g, total_computed, main, prefill_end)
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
    return num_new + int(external) + _num_evictable(s, group_hits)


def _checkpoint_position(
    s: ManagerState,
    request_id: str,
    g: int,
    query_start: int,
    query_end: int,
    prefill_end: int,
) -> int:
    """``MambaManager._checkpoint_position``: the prefill checkpoint this chunk reserves a
    block for, or 0."""
    spec = s.layout.config.groups[g].spec
    assert isinstance(spec, MambaSpec)
    b = spec.block_size
    if not (spec.num_prefill_checkpoint_blocks > 0 and query_end >= prefill_end):
        return 0
    position = rules.mamba_prefill_checkpoint_position(
        query_end, s.layout.block_size, s.layout.settings.use_eagle, s.layout.lookahead
    )
    if not rules.mamba_prefill_checkpoint_valid(
        query_start,
        query_end,
        position,
        s.layout.hash_block_size,
        b,
        spec.prefill_checkpoint_alignment,
    ):
        return 0
    index = rules.cdiv(query_end, b) - 2
    if index < 0:
        return 0
    row = s.rows.row_of(request_id)
    length = s.rows.length[s.rows.index(row, g)] if row is not None else 0
    if (
        row is None
        or index >= length
        or s.tables.host.a[s.tables.base(g, row) + index] == 0
        or ((request_id, g) in s.mamba.allocated and index >= length - spec.num_speculative_blocks)
    ):
        return position
    return 0


def _allocate_group(
    s: ManagerState, request_id: str, row: int, g: int, num_tokens: int, main: int
) -> tuple[int, ...]:
    """``allocate_new_blocks`` of one group: its new blocks (a Mamba group also returns the
    nulls and the speculative blocks it moved)."""
    rule = s.layout.rules[g]
    tab, lengths = s.tables.host.a, s.rows.length
    i = s.rows.index(row, g)
    base = s.tables.base(g, row)
    length = lengths[i]
    if rule.kind != MAMBA:
        count = rule.blocks_for_tokens(num_tokens) - length
        if count <= 0:
            return ()
        blocks = s.pool.pop_n(count)
        _write(s, g, row, length, blocks)
        lengths[i] = length + count
        return tuple(blocks)
    state = s.mamba
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
    new_blocks = s.pool.pop_n(max(required - len(table), 0))
    appended = table[length:] + new_blocks
    table.extend(new_blocks)
    if len(table) > s.layout.max_blocks_per_req:
        raise ValueError(
            f"max_blocks_per_req {s.layout.max_blocks_per_req} cannot hold the Mamba table of "
            f"{request_id!r} ({len(table)} positions)"
        )
    _write(s, g, row, 0, table)
    lengths[i] = len(table)
    state.allocated.add((request_id, g))
    # Real blocks: those still held from before, then the moved and the new ones.
    held = [pos for pos in state.positions.get((request_id, g), ()) if table[pos]]
    state.positions[request_id, g] = held + list(range(moved_to, len(table)))
    return tuple(appended)


def _record_adopted(
    s: ManagerState,
    request_id: str,
    row: int,
    g: int,
    group_hits: Sequence[int],
    num_computed: int,
) -> None:
    """The positions of the real blocks of an admitted Mamba table: its adopted hit."""
    skipped = s.layout.rules[g].skipped_positions(num_computed)
    base = s.tables.base(g, row)
    tab = s.tables.host.a
    s.mamba.positions[request_id, g] = [
        pos for pos in range(skipped, len(group_hits)) if tab[base + pos]
    ]


def _write(s: ManagerState, g: int, row: int, lo: int, blocks: Sequence[int]) -> None:
    if not blocks:
        return  # an empty slice assignment would resize the array, which its views forbid
    base = s.tables.base(g, row)
    s.tables.host.a[base + lo : base + lo + len(blocks)] = _int_array(blocks)
    s.tables.touched(g, row, lo, lo + len(blocks))


def _int_array(values: Sequence[int]) -> array[int]:
    return array("i", values)


def remove_skipped(s: ManagerState, request_id: str, row: int, computed: int) -> None:
    """``remove_skipped_blocks`` of every group, in group order."""
    tab, rows = s.tables.host.a, s.rows
    for g, rule in enumerate(s.layout.rules):
        if rule.kind != MAMBA:
            step.release_skipped_group(s, row, g, computed)
            continue
        i = rows.index(row, g)
        base = s.tables.base(g, row)
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
                s.tables.touched(g, row, first, last)
                s.pool.free_blocks(released)
                rows.nulls[i] = last
        last_state = s.mamba.last_state.get((request_id, g))
        if last_state is not None and last_state < rules.cdiv(computed, rule.block_size) - 1:
            block = tab[base + last_state]
            if block:
                s.pool.free_blocks([block])
                tab[base + last_state] = 0
                s.tables.touched(g, row, last_state, last_state + 1)
