"""A derandomized run of the differential machine draws the same examples whatever the process
imported before it (``hybridkv.conformance.draws``): first in a process, after other test
files, in a pytest-xdist worker or after a mutant hunt."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from hybridkv.conformance.adapters import reference_backend
from hybridkv.conformance.draws import seed_only_draws
from hybridkv.conformance.machine import RunStats, run_differential


def _run() -> RunStats:
    return run_differential([reference_backend()], max_examples=40, steps=30, shrink=False)


def _import_module_of_literals(directory: Path) -> None:
    """A new local module whose literals Hypothesis would otherwise mix into its draws (its name
    must not look like a test file's: Hypothesis skips ``test_*`` and ``*_test`` modules)."""
    source = "VALUES = [" + ", ".join(str(100 + 37 * i) for i in range(900)) + "]\n"
    path = directory / "draw_literals_module.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("draw_literals_module", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)


def _signature(stats: RunStats) -> tuple[int, object]:
    return stats.steps, (
        dict(stats.rules),
        stats.allocations,
        stats.failed_allocations,
        stats.hits,
        stats.lookups,
        dict(stats.group_counts),
    )


def test_a_derandomized_run_draws_the_same_examples_after_a_new_module_is_imported(
    tmp_path: Path,
) -> None:
    before = _signature(_run())
    try:
        _import_module_of_literals(tmp_path)
        after = _signature(_run())
    finally:
        sys.modules.pop("draw_literals_module", None)
    assert after == before
    assert before[0] > 0


def test_the_pin_restores_hypothesis_afterwards() -> None:
    providers = pytest.importorskip("hypothesis.internal.conjecture.providers")
    original = providers._get_local_constants
    with seed_only_draws():
        assert providers._get_local_constants is not original
        assert len(providers._get_local_constants()) == 0
    assert providers._get_local_constants is original
