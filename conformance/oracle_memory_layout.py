"""The memory-layout oracle: a plan's tensors and block count against the Memory Layout section
of the design document (one tensor per own-layer slot, shared across groups, each of
``num_blocks × page_size_bytes``).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.spec import KVCacheConfig


def check_memory_layout(
    config: KVCacheConfig, available_memory_bytes: int, kv_sharing: Mapping[str, str] | None = None
) -> list[str]:
    """Every way ``config`` breaks the Memory Layout section; empty when it obeys.

    m = the most own layers of any group; m tensors; tensor i is shared by the i-th own layer of
    every group that has one, in group order; each holds ``num_blocks × page_size_bytes``; and
    ``num_blocks = available_memory_bytes // (m × page_size_bytes)``.
    """
    sharing = kv_sharing or {}
    own = [[n for n in g.layer_names if n not in sharing] for g in config.groups]
    m = max(len(names) for names in own)
    page = config.groups[0].spec.page_size_bytes
    problems: list[str] = []
    expected_blocks = available_memory_bytes // (m * page)
    if config.num_blocks != expected_blocks:
        problems.append(f"num_blocks {config.num_blocks}, expected {expected_blocks}")
    if len(config.tensors) != m:
        problems.append(f"{len(config.tensors)} tensors, expected {m}")
    for i, tensor in enumerate(config.tensors):
        shared = tuple(names[i] for names in own if i < len(names))
        if tensor.shared_by != shared:
            problems.append(f"tensor {i} shared by {tensor.shared_by}, expected {shared}")
        if tensor.size != config.num_blocks * page:
            problems.append(f"tensor {i} holds {tensor.size} bytes, expected num_blocks × page")
    return problems
