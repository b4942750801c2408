"""An outside implementation joins through ``--adapter MODULE:FACTORY``, and the golden replay
through an adapter reports every outcome (a divergence, an exception with its operation index,
a refusal by name, a snapshot not shown) without raising."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.conformance.adapters import (
    AdapterLoadError,
    EngineOptions,
    ManagerAdapter,
    load_backend,
    manager_backend,
)
from hybridkv.conformance.golden import check_trace, load_trace
from hybridkv.reference import KVCacheManager
from hybridkv.spec import KVCacheConfig


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "my_adapter.make_adapter",
            "--adapter must be MODULE:FACTORY (e.g. my_module:make_adapter), got "
            "'my_adapter.make_adapter'",
        ),
        (
            "no_such_module_xyz:make_adapter",
            "--adapter 'no_such_module_xyz:make_adapter': module 'no_such_module_xyz' does not "
            "import: ModuleNotFoundError: No module named 'no_such_module_xyz'",
        ),
        (
            "hybridkv.conformance.adapters:make_nothing",
            "--adapter 'hybridkv.conformance.adapters:make_nothing': module "
            "'hybridkv.conformance.adapters' has no attribute 'make_nothing'",
        ),
        (
            "hybridkv.conformance.adapters:NOT_IMPLEMENTED",
            "--adapter 'hybridkv.conformance.adapters:NOT_IMPLEMENTED': "
            "hybridkv.conformance.adapters.NOT_IMPLEMENTED is not callable (got str); it must "
            "be an AdapterFactory",
        ),
    ],
)
def test_an_unusable_adapter_string_is_refused_in_one_line(spec: str, message: str) -> None:
    with pytest.raises(AdapterLoadError) as caught:
        load_backend(spec)
    assert str(caught.value) == message


def test_the_command_reports_an_unusable_adapter_and_exits_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridkv.conformance.__main__ import main

    assert main(["--adapter", "nocolon"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "error: --adapter must be MODULE:FACTORY (e.g. my_module:make_adapter), got 'nocolon'\n"
    )


def test_the_adapter_and_a_backend_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.conformance.__main__ import main

    spec = "hybridkv.conformance.adapters:reference_backend"
    assert main(["--adapter", spec, "--backend", "reference"]) == 2
    assert "--adapter and --backend are exclusive" in capsys.readouterr().err


def test_a_loaded_backend_is_named_by_its_string() -> None:
    name, factory = load_backend("hybridkv.conformance.adapters:reference_stand_in")
    assert name == "hybridkv.conformance.adapters:reference_stand_in"
    assert callable(factory)


# --- The replay reports, never raises ------------------------------------------------------


TRACE = "gen_s101_0000"


class _RaisesAt:
    """A factory whose adapters raise ``error`` from the ``at``-th call of ``method``."""

    def __init__(self, method: str, at: int, error: Exception) -> None:
        self.method, self.at, self.error = method, at, error

    def __call__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ManagerAdapter:
        adapter = manager_backend("reference", KVCacheManager)[1](
            config, max_model_len, enable_caching, events, engine
        )
        original = getattr(adapter, self.method)
        calls = 0

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == self.at:
                raise self.error
            return original(*args, **kwargs)

        setattr(adapter, self.method, wrapped)
        return adapter


def _op_index_of_nth(kind: str, n: int) -> int:
    ops = load_trace(TRACE)["scenario"]["ops"]
    return [i for i, op in enumerate(ops) if op["op"] == kind][n - 1]


def test_an_exception_in_an_operation_fails_the_trace_with_its_index() -> None:
    factory = _RaisesAt("lookup", 2, KeyError("lost"))
    result = check_trace(TRACE, factory)
    index = _op_index_of_nth("lookup", 2)
    assert (result.status, result.matched) == ("fail", index)
    assert result.detail.startswith(f'{TRACE}: op {index} {{"op": "lookup"')
    assert result.detail.endswith("raised KeyError: 'lost'")


def test_an_invariant_error_fails_the_trace_at_the_operation_before_it() -> None:
    factory = _RaisesAt("check_invariants", 3, AssertionError("ref count below 0"))
    result = check_trace(TRACE, factory)
    assert (result.status, result.matched) == ("fail", 2)
    assert result.detail.startswith(f"{TRACE}: op 2 ")
    assert result.detail.endswith("raised AssertionError: ref count below 0")


def test_a_factory_that_raises_fails_while_building_the_adapter() -> None:
    def factory(*args: Any) -> ManagerAdapter:
        raise RuntimeError("no GPU")

    result = check_trace(TRACE, factory)
    assert (result.status, result.matched, result.detail) == (
        "fail",
        0,
        f"{TRACE}: building the adapter raised RuntimeError: no GPU",
    )


def test_a_refusal_by_name_skips_the_trace() -> None:
    factory = _RaisesAt("allocate", 1, ValueError("mine does not implement lookahead slots"))
    result = check_trace(TRACE, factory)
    assert result.status == "skipped"
    assert result.detail == "ValueError: mine does not implement lookahead slots"


def test_a_plain_value_error_is_a_failure_not_a_skip() -> None:
    factory = _RaisesAt("allocate", 1, ValueError("num_new_tokens must be positive"))
    assert check_trace(TRACE, factory).status == "fail"


def test_an_adapter_without_a_snapshot_is_compared_on_everything_else() -> None:
    def factory(
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        events: bool,
        engine: EngineOptions,
    ) -> ManagerAdapter:
        adapter = manager_backend("reference", KVCacheManager)[1](
            config, max_model_len, enable_caching, events, engine
        )
        adapter.snapshot = lambda: None  # type: ignore[method-assign]
        return adapter

    states = sum(op["op"] == "state" for op in load_trace(TRACE)["scenario"]["ops"])
    result = check_trace(TRACE, factory)
    assert (result.status, result.states_not_shown) == ("pass", states)
    assert states > 0


def test_a_trace_sample_spreads_over_both_sets() -> None:
    from hybridkv.conformance.golden import trace_names
    from hybridkv.conformance.sections import sample_traces

    names = trace_names()
    assert sample_traces(names, 4) == [names[0], names[84], names[169], names[254]]
    assert [n[:4] for n in sample_traces(names, 4)] == ["eng_", "eng_", "gen_", "gen_"]
    assert sample_traces(names, 1000) == names
    assert sample_traces(names, None) == names


def test_the_command_refuses_a_sample_of_no_traces(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.conformance.__main__ import main

    assert main(["--traces", "0"]) == 2
    assert capsys.readouterr().err == "error: --traces must be at least 1, got 0\n"


def test_a_section_that_raises_is_reported_as_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hybridkv.conformance import golden
    from hybridkv.conformance.__main__ import main

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("vectors unreadable")

    monkeypatch.setattr(golden, "check_trace", broken)
    argv = ["--backend", "reference", "--traces", "1", "--examples", "2", "--hit-states", "4"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "  FAIL  golden traces: raised OSError: vectors unreadable\n" in out
    summary = [line.strip() for line in out.split("== summary", 1)[1].strip().splitlines()]
    assert summary[:3] == ["FAIL  golden traces", "PASS  differential machine", "PASS  oracles"]
