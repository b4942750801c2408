"""Every golden trace recorded from vLLM 0.33 replays identically on both backends.

Each trace is compared operation by operation (hit lengths, block ids per position, free-queue
order, cached blocks, reference counts), with the backend's invariant checker run after every
step (the optimized backend's also checks its rows, row thresholds and device tables). The
optimized backend runs on the CPU here; ``test_optimized_cuda`` replays traces on CUDA.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from hybridkv.conformance.golden import replay_trace, trace_names

if TYPE_CHECKING:
    from conftest import ManagerFactory


def test_all_189_traces_are_packaged() -> None:
    assert len(trace_names()) == 189


@pytest.mark.parametrize("name", trace_names())
def test_golden_trace_replays_identically(make_manager: ManagerFactory, name: str) -> None:
    _, divergence = replay_trace(name, make_manager, check_invariants=True)
    assert divergence is None, str(divergence)
