"""``python -m hybridkv.conformance.mutation_score``: the mutation score of ``reference/`` (mutmut).

The hand-written mutants of ``hybridkv.conformance.mutants`` are bugs the suite must catch; this
command asks a mutation-testing tool, mutmut, for *every* small change it can make to
``reference/`` (operators, constants, comparisons, arguments, strings...) and reports how many
the tests kill. It never touches the working tree: it assembles a copy of the package in a work
directory (``--workdir``, default a fresh temporary one) and runs mutmut there, two workers by
default. It takes tens of minutes (about 3,300 mutants).

The tests that run against each mutant (``--tests``):

* ``kill`` (default): the project's fast unit tests of the manager and planner (and of the
  invariant checker), plus a kill file of conformance checks: golden traces (every engine
  trace, a sixth of the unit traces; invariants after every step), the longest-hit oracle,
  the planner oracle, and state-machine runs against the optimized backend (independent
  code; when torch imports), one of them on the Mamba and mixed-block-size layouts;
* ``golden``: the kill set with all 189 unit traces instead of a sample (slower).

A mutant no test reaches ("no tests") counts as surviving in the score. The score is
killed / (all mutants − equivalent ones mutmut could not run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from hybridkv.conformance.extras import missing_extra

PROJECT_TESTS = (
    "conftest.py",
    "parallel_order.py",  # conftest.py imports it
    "test_block_hash_fast.py",
    "test_conformance_invariants.py",
    "test_manager_errors.py",
    "test_manager_lifecycle.py",
    "test_free_queue.py",
    "test_lazy_flags.py",
    "test_oracles.py",
    "test_document_examples.py",
    "test_engine_features.py",
    "test_grouping_policies.py",
    "test_kv_cache_blocks_surface.py",
    "test_planner.py",
    "test_plan_report.py",
)

KILL_TESTS = '''"""Conformance checks that run against every mutmut mutant of reference/."""

from hybridkv.conformance import oracles
from hybridkv.conformance.adapters import manager_backend, optimized_backend, reference_backend
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.conformance.machine import run_differential
from hybridkv.reference import KVCacheManager

EVERY = {every}

try:  # mutmut forks a child per mutant: an intra-op thread pool does not survive the fork
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


_, _factory = manager_backend("reference", KVCacheManager)


def test_golden_unit_traces():
    for name in trace_names("unit")[::EVERY]:
        _, divergence = replay_trace(name, _factory)
        assert divergence is None, str(divergence)


def test_golden_engine_traces():
    """Every engine trace: Mamba checkpoints, retention tails and partial entries appear in
    a few traces each, and a sample misses them."""
    for name in trace_names("engine"):
        _, divergence = replay_trace(name, _factory)
        assert divergence is None, str(divergence)


def test_longest_hit_oracle():
    assert not oracles.run_hit_oracle(300).failures


def test_planner_oracle():
    assert not oracles.run_planner_oracle(100).failures


def test_state_machine_against_the_optimized_backend():
    """The optimized backend is independent code: a differential run kills mutants of what
    only a comparison sees (statistics, events, free-queue order)."""
    backends = [reference_backend()]
    optimized = optimized_backend()
    if optimized is not None:
        backends.append(optimized)
    run_differential(backends, max_examples=25, steps=30, shrink=False)


def test_state_machine_on_mamba_and_mixed_block_sizes():
    """Partial entries, Mamba checkpoints and their events: few golden traces reach them."""
    backends = [reference_backend()]
    optimized = optimized_backend()
    if optimized is not None:
        backends.append(optimized)
    families = ("mamba_align", "mixed_block_sizes")
    run_differential(
        backends, max_examples=60, steps=40, shrink=False, families=families, roomy=True
    )
'''


def _repo_root() -> Path:
    """The source tree: the folder holding ``reference/``, ``spec/`` and ``conformance/``."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent, *here.parents):
        if (candidate / "reference").is_dir() and (candidate / "spec").is_dir():
            return candidate
    raise SystemExit("mutation_score: cannot find the source tree (reference/ and spec/)")


def prepare(workdir: Path, tests: str) -> None:
    """Lay out ``hybridkv/`` (spec, reference, conformance with its vectors) and the tests."""
    root = _repo_root()
    package = workdir / "hybridkv"
    ignore = shutil.ignore_patterns("__pycache__")
    # The whole top-level package (catalogue, data, CLI): the kill tests import them.
    shutil.copytree(root / "src" / "hybridkv", package, ignore=ignore)
    for name in ("spec", "reference", "conformance", "optimized"):
        shutil.copytree(root / name, package / name, ignore=ignore)
    test_dir = workdir / "tests"
    test_dir.mkdir()
    selected = []
    for name in PROJECT_TESTS:
        if (root / "tests" / name).exists():
            shutil.copy(root / "tests" / name, test_dir / name)
            selected.append(f"tests/{name}")
    if (root / "tests" / "fixtures").is_dir():
        shutil.copytree(root / "tests" / "fixtures", test_dir / "fixtures", ignore=ignore)
    every = 1 if tests == "golden" else 6
    (test_dir / "test_kill.py").write_text(KILL_TESTS.format(every=every))
    selected.append("tests/test_kill.py")
    lines = [
        "[mutmut]",
        "source_paths = hybridkv/reference/",
        "pytest_add_cli_args_test_selection =",
        *(f"    {path}" for path in selected),
        "pytest_add_cli_args =",
        "    -x",
        "    -q",
        "    -p",
        "    no:cacheprovider",
        "also_copy = hybridkv/",
    ]
    (workdir / "setup.cfg").write_text("\n".join(lines) + "\n")


def _survivors(workdir: Path) -> list[str]:
    """Names of the mutants that survived or that no test reached, from mutmut's meta files."""
    names = []
    for meta in sorted((workdir / "mutants").rglob("*.meta")):
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        names += [name for name, code in codes.items() if code in (0, 33)]
    return names


def score(stats: dict[str, int]) -> tuple[int, int, float]:
    """(killed, counted, killed / counted) from mutmut's CI/CD stats."""
    killed = stats.get("killed", 0)
    counted = stats.get("total", 0) - stats.get("skipped", 0)
    return killed, counted, killed / counted if counted else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.conformance.mutation_score")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--tests", choices=["kill", "golden"], default="kill")
    parser.add_argument("--max-children", type=int, default=2)
    parser.add_argument("--target", type=float, default=0.9, help="score below which to fail")
    parser.add_argument(
        "--rerun-survivors",
        action="store_true",
        help="in an existing --workdir: refresh the tests, rerun only the surviving mutants",
    )
    args = parser.parse_args(argv)
    missing = missing_extra("mutmut", "dev", parser.prog)
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hybridkv-mutmut-"))
    env = {**os.environ, "PYTHONPATH": str(workdir)}
    run = [sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children)]
    if args.rerun_survivors:
        survivors = _survivors(workdir)
        fresh = workdir / "fresh"
        shutil.rmtree(fresh, ignore_errors=True)
        prepare(fresh, args.tests)
        for path in (workdir / "tests", workdir / "mutants" / "tests"):
            shutil.rmtree(path)
            shutil.copytree(fresh / "tests", path)
        shutil.copy(fresh / "setup.cfg", workdir / "setup.cfg")
        shutil.rmtree(fresh)
        (workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
        print(f"rerunning {len(survivors)} survivors in {workdir}", flush=True)
        run += survivors
    else:
        if workdir.exists() and any(workdir.iterdir()):
            print(f"error: {workdir} is not empty", file=sys.stderr)
            return 2
        prepare(workdir, args.tests)
        print(f"mutmut in {workdir} ({args.tests} tests, {args.max_children} workers)", flush=True)
    subprocess.run(run, cwd=workdir, env=env, check=False, stdout=subprocess.DEVNULL)
    subprocess.run(
        [sys.executable, "-m", "mutmut", "export-cicd-stats"], cwd=workdir, env=env, check=True
    )
    stats = json.loads((workdir / "mutants" / "mutmut-cicd-stats.json").read_text())
    killed, counted, ratio = score(stats)
    print(json.dumps(stats, indent=1, sort_keys=True))
    print(f"mutation score of reference/: {killed}/{counted} killed = {ratio:.1%}")
    print(f"survivors: cd {workdir} && python -m mutmut results (then mutmut show NAME)")
    return 0 if ratio >= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
