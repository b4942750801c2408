"""The CrossHair manifest: every contract the project checks symbolically, by name.

Each entry is one ``crosshair check`` target (``module.function``). ``expect="hold"`` entries are
contracts of the project: CrossHair must report every condition and no counterexample, error or
"Unable to meet precondition" (a vacuous pass). ``expect="counterexample"`` entries are planted
bugs (``conformance/planted_bugs.py``): CrossHair must report one, or the checker has lost its
teeth at this budget.

``scale`` multiplies the profile's per-condition budget for the few targets whose search is
wide (harnesses over several cached-flag lists). ``known_problem`` marks a contract that is
wrong in ``spec/`` and has been reported: the run shows it as KNOWN instead of failing, and
fails as soon as CrossHair no longer finds the problem, so the marker cannot outlive the fix.

``tests/test_crosshair.py`` checks that every function with a ``post:`` contract in the checked
modules is listed here, so a new rule cannot escape the manifest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Expectation = Literal["hold", "counterexample"]


@dataclass(frozen=True)
class Target:
    """One function CrossHair checks, and what it must report."""

    name: str
    expect: Expectation = "hold"
    scale: float = 1.0
    known_problem: str | None = None


RULES = "hybridkv.spec.rules"
HARNESSES = "hybridkv.conformance.harnesses"
PLANTED = "hybridkv.conformance.planted_bugs"

CHECKED_MODULES: tuple[str, ...] = (RULES, HARNESSES, PLANTED)
"""Modules whose every ``post:``-contracted function must appear in the manifest."""

MANIFEST: tuple[Target, ...] = (
    # --- spec/rules.py: every rule of the design document ------------------------------------
    Target(f"{RULES}.cdiv"),
    Target(f"{RULES}.attention_blocks_for_tokens"),
    Target(f"{RULES}.mamba_blocks_for_tokens"),
    Target(f"{RULES}.full_attention_skipped_tokens"),
    Target(f"{RULES}.sliding_window_skipped_tokens"),
    Target(f"{RULES}.chunked_local_skipped_tokens"),
    Target(f"{RULES}.mamba_skipped_tokens"),
    Target(f"{RULES}.skipped_block_positions"),
    Target(f"{RULES}.sliding_window_hit_blocks_needed"),
    Target(f"{RULES}.full_attention_hit_blocks"),
    Target(f"{RULES}.window_hit_is_valid"),
    Target(f"{RULES}.sliding_window_hit_blocks", scale=2.0),
    Target(f"{RULES}.sliding_window_hit_blocks_skip", scale=2.0),
    Target(f"{RULES}.chunked_local_hit_blocks"),
    Target(f"{RULES}.group_size"),
    Target(f"{RULES}.num_groups_of_type"),
    Target(f"{RULES}.num_padding_slots"),
    Target(f"{RULES}.group_layer_ranges"),
    Target(f"{RULES}.raised_block_size"),
    Target(f"{RULES}.max_blocks_full_attention"),
    Target(f"{RULES}.max_blocks_sliding_window"),
    Target(f"{RULES}.max_blocks_chunked_local"),
    Target(f"{RULES}.max_blocks_mamba"),
    Target(f"{RULES}.num_blocks_for_memory"),
    Target(f"{RULES}.max_num_requests"),
    Target(f"{RULES}.scheduler_block_size"),
    Target(f"{RULES}.hash_block_size"),
    Target(f"{RULES}.replay_boundaries"),
    Target(f"{RULES}.sliding_window_contiguous_blocks"),
    Target(f"{RULES}.mamba_prefill_checkpoint_position"),
    Target(f"{RULES}.mamba_prefill_checkpoint_valid"),
    Target(f"{RULES}.sliding_window_retention_mask", scale=2.0),
    Target(f"{RULES}.mamba_retention_mask", scale=2.0),
    Target(f"{RULES}.hybrid_hit_length", scale=2.0),
    Target(f"{RULES}.vllm_group_size"),
    Target(f"{RULES}.strided_layer_indices"),
    Target(f"{RULES}.pipeline_stage_sizes"),
    Target(f"{RULES}.group_slots", scale=2.0),
    Target(f"{RULES}.min_padding_group_size", scale=2.0),
    Target(f"{RULES}.max_concurrent_batches"),
    Target(f"{RULES}.mamba_state_blocks"),
    Target(f"{RULES}.hit_block_span", scale=2.0),
    Target(f"{RULES}.can_serve_hit", scale=2.0),
    # --- conformance/harnesses.py: equivalence, oracles, pool state --------------------------
    Target(f"{HARNESSES}.sliding_window_scan_equivalence", scale=3.0),
    Target(f"{HARNESSES}.hybrid_hit_is_longest_accepted", scale=4.0),
    Target(f"{HARNESSES}.hybrid_hit_without_full_attention", scale=4.0),
    Target(f"{HARNESSES}.block_pool_operations_keep_invariants", scale=4.0),
    Target(f"{HARNESSES}.scheduler_block_size_is_lcm"),
    Target(f"{HARNESSES}.replay_boundaries_leave_the_dropped_block"),
    Target(f"{HARNESSES}.mamba_retention_keeps_reachable_states", scale=2.0),
    # --- conformance/planted_bugs.py: the checker must catch each ----------------------------
    Target(f"{PLANTED}.sliding_window_skipped_tokens_off_by_one", "counterexample"),
    Target(f"{PLANTED}.chunked_local_skipped_tokens_previous_chunk", "counterexample"),
    Target(f"{PLANTED}.full_attention_hit_blocks_no_stop", "counterexample"),
    Target(f"{PLANTED}.sliding_window_hit_blocks_needed_whole_window", "counterexample"),
    Target(f"{PLANTED}.chunked_local_hit_blocks_from_zero", "counterexample"),
    Target(f"{PLANTED}.num_padding_slots_remainder", "counterexample"),
    Target(f"{PLANTED}.sliding_window_scan_equivalence_skip_too_far", "counterexample"),
    Target(f"{PLANTED}.hybrid_one_pass_is_longest_accepted", "counterexample", scale=12.0),
    Target(f"{PLANTED}.block_pool_touch_keeps_queued", "counterexample"),
    Target(f"{PLANTED}.mamba_prefill_checkpoint_position_forgets_logits_token", "counterexample"),
    Target(f"{PLANTED}.scheduler_block_size_is_lcm_as_product", "counterexample"),
    Target(f"{PLANTED}.replay_boundaries_without_eagle_shift", "counterexample"),
    Target(f"{PLANTED}.mamba_retention_drops_the_replay_boundary", "counterexample", scale=2.0),
)
