"""``python -m hybridkv.bench --quick`` runs and prints its table (a smoke test, no timings
asserted: the command runs in its own process, which sets torch's thread count)."""

from __future__ import annotations

import subprocess
import sys


def test_the_benchmark_command_prints_its_table() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hybridkv.bench", "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for scenario in ("decode B=16", "hash 4,096-token prompt", "lookup", "admission", "memory"):
        assert scenario in result.stdout
    assert "ratio" in result.stdout
