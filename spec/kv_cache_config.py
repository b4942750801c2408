"""The planner's output: KV cache groups, the tensors that back them, and the number of blocks.

Names follow the design document ("Allocation", Case 2, and "Memory Layout"): layers that need
the same number of blocks form a *KV cache group* and share block ids; each *KV cache tensor* is
one buffer shared by one layer of every group; a logical block is one slice of every tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from hybridkv.spec.errors import check_non_negative
from hybridkv.spec.kv_cache_spec import KVCacheSpec

_V = TypeVar("_V")


def full_attention_first(types: Mapping[KVCacheSpec, _V]) -> list[tuple[KVCacheSpec, _V]]:
    """The attention-type order, written once: full attention (whose hit is a prefix) first,
    the other types in order of first appearance.

    The planner numbers its groups so (the document's Group 0 is full attention even in
    Gemma-3, whose first layer is sliding window) and the hybrid coordinator probes its types
    so (full attention's hit bounds every other type's).
    """
    return sorted(types.items(), key=lambda item: not item[0].hit_is_prefix)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers of one attention type that share block ids.

    ``layer_names`` lists the group's own layers in model order, then the layers that read one of
    them through KV sharing (Allocation, Case 5): those get no memory of their own.
    """

    layer_names: tuple[str, ...]
    spec: KVCacheSpec
    is_eagle_group: bool = False
    """The group holds a drafter's layers (EAGLE/MTP): its cache hits drop their last block
    when the manager runs with ``use_eagle``."""

    def __post_init__(self) -> None:
        if not self.layer_names:
            raise ValueError(f"layer_names must name at least one layer, got {self.layer_names!r}")
        if not isinstance(self.is_eagle_group, bool):
            raise ValueError(f"is_eagle_group must be a bool, got {self.is_eagle_group!r}")


@dataclass(frozen=True)
class KVCacheTensor:
    """One buffer of ``size`` bytes, shared by the layers in ``shared_by`` (one per group)."""

    size: int
    shared_by: tuple[str, ...]

    def __post_init__(self) -> None:
        check_non_negative("size", self.size)
        if not self.shared_by:
            raise ValueError(f"shared_by must name at least one layer, got {self.shared_by!r}")


@dataclass(frozen=True)
class KVCacheConfig:
    """What the manager needs: ``num_blocks`` (the null block included) and the groups.

    ``prefix_cache_retention_interval`` says which prefix-cache checkpoints sliding-window and
    Mamba groups keep: ``None`` every one (dense), ``0`` only the ones a replay or a shared
    prefix can reach (an engine's default), a positive multiple of the scheduler block size
    those plus one per interval. Other attention types always cache densely.
    """

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    tensors: tuple[KVCacheTensor, ...] = ()
    prefix_cache_retention_interval: int | None = None

    def __post_init__(self) -> None:
        if (
            not isinstance(self.num_blocks, int)
            or isinstance(self.num_blocks, bool)
            or (self.num_blocks < 2)
        ):
            raise ValueError(
                "num_blocks must be an int of at least 2 (the null block plus one), "
                f"got {self.num_blocks!r}"
            )
        if not self.groups:
            raise ValueError(f"groups must hold at least one KV cache group, got {self.groups!r}")
        if self.prefix_cache_retention_interval is not None:
            check_non_negative(
                "prefix_cache_retention_interval", self.prefix_cache_retention_interval
            )

    def attention_types(self) -> list[tuple[KVCacheSpec, list[int]]]:
        """(spec, group ids) per distinct spec, in the order a hybrid lookup probes them: full
        attention (whose hit is a prefix) first, the others in order of first appearance
        (``HybridCoordinator``)."""
        types: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(self.groups):
            types.setdefault(group.spec, []).append(group_id)
        return full_attention_first(types)
