"""vLLM's scheduler tests once per backend, one pytest session after another, in one process.

``own_tests`` starts ``python -m hybridkv.integrations.vllm.own_test_runs ARGS.json`` in vLLM's
source tree: the file lists, per backend, the arguments of one pytest run (``own_tests``
builds them: the plugin, ``--hybridkv-backend``, the JUnit report, the test files). Each run is
a whole pytest session (``pytest.main``). One process per backend spent two thirds of its time
importing vLLM and collecting its test modules; here the later sessions find them imported.
Each test still builds its own scheduler, and the plugin puts vLLM's manager back when its
session ends, so each session's outcomes are those of a run of its own
(``tests/test_vllm_own_tests.py`` checks the counts).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from hybridkv.extras import exit_if_missing

PROG = "python -m hybridkv.integrations.vllm.own_test_runs"


def main(argv: Sequence[str] | None = None) -> int:
    """Run each listed session in turn; exit 0 once all ran (their outcomes are in their
    reports: failing tests are what the comparison reads, not an error of this runner)."""
    parser = argparse.ArgumentParser(prog=PROG)
    parser.add_argument("runs", type=Path, help="JSON: backend → the arguments of its pytest run")
    args = parser.parse_args(argv)
    exit_if_missing(PROG, ["vllm", "torch", "pytest"])
    import pytest

    runs: dict[str, list[str]] = json.loads(args.runs.read_text(encoding="utf-8"))
    for arguments in runs.values():
        code = pytest.main(arguments)
        if code not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            return int(code)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
