"""``plan`` prints vLLM 0.33's own "KV cache size" log line and says which SSM dtype ``auto``
chose. The line's figures are checked against vLLM itself in ``test_planner_against_vllm``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from click.testing import CliRunner

from hybridkv.__main__ import main


def plan_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, ["plan", *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    plan: dict[str, Any] = json.loads(result.output)
    return plan


def plan_text(*args: str) -> str:
    result = CliRunner().invoke(main, ["plan", *args], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.split())


def test_kv_cache_size_is_int_of_concurrency_times_max_model_len() -> None:
    plan = plan_json()
    assert (plan["num_blocks"], plan["blocks_per_request"]) == (32768, 14726)
    assert plan["kv_cache_size_tokens"] == int(32768 / 14726 * 131072) == 291_658


def test_plan_prints_the_line_vllm_logs() -> None:
    expected = (
        "GPU KV cache size: 291,658 tokens, Maximum concurrency for 131,072 tokens per "
        "request: 2.23x"
    )
    assert plan_json()["vllm_log_line"] == expected
    assert f"vLLM logs {expected}" in plan_text()


@pytest.mark.parametrize(
    ("model", "args", "shown", "dtype"),
    [
        ("Nemotron-H-8B-Base-8K", (), "SSM state float32 (auto) ·", "float32"),
        ("Jamba-v0.1", (), "SSM state bfloat16 (auto) ·", "bfloat16"),
        ("Jamba-v0.1", ("--mamba-ssm-dtype", "fp32"), "SSM state float32 · block", "float32"),
    ],
)
def test_plan_says_which_ssm_dtype_it_planned(
    model: str, args: tuple[str, ...], shown: str, dtype: str
) -> None:
    assert shown in plan_text(model, *args)
    assert plan_json(model, *args)["ssm_dtype"] == dtype


def test_a_model_without_recurrent_layers_has_no_ssm_dtype() -> None:
    assert plan_json()["ssm_dtype"] is None
    assert "SSM state" not in plan_text()
