"""The padding oracle: a plan's padding slots by brute force (Allocation Case 3: the group size
is the smallest own-layer count of any type, and a type of ``n`` layers pads ``-n % g`` slots).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from hybridkv.conformance.oracle_grouping import kind_key
from hybridkv.spec import KVCacheSpec


def check_plan_padding(
    layers: Mapping[str, KVCacheSpec],
    groups_padding: Sequence[int],
    groups_own: Sequence[int],
    total_padding: int,
    layers_per_group: int,
    kv_sharing: Mapping[str, str] | None = None,
) -> list[str]:
    """Padding by brute force: g = the smallest own-layer count of any type, each group pads to
    g, and a type of n layers has ``-n % g`` padding slots in all (Case 3)."""
    sharing = kv_sharing or {}
    counts = Counter(kind_key(s) for n, s in layers.items() if n not in sharing)
    g = min(counts.values())
    problems: list[str] = []
    if layers_per_group != g:
        problems.append(f"layers per group {layers_per_group}, expected {g}")
    expected_total = sum(-n % g for n in counts.values())
    if total_padding != expected_total:
        problems.append(f"{total_padding} padding slots in all, expected {expected_total}")
    for gid, (pad, own) in enumerate(zip(groups_padding, groups_own, strict=True)):
        if pad != g - own:
            problems.append(f"group {gid}: {pad} padding slots for {own} own layers of {g}")
    return problems
