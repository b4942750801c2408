"""Planted bugs in the optimized backend: its vectorised, batched and deferred paths.

Hunted with the optimized backend in place of the reference; each patch is exact text of one
``hybridkv.optimized`` module, found exactly once.
"""

from __future__ import annotations

from hybridkv.conformance.mutant import Mutant, optimized_mutant

OPTIMIZED_MUTANTS: tuple[Mutant, ...] = (
    optimized_mutant(
        "opt_window_vector_off_by_one",
        "the vectorised step keeps one token too many in a sliding window",
        "batch",
        (
            "tokens = np.maximum(processed[:, None] - columns.window_less_one, 0)",
            "tokens = np.maximum(processed[:, None] - columns.window_less_one - 1, 0)",
        ),
    ),
    optimized_mutant(
        "opt_chunk_released_late",
        "the vectorised step releases a chunk's blocks one chunk late",
        "batch",
        (
            "processed[:, None] // columns.chunk_or_one * columns.chunk,",
            "np.maximum(processed[:, None] // columns.chunk_or_one - 1, 0) * columns.chunk,",
        ),
    ),
    optimized_mutant(
        "opt_batch_skips_group_release",
        "the vectorised step releases nothing from the last group's window or chunk",
        "batch",
        (
            "    skipped = np.minimum(tokens // b, length)\n",
            "    skipped = np.minimum(tokens // b, length)\n"
            "    skipped[:, -1] = np.minimum(nulls[:, -1], skipped[:, -1])\n",
        ),
    ),
    optimized_mutant(
        "opt_batch_release_not_busy",
        "a step skips a request whose only work is a window or chunk release (its quiet "
        "threshold leaves the release out)",
        "row_thresholds",
        (
            "        quiet = min(rows.capacity[row], rows.release_at[row]) + 1\n",
            "        quiet = rows.capacity[row] + 1\n",
        ),
        (
            "        quiet = np.minimum(capacity, release_at) + 1\n",
            "        quiet = capacity + 1\n",
        ),
    ),
    optimized_mutant(
        "opt_batch_cache_not_busy",
        "a step skips a request whose only work is caching a newly full block (its quiet "
        "threshold leaves the caching out)",
        "row_thresholds",
        (
            "            quiet = min(quiet, rows.cache_at[row])\n",
            "            pass\n",
        ),
        (
            "np.minimum(quiet, cache_at) if self._caching else quiet",
            "quiet",
        ),
    ),
    optimized_mutant(
        "opt_free_batch_head_order",
        "free_batch puts unhashed blocks at the head first batch first (sequential frees put "
        "the last batch first)",
        "batch_free",
        (
            "key = -pair[head_last] * (total + 1) + head_last",
            "key = pair[head_last] * (total + 1) + head_last",
        ),
    ),
    optimized_mutant(
        "opt_free_batch_tail_by_id",
        "free_batch appends hashed blocks in id order, not in the order of their last release",
        "batch_free",
        (
            "tail = freed[hashed][np.argsort(freed_last[hashed])]",
            "tail = freed[hashed]",
        ),
    ),
    optimized_mutant(
        "opt_hybrid_one_pass",
        "the optimized hybrid lookup stops after one pass over the types",
        "hits",
        (
            "    hit_length, longest = rules.hybrid_hit_length(\n        lookup,\n",
            "    calls = [0]\n\n"
            "    def once(index: int, length: int, drop: bool) -> int:\n"
            "        calls[0] += 1\n"
            "        return length if calls[0] > len(s.layout.types) else lookup(index, length, "
            "drop)\n\n"
            "    hit_length, longest = rules.hybrid_hit_length(\n        once,\n",
        ),
    ),
    optimized_mutant(
        "opt_window_hit_needs_whole_window",
        "the optimized sliding-window lookup needs window tokens cached, not window − 1",
        "type_hits",
        (
            "sliding_window_contiguous_blocks(spec.sliding_window, spec.block_size, drop)",
            "sliding_window_contiguous_blocks(spec.sliding_window + 1, spec.block_size, drop)",
        ),
    ),
    optimized_mutant(
        "opt_fused_capacity_one_block_late",
        "after taking a block, the fused step counts one block more of room than the row holds",
        "fused_step",
        ("rows.capacity[row] = (have + 1) * b", "rows.capacity[row] = (have + 2) * b"),
    ),
    optimized_mutant(
        "opt_release_walk_order",
        "the single-request path releases a window's blocks first to last",
        "step",
        ("        released.reverse()\n", ""),
    ),
    optimized_mutant(
        "opt_pending_release_of_uncached",
        "a running step defers the release of a block that holds no cached hash (it belongs at "
        "the head of the free queue, not the tail)",
        "step",
        (
            "        if min(map(pool.src.a.__getitem__, released)) >= 0:\n",
            "        if True:\n",
        ),
    ),
    optimized_mutant(
        "opt_lookup_before_pending",
        "a lookup reads the prefix cache without the running steps' pending inserts",
        "manager",
        (
            "            return self.no_blocks, 0, 0\n        self._s.settle()\n",
            "            return self.no_blocks, 0, 0\n",
        ),
    ),
    optimized_mutant(
        "opt_pending_release_order",
        "the pending releases free their blocks to the tail last to first",
        "free_queue",
        (
            "            self.link_after_array(self.prev.a[self.tail], blocks)\n",
            "            self.link_after_array(self.prev.a[self.tail], blocks[::-1].copy())\n",
        ),
    ),
    optimized_mutant(
        "opt_run_returns_duplicates",
        "a lookup's run of a source's blocks may return a block cached after another of its key",
        "source_runs",
        ("if block == end or block in dups:", "if block == end:"),
        ("        if pool.dups:\n            good &=", "        if False:\n            good &="),
    ),
    optimized_mutant(
        "opt_memo_run_skips_next_probe",
        "the memo's run ends a hit where its record ends, without looking for a block another "
        "request cached at the next position",
        "memo_hit",
        (
            "    if num == 0 or (num < scan and pool.candidates(hash_key(hashes[num]), full[0], "
            "num)):\n",
            "    if num == 0:\n",
        ),
    ),
    optimized_mutant(
        "opt_one_pass_counts_queued_hits_free",
        "the one-pass admission counts the hit's blocks waiting in the free queue as free, so it "
        "admits a request whose hit and new blocks together do not fit",
        "one_pass_admission",
        (
            "    if queued + new_count + kept_free > pool.num_free_blocks:\n",
            "    if new_count + kept_free > pool.num_free_blocks:\n",
        ),
    ),
    optimized_mutant(
        "opt_take_run_unchecked",
        "a take of many blocks trusts that the free queue's next ones are consecutive ids "
        "without comparing their links",
        "block_pool",
        (
            "        if not bool((self.next.n[first:last] == ids[1:]).all()):\n",
            "        if False:\n",
        ),
    ),
    optimized_mutant(
        "opt_run_trusts_stale_blocks",
        "evicting a block leaves it in its source's record, so a lookup's run trusts a block "
        "the source no longer holds",
        "prefix_cache",
        ("                recorded[tag] = end\n", "                pass\n"),
    ),
    optimized_mutant(
        "opt_free_walks_keeps_walk_order",
        "one pass of several windows' releases puts uncached blocks after the head first to last",
        "block_pool",
        ("            reuses.reverse()\n", ""),
    ),
    optimized_mutant(
        "opt_evict_keeps_hash",
        "a block taken from the free queue keeps its cached hash in the map",
        "block_pool",
        (
            "            if src[block] >= 0:\n                if sink is None:",
            "            if False:\n                if sink is None:",
        ),
    ),
    optimized_mutant(
        "opt_touch_keeps_queued",
        "a cache hit on an evictable block leaves it in the free queue",
        "free_queue",
        (
            "            if ref[block] == 0:\n                self.remove(block)\n"
            "            ref[block] += 1",
            "            ref[block] += 1",
        ),
    ),
    optimized_mutant(
        "opt_touch_many_keeps_queued",
        "a vectorised adoption leaves evictable hit blocks in the free queue",
        "free_queue",
        (
            "        for block in blocks[refs == 0].tolist():\n            self.remove(block)\n",
            "        for block in blocks[refs == 0].tolist():\n            pass\n",
        ),
    ),
)
