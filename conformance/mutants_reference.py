"""Planted bugs in ``spec/`` and ``reference/``: each a rule of the design document broken once.

The manager checks must catch every one (``tests/test_mutants.py``).
"""

from __future__ import annotations

from hybridkv.conformance.mutant import Mutant, manager_mutant

REFERENCE_MUTANTS: tuple[Mutant, ...] = (
    manager_mutant(
        "window_off_by_one",
        "sliding window keeps one token too many (n − window instead of n − window + 1)",
        "spec.rules",
        (
            "return max(0, num_computed_tokens - sliding_window + 1 - extra_retained_tokens)",
            "return max(0, num_computed_tokens - sliding_window - extra_retained_tokens)",
        ),
    ),
    manager_mutant(
        "unhashed_to_tail",
        "a released block with no cached hash goes to the tail instead of the head",
        "reference.block_pool",
        (
            "self.free_block_queue.prepend_n(reuse_first)",
            "self.free_block_queue.append_n(reuse_first)",
        ),
    ),
    manager_mutant(
        "hashed_to_head",
        "a released block holding a cached hash goes to the head (evicted first)",
        "reference.block_pool",
        (
            "(keep if cached else reuse_first).append(block)",
            "(reuse_first if cached else keep).append(block)",
        ),
    ),
    manager_mutant(
        "touch_keeps_queued",
        "a cache hit on an evictable block does not take it out of the free queue",
        "reference.block_pool",
        (
            "            if block.ref_cnt == 0:\n"
            "                self.free_block_queue.remove(block)\n",
            "",
        ),
    ),
    manager_mutant(
        "hit_not_capped",
        "a hit may cover the last token (max hit num_tokens instead of num_tokens − 1)",
        "reference.validation",
        (
            "    if max_cache_hit_length is None:\n        return request.num_tokens - 1\n",
            "    if max_cache_hit_length is None:\n        return request.num_tokens\n",
        ),
    ),
    manager_mutant(
        "hash_key_without_group",
        "the prefix-cache key drops the group id: groups share cache entries",
        "reference.block_pool",
        (
            "self._insert_block_hash((hashes[index], group_id), block, (index + 1) * block_size)",
            "self._insert_block_hash((hashes[index], 0), block, (index + 1) * block_size)",
        ),
        (
            "self.cached_block_hash_to_block.get((block_hash, group_id))",
            "self.cached_block_hash_to_block.get((block_hash, 0))",
        ),
    ),
    manager_mutant(
        "truncate_window_hit",
        "a lowered length truncates every type's blocks instead of looking sliding windows up",
        "spec.rules",
        (
            "            if full_attention[t] and t in full_found:",
            "            if t in full_found:",
        ),
        (
            "            if full_attention[t]:\n                full_found[t] = found\n",
            "            full_found[t] = found\n",
        ),
    ),
    manager_mutant(
        "free_head_first",
        "freeing a request walks its table first to last (its head is evicted first)",
        "reference.single_type_base",
        (
            "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id)[::-1])",
            "self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))",
        ),
    ),
    manager_mutant(
        "evict_keeps_cache_entry",
        "a block reused for new tokens stays in the prefix-cache mapping",
        "reference.block_pool",
        (
            "entry.pop(block.block_id, None) is None",
            "block.block_id not in entry",
        ),
    ),
    manager_mutant(
        "lookup_last_inserted",
        "a lookup returns the last block cached under a key instead of the first",
        "reference.block_pool",
        (
            "found.append(next(iter(blocks.values())))",
            "found.append(list(blocks.values())[-1])",
        ),
    ),
    manager_mutant(
        "capacity_ignores_queued_hits",
        "the capacity check does not count adopted hits that sit in the free queue",
        "reference.single_type_base",
        (
            "return num_new + num_evictable(new_computed_blocks[skipped_hits:])",
            "return num_new",
        ),
    ),
    manager_mutant(
        "release_after_capacity_check",
        "out-of-window blocks are released only after the capacity check",
        "reference.kv_cache_manager",
        (
            "        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - "
            "in_flight))\n",
            "",
        ),
        (
            "            return None\n        if any(hits) or num_external_computed_tokens:",
            "            return None\n"
            "        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - "
            "in_flight))\n"
            "        if any(hits) or num_external_computed_tokens:",
        ),
    ),
    manager_mutant(
        "cache_lookahead_tokens",
        "blocks are cached up to the lookahead slots, not only the computed tokens",
        "reference.kv_cache_manager",
        (
            "num_tokens_to_cache = min(total_computed + num_new_tokens, request.num_tokens)",
            "num_tokens_to_cache = min(num_tokens_need_slot, request.num_tokens)",
        ),
    ),
    manager_mutant(
        "full_hit_no_stop",
        "the full-attention scan counts cached blocks past the first miss",
        "spec.rules",
        (
            "    while num_hit < max_num_blocks and cached[num_hit]:\n"
            "        num_hit += 1\n"
            "    return num_hit\n\n\ndef window_hit_is_valid",
            "    num_hit = sum(1 for i in range(max_num_blocks) if cached[i])\n"
            "    return num_hit\n\n\ndef window_hit_is_valid",
        ),
    ),
    manager_mutant(
        "reset_while_in_use",
        "reset_prefix_cache succeeds while requests hold blocks",
        "reference.block_pool",
        (
            "        if self.num_free_blocks != self.num_blocks - 1:\n            return False\n",
            "",
        ),
    ),
    manager_mutant(
        "usage_counts_null_block",
        "usage divides by num_blocks instead of num_blocks − 1",
        "reference.block_pool",
        (
            "return 1.0 - (self.num_free_blocks / (self.num_blocks - 1))",
            "return 1.0 - (self.num_free_blocks / self.num_blocks)",
        ),
    ),
    manager_mutant(
        "window_hit_needs_whole_window",
        "a sliding-window hit needs the whole window cached, not window − 1 tokens",
        "spec.rules",
        (
            "return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)",
            "return cdiv(sliding_window, block_size) + (1 if use_eagle else 0)",
        ),
    ),
    manager_mutant(
        "no_max_model_len_cap",
        "slots are not capped at max_model_len (lookahead past the model length)",
        "reference.kv_cache_manager",
        (
            "num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, "
            "self.max_model_len)",
            "num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens",
        ),
    ),
    manager_mutant(
        "hybrid_one_pass",
        "the hybrid coordinator stops after one pass even with three or more types",
        "spec.rules",
        (
            "        if simple_hybrid:\n            return hit_length, longest\n",
            "        return hit_length, longest\n",
        ),
    ),
    manager_mutant(
        "chunk_keeps_previous",
        "chunked local attention keeps the previous chunk as well",
        "spec.rules",
        (
            "return num_computed_tokens // attention_chunk_size * attention_chunk_size",
            "return max(0, num_computed_tokens // attention_chunk_size - 1) * attention_chunk_size",
        ),
    ),
    manager_mutant(
        "mamba_keeps_old_states",
        "a Mamba group keeps every state block instead of the last computed token's",
        "reference.single_type_base",
        (
            '"mamba": lambda spec, n: rules.mamba_skipped_tokens(n),',
            '"mamba": lambda spec, n: 0,',
        ),
    ),
    # --- Engine rules (the engine golden traces and the engine oracle pin these) -----------
    manager_mutant(
        "mamba_same_step_rule_removed",
        "a Mamba state cached in this step may be adopted in the same step",
        "reference.mamba_manager",
        (
            "if new_computed_blocks and new_computed_blocks[-1].block_hash in (",
            "if False and new_computed_blocks[-1].block_hash in (",
        ),
    ),
    manager_mutant(
        "eagle_drop_not_applied",
        "use_eagle hits keep their last block (the drafter never recomputes it)",
        "spec.rules",
        (
            "drop = drops_eagle_block[t] and t not in eagle_verified",
            "drop = False",
        ),
    ),
    manager_mutant(
        "full_prompt_without_window_cap",
        "a full-prompt admission counts a window's every block, not what it holds at once",
        "reference.single_type_base",
        (
            "if apply_admission_cap and self.max_admission_blocks is not None:",
            "if False and self.max_admission_blocks is not None:",
        ),
    ),
    manager_mutant(
        "retention_mask_ignored",
        "sparse retention is ignored: sliding-window groups cache every block (dense)",
        "reference.single_type_base",
        ("            block_mask=mask,\n", "            block_mask=None,\n"),
    ),
    manager_mutant(
        "hash_view_first_hash",
        "a block larger than the hash block is keyed by its first hash instead of its last",
        "reference.block_pool",
        ("return block_hashes[scale - 1 :: scale]", "return block_hashes[:: scale]"),
    ),
    # --- The optimized backend's vectorised and batched paths ---------------------------------
)
