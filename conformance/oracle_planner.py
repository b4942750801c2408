"""The planner oracles together: ``check_plan_report`` runs the grouping, memory-layout and
padding oracles on one plan; ``run_planner_oracle`` on the reference planner's plans of the
document's models and random ones, for the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from hybridkv.conformance.oracle_grouping import check_grouping
from hybridkv.conformance.oracle_memory_layout import check_memory_layout
from hybridkv.conformance.oracle_padding import check_plan_padding
from hybridkv.conformance.oracle_reference_hit import OracleStats
from hybridkv.spec import KVCacheSpec

if TYPE_CHECKING:
    from hybridkv.reference.plan_report import PlanReport


def check_plan_report(
    layers: Mapping[str, KVCacheSpec],
    report: PlanReport,
    available_memory_bytes: int,
    kv_sharing: Mapping[str, str] | None = None,
) -> list[str]:
    """Every planner oracle on one plan: grouping (Cases 1–5), memory layout and padding."""
    problems = check_grouping(layers, report.config.groups, kv_sharing)
    problems += check_memory_layout(report.config, available_memory_bytes, kv_sharing)
    problems += check_plan_padding(
        layers,
        [g.num_padding_slots for g in report.groups],
        [g.num_own_layers for g in report.groups],
        report.num_padding_slots,
        report.layers_per_group,
        kv_sharing,
    )
    return problems


def run_planner_oracle(
    num_models: int, seed: int = 7, stats: OracleStats | None = None
) -> OracleStats:
    """The reference planner against the grouping, layout and padding oracles."""
    import random

    from hybridkv.conformance.strategies import document_models, random_models
    from hybridkv.reference import plan_report

    stats = OracleStats(failures=[]) if stats is None else stats
    if stats.failures is None:
        stats.failures = []
    for layers, sharing in document_models() + random_models(random.Random(seed), num_models):
        try:
            report = plan_report(
                layers, 10**9, max_model_len=4096, max_num_batched_tokens=512, kv_sharing=sharing
            )
        except ValueError:
            continue
        problems = check_plan_report(layers, report, 10**9, sharing)
        stats.planner_models += 1
        stats.failures += [f"planner: {p}" for p in problems]
    return stats
