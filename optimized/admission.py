"""Admission: a request's first allocation, adopting its cache hit, then taking new blocks.

``allocate`` is ``allocate_slots`` after validation (a request that already holds a row goes
to ``hybridkv.optimized.step``); ``whole_sequence_fits`` is a full-prompt admission's first
check. Both count, per group, the positions a window or
chunk skips (nulls), the hit's blocks adopted past them (those in the free queue leave it) and
the new blocks the rest needs, all before changing anything, so a request that does not fit
leaves the state as it was. A cross-attention group needs the positions of the encoder tokens
(``required_positions``) instead of the decoder's, at admission or, should a scheduler pass
them then, at a running request's step (``step_with_encoder``).

Data layout
-----------
A hit is one ``GroupHit`` per group (``hybridkv.optimized.lookup``): an int32 numpy array of
block ids with its count of leading nulls (``nulls``) and whether it holds no null past them
(``dense``). ``adopted_blocks`` concatenates every group's real blocks past its skipped
positions into one array (blocks differ across groups, so one ``touch_array`` adopts them);
``adopt`` writes each group's table slice ``tab[base : base + size]`` in one numpy assignment
and sets its row counters (``length``, ``cached``, ``kept``, ``nulls``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import general_caching, one_pass_admission, step
from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.hit_blocks import ids_past
from hybridkv.optimized.layout import BlockIds, GroupLayout
from hybridkv.optimized.lookup import GroupHit
from hybridkv.optimized.state import ManagerState
from hybridkv.policies.protocol import PolicyError
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.spec import rules


def allocate(
    s: ManagerState,
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    hits: Sequence[GroupHit],
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    kept_free: int = 0,
    num_external: int = 0,
    num_encoder: int = 0,
) -> KVCacheBlocks | None:
    """``allocate_slots`` after validation, ``hits`` each group's adopted hit; ``kept_free``
    blocks (reserved and watermark) must stay free; ``num_external`` tokens a KV connector
    supplies follow the hit; ``num_encoder`` tokens size the cross-attention tables."""
    pool = s.pool
    request_id = request.request_id
    row = s.rows.row_of(request_id)
    local = request.num_computed_tokens + num_new_computed_tokens
    computed = min(local + num_external, s.layout.max_model_len)
    need = min(computed + num_new_tokens + num_lookahead_tokens, s.layout.max_model_len)
    cache_up_to = -1
    if s.layout.caching and not delay_cache_blocks:
        cache_up_to = min(computed + num_new_tokens, request.num_tokens)
    if row is not None:
        if num_encoder and s.layout.cross_groups:
            return step_with_encoder(s, request, row, computed, need, num_encoder, kept_free)
        return step.step(s, request, row, computed, need, cache_up_to, kept_free)
    # Admission: skipped positions, then the adopted hits, then the external tokens' blocks,
    # then new blocks.
    skipped = s.layout.skipped_positions(local + num_external)
    if (
        s.layout.columns.defers
        and s.tuning.one_pass_admission
        and not num_external
        and pool.policy is None
    ):
        plain = one_pass_admission.admit(s, request, skipped, need, cache_up_to, hits, kept_free)
        if not isinstance(plain, one_pass_admission.NotPlain):
            return plain
    required = required_positions(s.layout, need, num_encoder)
    adopted = adopted_blocks(hits, skipped)
    total = int(np.count_nonzero(pool.ref.n[adopted] == 0))  # hits in the free queue
    for g, count in enumerate(required):
        total += max(count - max(skipped[g], len(hits[g])), 0)
    if total + kept_free > pool.num_free_blocks:
        return None
    row = s.rows.take(request_id)
    adopt(s, row, hits, skipped, adopted)
    try:
        if num_external:
            take_external(s, row, local, num_external)
        admitted = step.extend(s, row, required)
    except PolicyError:
        s.thresholds.refresh(row)  # the request keeps its hits, as the reference's does
        raise
    if cache_up_to >= 0:
        general_caching.cache(s, request, row, cache_up_to)
    s.thresholds.refresh(row)
    return KVCacheBlocks(admitted)


def required_positions(layout: GroupLayout, num_tokens: int, num_encoder: int) -> list[int]:
    """The positions each group's table needs: ``num_tokens`` decoder tokens' by its rule, a
    cross-attention group's ``num_encoder`` encoder tokens' instead (vLLM's coordinator hands
    its ``CrossAttentionManager`` the encoder tokens alone)."""
    required = [rule.blocks_for_tokens(num_tokens) for rule in layout.rules]
    for g in layout.cross_groups:
        required[g] = rules.attention_blocks_for_tokens(num_encoder, layout.rules[g].block_size)
    return required


def step_with_encoder(
    s: ManagerState,
    request: RequestLike,
    row: int,
    computed: int,
    need: int,
    num_encoder: int,
    kept_free: int,
) -> KVCacheBlocks | None:
    """``step.step`` of a running request that also brings encoder tokens: the same release,
    then one take for every group, group 0 first, the cross-attention tables sized by
    ``num_encoder``. Nothing is cached: a layout with a cross-attention group has caching off
    (``CrossAttentionSpec.check_prefix_caching``)."""
    processed = max(0, computed - request.num_in_flight_tokens)
    if processed >= s.rows.release_at[row]:
        step.release_skipped(s, row, processed)
    required = required_positions(s.layout, need, num_encoder)
    length, at = s.rows.length, row * s.layout.num_groups
    total = sum(max(count - length[at + g], 0) for g, count in enumerate(required))
    try:
        if not step.fits(s, total + kept_free):
            return None
        return KVCacheBlocks(step.extend(s, row, required))
    finally:
        s.thresholds.refresh(row)


def take_external(s: ManagerState, row: int, local: int, num_external: int) -> BlockIds:
    """Blocks for the ``num_external`` tokens a KV connector supplies after the ``local``
    computed ones, every group's hit adopted first (``allocate_external_computed_blocks``):
    each group's positions up to the last external token that its type still reads."""
    length, at = s.rows.length, row * s.layout.num_groups
    targets = [
        max(rule.external_positions(local, num_external), length[at + g])
        for g, rule in enumerate(s.layout.rules)
    ]
    return step.extend(s, row, targets)


def blocks_to_allocate(
    s: ManagerState,
    request_id: str,
    num_tokens: int,
    total_computed: int,
    apply_cap: bool,
    num_encoder: int = 0,
) -> int:
    """``KVCacheCoordinator.get_num_blocks_to_allocate`` with no hit to adopt, on a layout
    without a Mamba ``"align"`` group: a request holding a row needs the positions it lacks,
    one being admitted those past its skipped positions (a cross-attention group: those of
    ``num_encoder`` tokens)."""
    row = s.rows.row_of(request_id)
    total = 0
    positions = required_positions(s.layout, num_tokens, num_encoder)
    for g, rule in enumerate(s.layout.rules):
        required = positions[g]
        cap = s.layout.admission_caps[g]
        if apply_cap and cap is not None:
            required = min(required, cap)
        if row is not None:
            total += max(required - s.rows.length[s.rows.index(row, g)], 0)
        else:
            total += max(required - rule.skipped_positions(total_computed), 0)
    return total


def whole_sequence_fits(
    s: ManagerState,
    request: RequestLike,
    num_new_computed_tokens: int,
    hits: Sequence[GroupHit],
    watermark_blocks: int = 0,
    num_external: int = 0,
    num_encoder: int = 0,
) -> bool:
    """A full-prompt admission's first check: the whole sequence (and the ``num_encoder``
    tokens of a cross-attention group), a window counting only what it ever holds at once,
    fits in the free blocks less the watermark (before anything is released)."""
    computed = min(
        request.num_computed_tokens + num_new_computed_tokens + num_external,
        s.layout.max_model_len,
    )
    full_length = min(request.num_tokens, s.layout.max_model_len)
    row = s.rows.row_of(request.request_id)
    length = s.rows.length
    total = 0
    skipped = s.layout.skipped_positions(computed)
    positions = required_positions(s.layout, full_length, num_encoder)
    for g in range(s.layout.num_groups):
        required = positions[g]
        cap = s.layout.admission_caps[g]
        if cap is not None:
            required = min(required, cap)
        if row is not None:
            total += max(required - length[row * s.layout.num_groups + g], 0)
        else:
            total += max(required - max(skipped[g], len(hits[g])), 0)
    if row is None:
        adopted = adopted_blocks(hits, skipped)
        total += int(np.count_nonzero(s.pool.ref.n[adopted] == 0))
    return total + watermark_blocks <= s.pool.num_free_blocks


def adopted_blocks(hits: Sequence[GroupHit], skipped: Sequence[int]) -> npt.NDArray[Any]:
    """The real blocks an admission adopts: each group's hit past its skipped positions
    (every group's blocks differ from the others', and a group's from each other)."""
    parts = ids_past(hits, skipped)
    adopted = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
    real: npt.NDArray[Any] = adopted[adopted != 0]
    return real


def adopt(
    s: ManagerState,
    row: int,
    hits: Sequence[GroupHit],
    skipped: Sequence[int],
    adopted: npt.NDArray[Any],
) -> None:
    """Admit a request: null positions for its skipped tokens, then its adopted hits (whose
    real blocks are ``adopted``; a policy hears them group by group, as the reference adopts
    them)."""
    if s.pool.policy is None:
        if s.pool.touch_array(adopted):
            s.pool.paths.ran(paths.TOUCH_VECTORISED)
    else:
        s.pool.paths.ran(paths.TOUCH_HEARD)
        for hit, skip in zip(hits, skipped, strict=True):
            s.pool.touch(hit.ids[max(skip - hit.nulls, 0) :].tolist())
    rows, tab = s.rows, s.tab.n
    row_base = row * s.layout.max_blocks_per_req
    for g, (hit, skip) in enumerate(zip(hits, skipped, strict=True)):
        base = s.layout.group_bases[g] + row_base
        size = max(skip, len(hit))
        zeros = max(skip, hit.nulls)  # positions before the hit's first adopted block
        ids = hit.ids[zeros - hit.nulls :] if zeros < size else hit.ids[:0]
        tab[base : base + zeros] = 0
        tab[base + zeros : base + size] = ids
        nulls = zeros
        if not hit.dense and ids.shape[0]:
            real = np.flatnonzero(ids)
            nulls += int(real[0]) if real.shape[0] else int(ids.shape[0])
        i = rows.index(row, g)
        rows.length[i] = rows.cached[i] = rows.kept[i] = size
        rows.nulls[i] = nulls
        s.tables.touched(g, row, 0, size)
