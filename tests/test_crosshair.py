"""The CrossHair manifest: complete, by name, and run with small budgets (the fast profile).

CrossHair is a bounded symbolic search, not a proof: "confirmed over all paths" holds within
the preconditions' bounds, "not confirmed" means the budget ran out without a counterexample.
The run fails on any counterexample, error, vacuous precondition or silent planted bug.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import os
import subprocess

import pytest

from hybridkv.conformance import crosshair_batches
from hybridkv.conformance import crosshair_runner as runner
from hybridkv.conformance.crosshair_batches import (
    BATCH_SCALE,
    Batch,
    attribute,
    batches,
    run_batch,
    source_span,
)
from hybridkv.conformance.crosshair_manifest import CHECKED_MODULES, MANIFEST, Target
from hybridkv.conformance.crosshair_runner import ConditionResult
from hybridkv.conformance.harnesses import sliding_window_scan_equivalence
from hybridkv.spec import rules


def _contracted(module_name: str) -> set[str]:
    module = importlib.import_module(module_name)
    return {
        f"{module_name}.{name}"
        for name, obj in vars(module).items()
        if inspect.isfunction(obj)
        and obj.__module__ == module_name
        and "post:" in (obj.__doc__ or "")
    }


def test_every_contract_of_the_checked_modules_is_in_the_manifest() -> None:
    listed = {target.name for target in MANIFEST}
    contracted = set().union(*(_contracted(m) for m in CHECKED_MODULES))
    assert contracted - listed == set(), "contracts missing from the manifest"
    assert listed - contracted == set(), "manifest names without a post: contract"
    assert len(listed) == len(MANIFEST), "a target is listed twice"


def test_reference_functions_with_contracts_are_in_the_manifest() -> None:
    """The small pure functions of reference/ that carry a contract are checked too."""
    import pkgutil

    import hybridkv.reference

    listed = {target.name for target in MANIFEST}
    for info in pkgutil.iter_modules(hybridkv.reference.__path__):
        name = f"hybridkv.reference.{info.name}"
        assert _contracted(name) <= listed, f"{name} has contracts outside the manifest"


def test_planted_bugs_and_contracts_are_both_in_the_manifest() -> None:
    expectations = {target.expect for target in MANIFEST}
    assert expectations == {"hold", "counterexample"}
    assert sum(t.expect == "counterexample" for t in MANIFEST) >= 8


def test_the_command_line_names_each_target_with_every_budget() -> None:
    budget = runner.PROFILES["fast"]
    command = runner.crosshair_command(Target("hybridkv.spec.rules.cdiv", scale=2.0), budget)
    assert command[-1] == "hybridkv.spec.rules.cdiv"
    for flag in ("--report_all", "--per_condition_timeout", "--max_uninteresting_iterations"):
        assert flag in command
    assert command[command.index("--per_condition_timeout") + 1] == "4"


@pytest.mark.parametrize(
    ("output", "expect", "known", "verdict"),
    [
        ("f.py:3: info: Confirmed over all paths.", "hold", None, "pass"),
        ("f.py:3: info: Not confirmed.", "hold", None, "pass"),
        ("f.py:3: info: Unable to meet precondition.", "hold", None, "fail"),
        ("f.py:3: info: Unable to meet precondition.", "counterexample", None, "fail"),
        ("", "hold", None, "fail"),
        ("WARNING: Targets found, but contain no checkable functions.", "hold", None, "fail"),
        ("f.py:4: error: false when calling f(1) (which returns 0)", "hold", None, "fail"),
        (
            "f.py:4: error: false when calling f(1) (which returns 0)",
            "counterexample",
            None,
            "pass",
        ),
        ("f.py:3: info: Confirmed over all paths.", "counterexample", None, "fail"),
        ("f.py:4: error: PreconditionFailed: x", "hold", "reported", "known"),
        ("f.py:3: info: Confirmed over all paths.", "hold", "reported", "fail"),
    ],
)
def test_the_runner_fails_on_vacuous_silent_and_wrong_results(
    output: str, expect: str, known: str | None, verdict: str
) -> None:
    target = Target("m.f", expect, known_problem=known)  # type: ignore[arg-type]
    conditions, other = runner.parse_output(output)
    code = 1 if "error:" in output else 0
    assert runner.judge(target, code, conditions, other)[0] == verdict


def test_a_timeout_fails() -> None:
    assert runner.judge(Target("m.f"), None, (), ())[0] == "fail"


def test_the_skip_ahead_scan_equals_the_reference_scan_exhaustively() -> None:
    """The twin's equivalence, exhaustively on the harness's domain (CrossHair searches it)."""
    for length in range(9):
        for cached in itertools.product([False, True], repeat=length):
            for needed in range(9):
                assert sliding_window_scan_equivalence(list(cached), needed)
                fast = rules.sliding_window_hit_blocks_skip(cached, needed)
                assert fast == rules.sliding_window_hit_blocks(cached, needed)


def test_the_batches_check_every_target_once_under_its_own_budget() -> None:
    grouped = batches(MANIFEST)
    names = [t.name for b in grouped for t in b.targets]
    assert sorted(names) == sorted(t.name for t in MANIFEST)
    for batch in grouped:
        assert len({(t.expect, t.scale) for t in batch.targets}) == 1
        assert batch.weight <= BATCH_SCALE or len(batch.targets) == 1
    assert len(grouped) < len(MANIFEST) / 3


def test_each_reported_line_goes_to_the_target_whose_source_holds_it() -> None:
    batch = Batch((Target(f"{rules.__name__}.cdiv"), Target(f"{rules.__name__}.group_size")))
    path, cdiv_lines = source_span(batch.targets[0])
    _, group_size_lines = source_span(batch.targets[1])
    first = ConditionResult(cdiv_lines[2], "info", "Confirmed over all paths.")
    second = ConditionResult(group_size_lines[3], "error", "false when calling group_size(1)")
    found = attribute(batch, [(path, first), (path, second)])
    assert found == {batch.targets[0].name: [first], batch.targets[1].name: [second]}
    outside = ConditionResult(max(cdiv_lines[-1], group_size_lines[-1]) + 10_000, "info", "x")
    assert attribute(batch, [(path, outside)]) is None
    assert attribute(batch, [("elsewhere.py", first)]) is None


@pytest.mark.parametrize("returncode", [2, 1])
def test_a_batch_whose_report_cannot_be_split_is_checked_one_target_at_a_time(
    monkeypatch: pytest.MonkeyPatch, returncode: int
) -> None:
    """A crash, or an exit for a counterexample that no line reports: nothing is decided
    from the batch, each target runs alone."""
    batch = Batch((Target(f"{rules.__name__}.cdiv"), Target(f"{rules.__name__}.group_size")))
    done = subprocess.CompletedProcess(["crosshair"], returncode, "", "Traceback ...")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: done)
    alone: list[str] = []

    def run_alone(target: Target, budget: runner.Budget) -> runner.TargetResult:
        alone.append(target.name)
        return runner.TargetResult(target, 0, 0.0, (), (), "pass", "")

    monkeypatch.setattr(crosshair_batches, "run_target", run_alone)
    results = run_batch(batch, runner.PROFILES["fast"])
    assert alone == [t.name for t in batch.targets]
    assert [r.target for r in results] == list(batch.targets)


def _batch_param(batch: Batch) -> object:
    """One test per batch, marked with about its seconds on an idle 2-core machine (about
    two per unit of scale), so that the workers share the manifest."""
    return pytest.param(batch, id=batch.name, marks=pytest.mark.slow(seconds=2 * batch.weight))


@pytest.mark.parametrize("batch", [_batch_param(b) for b in batches(MANIFEST)])
def test_each_batch_of_the_manifest_holds_and_catches_its_planted_bugs_fast_profile(
    batch: Batch,
) -> None:
    """The fast profile, one CrossHair process per batch: every contract holds (confirmed or
    searched to the budget), every planted bug is caught, no target is vacuous."""
    results = run_batch(batch, runner.PROFILES["fast"])
    report = runner.CrosshairReport("fast", results)
    print("\n".join(report.lines()))
    assert [r.target for r in results] == list(batch.targets)
    failures = [r for r in results if r.verdict == "fail"]
    assert not failures, "\n".join(f"{r.target.name}: {r.reason}" for r in failures)
    assert all(r.conditions for r in results)


@pytest.mark.skipif(os.environ.get("HYBRIDKV_LONG") != "1", reason="long profile: HYBRIDKV_LONG=1")
def test_the_manifest_long_profile() -> None:
    report = crosshair_batches.run_manifest("long", workers=os.cpu_count() or 2)
    print("\n".join(report.lines()))
    assert report.ok
