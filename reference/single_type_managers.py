"""One manager per KV cache group, with the logic of its attention type (Implementation).

Every type shares the same life cycle: adopt cache hits, take new blocks, cache full blocks,
release what is no longer needed, free everything when the request ends. The types differ in a
few hooks, each a rule of ``hybridkv.spec.rules``:

- ``skipped_tokens``: which leading tokens the next token no longer attends to;
- ``find_longest_cache_hit``: which cache hits are valid (Prefix caching, Cases 0–3);
- ``reachable_block_mask``: which full blocks are worth caching (sparse retention);
- Mamba alone also overrides how many blocks a step takes (one state block, not one per
  ``block_size`` tokens).

Tables are indexable by token position: position ``i`` covers tokens ``i × block_size …``;
positions whose tokens are no longer needed hold the null block instead of being removed.

Counts a manager receives (vLLM's names, so the two read alike):

- ``num_tokens``: tokens that need a slot after this step (lookahead slots included);
- ``num_tokens_main_model``: the same without the lookahead slots (Mamba never counts them);
- ``total_computed_tokens``: tokens computed once the adopted hit counts;
- ``prefill_end``: where the request's prefill ends (Mamba reserves a prefill checkpoint only
  on the chunk that reaches it, under sparse retention).

A request is *running* in a group once the group tracks its cached positions
(``num_cached_block``): from its first adopted hit, or from the first time one of its blocks
is cached. Until then every allocation counts as an admission.

The longest prefix one of a request's blocks is cached under (vLLM's per-group
``estimate_cached_tokens``: the largest ``block_hash_num_tokens`` of its table) is read at the
few positions that can hold it (``prefix_positions``), not by scanning the table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool, hashes_at_block_size
from hybridkv.reference.kv_cache_block import BlockHashWithGroupId, KVCacheBlock
from hybridkv.reference.lazy_flags import LazyFlags
from hybridkv.reference.request import RequestLike
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

BlocksPerGroup = tuple[list[KVCacheBlock], ...]

SKIPPED_TOKENS: dict[str, Callable[[Any, int], int]] = {
    "full": lambda spec, n: rules.full_attention_skipped_tokens(n),
    "sliding_window": lambda spec, n: rules.sliding_window_skipped_tokens(n, spec.sliding_window),
    "chunked_local": lambda spec, n: rules.chunked_local_skipped_tokens(
        n, spec.attention_chunk_size
    ),
    "mamba": lambda spec, n: rules.mamba_skipped_tokens(n),
}
"""Each attention type's ``skipped_tokens`` rule, by ``spec.kind`` (the one dispatch of the
managers, beside ``MANAGERS``; a spec's own ``skipped_tokens`` calls the same rule)."""


def prompt_tokens(request: RequestLike) -> int:
    """The request's prompt length (all its tokens, for a request object without one)."""
    return int(getattr(request, "num_prompt_tokens", request.num_tokens))


def shared_prefix_boundary(request: RequestLike) -> int:
    """The scheduler's copy of the request's shared-prefix boundary (0 if it keeps none)."""
    return int(getattr(request, "shared_prefix_boundary", 0))


class SingleTypeKVCacheManager(ABC):
    """Allocation and prefix caching for one KV cache group (one attention type)."""

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        group_id: int,
        *,
        scheduler_block_size: int,
        enable_caching: bool = True,
        max_admission_blocks: int | None = None,
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        # Cache hits land on multiples of this (the coordinator sets it for hybrids).
        self.cache_hit_alignment_tokens = scheduler_block_size
        # A full-prompt admission caps a window's reservation at what it ever holds at once.
        self.max_admission_blocks = max_admission_blocks
        # This group's hits drop the EAGLE block (the coordinator decides).
        self.use_eagle = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # Positions of each running request's table already entered into the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        # One past the last position each running request adopted as a hit or entered into the
        # prefix cache itself (a retention mask may leave the positions after it uncached).
        self.num_kept_block: dict[str, int] = {}

    # --- Hooks ------------------------------------------------------------------------------

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token does not attend to (the type's rule)."""
        return SKIPPED_TOKENS[self.spec.kind](self.spec, num_computed_tokens)

    @abstractmethod
    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """The longest hit of at most ``max_length`` tokens, looked up jointly in ``group_ids``:
        one list per group (null blocks where the hit needs no KV, then cached blocks) and the
        hit length, a multiple of ``alignment_tokens``."""

    def reachable_block_mask(
        self,
        start_block: int,
        end_block: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> Sequence[bool] | None:
        """Which new full positions to cache (``None``: all). Dense types cache every one."""
        return None

    def _hashes(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        return hashes_at_block_size(block_hashes, self.block_pool.hash_block_size, self.block_size)

    # --- Allocation -------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        *,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Free blocks this group would consume to hold ``num_tokens`` tokens.

        A running request needs the positions its table lacks. A request being admitted sets
        aside its skipped positions (no block), adopts its hits, and needs the rest; a hit that
        sits in the free queue counts as consumed, since adopting it takes it out. A full-prompt
        admission caps a window's need at the blocks it ever holds at once.
        """
        required = rules.attention_blocks_for_tokens(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks is not None:
            required = min(required, self.max_admission_blocks)
        num_held = len(self.req_to_blocks.get(request_id, ()))
        if request_id in self.num_cached_block:
            return max(required - num_held, 0)
        skipped = self.skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped, len(new_computed_blocks) + num_held), 0)
        skipped_hits = max(0, skipped - num_held)
        return num_new + _num_evictable(new_computed_blocks[skipped_hits:])

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> None:
        """Admit a request: null positions for its skipped tokens, then its adopted hits."""
        skipped = max(self.skipped_tokens(num_computed_tokens) // self.block_size, 0)
        adopted = list(new_computed_blocks[skipped:])
        if self.enable_caching:
            self.block_pool.touch(adopted)
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend([self.block_pool.null_block] * skipped + adopted)
        # Hits are cached already; nulls hold nothing to cache.
        self.num_cached_block[request_id] = len(table)
        self.num_kept_block[request_id] = len(table)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Extend the table with new blocks up to the positions ``num_tokens`` tokens need."""
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = rules.attention_blocks_for_tokens(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

    # --- Caching ----------------------------------------------------------------------------

    def cache_blocks(
        self,
        request: RequestLike,
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        """Enter the table's full blocks covered by ``num_tokens`` tokens into the prefix cache
        (those ``reachable_block_mask`` keeps)."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, num_hashed) // self.block_size
        if num_cached >= num_full:
            return
        boundaries = list(reachable_boundaries)
        shared = shared_prefix_boundary(request)
        if shared:
            boundaries.append(shared)
            if self.use_eagle:
                # A sibling diverging right after the junction cannot peek past it.
                boundaries.append(shared - self.block_size)
        mask = self.reachable_block_mask(num_cached, num_full, retention_interval, boundaries)
        table = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=num_cached,
            num_full_blocks=num_full,
            block_size=self.block_size,
            group_id=self.group_id,
            block_mask=mask,
        )
        self.num_cached_block[request_id] = num_full
        for index in range(num_full - 1, num_cached - 1, -1):
            # The last position ``cache_full_blocks`` entered (it skips nulls and masked ones).
            if not table[index].is_null and (mask is None or mask[index - num_cached]):
                self.num_kept_block[request_id] = index + 1
                break

    # --- Estimate ---------------------------------------------------------------------------

    def cached_prefix_tokens(self, request_id: str) -> int:
        """The longest prefix one of the request's blocks is cached under: the largest
        ``block_hash_num_tokens`` of its table (0 when none is cached), read at
        ``prefix_positions`` only."""
        table = self.req_to_blocks.get(request_id, [])
        return max(
            (
                table[index].block_hash_num_tokens or 0
                for index in self.prefix_positions(request_id)
                if 0 <= index < len(table)
            ),
            default=0,
        )

    def prefix_positions(self, request_id: str) -> tuple[int, ...]:
        """Table positions among which the longest cached prefix of the table sits.

        An attention table's block at position ``i`` is cached under ``(i + 1) × block_size``
        tokens (an adopted hit, or a full block the request cached) or, the prompt-tail entry
        of a full-attention block larger than the hash block, under fewer: the further right,
        the longer. A held attention block keeps its key (a prompt-tail entry only grows into
        the full-block key; only Mamba states lose or change keys while held). Positions from
        ``num_cached_block`` on hold blocks the request took fresh, without a key but for a
        prompt-tail entry, which can sit at ``num_cached_block`` only (caching its block whole
        moves the count past it). Below it, the positions after the last one kept hold nulls or
        blocks a retention mask left uncached. So the longest prefix is at the last kept
        position or at ``num_cached_block``; a window's released position reads as a null, and
        then every position before it is one too."""
        return (
            self.num_kept_block.get(request_id, 0) - 1,
            self.num_cached_block.get(request_id, 0),
        )

    # --- Release ----------------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release the blocks of tokens no longer needed; their positions become null."""
        skipped = self.skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        table = self.req_to_blocks.setdefault(request_id, [])
        self._remove_blocks_in_range(request_id, 0, min(skipped // self.block_size, len(table)))

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Release positions ``first … last − 1``, from the last down, stopping at the first
        null one: everything before it was released by an earlier call."""
        table = self.req_to_blocks.get(request_id)
        if table is None or first >= last:
            return
        released: list[KVCacheBlock] = []
        for index in range(min(last, len(table)) - 1, first - 1, -1):
            if table[index].is_null:
                break
            released.append(table[index])
            table[index] = self.block_pool.null_block
        self.block_pool.free_blocks(released)

    def free(self, request_id: str) -> None:
        """Release the whole table, last position first, so the tail is evicted first."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.num_kept_block.pop(request_id, None)
        self.block_pool.free_blocks(table[::-1])

    def new_step_starts(self) -> None:  # noqa: B027 (a hook: only Mamba keeps per-step state)
        """The scheduler begins a step (only Mamba keeps per-step state)."""


class CachedFlags(LazyFlags):
    """``cached[i]``: is position ``i`` of a request cached in every one of ``group_ids``?

    A lazy view, so that a scan that stops early asks the pool only about the positions it
    visits.
    """

    def __init__(
        self,
        pool: BlockPool,
        block_hashes: Sequence[BlockHash],
        group_ids: Sequence[int],
        length: int,
    ) -> None:
        super().__init__(length)
        self._pool = pool
        self._hashes = block_hashes
        self._group_ids = group_ids

    def flag(self, index: int) -> bool:
        return self._pool.get_cached_block(self._hashes[index], self._group_ids) is not None


def _num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
    """Hit blocks that wait in the free queue: adopting them consumes free blocks."""
    return sum(1 for block in blocks if block.ref_cnt == 0 and not block.is_null)


def _lookup(
    pool: BlockPool, block_hash: BlockHash, group_ids: Sequence[int]
) -> list[KVCacheBlock] | None:
    return pool.get_cached_block(block_hash, group_ids)


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: every token is needed; a hit is a cached prefix (Prefix caching, Case 0)."""

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """The cached prefix, scanned left to right; with the EAGLE drop one block shorter, and
        rounded down to the alignment (the scheduler block, when block sizes differ)."""
        hashes = self._hashes(block_hashes)
        limit = min(max_length // self.block_size, len(hashes))
        cached = CachedFlags(self.block_pool, hashes, group_ids, limit)
        num_hit = rules.full_attention_hit_blocks(cached, limit)
        hits: BlocksPerGroup = tuple([] for _ in group_ids)
        for index in range(num_hit):
            found = _lookup(self.block_pool, hashes[index], group_ids)
            assert found is not None
            for group_hits, block in zip(hits, found, strict=True):
                group_hits.append(block)
        hit_length = num_hit * self.block_size
        if drop_eagle_block and hit_length > 0:
            hit_length -= min(alignment_tokens, self.block_size)
        hit_length -= hit_length % alignment_tokens
        for group_hits in hits:
            del group_hits[rules.cdiv(hit_length, self.block_size) :]
        return hits, hit_length

    def cache_blocks(
        self,
        request: RequestLike,
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        super().cache_blocks(request, num_tokens, retention_interval, reachable_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_prompt_tail(request, num_tokens)

    def _cache_prompt_tail(self, request: RequestLike, num_tokens: int) -> None:
        """A block larger than the hash block also answers for the prompt's last hash boundary
        inside it (where a resend's hit ends), once that boundary is computed."""
        hash_block_size = self.block_pool.hash_block_size
        limit = prompt_tokens(request) - (0 if self.use_eagle else 1)
        boundary = min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        index = boundary // self.block_size
        if index < len(table):
            self.block_pool.cache_partial_block(
                request, table[index], num_tokens=boundary, group_id=self.group_id
            )


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window: tokens leave the window; a hit needs only the last ``window − 1`` tokens
    cached (Prefix caching, Case 1)."""

    spec: SlidingWindowSpec

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """Scan right to left for ``contiguous`` cached blocks ending at an aligned length; with
        none, the run of cached blocks from block 0. The EAGLE drop needs one block more and
        drops it."""
        hashes = self._hashes(block_hashes)
        size = self.block_size
        needed = rules.sliding_window_contiguous_blocks(
            self.spec.sliding_window, size, drop_eagle_block
        )
        max_num_blocks = min(max_length // size, len(hashes))
        null = self.block_pool.null_block
        hits: BlocksPerGroup = tuple([null] * max_num_blocks for _ in group_ids)
        run = 0
        found_run = False
        for index in range(max_num_blocks - 1, -1, -1):
            found = _lookup(self.block_pool, hashes[index], group_ids)
            if found is None:
                run = 0
                continue
            if run == 0 and size != alignment_tokens:
                kept = index if drop_eagle_block else index + 1
                if kept * size % alignment_tokens:
                    continue
            for group_hits, block in zip(hits, found, strict=True):
                group_hits[index] = block
            run += 1
            if run >= needed:
                for group_hits in hits:
                    del group_hits[index + run :]
                found_run = True
                break
        if not found_run:
            for group_hits in hits:
                del group_hits[run:]
            _align(hits, size, alignment_tokens)
        if drop_eagle_block and hits[0]:
            for group_hits in hits:
                group_hits.pop()
            _align(hits, size, alignment_tokens)
        return hits, len(hits[0]) * size

    def reachable_block_mask(
        self,
        start_block: int,
        end_block: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> Sequence[bool] | None:
        return rules.sliding_window_retention_mask(
            start_block,
            end_block,
            alignment_tokens=self.cache_hit_alignment_tokens,
            block_size=self.block_size,
            contiguous_blocks=rules.sliding_window_contiguous_blocks(
                self.spec.sliding_window, self.block_size, self.use_eagle
            ),
            use_eagle=self.use_eagle,
            retention_interval=retention_interval,
            reachable_boundaries=reachable_boundaries,
        )


def _align(hits: BlocksPerGroup, block_size: int, alignment_tokens: int) -> None:
    """Drop trailing positions until the hit length is a multiple of the alignment."""
    while len(hits[0]) * block_size % alignment_tokens:
        for group_hits in hits:
            group_hits.pop()


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention: only the current chunk is needed, for allocation and for hits."""

    spec: ChunkedLocalAttentionSpec

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """Null blocks before the chunk that holds ``max_length``, then its cached blocks."""
        hashes = self._hashes(block_hashes)
        max_num_blocks = min(max_length // self.block_size, len(hashes))
        first = rules.chunked_local_skipped_tokens(max_length, self.spec.attention_chunk_size)
        first //= self.block_size
        hits: BlocksPerGroup = tuple([self.block_pool.null_block] * first for _ in group_ids)
        for index in range(first, max_num_blocks):
            found = _lookup(self.block_pool, hashes[index], group_ids)
            if found is None:
                break
            for group_hits, block in zip(hits, found, strict=True):
                group_hits.append(block)
        return hits, len(hits[0]) * self.block_size


class MambaManager(SingleTypeKVCacheManager):
    """Mamba: a state per request instead of KV per token (Allocation, Case 4).

    ``"none"`` mode holds one running state: a table of ``max_model_len`` tokens per block is one
    block per request (plus the speculative blocks); with a smaller block it behaves like a
    window of one token. ``"align"`` mode (prefix caching, Case 3) keeps the states at block
    boundaries as prefix-cache entries: position ``i`` holds the state after ``(i + 1) × B``
    tokens where one lives, null elsewhere, and a running request holds one or two state
    blocks (plus a prefill checkpoint and the speculative blocks), whatever its length.
    """

    spec: MambaSpec

    def __init__(
        self,
        spec: KVCacheSpec,
        block_pool: BlockPool,
        group_id: int,
        *,
        scheduler_block_size: int,
        enable_caching: bool = True,
        max_admission_blocks: int | None = None,
    ) -> None:
        super().__init__(
            spec,
            block_pool,
            group_id,
            scheduler_block_size=scheduler_block_size,
            enable_caching=enable_caching,
            max_admission_blocks=max_admission_blocks,
        )
        assert isinstance(spec, MambaSpec)
        self.align = spec.mamba_cache_mode == "align"
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.has_checkpoint_blocks = self.align and spec.num_prefill_checkpoint_blocks > 0
        # The EAGLE drop moves every retained state one block lower (the coordinator sets it).
        self.drop_eagle_checkpoint_block = False
        # States cached since the scheduler's last ``new_step_starts`` (the same-step rule).
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # Align mode: the position of the previous state, released once the next one exists.
        self.last_state_block_idx: dict[str, int] = {}
        # Align mode: positions below this were released already.
        self.num_retired_blocks: dict[str, int] = {}
        # Align mode: requests that took their first blocks (speculative blocks included).
        self.allocated_block_reqs: set[str] = set()
        # Align mode: (checkpoint token position, table position) reserved by this allocation.
        self.checkpoints: dict[str, tuple[int, int]] = {}
        # Align mode: the positions of the request's real blocks (states, checkpoint,
        # speculative blocks), as of its last allocation: a few, wherever they sit.
        self.state_positions: dict[str, list[int]] = {}

    # --- Cache hits -------------------------------------------------------------------------

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """The largest aligned block boundary whose state is cached: nulls, then that state.
        Nothing has to be contiguous (Prefix caching, Case 3)."""
        hashes = self._hashes(block_hashes)
        size = self.block_size
        null = self.block_pool.null_block
        for index in range(min(max_length // size, len(hashes)) - 1, -1, -1):
            found = _lookup(self.block_pool, hashes[index], group_ids)
            if found is None:
                continue
            if size != alignment_tokens and (index + 1) * size % alignment_tokens:
                continue
            return tuple([null] * index + [block] for block in found), (index + 1) * size
        return tuple([] for _ in group_ids), 0

    def reachable_block_mask(
        self,
        start_block: int,
        end_block: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> Sequence[bool] | None:
        return rules.mamba_retention_mask(
            start_block,
            end_block,
            alignment_tokens=self.cache_hit_alignment_tokens,
            block_size=self.block_size,
            retention_interval=retention_interval,
            reachable_boundaries=reachable_boundaries,
        )

    def prefix_positions(self, request_id: str) -> tuple[int, ...]:
        """Align mode: every real block's position. A state's key need not match its position
        (a checkpoint is keyed at its own boundary), another request may re-key or evict a state
        it shares, and speculative blocks move: only the few real blocks bound the search."""
        if not self.align:
            return super().prefix_positions(request_id)
        return tuple(self.state_positions.get(request_id, ()))

    # --- Allocation -------------------------------------------------------------------------

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
    ) -> None:
        """Align mode also records where the adopted state sits (the table is the skipped
        nulls, then the hit: nulls and one state)."""
        super().add_local_computed_blocks(request_id, new_computed_blocks, num_computed_tokens)
        if self.align:
            table = self.req_to_blocks[request_id]
            self.state_positions[request_id] = [
                index for index, block in enumerate(table) if not block.is_null
            ]

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        *,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1].block_hash in (
            self.cached_blocks_this_step
        ):
            # The same-step rule: a state cached in this step is written by this step's
            # forward pass; no allocation can adopt it before the next step.
            return self.block_pool.num_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap=apply_admission_cap,
                prefill_end=prefill_end,
            )
        # Lookahead slots never count: the state sits at the last computed token.
        num_tokens = num_tokens_main_model
        required = rules.cdiv(num_tokens, self.block_size) + self.num_speculative_blocks
        num_new = required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        checkpoint = self._checkpoint_position(
            request_id, total_computed_tokens, num_tokens, prefill_end
        )
        if not apply_admission_cap:
            if checkpoint > 0:
                self.checkpoints[request_id] = (
                    checkpoint,
                    rules.cdiv(num_tokens, self.block_size) - 2,
                )
            else:
                self.checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 + int(checkpoint > 0)
            if request_id not in self.allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        return num_new + _num_evictable(new_computed_blocks)

    def _checkpoint_position(
        self, request_id: str, query_start: int, query_end: int, prefill_end: int
    ) -> int:
        """The prefill checkpoint this chunk reserves a block for, or 0."""
        position = rules.mamba_prefill_checkpoint_position(
            query_end,
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        index = rules.cdiv(query_end, self.block_size) - 2
        table = self.req_to_blocks.get(request_id, [])
        needed = (
            self.has_checkpoint_blocks
            and query_end >= prefill_end
            and rules.mamba_prefill_checkpoint_valid(
                query_start,
                query_end,
                position,
                self.block_pool.hash_block_size,
                self.block_size,
                self.spec.prefill_checkpoint_alignment,
            )
            and index >= 0
            and (
                index >= len(table)
                or table[index].is_null
                or (
                    request_id in self.allocated_block_reqs
                    and index >= len(table) - self.num_speculative_blocks
                )
            )
        )
        return position if needed else 0

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        if not self.align:
            return super().allocate_new_blocks(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model,
            )
        table = self.req_to_blocks.setdefault(request_id, [])
        required = rules.cdiv(num_tokens_main_model, self.block_size)
        required += self.num_speculative_blocks
        checkpoint = int(request_id in self.checkpoints)
        if required <= len(table) and not checkpoint:
            self.allocated_block_reqs.add(request_id)
            return []
        previous_length = len(table)
        allocated_before = request_id in self.allocated_block_reqs
        if allocated_before:
            # The running state sits before the speculative blocks.
            self.last_state_block_idx[request_id] = (
                previous_length - 1 - self.num_speculative_blocks
            )
        elif previous_length > 0:
            # An admitted hit: its last position holds the adopted state.
            self.last_state_block_idx[request_id] = previous_length - 1
        state_position = required - self.num_speculative_blocks - 1
        null_end = state_position - checkpoint
        if previous_length < state_position:
            table.extend([self.block_pool.null_block] * (null_end - previous_length))
        moved_to = len(table)
        if allocated_before:
            # Speculative blocks the state moved past go to the end of the table (same ids).
            for index in range(previous_length - self.num_speculative_blocks, previous_length):
                if index >= null_end:
                    break
                table.append(table[index])
                table[index] = self.block_pool.null_block
        new_blocks = self.block_pool.get_new_blocks(max(required - len(table), 0))
        appended = table[previous_length:] + new_blocks
        table.extend(new_blocks)
        self.allocated_block_reqs.add(request_id)
        # Real blocks: those still held from before, then the moved and the new ones.
        held = [i for i in self.state_positions.get(request_id, ()) if not table[i].is_null]
        self.state_positions[request_id] = held + list(range(moved_to, len(table)))
        return appended

    # --- Caching ----------------------------------------------------------------------------

    def cache_blocks(
        self,
        request: RequestLike,
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        """Cache the states at block boundaries this allocation covers (and its checkpoint),
        remembering them as cached in this step."""
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, retention_interval, reachable_boundaries)
        after = self.num_cached_block.get(request_id, 0)
        if self.align:
            key = self._cache_partial_tail(request, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        table = self.req_to_blocks.get(request_id, [])
        for block in table[before:after]:
            if not block.is_null and block.block_hash is not None:
                self.cached_blocks_this_step.add(block.block_hash)

    def _cache_partial_tail(
        self, request: RequestLike, num_tokens: int, retention_interval: int | None
    ) -> BlockHashWithGroupId | None:
        """Key the reserved checkpoint block at its boundary, or the state at the prompt's last
        hash boundary; ``None`` when nothing new is cached."""
        table = self.req_to_blocks[request.request_id]
        checkpoint = self.checkpoints.get(request.request_id)
        if checkpoint is not None:
            if checkpoint[1] >= len(table):
                # Reserved by an allocation that then failed, and cached later (delayed
                # caching): no block was taken for it, so nothing is cached (vLLM asserts).
                return None
            return self._cache_checkpoint(request, table, *checkpoint, retention_interval)
        hash_block_size = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        boundary = rules.mamba_prefill_checkpoint_position(
            prompt_tokens(request),
            hash_block_size,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        if num_tokens != boundary or num_tokens > len(request.block_hashes) * hash_block_size:
            # Not the prompt's boundary, or its hash lags behind (lookahead hashes in flight):
            # no key yet, nothing cached (as for a checkpoint past the hashes).
            return None
        index = rules.cdiv(num_tokens, self.block_size) - 1
        if index >= len(table) or table[index].is_null:
            return None
        if table[index].block_hash_num_tokens == num_tokens:
            return None
        return self.block_pool.cache_partial_block(
            request, table[index], num_tokens=num_tokens, group_id=self.group_id
        )

    def _cache_checkpoint(
        self,
        request: RequestLike,
        table: list[KVCacheBlock],
        position: int,
        index: int,
        retention_interval: int | None,
    ) -> BlockHashWithGroupId | None:
        """The checkpoint block receives the state at ``position``: cache it when a later
        request can reach it (the prompt's checkpoint, a retained one, the shared prefix);
        otherwise the slot is transient and loses any key it got in this step."""
        block = table[index]
        is_prompt_checkpoint = position == rules.mamba_prefill_checkpoint_position(
            prompt_tokens(request),
            self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )
        is_retained = False
        if position % self.block_size == 0:
            state_index = position // self.block_size - 1
            mask = self.reachable_block_mask(state_index, state_index + 1, retention_interval, ())
            is_retained = mask is None or mask[0]
        # A checkpoint past the request's hashes (a speculative step's drafts reach beyond its
        # known tokens) has no key yet: it is transient (vLLM would fail an assertion here).
        hashed = position <= len(request.block_hashes) * self.block_pool.hash_block_size
        reachable = (
            is_prompt_checkpoint or is_retained or position == shared_prefix_boundary(request)
        )
        if not (hashed and reachable):
            self.block_pool.maybe_evict_cached_block(block)
            return None
        if block.block_hash_num_tokens == position:
            return None
        return self.block_pool.cache_partial_block(
            request,
            block,
            num_tokens=position,
            group_id=self.group_id,
            replace_existing_hashes=True,
        )

    # --- Release ----------------------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Release every state before the one holding the last computed token; in align mode
        also the previous state block once the request has moved past it."""
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if not self.align:
            return
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < rules.cdiv(num_computed_tokens, self.block_size) - 1:
            table = self.req_to_blocks[request_id]
            if not table[last].is_null:
                self.block_pool.free_blocks([table[last]])
                table[last] = self.block_pool.null_block

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Align mode: prefill leaves nulls between states, so skip them instead of stopping."""
        if not self.align:
            super()._remove_blocks_in_range(request_id, first, last)
            return
        table = self.req_to_blocks.get(request_id, [])
        first = max(first, self.num_retired_blocks.get(request_id, 0))
        last = min(last, len(table))
        if first >= last:
            return
        released: list[KVCacheBlock] = []
        for index in range(last - 1, first - 1, -1):
            if not table[index].is_null:
                released.append(table[index])
                table[index] = self.block_pool.null_block
        self.block_pool.free_blocks(released)
        self.num_retired_blocks[request_id] = last

    def free(self, request_id: str) -> None:
        self.allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        self.state_positions.pop(request_id, None)
        super().free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()


MANAGERS: dict[str, type[SingleTypeKVCacheManager]] = {
    "full": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "chunked_local": ChunkedLocalAttentionManager,
    "mamba": MambaManager,
}
"""The manager of each attention type, by ``spec.kind``."""


def manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager of a spec's attention type."""
    return MANAGERS[spec.kind]
