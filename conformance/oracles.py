"""Independent oracles: brute force against the clever algorithms.

Two claims of the design document are checked by trying every candidate, one oracle a module:

* **Longest hit.** The hybrid coordinator's hit is the *longest* length that every group
  accepts: ``oracle_longest_hit`` (the algorithm over the rule functions, and the brute force
  over plain cached flags), ``oracle_reference_hit`` (states built inside the reference
  manager), ``oracle_engine_hit`` (Mamba ``"align"`` and mixed block sizes on their lcm),
  ``oracle_adapter_hit`` (states built inside any implementation through its adapter).
* **Grouping.** A planner's output obeys Allocation Cases 1–5: ``oracle_grouping`` (every layer
  placed once, one attention type per group, the group size rule, sharing),
  ``oracle_padding``, ``oracle_memory_layout``, and ``oracle_planner`` (all three on a plan).

This module re-exports their public names (``oracles.X``), as the tests, the mutant hunt and
the conformance command use them.
"""

from __future__ import annotations

from hybridkv.conformance.oracle_adapter_hit import (
    AdapterOracleStats,
    adapter_hit_state,
    run_adapter_hit_oracle,
)
from hybridkv.conformance.oracle_engine_hit import (
    EngineGroupState,
    EngineKind,
    EngineOracleStats,
    brute_force_engine_hit,
    engine_first_needed_block,
    engine_group_accepts,
    engine_spec_of,
    random_engine_cache_state,
    reference_engine_hit,
    run_engine_hit_oracle,
)
from hybridkv.conformance.oracle_grouping import check_grouping
from hybridkv.conformance.oracle_longest_hit import (
    GroupCacheState,
    Kind,
    brute_force_hit_blocks,
    group_accepts,
    hybrid_hit_tokens,
    joint_type_states,
    random_cache_state,
    type_longest_hit_blocks,
)
from hybridkv.conformance.oracle_memory_layout import check_memory_layout
from hybridkv.conformance.oracle_padding import check_plan_padding
from hybridkv.conformance.oracle_planner import (
    check_plan_report,
    run_planner_oracle,
)
from hybridkv.conformance.oracle_reference_hit import (
    ManagerHit,
    OracleStats,
    reference_hit,
    run_hit_oracle,
    spec_of,
)

__all__ = [
    "AdapterOracleStats",
    "EngineGroupState",
    "EngineKind",
    "EngineOracleStats",
    "GroupCacheState",
    "Kind",
    "ManagerHit",
    "OracleStats",
    "adapter_hit_state",
    "brute_force_engine_hit",
    "brute_force_hit_blocks",
    "check_grouping",
    "check_memory_layout",
    "check_plan_padding",
    "check_plan_report",
    "engine_first_needed_block",
    "engine_group_accepts",
    "engine_spec_of",
    "group_accepts",
    "hybrid_hit_tokens",
    "joint_type_states",
    "random_cache_state",
    "random_engine_cache_state",
    "reference_engine_hit",
    "reference_hit",
    "run_adapter_hit_oracle",
    "run_engine_hit_oracle",
    "run_hit_oracle",
    "run_planner_oracle",
    "spec_of",
    "type_longest_hit_blocks",
]
