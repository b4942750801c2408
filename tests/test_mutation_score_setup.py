"""The mutation-score work directory holds everything its kill tests import."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.conformance import mutation_score


def test_the_kill_set_collects_in_the_assembled_work_directory(tmp_path: Path) -> None:
    """A kill test that fails to import would fail every mutant's run and count as a kill;
    collecting the assembled tests (with only the work directory on the path) catches it."""
    mutation_score.prepare(tmp_path, "kill")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = [line for line in result.stdout.splitlines() if "::" in line]
    assert any("test_kill.py::test_golden_engine_traces" in line for line in collected)
    assert any("test_grouping_policies.py::" in line for line in collected)


def test_the_score_counts_killed_over_runnable_mutants() -> None:
    stats = {"killed": 90, "survived": 8, "no_tests": 2, "total": 105, "skipped": 5}
    assert mutation_score.score(stats) == (90, 100, 0.9)


def test_a_missing_optional_tool_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """After ``pip install -e '.[dev]'`` every documented command runs; without its tool, an
    optional command says in one line which extra installs it (no traceback)."""
    import importlib.util

    from hybridkv.conformance import __main__ as command
    from hybridkv.conformance import mutation_score

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("mutmut", "crosshair") else real(name, *a),
    )
    assert mutation_score.main([]) == 2
    assert capsys.readouterr().err == (
        "python -m hybridkv.conformance.mutation_score needs mutmut, which is not installed: "
        "pip install '.[dev]'\n"
    )
    assert command.main(["--crosshair"]) == 2
    assert capsys.readouterr().err == (
        "error: --crosshair needs crosshair, which is not installed: pip install '.[crosshair]'\n"
    )
