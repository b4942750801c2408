"""With pipeline stages every figure of a plan is per GPU: each GPU holds its stage's layers.

Gemma-3-27b at 32K tokens, 40 GiB per GPU, ``--pp 2``: stage 0 holds decoder layers 0–30, so a
full-attention-only manager needs 31 layers × 2,048 blocks × 128 KiB = 7.75 GiB per request
on that GPU (not the whole model's 15.50 GiB), and 5 such requests fit, as 5 hybrid ones do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from hybridkv.__main__ import main

GEMMA_32K_PP2 = ("plan", "gemma-3-27b-it", "--max-model-len", "32768", "--pp", "2")


def _plan_json(*args: str) -> dict[str, Any]:
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    plan: dict[str, Any] = json.loads(result.output)
    return plan


def test_full_attention_only_per_request_is_the_fullest_stages_layers() -> None:
    full = _plan_json(*GEMMA_32K_PP2)["full_attention_only"]
    assert full["bytes_per_request"] == 31 * 2048 * 131072 == 8_321_499_136
    assert full["bytes_per_token"] == 31 * 8192
    assert full["max_num_requests"] == 5
    assert full["memory_saved_bytes"] == 5 * (8_321_499_136 - 7_637_565_440)


def test_full_attention_only_without_stages_is_the_whole_model() -> None:
    full = _plan_json("plan", "gemma-3-27b-it", "--max-model-len", "32768")["full_attention_only"]
    assert full["bytes_per_request"] == 62 * 2048 * 131072
    assert full["max_num_requests"] == 2


def test_tensors_carry_their_stage() -> None:
    tensors = _plan_json(*GEMMA_32K_PP2)["tensors"]
    assert [tensor["stage"] for tensor in tensors] == [0] * 5 + [1] * 5
    assert tensors[5]["shared_by"][0] == "layers.36"


def test_plan_table_says_per_gpu_with_pipeline_stages() -> None:
    result = CliRunner().invoke(main, list(GEMMA_32K_PP2), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert (
        "full attention only 7.75 GiB per request per GPU (hybrid: 7.11 GiB); 5 fit in this "
        "memory. For 5 requests the hybrid manager needs 3.18 GiB (8%) less"
    ) in text
    assert "tensors 5 per GPU × 8.00 GiB (10 over 2 stages: 5 + 5)" in text
    assert "one request 11,654 blocks = 7.11 GiB per GPU at 32,768 tokens" in text
    assert "Memory layout: 10 tensors over 2 pipeline stages (one GPU each) × 7 groups" in text
    assert "│ 1 │ 5 │ L36 │" in text


def test_svg_has_a_band_per_stage_and_each_tensors_own_layers(tmp_path: Path) -> None:
    svg = tmp_path / "layout.svg"
    result = CliRunner().invoke(main, [*GEMMA_32K_PP2, "--svg", str(svg)])
    assert result.exit_code == 0, result.output
    text = svg.read_text()
    assert ">GPU 0</text>" in text
    assert ">GPU 1</text>" in text
    assert "10 tensors (5 + 5 on 2 GPUs, a pipeline stage each)" in text
    rows = [line for line in text.splitlines() if ">layers.36<" in line]
    assert len(rows) == 1
