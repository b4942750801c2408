"""Every golden trace recorded from vLLM 0.33 replays identically.

Each trace is compared operation by operation (hit lengths, block ids per position, free-queue
order, cached blocks, reference counts), with the backend's invariant checker run after every
step (the optimized backend's also checks its rows, row thresholds and device tables). The
optimized backend runs on the CPU here; ``test_optimized_cuda`` replays traces on CUDA.

The 189 unit-test traces and the 150 engine traces run on both backends, each wrapped in the
``ProtocolAdapter`` (``manager_backend``): the replay drives the same adapter protocol an
outside implementation joins through.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from hybridkv.conformance.adapters import manager_backend
from hybridkv.conformance.golden import load_trace, replay_trace, trace_names
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import KVCacheManager

if TYPE_CHECKING:
    from conftest import ManagerFactory


def test_both_trace_sets_are_packaged() -> None:
    assert len(trace_names("unit")) == 189
    assert len(trace_names("engine")) == 150
    assert trace_names() == sorted(trace_names("unit") + trace_names("engine"))


def test_an_unknown_trace_set_is_refused() -> None:
    message = r"^trace_set must be one of \['engine', 'unit'\], got 'x'$"
    with pytest.raises(ValueError, match=message):
        trace_names("x")


@pytest.mark.parametrize("name", trace_names("unit"))
def test_golden_trace_replays_identically(
    backend: str, make_manager: ManagerFactory, name: str
) -> None:
    _, factory = manager_backend(backend, make_manager)
    _, divergence = replay_trace(name, factory, check_invariants=True)
    assert divergence is None, str(divergence)


@pytest.mark.parametrize("name", trace_names("engine"))
def test_engine_trace_replays_identically_on_the_reference(name: str) -> None:
    matched, divergence = replay_trace(
        name, manager_backend("reference", KVCacheManager)[1], check_invariants=True
    )
    assert divergence is None, str(divergence)
    assert matched == len(load_trace(name)["observations"])


@pytest.mark.parametrize("name", trace_names("engine"))
def test_engine_trace_replays_identically_on_the_optimized_backend(name: str) -> None:
    matched, divergence = replay_trace(
        name, manager_backend("optimized", TorchKVCacheManager)[1], check_invariants=True
    )
    assert divergence is None, str(divergence)
    assert matched == len(load_trace(name)["observations"])
