"""The Mamba manager: a state per request instead of KV per token (Allocation, Case 4).

Its cache hit is the latest cached state at an aligned block boundary, with nothing before it
needed (Prefix caching, Case 3); an allocation takes one or two state blocks (plus a prefill
checkpoint and the speculative blocks), not one per ``block_size`` tokens; release frees every
state before the one holding the last computed token. Which states are cached is
``mamba_caching.MambaStateCaching``, the other half of this class.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.block_pool import BlockPool
from hybridkv.reference.kv_cache_block import BlockHashWithGroupId, KVCacheBlock
from hybridkv.reference.mamba_caching import MambaStateCaching
from hybridkv.reference.single_type_base import BlocksPerGroup, cached_blocks, num_evictable
from hybridkv.spec import KVCacheSpec, MambaSpec, rules


class MambaManager(MambaStateCaching):
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
        # "align" states cached since the last ``take_boundary_state_offloads``: (request id,
        # block id, tokens), for a KV connector.
        self.boundary_offloads: list[tuple[str, int, int]] = []
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
            found = cached_blocks(self.block_pool, hashes[index], group_ids)
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
        num_external_computed_tokens: int = 0,
    ) -> None:
        """Align mode also records where the adopted state sits (the table is the skipped
        nulls, then the hit: nulls and one state)."""
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, num_computed_tokens, num_external_computed_tokens
        )
        if self.align:
            table = self.req_to_blocks[request_id]
            self.state_positions[request_id] = [
                index for index, block in enumerate(table) if not block.is_null
            ]

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """The state at the last external token (every earlier one is skipped); align mode
        records where it sits."""
        new_blocks = super().allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens
        )
        if self.align and new_blocks:
            table = self.req_to_blocks[request_id]
            positions = self.state_positions.setdefault(request_id, [])
            positions.extend(range(len(table) - len(new_blocks), len(table)))
        return new_blocks

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
        # External tokens at admission: their last state takes a block of its own before the
        # new ones (vLLM 0.33 counts none for it and fails inside the allocation instead). The
        # full-sequence admission check counts as vLLM's does: it takes nothing.
        admitted = request_id not in self.num_cached_block
        external_state = int(
            num_external_computed_tokens > 0 and admitted and not apply_admission_cap
        )
        if external_state:
            num_new = required - rules.cdiv(total_computed_tokens, self.block_size)
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
        return num_new + external_state + num_evictable(new_computed_blocks)

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

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self.allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self.num_retired_blocks.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        self.state_positions.pop(request_id, None)
        # Its blocks go back to the pool: a connector must not read them later.
        self.boundary_offloads = [o for o in self.boundary_offloads if o[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    def take_boundary_state_offloads(self) -> list[tuple[str, int, int]]:
        offloads, self.boundary_offloads = self.boundary_offloads, []
        return offloads

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
