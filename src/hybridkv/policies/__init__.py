"""Eviction policies: which free blocks new tokens reuse (``EvictionPolicy``), one per module.

``KVCacheManager(..., eviction_policy=...)`` takes ``"lru"`` (vLLM 0.33's order, the default,
kept by the pool's own free queue), the name of a shipped policy, ``"module:Class"`` (a class
of yours, built with no arguments), or a policy instance. ``resolve_policy`` turns that choice
into what the block pool holds: ``None`` for the default, else the policy.
"""

from __future__ import annotations

import importlib

from hybridkv.policies.arc import ARCPolicy
from hybridkv.policies.cost import CostPolicy
from hybridkv.policies.hybrid import HybridPolicy
from hybridkv.policies.hybrid_arc import HybridARCPolicy
from hybridkv.policies.lru import LRUPolicy
from hybridkv.policies.protocol import CachedBlock, EvictionPolicy, PolicyError

__all__ = [
    "POLICIES",
    "ARCPolicy",
    "CachedBlock",
    "CostPolicy",
    "EvictionPolicy",
    "HybridARCPolicy",
    "HybridPolicy",
    "LRUPolicy",
    "PolicyError",
    "resolve_policy",
]

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "hybrid": HybridPolicy,
    "arc": ARCPolicy,
    "cost": CostPolicy,
    "hybrid-arc": HybridARCPolicy,
}
"""The shipped policies by name."""

DEFAULT = "lru"


def resolve_policy(choice: object) -> EvictionPolicy | None:
    """The policy a block pool consults, or ``None`` for vLLM's own free-queue order.

    A name builds a fresh instance, so two managers never share a policy's state; an instance
    is used as given (it must serve one manager only).
    """
    if choice == DEFAULT:
        return None
    if isinstance(choice, str):
        return _build(choice)
    if isinstance(choice, EvictionPolicy):
        return choice
    raise ValueError(
        f"eviction_policy must be one of {sorted(POLICIES)}, 'module:Class' or an "
        f"EvictionPolicy instance, got {choice!r}"
    )


def _build(name: str) -> EvictionPolicy:
    """A shipped policy by name, or ``module:Class`` imported and built with no arguments."""
    if name in POLICIES:
        return POLICIES[name]()
    module_name, colon, class_name = name.partition(":")
    if not colon or not module_name or not class_name:
        raise ValueError(
            f"eviction_policy {name!r} is not a policy name ({', '.join(sorted(POLICIES))}) "
            "nor 'module:Class'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"eviction_policy {name!r}: cannot import {module_name!r}: {error}"
        ) from None
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise ValueError(f"eviction_policy {name!r}: {module_name} has no class {class_name!r}")
    policy = cls()
    if not isinstance(policy, EvictionPolicy):
        raise ValueError(
            f"eviction_policy {name!r}: {class_name} lacks the EvictionPolicy methods "
            "(name, cached, released, touched, choose, taken, uncached, reset)"
        )
    return policy
