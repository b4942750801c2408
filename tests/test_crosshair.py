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

import pytest

from hybridkv.conformance import crosshair_runner as runner
from hybridkv.conformance.crosshair_manifest import CHECKED_MODULES, MANIFEST, Target
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


@pytest.mark.slow(seconds=66)
def test_the_manifest_holds_and_catches_every_planted_bug_fast_profile() -> None:
    report = runner.run_manifest("fast", workers=2)
    print("\n".join(report.lines()))
    failures = [r for r in report.results if r.verdict == "fail"]
    assert not failures, "\n".join(f"{r.target.name}: {r.reason}" for r in failures)
    assert all(r.conditions for r in report.results)


@pytest.mark.skipif(os.environ.get("HYBRIDKV_LONG") != "1", reason="long profile: HYBRIDKV_LONG=1")
def test_the_manifest_long_profile() -> None:
    report = runner.run_manifest("long", workers=os.cpu_count() or 2)
    print("\n".join(report.lines()))
    assert report.ok
