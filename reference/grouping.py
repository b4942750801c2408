"""Grouping policies: how each attention type's layers are cut into KV cache groups.

Three policies share everything else (Case 4's page size, Case 5's readers, the layout):

``"document"``
    the design document's Cases 1–3: groups of g = the smallest layer count of any type,
    consecutive layers of a type, full attention first.
``"vllm"``
    what vLLM 0.33 allocates: g = the smallest count, or the largest when it is under 1.5×
    the smallest (``rules.vllm_group_size``); layers *strided* over a type's groups
    (``rules.strided_layer_indices``), so every group spans every pipeline stage; groups in
    order of each type's first layer.
``"min-padding"``
    the group size whose strided groups cost the fewest layer slots per block on the fullest
    pipeline stage (``rules.min_padding_group_size``): the most tokens in a given memory when
    groups hold equally many blocks. Full attention first, as in the document.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, TypeVar, get_args

from hybridkv.spec import rules

GroupingPolicy = Literal["document", "vllm", "min-padding"]
GROUPING_POLICIES: tuple[GroupingPolicy, ...] = get_args(GroupingPolicy)

_S = TypeVar("_S")


def check_policy(policy: object) -> None:
    """``ValueError`` naming the value unless ``policy`` is one of ``GROUPING_POLICIES``."""
    if policy not in GROUPING_POLICIES:
        raise ValueError(f"policy must be one of {', '.join(GROUPING_POLICIES)}, got {policy!r}")


def split_types(
    types: Sequence[tuple[_S, tuple[str, ...]]],
    policy: GroupingPolicy,
    stages: Mapping[str, int],
) -> list[tuple[_S, tuple[str, ...]]]:
    """Each type's own layers, cut into groups by ``policy``: ``(spec, own layers)`` in order.

    ``types`` is already in the policy's group order; ``stages`` gives each layer's pipeline
    stage (only ``"min-padding"`` looks at it: strided groups balance stages by themselves).
    """
    counts = [len(names) for _, names in types]
    if policy == "document":
        size = rules.group_size(counts)
        return [
            (spec, names[start:stop])
            for spec, names in types
            for start, stop in rules.group_layer_ranges(len(names), size)
        ]
    if policy == "vllm":
        size = rules.vllm_group_size(counts)
    else:
        size = rules.min_padding_group_size([[stages[n] for n in names] for _, names in types])
    return [
        (spec, tuple(names[i] for i in indices))
        for spec, names in types
        for indices in rules.strided_layer_indices(len(names), size)
    ]
