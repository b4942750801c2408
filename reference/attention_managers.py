"""The attention types' managers: full attention, sliding window, chunked local attention and
cross-attention.

Each differs from ``SingleTypeKVCacheManager`` only in its hooks: which cache hits are valid
(``find_longest_cache_hit``: Prefix caching, Cases 0–2) and, for a sliding window, which full
blocks are worth caching (``reachable_block_mask``); full attention also caches the prompt's
last partial boundary when EAGLE drops a block. Cross-attention adopts, caches and skips
nothing (the coordinator sizes its table by the encoder tokens). ``mamba_manager`` holds
Mamba's.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.lazy_flags import LazyFlags
from hybridkv.reference.request import RequestLike
from hybridkv.reference.single_type_base import (
    BlocksPerGroup,
    SingleTypeKVCacheManager,
    cached_blocks,
    prompt_tokens,
)
from hybridkv.spec import ChunkedLocalAttentionSpec, SlidingWindowSpec, rules


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
            found = cached_blocks(self.block_pool, hashes[index], group_ids)
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
            found = cached_blocks(self.block_pool, hashes[index], group_ids)
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
            found = cached_blocks(self.block_pool, hashes[index], group_ids)
            if found is None:
                break
            for group_hits, block in zip(hits, found, strict=True):
                group_hits.append(block)
        return hits, len(hits[0]) * self.block_size


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross-attention (encoder-decoder models): vLLM 0.33's ``CrossAttentionManager``.

    The coordinator hands it the request's encoder tokens where the other types get decoder
    tokens (one static allocation, sized by the encoder input). Encoder states are unique per
    request, so it adopts no hit, takes nothing for a KV connector's tokens and caches nothing
    (prefix caching is refused with it: ``CrossAttentionSpec.check_prefix_caching``).
    """

    def find_longest_cache_hit(
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_ids: Sequence[int],
        *,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> tuple[BlocksPerGroup, int]:
        """Never a hit: no prefix of one request's encoder input is another's."""
        return tuple([] for _ in group_ids), 0

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Nothing to adopt (vLLM's is a no-op too: the request stays unadmitted here)."""

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """A KV connector supplies decoder tokens only: no block here."""
        return []

    def cache_blocks(
        self,
        request: RequestLike,
        num_tokens: int,
        retention_interval: int | None,
        reachable_boundaries: Sequence[int],
    ) -> None:
        """Nothing is cached (prefix caching is off with a cross-attention group)."""
