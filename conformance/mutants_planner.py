"""Planted bugs in the planner: grouping, padding and memory layout.

Hunted by the grouping, memory-layout and padding oracles over the document's models and random
ones.
"""

from __future__ import annotations

from hybridkv.conformance.mutant import Mutant, planner_mutant

PLANNER_MUTANTS: tuple[Mutant, ...] = (
    planner_mutant(
        "group_size_max",
        "the group size is the largest layer count of any type, not the smallest",
        "spec.rules",
        ("    return min(layer_counts)", "    return max(layer_counts)"),
    ),
    planner_mutant(
        "padding_count_wrong",
        "a group's padding slots are counted from its whole layer list, sharing layers included",
        "reference.plan_report",
        (
            "num_padding_slots=layers_per_group - num_own,",
            "num_padding_slots=max(layers_per_group - len(group.layer_names), 0),",
        ),
    ),
    planner_mutant(
        "block_size_raise_floor",
        "Case 4 rounds the raised block size down, so a page cannot hold the Mamba state",
        "spec.rules",
        (
            "return block_size * max(1, cdiv(state_bytes, block_size * kv_hidden_size))",
            "return block_size * max(1, state_bytes // (block_size * kv_hidden_size))",
        ),
    ),
    planner_mutant(
        "sharing_layers_allocated",
        "KV-sharing layers get groups of their own (Case 5 ignored)",
        "reference.planner",
        (
            "{name: spec for name, spec in layers.items() if name not in kv_sharing}",
            "dict(layers)",
        ),
    ),
    planner_mutant(
        "types_in_model_order",
        "groups follow the model's order of types instead of full attention first",
        "reference.planner",
        (
            "ordered = full_attention_first(_types_in_model_order(specs))",
            "ordered = list(_types_in_model_order(specs).items())",
        ),
    ),
)
