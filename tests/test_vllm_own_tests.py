"""vLLM's own scheduler tests with the manager swapped: the comparison rules, and the run itself
(skipped when vLLM is not installed or its test tree can be neither found nor downloaded)."""

from __future__ import annotations

import importlib.util
from collections import Counter
from pathlib import Path

import pytest

from hybridkv.integrations.vllm import own_tests
from hybridkv.integrations.vllm.own_tests import Outcome, compare, parse_report

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.v1.core.test_scheduler" name="test_plain" time="0.1"/>
<testcase classname="tests.v1.core.test_scheduler" name="test_connector[2]" time="0.1">
<failure message="hybridkv.integrations.vllm.errors.UnsupportedSetting: hybridkv does not
support num_external_computed_tokens=2: tokens cached by a KV connector are not modelled">
trace</failure></testcase>
<testcase classname="tests.v1.core.test_scheduler" name="test_skipped" time="0.0">
<skipped message="needs a GPU"/></testcase>
<testcase classname="tests.v1.core.test_async_scheduler" name="test_broken" time="0.1">
<error message="failed on setup">trace</error></testcase>
</testsuite></testsuites>
"""


def test_a_report_gives_each_test_its_outcome_and_message(tmp_path: Path) -> None:
    path = tmp_path / "report.xml"
    path.write_text(REPORT, encoding="utf-8")
    outcomes = parse_report(path)
    assert {test_id: o.status for test_id, o in outcomes.items()} == {
        "tests.v1.core.test_scheduler::test_plain": "passed",
        "tests.v1.core.test_scheduler::test_connector[2]": "failed",
        "tests.v1.core.test_scheduler::test_skipped": "skipped",
        "tests.v1.core.test_async_scheduler::test_broken": "error",
    }
    # XML folds the attribute's line break into a space.
    assert outcomes["tests.v1.core.test_scheduler::test_connector[2]"].refused == (
        "hybridkv does not support num_external_computed_tokens=N: tokens cached by a KV "
        "connector are not modelled"
    )


def test_a_refusal_is_read_from_the_first_line_with_its_value_folded() -> None:
    outcome = Outcome(
        "failed",
        "hybridkv.integrations.vllm.errors.UnsupportedSetting: hybridkv does not support "
        "num_external_computed_tokens=32: tokens cached by a KV connector are not modelled\nmore",
    )
    assert outcome.refused == (
        "hybridkv does not support num_external_computed_tokens=N: tokens cached by a KV "
        "connector are not modelled"
    )
    assert Outcome("failed", "assert 1 == 2").refused is None
    assert Outcome("passed", "UnsupportedSetting").refused is None
    coordinator = "assert False\n +  where False = isinstance(<...CoordinatorView object>, ...)"
    assert Outcome("failed", coordinator).refused == "asserts vLLM's coordinator class"


def test_a_test_lost_without_a_refusal_is_a_difference() -> None:
    refusal = "x.UnsupportedInternal: hybridkv does not support vLLM manager internals (a.b): why"
    baseline = {
        "t::same": Outcome("passed"),
        "t::refused": Outcome("passed"),
        "t::lost": Outcome("passed"),
        "t::gone": Outcome("passed"),
        "t::fails_on_vllm": Outcome("failed", "needs a model"),
    }
    run = {
        "t::same": Outcome("passed"),
        "t::refused": Outcome("failed", refusal),
        "t::lost": Outcome("failed", "assert 3 == 4"),
        "t::fails_on_vllm": Outcome("passed"),
    }
    comparison = compare(baseline, "optimized", run)
    assert comparison.passed == 2
    assert comparison.refused == Counter(
        {"hybridkv does not support vLLM manager internals (a.b): why": 1}
    )
    assert comparison.unexplained == (
        "t::lost: failed 'assert 3 == 4'",
        "t::gone: missing ''",
    )
    assert comparison.passes_only_here == ("t::fails_on_vllm",)


@pytest.mark.slow(seconds=40)
def test_vllms_scheduler_tests_pass_on_both_backends_but_for_named_refusals(
    tmp_path: Path,
) -> None:
    """The run the README reports: every test that passes on vLLM's own manager passes on the
    reference and on the optimized backend, or stops on a setting refused by name."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)")
    try:
        source = own_tests.fetch_source()
    except own_tests.SourceUnavailable as error:
        pytest.skip(f"vLLM's test tree is unavailable: {error}")
    runs = own_tests.run_backends(
        source, {name: tmp_path / f"{name}.xml" for name in own_tests.RUNS}
    )
    baseline = runs["vllm"]
    assert sum(o.status == "passed" for o in baseline.values()) == 234
    for backend in ("reference", "optimized"):
        comparison = compare(baseline, backend, runs[backend])
        print(own_tests.summary(baseline, [comparison]))
        assert comparison.unexplained == ()
        assert (comparison.passed, sum(comparison.refused.values())) == (229, 5)
        assert comparison.passes_only_here == ()
