"""Both backends run the reference's manager tests (PEP 399 style).

A test that takes ``make_manager`` runs once per backend, and the backend's name shows in its
id: ``test_x[reference]``, ``test_x[optimized]``. ``make_manager`` is the backend's manager
class, called like ``hybridkv.reference.KVCacheManager``; the optimized backend gets its
defaults (``device="cpu"``, ``max_num_reqs=256``). Without torch the ``optimized`` runs are
skipped (``pytest.importorskip("torch")``), and the ``reference`` runs go on.
"""

from __future__ import annotations

from typing import Protocol

import pytest

from hybridkv.conformance.protocol import KVCacheManagerLike
from hybridkv.reference import KVCacheManager
from hybridkv.spec import KVCacheConfig

BACKENDS = ["reference", "optimized"]


class BackendManager(KVCacheManagerLike, Protocol):
    """The scheduler API both backends share, plus the configuration they were built with."""

    @property
    def config(self) -> KVCacheConfig: ...


class ManagerFactory(Protocol):
    """A backend's manager class: ``KVCacheManager``'s constructor arguments."""

    def __call__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        log_stats: bool = True,
    ) -> BackendManager: ...


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The backend's name: ``reference`` or ``optimized``."""
    name: str = request.param
    return name


@pytest.fixture
def make_manager(backend: str) -> ManagerFactory:
    """The manager class of the backend under test (skips ``optimized`` without torch)."""
    if backend == "reference":
        return KVCacheManager
    pytest.importorskip("torch")
    from hybridkv.optimized import TorchKVCacheManager  # imports torch

    return TorchKVCacheManager
