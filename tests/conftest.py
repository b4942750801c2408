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

SLOWEST_FIRST = (
    "tests/test_vllm_own_tests.py::test_vllms_scheduler_tests_pass_on_both_backends",
    "tests/test_crosshair.py::test_the_manifest_holds_and_catches_every_planted_bug",
    "tests/test_mutants.py::test_the_suite_catches_the_mutant",
    "tests/test_mutants.py::test_the_unpatched_reference_passes_every_check",
    "tests/test_conformance.py::test_the_optimized_backend_agrees_with_the_reference",
)
"""Node-id prefixes of the slowest tests (``--durations``), longest first.

The suite runs on every core (``-n auto --dist worksteal`` in ``pyproject.toml``): each worker
takes an equal share of the collected tests and an idle one steals from the end of another's
share. Collected first, the longest tests start at once instead of last, while the short ones
fill the other workers; without this the run would wait on one long test at its end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Move the slowest tests to the front, in ``SLOWEST_FIRST``'s order; nothing is dropped."""

    def rank(item: pytest.Item) -> int:
        for index, prefix in enumerate(SLOWEST_FIRST):
            if item.nodeid.startswith(prefix):
                return index
        return len(SLOWEST_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order


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
