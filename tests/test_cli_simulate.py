"""``hybridkv simulate`` through the real entry point: seeded numbers, traces, plots, errors."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hybridkv.__main__ import main


def write_trace(path: Path, *lines: dict[str, Any]) -> Path:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def run(*args: str) -> Result:
    return CliRunner().invoke(main, ["simulate", *args])


def simulate_json(*args: str) -> dict[str, Any]:
    result = run(*args, "--format", "json")
    assert result.exit_code == 0, result.output
    numbers: dict[str, Any] = json.loads(result.output)
    return numbers


def deterministic(numbers: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in numbers.items() if not k.startswith("manager_")}


def test_the_same_seed_gives_the_same_numbers_twice() -> None:
    args = ("--requests", "16", "--memory", "2GiB", "--seed", "3")
    first = simulate_json(*args)
    assert deterministic(first) == deterministic(simulate_json(*args))
    assert first["finished"] + first["rejected"] == 16
    assert first["hit_tokens"] > 0
    assert first["computed_tokens"] + first["hit_tokens"] >= first["prompt_tokens"]
    assert deterministic(first) != deterministic(simulate_json("--requests", "16", "--seed", "4"))


def test_simulate_json_keys_are_stable() -> None:
    assert list(simulate_json("--requests", "4", "--workload", "chat")) == [
        "model", "workload", "backend", "seed", "num_blocks", "block_size", "prefix_caching",
        "skipped_too_long", "requests", "finished", "rejected", "steps", "preemptions",
        "prompt_tokens", "hit_tokens", "hit_rate", "computed_tokens", "saved_tokens",
        "peak_usage", "mean_usage",
        "manager_seconds", "manager_ms_per_step",
    ]  # fmt: skip


def test_less_memory_preempts() -> None:
    numbers = simulate_json("--requests", "24", "--memory", "2GiB", "--workload", "rag")
    assert numbers["preemptions"] > 0
    assert numbers["peak_usage"] > 0.9


def test_mamba_hybrids_cache_prefixes_in_align_mode() -> None:
    """Prefix caching, Case 3: with caching on (the default) a Jamba-like model's Mamba groups
    cache their states in ``"align"`` mode, and chat turns hit: 4,800 of 6,008 prompt tokens."""
    numbers = simulate_json("Jamba-v0.1", "--requests", "6", "--workload", "chat")
    assert numbers["prefix_caching"] is True
    assert numbers["block_size"] == 80
    assert numbers["hit_tokens"] == 4800
    assert numbers["prompt_tokens"] == 6008
    assert numbers["finished"] == 6


def test_mamba_hybrids_run_without_prefix_caching() -> None:
    numbers = simulate_json(
        "Jamba-v0.1", "--requests", "6", "--workload", "chat", "--no-prefix-caching"
    )
    assert numbers["prefix_caching"] is False
    assert numbers["hit_tokens"] == 0
    assert numbers["finished"] == 6


def test_simulate_a_trace(tmp_path: Path) -> None:
    lines = [
        {"prompt_len": 300, "prefix_id": "doc", "prefix_len": 256, "output_len": 8,
         "arrival_step": 2 * i}
        for i in range(6)
    ]  # fmt: skip
    numbers = simulate_json("--trace", str(write_trace(tmp_path / "t.jsonl", *lines)))
    assert numbers["workload"].startswith("trace")
    assert numbers["finished"] == 6
    assert numbers["hit_tokens"] == 5 * 256


def test_simulate_table_output() -> None:
    result = run("--requests", "4", "--workload", "agent")
    assert result.exit_code == 0, result.output
    for label in ("prefix hits", "tokens", "KV usage", "preemptions", "steps", "manager time"):
        assert label in result.output


def test_workload_and_trace_together_is_an_error(tmp_path: Path) -> None:
    result = run("--workload", "chat", "--trace", str(tmp_path / "t.jsonl"))
    assert result.exit_code == 2
    assert "not both" in result.output


def test_bad_trace_is_a_user_error(tmp_path: Path) -> None:
    result = run("--trace", str(write_trace(tmp_path / "t.jsonl", {"prompt_len": 4})))
    assert result.exit_code == 2
    assert "trace line 1: 'output_len'" in result.output


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    result = run("--requests", "4", "--workload", "chat", "--plot", str(path))
    assert result.exit_code == 0, result.output
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _optimized_backend_ready() -> bool:
    """torch installed and ``hybridkv.optimized`` has its manager (it may not have landed)."""
    if importlib.util.find_spec("torch") is None:
        return False
    import hybridkv.optimized

    return hasattr(hybridkv.optimized, "TorchKVCacheManager")


@pytest.mark.skipif(_optimized_backend_ready(), reason="the optimized backend can run")
def test_optimized_backend_that_cannot_run_is_a_clear_error() -> None:
    result = run("--requests", "2", "--backend", "optimized")
    assert result.exit_code == 2
    assert "--backend optimized" in result.output


@pytest.mark.skipif(not _optimized_backend_ready(), reason="needs torch and hybridkv.optimized")
def test_optimized_backend_gives_the_reference_numbers() -> None:
    args = ("--requests", "12", "--memory", "2GiB", "--workload", "mixed")
    optimized = simulate_json(*args, "--backend", "optimized")
    assert deterministic(optimized) == {
        **deterministic(simulate_json(*args)),
        "backend": "optimized",
    }


def test_requests_beside_a_trace_is_an_error_naming_both(tmp_path: Path) -> None:
    path = write_trace(tmp_path / "t.jsonl", {"prompt_len": 8, "output_len": 1})
    result = run("--trace", str(path), "--requests", "5")
    assert result.exit_code == 2
    assert (
        f"Error: give --requests or --trace, not both: the trace {path} has its own requests"
    ) in " ".join(result.output.split())


def test_a_trace_line_too_long_is_skipped_counted_and_reported(tmp_path: Path) -> None:
    lines = [{"prompt_len": 64, "output_len": 4}] * 3 + [{"prompt_len": 20000, "output_len": 4}]
    path = str(write_trace(tmp_path / "t.jsonl", *lines))
    numbers = simulate_json("--trace", path)
    assert (numbers["finished"], numbers["skipped_too_long"]) == (3, 1)
    result = CliRunner().invoke(main, ["simulate", "--trace", path], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "skipped 1 trace lines longer than max_model_len 16,384 (lines 4)" in " ".join(
        result.output.split()
    )


def test_a_run_in_which_nothing_fits_exits_1_with_the_reason() -> None:
    result = run("--memory", "10MiB")
    assert result.exit_code == 1
    assert "0 finished, 48 rejected" in result.output
    assert result.output.strip().splitlines()[-1] == (
        "Error: no request fits: all 48 need more than the pool of 8 blocks (10,485,760 bytes) "
        "holds; add --memory or lower --max-model-len"
    )
