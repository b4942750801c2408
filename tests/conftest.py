"""Both backends run the reference's manager tests (PEP 399 style).

A test that takes ``make_manager`` runs once per backend, and the backend's name shows in its
id: ``test_x[reference]``, ``test_x[optimized]``. ``make_manager`` is the backend's manager
class, called like ``hybridkv.reference.KVCacheManager``; the optimized backend gets its
defaults (``device="cpu"``, ``max_num_reqs=256``). Without torch the ``optimized`` runs are
skipped (``pytest.importorskip("torch")``), and the ``reference`` runs go on.
"""

from __future__ import annotations

import os
from typing import Protocol

import pytest
from parallel_order import reorder_for_workers

from hybridkv.conformance.protocol import KVCacheManagerLike
from hybridkv.reference import KVCacheManager
from hybridkv.spec import KVCacheConfig

BACKENDS = ["reference", "optimized"]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist each worker is one of as many processes as cores: torch's intra-op
    # pool (one thread per core by default) would oversubscribe them. Set before any test
    # module imports torch; the subprocesses tests start inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Spread the tests marked ``slow`` over the xdist workers (``parallel_order``)."""
    reorder_for_workers(items)


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
