"""``allocate_slots`` past its quiet exit: the checks of a call, then the phase that serves it.

The manager's ``allocate_slots`` answers a running request's quiet or plain step itself (the
hot path); every other call comes here: its hit and counts are checked (``checked_hits``,
unless the manager found them plain), the pool is settled, and the call goes to the Mamba
``"align"`` path (``hybridkv.optimized.mamba``) or to admission
(``hybridkv.optimized.admission``, which sends a request already holding a row to its step).

Data layout
-----------
A hit arrives as ``KVCacheBlocks``: the block ids per group (``BlockIds``, what the Mamba path
reads) and, for the attention paths, one ``GroupHit`` per group (an int32 numpy array with its
leading nulls; the manager's own lookup result carries them already, ``HitBlocks``).
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.optimized import admission, mamba
from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.layout import BlockIds, GroupLayout
from hybridkv.optimized.lookup import GroupHit, HitBlocks
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.step_columns import ColumnRequest
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.validation import check_allocation, check_issued_allocation
from hybridkv.spec import rules
from hybridkv.spec.errors import check_non_negative


def allocate(
    s: ManagerState,
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
    num_lookahead_tokens: int,
    delay_cache_blocks: bool,
    full_sequence_must_fit: bool,
    reserved_blocks: int,
    watermark_blocks: int,
    *,
    checked: bool,
    issued: bool,
    num_external: int = 0,
    num_encoder: int = 0,
) -> KVCacheBlocks | None:
    """``allocate_slots`` of a call its quiet exit did not answer (``checked``: no hit and
    plain counts, already checked; ``issued``: the hit is the manager's last lookup result;
    ``num_external``: tokens a KV connector supplies after the hit; ``num_encoder``: tokens
    that size the cross-attention tables)."""
    s.pool.paths.ran(paths.ALLOCATE)
    if type(request) is Request or type(request) is ColumnRequest:
        request.offer_block_hasher(s.block_hasher)  # a request met here first
    found, group_hits = checked_hits(
        s,
        request,
        num_new_tokens,
        num_new_computed_tokens,
        new_computed_blocks,
        num_lookahead_tokens,
        (reserved_blocks, watermark_blocks),
        checked=checked,
        issued=issued,
        num_external=num_external,
    )
    check_non_negative("num_encoder_tokens", num_encoder)
    if num_encoder:
        check_encoder_width(s.layout, num_encoder)
    s.settle()
    try:
        if s.layout.has_align:
            return mamba.allocate(
                s,
                request,
                num_new_tokens,
                num_new_computed_tokens,
                found,
                num_lookahead_tokens,
                delay_cache_blocks,
                full_sequence_must_fit,
                reserved_blocks,
                watermark_blocks,
                num_external,
            )
        if full_sequence_must_fit and not admission.whole_sequence_fits(
            s,
            request,
            num_new_computed_tokens,
            group_hits,
            watermark_blocks,
            num_external,
            num_encoder,
        ):
            return None
        return admission.allocate(
            s,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            group_hits,
            num_lookahead_tokens,
            delay_cache_blocks,
            reserved_blocks + watermark_blocks,
            num_external,
            num_encoder,
        )
    finally:
        s.tables.flush()


def check_encoder_width(layout: GroupLayout, num_encoder: int) -> None:
    """The encoder tokens fit a cross-attention table of ``max_blocks_per_req`` positions (the
    reference's lists have no such bound: a ``ValueError`` before anything changes)."""
    for g in layout.cross_groups:
        block_size = layout.rules[g].block_size
        if rules.cdiv(num_encoder, block_size) > layout.max_blocks_per_req:
            raise ValueError(
                f"num_encoder_tokens must fit cross-attention group {g}'s table of "
                f"max_blocks_per_req={layout.max_blocks_per_req} blocks of {block_size} tokens, "
                f"got {num_encoder!r}: build the manager with a larger max_blocks_per_req"
            )


def checked_hits(
    s: ManagerState,
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
    num_lookahead_tokens: int,
    kept_free: tuple[int, int],
    *,
    checked: bool,
    issued: bool,
    num_external: int = 0,
) -> tuple[BlockIds, Sequence[GroupHit]]:
    """``allocate_slots``'s checks of a call with a hit or unusual counts (``kept_free``: its
    reserved and watermark blocks; ``checked``: no hit, counts checked already): the hit's ids
    per group, and its ``GroupHit``s (a Mamba ``"align"`` layout reads the ids only). The
    manager's own last lookup result (``issued``) needs only its counts checked; its arrays
    are adopted as they are (no Python ints built)."""
    layout = s.layout
    if checked:
        return layout.no_hits, layout.no_group_hits
    found: BlockIds
    group_hits: Sequence[GroupHit]
    if issued and isinstance(new_computed_blocks, HitBlocks) and not layout.has_align:
        found, group_hits = layout.no_hits, new_computed_blocks.group_hits
        check_issued_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            [hit.size for hit in group_hits],
            num_lookahead_tokens,
            config=layout.config,
            enable_caching=layout.caching,
            holds_blocks=s.rows.__contains__,
            settings=layout.settings,
            allow_fewer_hashes=True,
            num_external_computed_tokens=num_external,
        )
    else:
        found = check_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            config=layout.config,
            enable_caching=layout.caching,
            holds_blocks=s.rows.__contains__,
            settings=layout.settings,
            allow_fewer_hashes=True,
            issued=issued,
            num_external_computed_tokens=num_external,
        )
        group_hits = tuple(map(GroupHit.of, found)) if not layout.has_align else ()
    check_non_negative("reserved_blocks", kept_free[0])
    check_non_negative("watermark_blocks", kept_free[1])
    return found, group_hits
