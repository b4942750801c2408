"""The single-type manager's base: what every attention type's manager shares (Implementation).

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

Each type's manager: ``attention_managers`` (full attention, sliding window, chunked local),
``mamba_manager``; ``single_type_managers`` maps a spec to its manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool, hashes_at_block_size
from hybridkv.reference.kv_cache_block import KVCacheBlock
from hybridkv.reference.request import RequestLike
from hybridkv.spec import KVCacheSpec, rules

BlocksPerGroup = tuple[list[KVCacheBlock], ...]


SKIPPED_TOKENS: dict[str, Callable[[Any, int], int]] = {
    "full": lambda spec, n: rules.full_attention_skipped_tokens(n),
    "sliding_window": lambda spec, n: rules.sliding_window_skipped_tokens(
        n, spec.sliding_window, spec.extra_retained_tokens
    ),
    "chunked_local": lambda spec, n: rules.chunked_local_skipped_tokens(
        n, spec.attention_chunk_size
    ),
    "cross_attention": lambda spec, n: rules.full_attention_skipped_tokens(n),
    "mamba": lambda spec, n: rules.mamba_skipped_tokens(n),
}
"""Each attention type's ``skipped_tokens`` rule, by ``spec.kind`` (the one dispatch of the
managers, beside ``MANAGERS``; a spec's own ``skipped_tokens`` calls the same rule)."""


def prompt_tokens(request: RequestLike) -> int:
    """The request's prompt length (``RequestLike.num_prompt_tokens``)."""
    return request.num_prompt_tokens


def shared_prefix_boundary(request: RequestLike) -> int:
    """The scheduler's copy of the request's shared-prefix boundary (0 until it stores one)."""
    return request.shared_prefix_boundary


def num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
    """Hit blocks that wait in the free queue: adopting them consumes free blocks."""
    return sum(1 for block in blocks if block.ref_cnt == 0 and not block.is_null)


def cached_blocks(
    pool: BlockPool, block_hash: BlockHash, group_ids: Sequence[int]
) -> list[KVCacheBlock] | None:
    """The block cached under ``block_hash`` in each of ``group_ids`` (``None`` unless all
    have one): one position of a hit, for every type's scan."""
    return pool.get_cached_block(block_hash, group_ids)


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
        num_external_computed_tokens: int = 0,
    ) -> int:
        """Free blocks this group would consume to hold ``num_tokens`` tokens (the external
        tokens' positions are among them: no type but Mamba counts them apart).

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
        return num_new + num_evictable(new_computed_blocks[skipped_hits:])

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_computed_tokens: int,
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Admit a request: null positions for its skipped tokens, then its adopted hits. Tokens
        a KV connector supplies (``num_external_computed_tokens``) count as computed: a window
        skips what lies behind all of them."""
        total = num_computed_tokens + num_external_computed_tokens
        skipped = max(self.skipped_tokens(total) // self.block_size, 0)
        adopted = list(new_computed_blocks[skipped:])
        if self.enable_caching:
            self.block_pool.touch(adopted)
        table = self.req_to_blocks.setdefault(request_id, [])
        table.extend([self.block_pool.null_block] * skipped + adopted)
        # Hits are cached already; nulls hold nothing to cache.
        self.num_cached_block[request_id] = len(table)
        self.num_kept_block[request_id] = len(table)

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Blocks for the tokens a KV connector will write (after every group adopted its hit,
        so one group's new blocks cannot evict another's hit): the positions up to the last
        computed token, but only where the type still reads them (a window's in-window
        positions, a Mamba group's last state). Returns the new blocks."""
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.skipped_tokens(total)
        if skipped > 0:
            num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return []
        table = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, rules.cdiv(total, self.block_size) - len(table))
        new_blocks = self.block_pool.get_new_blocks(num_new)
        table.extend(new_blocks)
        return new_blocks

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

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request and hand its table back without releasing it (the caller frees
        it later, last position first): a KV connector may still be writing its blocks. The
        leading nulls (a window's released positions) are left out."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self.num_kept_block.pop(request_id, None)
        first = next((i for i, block in enumerate(table) if not block.is_null), len(table))
        return table[first:]

    def free(self, request_id: str) -> None:
        """Release the whole table, last position first, so the tail is evicted first."""
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id)[::-1])

    def take_boundary_state_offloads(self) -> list[tuple[str, int, int]]:
        """States cached since the last call that a KV connector may offload, as (request id,
        block id, tokens): only a Mamba ``"align"`` group has any."""
        return []

    def new_step_starts(self) -> None:  # noqa: B027 (a hook: only Mamba keeps per-step state)
        """The scheduler begins a step (only Mamba keeps per-step state)."""
