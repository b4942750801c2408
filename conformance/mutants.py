"""Planted bugs in the reference, and the suite that must catch every one.

Each ``Mutant`` is a source patch of one module of ``spec/`` or ``reference/`` (exact text,
found exactly once, so a patch that no longer applies fails loudly instead of testing nothing).
``load_mutant`` imports a private copy of the reference with the patch applied, leaving the
real modules untouched, and ``hunt`` runs the conformance checks against it, cheapest first,
until one fails:

* manager mutants: the stateful differential machine (mutant vs the pristine reference, every
  observable and invariant after every step), then the longest-hit oracles on built cache
  states (the first set's layouts, then Mamba "align" and mixed block sizes), then the golden
  vLLM traces: the engine set (Mamba, mixed block sizes, retention, full-prompt admission,
  speculative decoding), then the unit set;
* planner mutants: the grouping, memory-layout and padding oracles over the document's models
  and random ones.

A mutant that survives every check means the suite has a blind spot: ``tests/test_mutants.py``
fails for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import random
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from hybridkv.conformance import oracles
from hybridkv.conformance.adapters import (
    Backend,
    manager_backend,
    optimized_backend,
    reference_backend,
)
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.conformance.strategies import document_models, random_models

Suite = Literal["manager", "planner"]


@dataclass(frozen=True)
class Mutant:
    """One planted bug: ``patches`` (old, new) applied to ``module``'s source."""

    name: str
    description: str
    module: str
    patches: tuple[tuple[str, str], ...]
    suite: Suite = "manager"


def _m(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    return Mutant(name, description, f"hybridkv.{module}", patches)


def _o(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    """A mutant of the optimized backend (``hybridkv.optimized``): its vectorised and batched
    paths, hunted with the optimized backend in place of the reference."""
    return Mutant(name, description, f"hybridkv.optimized.{module}", patches)


def _p(name: str, description: str, module: str, *patches: tuple[str, str]) -> Mutant:
    return Mutant(name, description, f"hybridkv.{module}", patches, "planner")


MUTANTS: tuple[Mutant, ...] = (
    _m(
        "window_off_by_one",
        "sliding window keeps one token too many (n − window instead of n − window + 1)",
        "spec.rules",
        (
            "return max(0, num_computed_tokens - sliding_window + 1)",
            "return max(0, num_computed_tokens - sliding_window)",
        ),
    ),
    _m(
        "unhashed_to_tail",
        "a released block with no cached hash goes to the tail instead of the head",
        "reference.block_pool",
        (
            "self.free_block_queue.prepend_n(reuse_first)",
            "self.free_block_queue.append_n(reuse_first)",
        ),
    ),
    _m(
        "hashed_to_head",
        "a released block holding a cached hash goes to the head (evicted first)",
        "reference.block_pool",
        (
            "(keep if cached else reuse_first).append(block)",
            "(reuse_first if cached else keep).append(block)",
        ),
    ),
    _m(
        "touch_keeps_queued",
        "a cache hit on an evictable block does not take it out of the free queue",
        "reference.block_pool",
        (
            "            if block.ref_cnt == 0:\n"
            "                self.free_block_queue.remove(block)\n",
            "",
        ),
    ),
    _m(
        "hit_not_capped",
        "a hit may cover the last token (max hit num_tokens instead of num_tokens − 1)",
        "reference.kv_cache_manager",
        (
            "max_cache_hit_length = request.num_tokens - 1",
            "max_cache_hit_length = request.num_tokens",
        ),
    ),
    _m(
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
    _m(
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
    _m(
        "free_head_first",
        "freeing a request walks its table first to last (its head is evicted first)",
        "reference.single_type_managers",
        (
            "self.block_pool.free_blocks(table[::-1])",
            "self.block_pool.free_blocks(table)",
        ),
    ),
    _m(
        "evict_keeps_cache_entry",
        "a block reused for new tokens stays in the prefix-cache mapping",
        "reference.block_pool",
        (
            "entry.pop(block.block_id, None) is None",
            "block.block_id not in entry",
        ),
    ),
    _m(
        "lookup_last_inserted",
        "a lookup returns the last block cached under a key instead of the first",
        "reference.block_pool",
        (
            "found.append(next(iter(blocks.values())))",
            "found.append(list(blocks.values())[-1])",
        ),
    ),
    _m(
        "capacity_ignores_queued_hits",
        "the capacity check does not count adopted hits that sit in the free queue",
        "reference.single_type_managers",
        (
            "return num_new + _num_evictable(new_computed_blocks[skipped_hits:])",
            "return num_new",
        ),
    ),
    _m(
        "release_after_capacity_check",
        "out-of-window blocks are released only after the capacity check",
        "reference.kv_cache_manager",
        (
            "        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - "
            "in_flight))\n",
            "",
        ),
        (
            "            return None\n        if any(hits):",
            "            return None\n"
            "        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - "
            "in_flight))\n"
            "        if any(hits):",
        ),
    ),
    _m(
        "cache_lookahead_tokens",
        "blocks are cached up to the lookahead slots, not only the computed tokens",
        "reference.kv_cache_manager",
        (
            "num_tokens_to_cache = min(total_computed + num_new_tokens, request.num_tokens)",
            "num_tokens_to_cache = min(num_tokens_need_slot, request.num_tokens)",
        ),
    ),
    _m(
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
    _m(
        "reset_while_in_use",
        "reset_prefix_cache succeeds while requests hold blocks",
        "reference.block_pool",
        (
            "        if self.num_free_blocks != self.num_blocks - 1:\n            return False\n",
            "",
        ),
    ),
    _m(
        "usage_counts_null_block",
        "usage divides by num_blocks instead of num_blocks − 1",
        "reference.block_pool",
        (
            "return 1.0 - (self.num_free_blocks / (self.num_blocks - 1))",
            "return 1.0 - (self.num_free_blocks / self.num_blocks)",
        ),
    ),
    _m(
        "window_hit_needs_whole_window",
        "a sliding-window hit needs the whole window cached, not window − 1 tokens",
        "spec.rules",
        (
            "return cdiv(sliding_window - 1, block_size) + (1 if use_eagle else 0)",
            "return cdiv(sliding_window, block_size) + (1 if use_eagle else 0)",
        ),
    ),
    _m(
        "no_max_model_len_cap",
        "slots are not capped at max_model_len (lookahead past the model length)",
        "reference.kv_cache_manager",
        (
            "num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, "
            "self.max_model_len)",
            "num_tokens_need_slot = num_tokens_main_model + num_lookahead_tokens",
        ),
    ),
    _m(
        "hybrid_one_pass",
        "the hybrid coordinator stops after one pass even with three or more types",
        "spec.rules",
        (
            "        if simple_hybrid:\n            return hit_length, longest\n",
            "        return hit_length, longest\n",
        ),
    ),
    _m(
        "chunk_keeps_previous",
        "chunked local attention keeps the previous chunk as well",
        "spec.rules",
        (
            "return num_computed_tokens // attention_chunk_size * attention_chunk_size",
            "return max(0, num_computed_tokens // attention_chunk_size - 1) * attention_chunk_size",
        ),
    ),
    _m(
        "mamba_keeps_old_states",
        "a Mamba group keeps every state block instead of the last computed token's",
        "reference.single_type_managers",
        (
            '"mamba": lambda spec, n: rules.mamba_skipped_tokens(n),',
            '"mamba": lambda spec, n: 0,',
        ),
    ),
    # --- Engine rules (the engine golden traces and the engine oracle pin these) -----------
    _m(
        "mamba_same_step_rule_removed",
        "a Mamba state cached in this step may be adopted in the same step",
        "reference.single_type_managers",
        (
            "if new_computed_blocks and new_computed_blocks[-1].block_hash in (",
            "if False and new_computed_blocks[-1].block_hash in (",
        ),
    ),
    _m(
        "eagle_drop_not_applied",
        "use_eagle hits keep their last block (the drafter never recomputes it)",
        "spec.rules",
        (
            "drop = drops_eagle_block[t] and t not in eagle_verified",
            "drop = False",
        ),
    ),
    _m(
        "full_prompt_without_window_cap",
        "a full-prompt admission counts a window's every block, not what it holds at once",
        "reference.single_type_managers",
        (
            "if apply_admission_cap and self.max_admission_blocks is not None:",
            "if False and self.max_admission_blocks is not None:",
        ),
    ),
    _m(
        "retention_mask_ignored",
        "sparse retention is ignored: sliding-window groups cache every block (dense)",
        "reference.single_type_managers",
        ("            block_mask=mask,\n", "            block_mask=None,\n"),
    ),
    _m(
        "hash_view_first_hash",
        "a block larger than the hash block is keyed by its first hash instead of its last",
        "reference.block_pool",
        ("return block_hashes[scale - 1 :: scale]", "return block_hashes[:: scale]"),
    ),
    # --- The optimized backend's vectorised and batched paths ---------------------------------
    _o(
        "opt_window_vector_off_by_one",
        "the vectorised step keeps one token too many in a sliding window",
        "batch",
        (
            "tokens = np.maximum(processed[:, None] - columns.window_less_one, 0)",
            "tokens = np.maximum(processed[:, None] - columns.window_less_one - 1, 0)",
        ),
    ),
    _o(
        "opt_chunk_released_late",
        "the vectorised step releases a chunk's blocks one chunk late",
        "batch",
        (
            "processed[:, None] // columns.chunk_or_one * columns.chunk,",
            "np.maximum(processed[:, None] // columns.chunk_or_one - 1, 0) * columns.chunk,",
        ),
    ),
    _o(
        "opt_batch_skips_group_release",
        "the vectorised step releases nothing from the last group's window or chunk",
        "batch",
        (
            "        skipped = np.minimum(tokens // b, length)\n",
            "        skipped = np.minimum(tokens // b, length)\n"
            "        skipped[:, -1] = np.minimum(nulls[:, -1], skipped[:, -1])\n",
        ),
    ),
    _o(
        "opt_batch_release_not_busy",
        "a step skips a request whose only work is a window or chunk release (its quiet "
        "threshold leaves the release out)",
        "row_thresholds",
        (
            "        quiet = min(rows.capacity[row], rows.release_at[row]) + 1\n",
            "        quiet = rows.capacity[row] + 1\n",
        ),
        (
            "        quiet = np.minimum(nxt[0, rows], nxt[1, rows]) + 1\n",
            "        quiet = nxt[0, rows] + 1\n",
        ),
    ),
    _o(
        "opt_batch_cache_not_busy",
        "a step skips a request whose only work is caching a newly full block (its quiet "
        "threshold leaves the caching out)",
        "row_thresholds",
        (
            "            quiet = min(quiet, rows.cache_at[row])\n",
            "            pass\n",
        ),
        (
            "np.minimum(quiet, nxt[2, rows]) if self._caching else quiet",
            "quiet",
        ),
    ),
    _o(
        "opt_free_batch_head_order",
        "free_batch puts unhashed blocks at the head first batch first (sequential frees put "
        "the last batch first)",
        "batch",
        (
            "key = -pair[head_last] * (total + 1) + head_last",
            "key = pair[head_last] * (total + 1) + head_last",
        ),
    ),
    _o(
        "opt_free_batch_tail_by_id",
        "free_batch appends hashed blocks in id order, not in the order of their last release",
        "batch",
        (
            "tail = freed[hashed][np.argsort(freed_last[hashed])]",
            "tail = freed[hashed]",
        ),
    ),
    _o(
        "opt_hybrid_one_pass",
        "the optimized hybrid lookup stops after one pass over the types",
        "manager",
        (
            "        hit_length, longest = rules.hybrid_hit_length(\n            lookup,\n",
            "        calls = [0]\n\n"
            "        def once(index: int, length: int, drop: bool) -> int:\n"
            "            calls[0] += 1\n"
            "            return length if calls[0] > len(self._types) else lookup(index, length, "
            "drop)\n\n"
            "        hit_length, longest = rules.hybrid_hit_length(\n            once,\n",
        ),
    ),
    _o(
        "opt_window_hit_needs_whole_window",
        "the optimized sliding-window lookup needs window tokens cached, not window − 1",
        "type_hits",
        (
            "needed = rules.sliding_window_contiguous_blocks(spec.sliding_window, b, p.drop)",
            "needed = rules.sliding_window_contiguous_blocks(spec.sliding_window + 1, b, p.drop)",
        ),
    ),
    _o(
        "opt_release_walk_order",
        "the single-request path releases a window's blocks first to last",
        "manager",
        ("            released.reverse()\n", ""),
    ),
    _o(
        "opt_pending_release_of_uncached",
        "a running step defers the release of a block that holds no cached hash (it belongs at "
        "the head of the free queue, not the tail)",
        "manager",
        (
            "            if min(map(pool.src.a.__getitem__, released)) >= 0:\n",
            "            if True:\n",
        ),
    ),
    _o(
        "opt_lookup_before_pending",
        "a lookup reads the prefix cache without the running steps' pending inserts",
        "manager",
        (
            "            return self._no_blocks, 0, 0\n        self._settle()\n",
            "            return self._no_blocks, 0, 0\n",
        ),
    ),
    _o(
        "opt_pending_release_order",
        "the pending releases free their blocks to the tail last to first",
        "block_pool",
        (
            "            self.link_after_array(self.prev.a[self.tail], blocks)\n",
            "            self.link_after_array(self.prev.a[self.tail], blocks[::-1].copy())\n",
        ),
    ),
    _o(
        "opt_run_returns_duplicates",
        "a lookup's run of a source's blocks may return a block cached after another of its key",
        "lookup",
        ("if block == end or block in dups:", "if block == end:"),
        ("        if pool.dups:\n            good &=", "        if False:\n            good &="),
    ),
    _o(
        "opt_run_trusts_stale_blocks",
        "evicting a block leaves it in its source's record, so a lookup's run trusts a block "
        "the source no longer holds",
        "block_pool",
        ("            recorded[tag] = self.end\n", "            pass\n"),
    ),
    _o(
        "opt_free_walks_keeps_walk_order",
        "one pass of several windows' releases puts uncached blocks after the head first to last",
        "block_pool",
        ("            reuses.reverse()\n", ""),
    ),
    _o(
        "opt_evict_keeps_hash",
        "a block taken from the free queue keeps its cached hash in the map",
        "block_pool",
        (
            "            if src[block] >= 0:\n                if sink is None:",
            "            if False:\n                if sink is None:",
        ),
    ),
    _o(
        "opt_touch_keeps_queued",
        "a cache hit on an evictable block leaves it in the free queue",
        "block_pool",
        (
            "            if ref[block] == 0:\n                self.remove(block)\n"
            "            ref[block] += 1",
            "            ref[block] += 1",
        ),
    ),
    _o(
        "opt_touch_many_keeps_queued",
        "a vectorised adoption leaves evictable hit blocks in the free queue",
        "block_pool",
        (
            "        for block in blocks[ref[blocks] == 0].tolist():\n"
            "            self.remove(block)\n",
            "        for block in blocks[ref[blocks] == 0].tolist():\n            pass\n",
        ),
    ),
    _p(
        "group_size_max",
        "the group size is the largest layer count of any type, not the smallest",
        "spec.rules",
        ("    return min(layer_counts)", "    return max(layer_counts)"),
    ),
    _p(
        "padding_count_wrong",
        "a group's padding slots are counted from its whole layer list, sharing layers included",
        "reference.plan_report",
        (
            "num_padding_slots=layers_per_group - num_own,",
            "num_padding_slots=max(layers_per_group - len(group.layer_names), 0),",
        ),
    ),
    _p(
        "block_size_raise_floor",
        "Case 4 rounds the raised block size down, so a page cannot hold the Mamba state",
        "spec.rules",
        (
            "return block_size * max(1, cdiv(state_bytes, block_size * kv_hidden_size))",
            "return block_size * max(1, state_bytes // (block_size * kv_hidden_size))",
        ),
    ),
    _p(
        "sharing_layers_allocated",
        "KV-sharing layers get groups of their own (Case 5 ignored)",
        "reference.planner",
        (
            "{name: spec for name, spec in layers.items() if name not in kv_sharing}",
            "dict(layers)",
        ),
    ),
    _p(
        "types_in_model_order",
        "groups follow the model's order of types instead of full attention first",
        "reference.planner",
        (
            'ordered = sorted(types.items(), key=lambda item: spec_kind(item[0]) != "full")',
            "ordered = list(types.items())",
        ),
    ),
)


# --- Loading a private, patched copy of the reference ---------------------------------------


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, source: str, path: str) -> None:
        self.source = source
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.path
        exec(compile(self.source, self.path, "exec"), module.__dict__)


class _PatchedFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, source: str, path: str) -> None:
        self.name = name
        self.loader = _PatchedLoader(source, path)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self.loader, origin=self.loader.path)


def patched_source(mutant: Mutant) -> tuple[str, str]:
    """The module's patched source and its file path; ``ValueError`` if a patch does not apply."""
    spec = importlib.util.find_spec(mutant.module)
    if spec is None or spec.origin is None:
        raise ValueError(f"mutant {mutant.name}: module {mutant.module} not found")
    with open(spec.origin, encoding="utf-8") as handle:
        source = handle.read()
    for old, new in mutant.patches:
        count = source.count(old)
        if count != 1:
            raise ValueError(
                f"mutant {mutant.name}: patch text found {count} times in {mutant.module} "
                f"(expected once; update the mutant to the current source):\n{old}"
            )
        source = source.replace(old, new)
    return source, spec.origin


def fresh_packages(mutant: Mutant) -> tuple[str, ...]:
    """The packages imported afresh for a mutant: the optimized backend's for its mutants (it
    keeps the real reference, whose requests the adapters build), the reference's otherwise
    (``spec`` modules are patched in place and the reference re-imports them)."""
    if mutant.module.startswith("hybridkv.optimized"):
        return ("hybridkv.optimized",)
    return ("hybridkv.reference",)


@contextmanager
def _private_modules(mutant: Mutant) -> Iterator[None]:
    """Import inside this block gets fresh reference modules and the patched target module;
    afterwards ``sys.modules`` and the package attributes are exactly as before."""
    source, path = patched_source(mutant)
    fresh = (*fresh_packages(mutant), mutant.module)
    saved = {
        name: module
        for name, module in sys.modules.items()
        if any(name == f or name.startswith(f + ".") for f in fresh)
    }
    parents = {}
    for name in {*saved, mutant.module}:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            parents[(parent, child)] = getattr(sys.modules[parent], child)
    finder = _PatchedFinder(mutant.module, source, path)
    for name in saved:
        del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(mutant.module)
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if any(name == f or name.startswith(f + ".") for f in fresh):
                del sys.modules[name]
        sys.modules.update(saved)
        for (parent, child), value in parents.items():
            setattr(sys.modules[parent], child, value)


@dataclass(frozen=True)
class MutantBundle:
    """The public objects of a mutated copy of the reference (for a mutant of the optimized
    backend, ``KVCacheManager`` is its patched ``TorchKVCacheManager``)."""

    mutant: Mutant
    KVCacheManager: Any
    plan_groups: Callable[..., Any]
    plan_kv_cache: Callable[..., Any]
    plan_report: Callable[..., Any]


def load_mutant(mutant: Mutant) -> MutantBundle:
    """A private copy of ``hybridkv.reference`` (or ``hybridkv.optimized``) with ``mutant``
    applied."""
    with _private_modules(mutant):
        reference = importlib.import_module("hybridkv.reference")
        manager = reference.KVCacheManager
        if is_optimized(mutant):
            manager = importlib.import_module("hybridkv.optimized").TorchKVCacheManager
        return MutantBundle(
            mutant,
            manager,
            reference.plan_groups,
            reference.plan_kv_cache,
            reference.plan_report,
        )


def is_optimized(mutant: Mutant) -> bool:
    return mutant.module.startswith("hybridkv.optimized")


# --- The suites ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hunt:
    """Which check caught a mutant (``None``: it survived every one), and how."""

    mutant: Mutant
    caught_by: str | None
    detail: str


def _first_line(error: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def mutant_backend(bundle: MutantBundle) -> Backend:
    """The mutated manager behind the adapter protocol (a mutant of the reference plans with
    its own, possibly mutated, planner); a mutant of the optimized backend with
    its size thresholds (``optimized_backend``: small on half the layouts, so that its
    vectorised and batched paths run)."""
    if is_optimized(bundle.mutant):
        backend = optimized_backend(manager_class=bundle.KVCacheManager)
        assert backend is not None
        return backend
    return manager_backend("mutant", bundle.KVCacheManager, plan_report=bundle.plan_report)


def manager_checks(
    bundle: MutantBundle, examples: int = 40, steps: int = 30
) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, check) pairs; a check raises when it sees the bug."""
    backend: Backend = mutant_backend(bundle)

    def differential() -> None:
        from hybridkv.conformance.machine import run_differential

        run_differential(
            [reference_backend(), backend], max_examples=examples, steps=steps, shrink=False
        )

    def replay(trace_set: str) -> None:
        for name in trace_names(trace_set):
            _, divergence = replay_trace(name, backend[1])
            if divergence is not None:
                raise AssertionError(str(divergence).splitlines()[0])

    def golden() -> None:
        replay("unit")

    def engine_golden() -> None:
        """The engine traces (Mamba, mixed block sizes, retention, full-prompt admission,
        speculative decoding): the only recorded vLLM behaviour for the engine rules."""
        replay("engine")

    def longest_hit() -> None:
        if is_optimized(bundle.mutant):
            found = oracles.run_adapter_hit_oracle(backend[0], backend[1], 150, seed=4)
            if found.failures:
                raise AssertionError(found.failures[0])
            return
        rng = random.Random(4)
        for _ in range(300):
            groups, prompt, block_size = random_cache_state(rng)
            hit = oracles.reference_hit(groups, prompt, block_size, bundle.KVCacheManager)
            if (hit.hit_tokens, hit.block_ids) != (hit.brute_force_tokens, hit.expected_block_ids):
                raise AssertionError(f"longest hit {hit} for {groups}")
        engine = oracles.run_engine_hit_oracle(200, seed=4, manager_class=bundle.KVCacheManager)
        if engine.failures:
            raise AssertionError(engine.failures[0])

    def differential_roomy() -> None:
        """Pools that feed prefills and decodes: a batched step with work to do in every
        request (new blocks, releases, newly full blocks to cache) is common only here."""
        from hybridkv.conformance.machine import run_differential

        run_differential(
            [reference_backend(), backend],
            max_examples=examples,
            steps=steps,
            shrink=False,
            roomy=True,
        )

    yield "differential machine", differential
    yield "differential machine, roomy pools", differential_roomy
    yield "longest-hit oracle", longest_hit
    # The engine set first: it replays faster than the unit set (13 s vs 20 s for the
    # reference) and exercises the same code plus the engine rules, so most mutants that get
    # this far fail within its first traces.
    yield "engine golden traces", engine_golden
    yield "golden traces", golden


def random_cache_state(
    rng: random.Random, *, aligned: bool = True
) -> tuple[list[oracles.GroupCacheState], list[int], int]:
    """1–4 groups of mixed types with random cached flags, a prompt, and the block size."""
    block_size = rng.choice([1, 2, 3, 4])
    num_tokens = rng.randint(1, 30)
    groups = []
    for _ in range(rng.choice([1, 2, 3, 3, 4, 4])):
        kind = rng.choice(["full", "sliding_window", "chunked_local"])
        if kind == "chunked_local":
            choices = [1, 2, 3] if aligned else [1, 2, 3, 1.5, 2.5]
            param = int(block_size * rng.choice(choices)) or 1
        else:
            param = rng.randint(2, 12)
        density = rng.random()
        cached = tuple(rng.random() < density for _ in range(num_tokens // block_size))
        groups.append(oracles.GroupCacheState(kind, param, cached))  # type: ignore[arg-type]
    prompt = [rng.randint(0, 100) for _ in range(num_tokens)]
    return groups, prompt, block_size


def planner_checks(bundle: MutantBundle) -> Iterator[tuple[str, Callable[[], None]]]:
    def grouping() -> None:
        from hybridkv.reference import plan_report

        models = document_models() + random_models(random.Random(7), 300)
        for layers, sharing in models:
            args = (layers, 10**9)
            kw: dict[str, Any] = {
                "max_model_len": 4096,
                "max_num_batched_tokens": 512,
                "kv_sharing": sharing,
            }
            try:
                plan_report(*args, **kw)
            except ValueError:
                continue  # a model the document does not cover: the error is the spec
            report = bundle.plan_report(*args, **kw)
            problems = oracles.check_plan_report(layers, report, 10**9, sharing)
            if problems:
                raise AssertionError(f"{problems[0]} (model of {len(layers)} layers)")

    yield "planner oracles", grouping


def hunt(mutant: Mutant, examples: int = 40) -> Hunt:
    """Run the checks of the mutant's suite until one fails."""
    bundle = load_mutant(mutant)
    if is_optimized(mutant):
        # The vectorised paths run in steps of several busy requests: the fast profile's
        # differential budget (a caught mutant stops at its first difference).
        checks = manager_checks(bundle, max(examples, 200), 40)
    elif mutant.suite == "planner":
        checks = planner_checks(bundle)
    else:
        checks = manager_checks(bundle, examples)
    for name, check in checks:
        try:
            check()
        except Exception as error:
            return Hunt(mutant, name, _first_line(error))
    return Hunt(mutant, None, "survived every check")


def hunt_all(
    mutants: Sequence[Mutant] = MUTANTS,
    examples: int = 40,
    progress: Callable[[Hunt], None] | None = None,
) -> list[Hunt]:
    results = []
    for mutant in mutants:
        result = hunt(mutant, examples)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# --- Which check kills which mutant, each check alone ---------------------------------------

KILL_COLUMNS = ("golden traces", "differential machine", "oracles", "CrossHair")


@dataclass(frozen=True)
class KillRow:
    """One planted bug and, per check of ``KILL_COLUMNS``, whether that check alone caught it
    (``None``: the check does not apply to it)."""

    name: str
    target: str
    kills: tuple[bool | None, ...]


def _kills(check: Callable[[], None]) -> bool:
    try:
        check()
    except Exception:
        return True
    return False


def kill_row(mutant: Mutant, examples: int, steps: int) -> KillRow:
    """Every check of the mutant's suite run alone on it (golden traces: both sets)."""
    bundle = load_mutant(mutant)
    target = mutant.module.removeprefix("hybridkv.")

    def machine() -> None:
        """The machine exactly as the conformance command runs it (small, roomy and
        serving-size pools; the planners compared on a model per example)."""
        from hybridkv.conformance.machine import run_command_machine

        run_command_machine(
            [reference_backend(), mutant_backend(bundle)],
            examples=examples,
            steps=steps,
            shrink=False,
        )

    if mutant.suite == "planner":
        (_, grouping), *_ = planner_checks(bundle)
        return KillRow(mutant.name, target, (None, _kills(machine), _kills(grouping), None))
    checks = dict(manager_checks(bundle, examples, steps))

    def golden() -> None:
        checks["engine golden traces"]()
        checks["golden traces"]()

    kills = (
        _kills(golden),
        _kills(machine),
        _kills(checks["longest-hit oracle"]),
        None,
    )
    return KillRow(mutant.name, target, kills)


def crosshair_rows(profile: str = "fast") -> list[KillRow]:
    """The planted contract bugs of ``conformance/planted_bugs.py``: CrossHair alone (the other
    checks do not run them: nothing in the manager calls these functions)."""
    from hybridkv.conformance.crosshair_manifest import MANIFEST
    from hybridkv.conformance.crosshair_runner import PROFILES, run_target

    rows = []
    for target in MANIFEST:
        if target.expect != "counterexample":
            continue
        result = run_target(target, PROFILES[profile])
        name = target.name.rpartition(".")[2]
        caught = result.verdict == "pass"
        rows.append(KillRow(name, "conformance.planted_bugs", (None, None, None, caught)))
    return rows


def kill_table(rows: Sequence[KillRow]) -> str:
    """A Markdown table: one row per planted bug, ✓ killed alone, ✗ survived, – not applicable;
    then the per-check counts and the differential machine's share."""

    def mark(value: bool | None) -> str:
        return "–" if value is None else "✓" if value else "✗"

    lines = [
        "| planted bug | in | " + " | ".join(KILL_COLUMNS) + " |",
        "|---|---|" + "---|" * len(KILL_COLUMNS),
    ]
    for row in rows:
        lines.append(
            f"| `{row.name}` | `{row.target}` | " + " | ".join(map(mark, row.kills)) + " |"
        )
    counts = []
    for index, column in enumerate(KILL_COLUMNS):
        applied = [row.kills[index] for row in rows if row.kills[index] is not None]
        counts.append(f"{column} {sum(map(bool, applied))}/{len(applied)}")
    machine = [row for row in rows if row.kills[1] is not None]
    caught = sum(bool(row.kills[1]) for row in machine)
    lines.append("")
    lines.append(f"Killed alone: {', '.join(counts)}.")
    lines.append(
        f"The differential machine alone: {caught} of {len(machine)} planted mutants "
        f"({100 * caught / max(1, len(machine)):.0f}%), {caught} of {len(rows)} planted bugs "
        f"with CrossHair's contract bugs ({100 * caught / max(1, len(rows)):.0f}%)."
    )
    survivors = [row.name for row in machine if not row.kills[1]]
    if survivors:
        lines.append(f"Not caught by the machine alone: {', '.join(survivors)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.conformance.mutants --table``: the kill table (not run in CI)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hybridkv.conformance.mutants")
    parser.add_argument("--table", action="store_true", help="print the per-check kill table")
    parser.add_argument("--examples", type=int, default=None, help="differential examples")
    parser.add_argument("--steps", type=int, default=None, help="differential steps")
    parser.add_argument("--only", default=None, help="comma-separated mutant names")
    parser.add_argument("--no-crosshair", action="store_true", help="skip the planted bugs")
    args = parser.parse_args(argv)
    if not args.table:
        parser.error("nothing to do: pass --table")
    from hybridkv.conformance.__main__ import PROFILES

    fast = PROFILES["fast"]
    examples = args.examples if args.examples is not None else fast.examples
    steps = args.steps if args.steps is not None else fast.steps
    chosen = MUTANTS
    if args.only:
        names = set(args.only.split(","))
        chosen = tuple(m for m in MUTANTS if m.name in names)
    rows = []
    for mutant in chosen:
        row = kill_row(mutant, examples, steps)
        print(f"  {row.name}: {row.kills}", file=sys.stderr, flush=True)
        rows.append(row)
    if not args.no_crosshair:
        rows.extend(crosshair_rows())
    print(kill_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
