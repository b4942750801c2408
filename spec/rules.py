"""Every rule of the design document as a small pure function with a contract.

Contracts are PEP 316 docstrings (``pre:`` / ``post:``), which CrossHair checks symbolically; the
conformance manifest names each function here. Preconditions bound the inputs so that CrossHair
explores every path; the functions themselves accept any valid size.

The reference managers call these functions, so the checked rule *is* the implementation.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence


def cdiv(a: int, b: int) -> int:
    """Ceiling division: the number of ``b``-sized pieces that hold ``a`` items.

    pre: 0 <= a <= 10_000_000
    pre: 0 < b <= 1_000_000
    post: (__return__ - 1) * b < a <= __return__ * b or (a == 0 and __return__ == 0)
    """
    return -(a // -b)


# --- Blocks a request needs -------------------------------------------------------------------


def attention_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Block-table positions an attention layer needs for ``num_tokens`` tokens (Allocation).

    Every attention type keeps one position per ``block_size`` tokens; the positions it no longer
    needs become the null block, they are not removed (the table stays indexable by token).

    pre: 0 <= num_tokens <= 10_000
    pre: 0 < block_size <= 64
    post: __return__ * block_size >= num_tokens
    post: (__return__ - 1) * block_size < num_tokens or __return__ == 0
    """
    return cdiv(num_tokens, block_size)


def mamba_blocks_for_tokens(num_tokens: int) -> int:
    """A Mamba layer holds one state block per request, whatever its length (Allocation, Case 4).

    pre: 0 <= num_tokens <= 10_000
    post: __return__ == (1 if num_tokens > 0 else 0)
    """
    return 1 if num_tokens > 0 else 0


# --- Tokens no longer needed ------------------------------------------------------------------


def full_attention_skipped_tokens(num_computed_tokens: int) -> int:
    """Full attention needs every token until the request finishes.

    pre: 0 <= num_computed_tokens <= 10_000
    post: __return__ == 0
    """
    return 0


def sliding_window_skipped_tokens(
    num_computed_tokens: int, sliding_window: int, extra_retained_tokens: int = 0
) -> int:
    """Tokens before the window of the next token: ``max(0, n − window + 1 − extra)``.

    The next token (index n) attends to tokens n − window + 1 … n, so every earlier token can
    give its slot back (Prefix caching, Case 1: "free blocks outside the sliding window"), but
    the ``extra_retained_tokens`` just below the window: multi-module MTP prefills the last
    ``num_prefill_lookahead − 1`` tokens again, so vLLM 0.33 extends the window's trailing edge
    by that many (``SlidingWindowManager.get_num_skipped_tokens``). The extension is a wider
    window for this rule: the skip of ``(window, extra)`` is the skip of ``(window + extra, 0)``.

    pre: 0 <= num_computed_tokens <= 10_000
    pre: 0 < sliding_window <= 1_000
    pre: 0 <= extra_retained_tokens <= 100
    post: 0 <= __return__ <= num_computed_tokens
    post: num_computed_tokens - __return__ == min(num_computed_tokens, sliding_window - 1 + extra_retained_tokens)
    post: __return__ == max(0, num_computed_tokens - (sliding_window + extra_retained_tokens) + 1)
    """  # noqa: E501
    return max(0, num_computed_tokens - sliding_window + 1 - extra_retained_tokens)


def chunked_local_skipped_tokens(num_computed_tokens: int, attention_chunk_size: int) -> int:
    """Tokens of the chunks before the current one: ``(n // chunk) × chunk``.

    pre: 0 <= num_computed_tokens <= 10_000
    pre: 0 < attention_chunk_size <= 1_000
    post: __return__ % attention_chunk_size == 0
    post: 0 <= num_computed_tokens - __return__ < attention_chunk_size
    """
    return num_computed_tokens // attention_chunk_size * attention_chunk_size


def mamba_skipped_tokens(num_computed_tokens: int) -> int:
    """A recurrent layer needs no token's KV, only its state after the last computed token.

    pre: 0 <= num_computed_tokens <= 10_000
    post: __return__ == max(num_computed_tokens - 1, 0)
    """
    return max(num_computed_tokens - 1, 0)


def skipped_block_positions(num_skipped_tokens: int, block_size: int) -> int:
    """Whole blocks that hold only skipped tokens: these positions become the null block.

    pre: 0 <= num_skipped_tokens <= 10_000
    pre: 0 < block_size <= 64
    post: __return__ * block_size <= num_skipped_tokens < (__return__ + 1) * block_size
    """
    return num_skipped_tokens // block_size


# --- Cache hits (Prefix caching, Cases 0–2) ---------------------------------------------------


def sliding_window_hit_blocks_needed(sliding_window: int, block_size: int) -> int:
    """Consecutive cached blocks a sliding-window hit must end with.

    The token after a hit attends to the ``sliding_window − 1`` tokens before it, so those (and
    only those) must be cached: ``cdiv(window − 1, block_size)`` blocks (Prefix caching, Case 1).

    pre: 0 < sliding_window <= 1_000
    pre: 0 < block_size <= 64
    post: __return__ * block_size >= sliding_window - 1
    post: __return__ == 0 or (__return__ - 1) * block_size < sliding_window - 1
    """
    return cdiv(sliding_window - 1, block_size)


def full_attention_hit_blocks(cached: Sequence[bool], max_num_blocks: int) -> int:
    """Longest run of cached blocks from block 0, scanned left to right (Prefix caching, Case 0).

    A full-attention hit needs every token before it, so the scan stops at the first miss.

    pre: len(cached) <= 8
    pre: 0 <= max_num_blocks <= len(cached)
    post: 0 <= __return__ <= max_num_blocks
    post: all(cached[:__return__])
    post: __return__ == max_num_blocks or not cached[__return__]
    """
    num_hit = 0
    while num_hit < max_num_blocks and cached[num_hit]:
        num_hit += 1
    return num_hit


def window_hit_is_valid(cached: Sequence[bool], needed: int, num_blocks: int) -> bool:
    """Whether a hit of ``num_blocks`` blocks is valid for a sliding window (the brute-force rule).

    Valid when the ``needed`` blocks before position ``num_blocks`` are all cached, or when fewer
    than ``needed`` blocks precede it and all of them are cached. Positions past the end of
    ``cached`` are never valid. A window of one token needs no block before the hit
    (``needed`` 0), yet a hit still ends on a cached block, as with ``needed`` 1: vLLM's scan
    stops at a cached block, never at a miss.

    pre: len(cached) <= 8
    pre: 0 <= needed <= 8
    pre: 0 <= num_blocks <= 9
    post: __return__ or num_blocks > 0
    post: not __return__ or num_blocks <= len(cached)
    post: not __return__ or num_blocks == 0 or cached[num_blocks - 1]
    """
    if num_blocks > len(cached):
        return False
    return all(cached[max(0, num_blocks - max(needed, 1)) : num_blocks])


def sliding_window_hit_blocks(cached: Sequence[bool], needed: int) -> tuple[int, int]:
    """The longest sliding-window hit: ``(hit blocks, first real block)``, scanning right to left.

    A hit of ``k`` blocks is valid when the ``needed`` blocks before position ``k`` are cached,
    or when fewer than ``needed`` blocks precede it and all of them are cached. The scan starts
    from the longest candidate and stops at the first valid one (Prefix caching, Case 1: with a
    window of 4 and 15 cached-or-not tokens it picks 14 over 5 and 6). Positions before the
    first real block need no KV: the manager fills them with the null block. With no run of
    ``needed`` blocks, the hit is the run of cached blocks starting at block 0. A one-token
    window (``needed`` 0) scans as ``needed`` 1: its hit ends at the last cached block.

    pre: len(cached) <= 8
    pre: 0 <= needed <= 8
    post: 0 <= __return__[1] <= __return__[0] <= len(cached)
    post: all(cached[__return__[1]:__return__[0]])
    post: __return__[1] == 0 or __return__[0] - __return__[1] == max(needed, 1)
    post: window_hit_is_valid(cached, needed, __return__[0])
    post: not any(window_hit_is_valid(cached, needed, j) for j in range(__return__[0] + 1, 9))
    """
    span = max(needed, 1)
    run = 0
    for i in range(len(cached) - 1, -1, -1):
        if cached[i]:
            run += 1
            if run >= span:
                return i + run, i
        else:
            run = 0
    return run, 0


def chunked_local_hit_blocks(
    cached: Sequence[bool], max_length: int, block_size: int, attention_chunk_size: int
) -> tuple[int, int]:
    """Chunked local hit: ``(hit blocks, first real block)`` for a hit of at most ``max_length``.

    The next token attends only to its own chunk, so every block before the chunk that holds
    token ``max_length`` is a null position, cached or not; the blocks of that chunk must be
    cached from its first block on, scanned left to right.

    pre: len(cached) <= 8
    pre: 0 < block_size <= 4
    pre: 0 < attention_chunk_size <= 16
    pre: 0 <= max_length and max_length // block_size <= len(cached)
    post: __return__[1] == max_length // attention_chunk_size * attention_chunk_size // block_size
    post: __return__[1] <= __return__[0] <= max_length // block_size
    post: all(cached[__return__[1]:__return__[0]])
    post: __return__[0] == max_length // block_size or not cached[__return__[0]]
    """
    max_num_blocks = max_length // block_size
    first_real = chunked_local_skipped_tokens(max_length, attention_chunk_size) // block_size
    num_hit = first_real
    while num_hit < max_num_blocks and cached[num_hit]:
        num_hit += 1
    return num_hit, first_real


# --- Grouping (Allocation, Cases 2–4) ---------------------------------------------------------


def group_size(layer_counts: Sequence[int]) -> int:
    """Layers per KV cache group: the smallest layer count among the attention types (Case 3).

    pre: 0 < len(layer_counts) <= 4
    pre: all(0 < c <= 100 for c in layer_counts)
    post: __return__ in layer_counts
    post: all(__return__ <= c for c in layer_counts)
    """
    return min(layer_counts)


def num_groups_of_type(num_layers: int, layers_per_group: int) -> int:
    """KV cache groups one attention type fills: ``cdiv(layers, group size)`` (Cases 2–3).

    pre: 0 < num_layers <= 100
    pre: 0 < layers_per_group <= 100
    post: (__return__ - 1) * layers_per_group < num_layers <= __return__ * layers_per_group
    """
    return cdiv(num_layers, layers_per_group)


def num_padding_slots(num_layers: int, layers_per_group: int) -> int:
    """Empty slots in a type's last group: Gemma-3-27b's 52 sliding layers in groups of 10 → 8.

    pre: 0 < num_layers <= 100
    pre: 0 < layers_per_group <= 100
    post: 0 <= __return__ < layers_per_group
    post: (num_layers + __return__) % layers_per_group == 0
    """
    return -num_layers % layers_per_group


def group_layer_ranges(num_layers: int, layers_per_group: int) -> tuple[tuple[int, int], ...]:
    """Where one attention type's layers split into KV cache groups (Cases 2–3).

    ``(start, stop)`` index ranges into the type's layers in model order: consecutive groups of
    ``layers_per_group`` layers; only the last may be short, its missing slots being padding
    (Gemma-3-27b's 52 sliding layers in groups of 10: five full groups, then sw.50–sw.51).

    pre: 0 < num_layers <= 12
    pre: 0 < layers_per_group <= 12
    post: len(__return__) == num_groups_of_type(num_layers, layers_per_group)
    post: __return__[0][0] == 0 and __return__[-1][1] == num_layers
    post: all(__return__[i][1] == __return__[i + 1][0] for i in range(len(__return__) - 1))
    post: all(stop - start == layers_per_group for start, stop in __return__[:-1])
    post: 0 < __return__[-1][1] - __return__[-1][0] <= layers_per_group
    """
    starts = range(0, num_layers, layers_per_group)
    return tuple((start, min(start + layers_per_group, num_layers)) for start in starts)


def raised_block_size(block_size: int, kv_hidden_size: int, state_bytes: int) -> int:
    """Case 4: the smallest multiple of ``block_size`` whose attention page holds a Mamba state.

    The attention page of one layer is ``block_size × kv_hidden_size``; the block size grows
    until that page is at least ``state_bytes``, so one page size serves both layer types.

    pre: 0 < block_size <= 64
    pre: 0 < kv_hidden_size <= 4096
    pre: 0 < state_bytes <= 1_000_000
    post: __return__ % block_size == 0
    post: __return__ * kv_hidden_size >= state_bytes
    post: __return__ == block_size or (__return__ - block_size) * kv_hidden_size < state_bytes
    """
    return block_size * max(1, cdiv(state_bytes, block_size * kv_hidden_size))


# --- Planning bounds (the plan report) -------------------------------------------------------


def max_blocks_full_attention(max_model_len: int, block_size: int) -> int:
    """Most blocks one full-attention request holds: one per block of its longest length.

    pre: 0 < max_model_len <= 10_000
    pre: 0 < block_size <= 64
    post: __return__ == cdiv(max_model_len, block_size)
    """
    return cdiv(max_model_len, block_size)


def max_blocks_sliding_window(
    max_model_len: int,
    block_size: int,
    sliding_window: int,
    max_num_batched_tokens: int,
    extra_retained_tokens: int = 0,
) -> int:
    """Most real blocks one sliding-window request holds at once.

    One step computes up to ``max_num_batched_tokens`` tokens that attend ``window − 1`` tokens
    back (and ``extra_retained_tokens`` more are kept below the window, multi-module MTP's),
    and those tokens need not start on a block boundary: one block more (vLLM 0.33's
    ``SlidingWindowSpec.max_admission_blocks_per_request``).

    pre: 0 < max_model_len <= 10_000
    pre: 0 < block_size <= 64
    pre: 0 < sliding_window <= 1_000
    pre: 0 < max_num_batched_tokens <= 1_000
    pre: 0 <= extra_retained_tokens <= 100
    post: __return__ >= 1
    post: __return__ <= cdiv(max_model_len, block_size) + 1
    """
    tokens = min(sliding_window - 1 + extra_retained_tokens + max_num_batched_tokens, max_model_len)
    return cdiv(tokens, block_size) + 1


def max_blocks_chunked_local(
    max_model_len: int, block_size: int, attention_chunk_size: int, max_num_batched_tokens: int
) -> int:
    """Most real blocks one chunked-local request holds at once: a chunk plus one step.

    pre: 0 < max_model_len <= 10_000
    pre: 0 < block_size <= 64
    pre: 0 < attention_chunk_size <= 1_000
    pre: 0 < max_num_batched_tokens <= 1_000
    post: __return__ <= cdiv(max_model_len, block_size)
    """
    tokens = min(attention_chunk_size + max_num_batched_tokens, max_model_len)
    return cdiv(tokens, block_size)


def max_blocks_mamba(max_model_len: int) -> int:
    """Most blocks one Mamba request holds: its one state block, whatever its length (Case 4).

    pre: 0 < max_model_len <= 10_000
    post: __return__ == 1
    """
    return mamba_blocks_for_tokens(max_model_len)


# --- Memory layout (Memory Layout) -------------------------------------------------------------


def num_blocks_for_memory(
    available_memory_bytes: int, num_tensors: int, layer_page_size_bytes: int
) -> int:
    """Blocks that fit: a block takes one ``layer_page_size_bytes`` slice of each of the tensors.

    With m layers per group there are m tensors, so a block costs m × page_size_bytes, which is
    the document's page size of a KV cache group (Memory Layout). The count includes the null
    block.

    pre: 0 <= available_memory_bytes <= 10**12
    pre: 0 < num_tensors <= 64
    pre: 0 < layer_page_size_bytes <= 10**8
    post: __return__ >= 0
    post: __return__ * num_tensors * layer_page_size_bytes <= available_memory_bytes
    post: available_memory_bytes < (__return__ + 1) * num_tensors * layer_page_size_bytes
    """
    return available_memory_bytes // (num_tensors * layer_page_size_bytes)


def max_num_requests(num_blocks: int, blocks_per_request: int) -> int:
    """Requests of the longest length that fit at once; the null block is never handed out.

    pre: 2 <= num_blocks <= 1_000_000
    pre: 0 < blocks_per_request <= 10_000
    post: __return__ >= 0
    post: __return__ * blocks_per_request <= num_blocks - 1
    post: num_blocks - 1 < (__return__ + 1) * blocks_per_request
    """
    return (num_blocks - 1) // blocks_per_request


# --- Faster twins (each proved equal to its rule by a harness in hybridkv.conformance) -------


def sliding_window_hit_blocks_skip(cached: Sequence[bool], needed: int) -> tuple[int, int]:
    """``sliding_window_hit_blocks``, scanning each candidate window and skipping on a miss.

    A candidate hit of ``end`` blocks needs blocks ``end − needed … end − 1`` cached; checking
    them right to left, a miss at ``p`` rules out every candidate whose window holds ``p``, so
    the next candidate ends at ``p``. Each block is read at most once per skip instead of once
    per candidate, and a long cached tail is found after ``needed`` reads.

    pre: len(cached) <= 8
    pre: 0 <= needed <= 8
    post: 0 <= __return__[1] <= __return__[0] <= len(cached)
    post: all(cached[__return__[1]:__return__[0]])
    post: __return__[1] == 0 or __return__[0] - __return__[1] == max(needed, 1)
    """
    span = max(needed, 1)  # a one-token window: as one block (``sliding_window_hit_blocks``)
    end = len(cached)
    while end >= span:
        miss = end - 1
        while miss >= end - span and cached[miss]:
            miss -= 1
        if miss < end - span:
            return end, end - span
        end = miss
    run = 0
    while run < end and cached[run]:
        run += 1
    return run, 0


# --- Engine features: block sizes, Mamba checkpoints, sparse retention, EAGLE ----------------


def scheduler_block_size(block_sizes: Sequence[int]) -> int:
    """The scheduler's block: the lcm of the groups' block sizes, so every hit ends on a block
    boundary of every group (groups may have different block sizes).

    pre: 0 < len(block_sizes) <= 3
    pre: all(0 < b <= 64 for b in block_sizes)
    post: all(__return__ % b == 0 for b in block_sizes)
    post: max(block_sizes) <= __return__ <= math.prod(block_sizes)
    """
    return functools.reduce(math.lcm, block_sizes)


def hash_block_size(block_sizes: Sequence[int], *, lcm_hashing: bool) -> int:
    """Tokens per block hash: the gcd of the block sizes, so that every group's block is a whole
    number of hashes; the lcm when nothing will be looked up at a finer grain (caching off, or
    a Mamba group in ``"none"`` mode).

    pre: 0 < len(block_sizes) <= 3
    pre: all(0 < b <= 64 for b in block_sizes)
    post: all(b % __return__ == 0 for b in block_sizes) or lcm_hashing
    post: not lcm_hashing or all(__return__ % b == 0 for b in block_sizes)
    """
    if lcm_hashing:
        return functools.reduce(math.lcm, block_sizes)
    return functools.reduce(math.gcd, block_sizes)


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at.

    A resend is capped at ``num_prompt_tokens − 1`` (its last token is recomputed for its
    logits). With the EAGLE drop a hit ends one scheduler block lower, at the resend's or at a
    longer sibling's aligned length.

    pre: 0 <= num_prompt_tokens <= 1000
    pre: 0 < scheduler_block_size <= 64
    post: 0 < len(__return__) <= 2
    post: use_eagle or __return__ == (num_prompt_tokens - 1,)
    post: not use_eagle or all(b % scheduler_block_size == 0 and b >= 0 for b in __return__)
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


def sliding_window_contiguous_blocks(sliding_window: int, block_size: int, use_eagle: bool) -> int:
    """Cached blocks a sliding-window hit must end with: ``cdiv(window − 1, B)``, one more with
    the EAGLE drop (the extra block is matched, then dropped so the drafter recomputes it).

    pre: 0 < sliding_window <= 1_000
    pre: 0 < block_size <= 64
    post: __return__ == sliding_window_hit_blocks_needed(sliding_window, block_size) + use_eagle
    """
    return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)


def mamba_prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool, num_hash_lookahead_tokens: int
) -> int:
    """The last hash boundary whose Mamba state a later request can reuse, for a prefill of
    ``num_tokens`` tokens.

    At least one token is left for its logits (or the lookahead tokens a hash needs); with the
    EAGLE drop the checkpoint moves one hash block lower instead.

    pre: 0 <= num_tokens <= 1000
    pre: 0 < hash_block_size <= 64
    pre: 0 <= num_hash_lookahead_tokens <= 4
    post: __return__ % hash_block_size == 0
    post: 0 <= __return__ < max(num_tokens, 1)
    """
    proof_limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = max(proof_limit, 0) // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def mamba_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    mamba_block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether a kernel can export the state at ``checkpoint_position`` from inside the prefill
    chunk ``[query_start, query_end)``.

    The chunk must start on a hash boundary at least one hash block below the checkpoint, the
    checkpoint must lie strictly inside it at a multiple of ``checkpoint_alignment`` from its
    start, and its block must differ from the one that holds the chunk's initial state.

    pre: 0 <= query_start <= query_end <= 1000
    pre: 0 <= checkpoint_position <= 1000
    pre: 0 < hash_block_size <= mamba_block_size <= 64
    pre: checkpoint_alignment is None or 0 < checkpoint_alignment <= 64
    post: not __return__ or query_start < checkpoint_position < query_end
    post: not __return__ or checkpoint_alignment is not None
    """
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


def sliding_window_retention_mask(
    start_block: int,
    end_block: int,
    *,
    alignment_tokens: int,
    block_size: int,
    contiguous_blocks: int,
    use_eagle: bool,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int],
) -> tuple[bool, ...] | None:
    """Which of positions ``start_block … end_block − 1`` a sliding-window group caches
    (``None``: all of them).

    A hit at an aligned length needs only the ``contiguous_blocks`` ending there, so each
    aligned segment keeps just its tail: dense retention (``None``) at every
    ``alignment_tokens`` boundary, a positive interval once per interval, ``0`` none. With any
    sparse setting the tails ending at the reachable boundaries (a replay, a shared prefix) are
    kept too. With the EAGLE drop the tail ends one block past the boundary.

    pre: 0 <= start_block <= end_block <= 12
    pre: 0 < block_size <= 8 and 0 < alignment_tokens <= 32
    pre: 0 <= contiguous_blocks <= 6
    pre: retention_interval is None or 0 <= retention_interval <= 64
    pre: len(reachable_boundaries) <= 3 and all(0 <= b <= 100 for b in reachable_boundaries)
    post: __return__ is None or len(__return__) == end_block - start_block
    """
    if alignment_tokens % block_size != 0:
        return None
    shift = 1 if use_eagle else 0
    mask = [False] * (end_block - start_block)
    segment_tokens = (
        alignment_tokens
        if retention_interval is None
        else (None if retention_interval == 0 else retention_interval)
    )
    if segment_tokens is not None:
        per_segment = segment_tokens // block_size
        if contiguous_blocks >= per_segment:
            return None
        for i in range(start_block, end_block):
            if i >= shift and (i - shift) % per_segment >= per_segment - contiguous_blocks:
                mask[i - start_block] = True
    if retention_interval is not None:
        for boundary in reachable_boundaries:
            end = boundary // alignment_tokens * alignment_tokens // block_size + shift
            for j in range(max(start_block, end - contiguous_blocks), min(end_block, end)):
                mask[j - start_block] = True
    return tuple(mask)


def mamba_retention_mask(
    start_block: int,
    end_block: int,
    *,
    alignment_tokens: int,
    block_size: int,
    retention_interval: int | None,
    reachable_boundaries: Sequence[int],
) -> tuple[bool, ...] | None:
    """Which Mamba states of positions ``start_block … end_block − 1`` are cached (``None``:
    all). Position ``i`` holds the state after ``(i + 1) × block_size`` tokens, and a hit needs
    that one state only: dense keeps all, ``0`` only those at the reachable boundaries, a
    positive interval also one per interval.

    pre: 0 <= start_block <= end_block <= 12
    pre: 0 < block_size <= 8 and 0 < alignment_tokens <= 32
    pre: retention_interval is None or 0 <= retention_interval <= 64
    pre: len(reachable_boundaries) <= 3 and all(-8 <= b <= 100 for b in reachable_boundaries)
    post: __return__ is None or len(__return__) == end_block - start_block
    post: retention_interval is not None or __return__ is None
    """
    if retention_interval is None:
        return None
    mask = [False] * (end_block - start_block)
    if retention_interval > 0:
        per_segment = retention_interval // block_size
        if per_segment <= 1:
            return None
        first_boundary = (start_block + per_segment) // per_segment * per_segment - 1
        for i in range(first_boundary - start_block, len(mask), per_segment):
            mask[i] = True
    for boundary in reachable_boundaries:
        boundary_block = boundary // alignment_tokens * alignment_tokens // block_size - 1
        if start_block <= boundary_block < end_block:
            mask[boundary_block - start_block] = True
    return tuple(mask)


# --- Grouping policies: vLLM 0.33's rule, and the fewest padded slots ------------------------


def vllm_group_size(layer_counts: Sequence[int]) -> int:
    """Layers per group as vLLM 0.33 picks them: the smallest count of any type, unless the
    largest is under 1.5× the smallest, then the largest (gpt-oss-20b + an EAGLE layer: 12
    sliding + 13 full → groups of 13, one padding slot, not 12 and 11).

    pre: 0 < len(layer_counts) <= 4
    pre: all(0 < c <= 100 for c in layer_counts)
    post: __return__ in (min(layer_counts), max(layer_counts))
    post: (__return__ == max(layer_counts)) == (2 * max(layer_counts) < 3 * min(layer_counts))
    """
    smallest, largest = min(layer_counts), max(layer_counts)
    return largest if 2 * largest < 3 * smallest else smallest


def strided_layer_indices(num_layers: int, layers_per_group: int) -> tuple[tuple[int, ...], ...]:
    """vLLM's assignment of one type's layers to its ``cdiv(n, g)`` groups: group i holds
    layers i, i + k, i + 2k, … (k groups), so every group spans every pipeline stage and the
    groups differ by at most one layer (3 layers in groups of 2: (0, 2), (1,)).

    pre: 0 < num_layers <= 12
    pre: 0 < layers_per_group <= 12
    post: len(__return__) == num_groups_of_type(num_layers, layers_per_group)
    post: sorted(i for group in __return__ for i in group) == list(range(num_layers))
    post: all(0 < len(group) <= layers_per_group for group in __return__)
    post: len(__return__[0]) - len(__return__[-1]) <= 1
    """
    num_groups = cdiv(num_layers, layers_per_group)
    return tuple(tuple(range(i, num_layers, num_groups)) for i in range(num_groups))


def pipeline_stage_sizes(num_layers: int, pipeline_parallel_size: int) -> tuple[int, ...]:
    """Decoder layers per pipeline stage, as vLLM splits them (``get_pp_indices``): evenly,
    the remainder one each to the stages before the last (which also holds the output head).

    pre: 0 < pipeline_parallel_size <= 8
    pre: pipeline_parallel_size <= num_layers <= 200
    post: len(__return__) == pipeline_parallel_size
    post: sum(__return__) == num_layers
    post: max(__return__) - min(__return__) <= 1
    post: __return__[-1] == num_layers // pipeline_parallel_size
    """
    base, remainder = divmod(num_layers, pipeline_parallel_size)
    sizes = [base] * pipeline_parallel_size
    for i in range(2, remainder + 2):
        sizes[-i] += 1
    return tuple(sizes)


def group_slots(stages: Sequence[Sequence[int]], layers_per_group: int) -> int:
    """Layer slots a block costs over all groups, on the fullest pipeline stage: groups × m.

    ``stages[t]`` lists the pipeline stage of each layer of type t in model order. With
    strided groups of at most ``layers_per_group`` layers, m is the most layers one group has
    on one stage: every stage's tensors are m pages per block, so the pool's blocks are
    ``memory // (m × page)`` and each of the G groups gets an equal share when every group
    holds as many blocks (full attention). Fewer slots: more tokens in the same memory.

    pre: 0 < len(stages) <= 2
    pre: all(0 < len(of_type) <= 5 for of_type in stages)
    pre: all(s in (0, 1) for of_type in stages for s in of_type)
    pre: 0 < layers_per_group <= 5
    post: sum(map(len, stages)) <= __return__ * 2
    """
    num_groups, widest = 0, 0
    for of_type in stages:
        for indices in strided_layer_indices(len(of_type), layers_per_group):
            num_groups += 1
            per_stage: dict[int, int] = {}
            for i in indices:
                per_stage[of_type[i]] = per_stage.get(of_type[i], 0) + 1
            widest = max(widest, *per_stage.values())
    return num_groups * widest


def min_padding_group_size(stages: Sequence[Sequence[int]]) -> int:
    """The group size with the fewest slots per block (``group_slots``); ties: fewer groups,
    then the larger size. Strided groups change only where some type's group count
    ``cdiv(n, g)`` does, so only the sizes ``cdiv(n, k)`` are tried.

    pre: 0 < len(stages) <= 2
    pre: all(0 < len(of_type) <= 5 for of_type in stages)
    pre: all(s in (0, 1) for of_type in stages for s in of_type)
    post: 0 < __return__ <= max(map(len, stages))
    post: all(group_slots(stages, __return__) <= group_slots(stages, g) for g in range(1, 6))
    """
    counts = [len(of_type) for of_type in stages]
    candidates = {cdiv(n, k) for n in counts for k in range(1, n + 1)}

    def cost(size: int) -> tuple[int, int, int]:
        groups = sum(num_groups_of_type(n, size) for n in counts)
        return group_slots(stages, size), groups, -size

    return min(candidates, key=cost)


def max_concurrent_batches(pipeline_parallel_size: int, async_scheduling: bool) -> int:
    """Scheduler steps in flight at once in vLLM 0.33 (model runner V2, the default on GPUs):
    one per pipeline stage, and one more with async scheduling, which schedules step n + 1
    before step n's tokens are settled. A sliding-window or chunked-local group reserves
    blocks for every in-flight step.

    pre: 0 < pipeline_parallel_size <= 8
    post: __return__ - pipeline_parallel_size == (1 if async_scheduling else 0)
    """
    return pipeline_parallel_size + (1 if async_scheduling else 0)


def mamba_state_blocks(enable_prefix_caching: bool) -> int:
    """State blocks one request holds in a Mamba group: one, or two with prefix caching
    (vLLM 0.33's ``mamba_cache_mode="align"``: the running state and the last state at a
    block boundary, which a later request can hit).

    post: __return__ == (2 if enable_prefix_caching else 1)
    """
    return 2 if enable_prefix_caching else 1


# --- The hybrid intersection (Prefix caching, Case 2) -----------------------------------------


def hybrid_hit_length(
    lookup: Callable[[int, int, bool], int],
    full_attention: Sequence[bool],
    drops_eagle_block: Sequence[bool],
    max_length: int,
) -> tuple[int, int]:
    """The longest hit every attention type accepts, and the longest one type found alone.

    ``lookup(t, length, drop)`` is type ``t``'s own longest hit of at most ``length`` tokens
    (``drop``: apply the EAGLE last-block drop). Types are visited in order, each searching
    within the previous one's result; a pass that lowers the length is repeated until no type
    lowers it (a fixed point: lengths only fall). Full attention comes first and is looked up
    once: its hit is a prefix, so any shorter length is a hit too. With exactly one full type
    and one other, one pass suffices. A type drops its EAGLE block once per candidate length.

    The reference coordinator, the optimized backend and the conformance oracle all call this.

    The contract holds for any ``lookup`` (lengths only fall); that the result is the longest
    hit every type accepts is checked against the brute force by the CrossHair harnesses
    ``hybridkv.conformance.harnesses.hybrid_hit_is_longest_accepted`` and
    ``hybrid_hit_without_full_attention`` (through ``oracles.hybrid_hit_tokens``).

    pre: 0 <= max_length <= 1000
    pre: len(full_attention) == len(drops_eagle_block) <= 4
    post: __return__[0] <= max_length
    """
    num_types = len(full_attention)
    hit_length = max_length
    longest = 0
    full_found: dict[int, int] = {}
    eagle_verified: set[int] = set()
    simple_hybrid = num_types == 2 and full_attention[0]
    while True:
        length = hit_length
        for t in range(num_types):
            if full_attention[t] and t in full_found:
                length = min(length, full_found[t])
                continue
            drop = drops_eagle_block[t] and t not in eagle_verified
            found = lookup(t, length, drop)
            if drop:
                eagle_verified.add(t)
            elif found < length:
                eagle_verified.clear()
            length = found
            if full_attention[t]:
                full_found[t] = found
            longest = max(longest, length)
        if length >= hit_length:
            return hit_length, longest
        hit_length = length
        if simple_hybrid:
            return hit_length, longest


# --- Eviction: which cached block can still serve a cache hit (issue 23) ----------------------


def hit_block_span(
    kind: str, window_or_chunk: int, block_size: int, prefix_end_tokens: int
) -> tuple[int, int]:
    """Block positions ``[lo, hi)`` a cache hit ending at ``prefix_end_tokens`` reads in a group.

    ``hi`` is the first block past the hit (every block holding a token before the end). Full
    attention reads from block 0 (Prefix caching, Case 0); a sliding window reads the blocks
    holding the ``window − 1`` tokens before the end (Case 1); chunked local attention reads the
    blocks of the chunk the next token falls in, none at a chunk boundary; Mamba reads the one
    state at the end (Allocation, Case 4). ``window_or_chunk`` is the window or chunk size in
    tokens (ignored for full attention and Mamba).

    pre: kind in ("full", "sliding_window", "chunked_local", "mamba")
    pre: 0 < window_or_chunk <= 64
    pre: 0 < block_size <= 16
    pre: 0 <= prefix_end_tokens <= 256
    post: 0 <= __return__[0] <= __return__[1] == cdiv(prefix_end_tokens, block_size)
    post: kind != "full" or __return__[0] == 0
    post: kind != "mamba" or __return__[1] - __return__[0] == min(1, prefix_end_tokens)
    post: kind != "sliding_window" or __return__[0] * block_size <= max(0, prefix_end_tokens - window_or_chunk + 1) < (__return__[0] + 1) * block_size or __return__[0] == __return__[1]
    post: kind != "chunked_local" or __return__[0] == __return__[1] or __return__[0] * block_size <= prefix_end_tokens // window_or_chunk * window_or_chunk < (__return__[0] + 1) * block_size
    """  # noqa: E501
    hi = cdiv(prefix_end_tokens, block_size)
    if kind == "sliding_window":
        lo = max(0, prefix_end_tokens - window_or_chunk + 1) // block_size
    elif kind == "chunked_local":
        lo = prefix_end_tokens // window_or_chunk * window_or_chunk // block_size
    elif kind == "mamba":
        lo = max(hi - 1, 0)
    else:
        lo = 0
    return min(lo, hi), hi


def can_serve_hit(
    kind: str, window_or_chunk: int, block_index: int, block_size: int, prefix_end_tokens: int
) -> bool:
    """Whether the block at ``block_index`` is read by a hit ending at ``prefix_end_tokens``.

    A cached block no cached prefix end reads can never serve a hit: an eviction policy may
    reuse it first at no loss (sliding-window blocks outside every window, chunked blocks of a
    finished chunk, a Mamba state that is no prefix end).

    pre: kind in ("full", "sliding_window", "chunked_local", "mamba")
    pre: 0 < window_or_chunk <= 64
    pre: 0 < block_size <= 16
    pre: 0 <= block_index <= 32
    pre: 0 <= prefix_end_tokens <= 256
    post: not __return__ or block_index * block_size < prefix_end_tokens
    post: kind != "full" or __return__ == (block_index * block_size < prefix_end_tokens)
    post: kind != "mamba" or __return__ == (prefix_end_tokens > 0 and block_index == (prefix_end_tokens - 1) // block_size)
    post: kind != "sliding_window" or not __return__ or (block_index + 1) * block_size > prefix_end_tokens - window_or_chunk + 1
    post: kind != "sliding_window" or __return__ or block_index * block_size >= prefix_end_tokens or (block_index + 1) * block_size <= prefix_end_tokens - window_or_chunk + 1
    """  # noqa: E501
    lo, hi = hit_block_span(kind, window_or_chunk, block_size, prefix_end_tokens)
    return lo <= block_index < hi
