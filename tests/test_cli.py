"""``hybridkv`` through its real entry point: plan, models, errors, forwarding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hybridkv.__main__ import main
from hybridkv.catalogue import AttentionFacts, MLAFacts, ModelFacts
from hybridkv.cli.forward import forward
from hybridkv.cli.options import ModelChoice, UserError
from hybridkv.cli.plan_data import PlanSettings, make_plan

CONFIGS = Path(__file__).parent / "fixtures" / "configs"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


DOCUMENT = ("--policy", "document", "--no-async-scheduling", "--no-prefix-caching")
"""The design document's plan with one step in flight: the numbers before the engine settings."""


def plan_json(*args: str) -> dict[str, Any]:
    result = run("plan", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    plan: dict[str, Any] = json.loads(result.output)
    return plan


# --- plan: exact numbers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "groups", "padding", "per_group", "block_size", "num_blocks", "blocks", "requests"),
    [
        # 52 sliding + 10 full → groups of 10, the last sliding group 2 layers + 8 padding slots
        ("gemma-3-27b-it", 7, [0, 0, 0, 0, 0, 0, 8], 10, 16, 32768, 11654, 2),
        ("gemma-3-1b-it", 7, [0, 0, 0, 0, 0, 0, 2], 4, 16, 655360, 5318, 123),
        ("gpt-oss-120b", 2, [0, 0], 18, 16, 72817, 8713, 8),
        ("Llama-4-Maverick-17B-128E", 4, [0, 0, 0, 0], 12, 16, 54613, 68608, 0),
        ("gemma-3n-E4B-it", 5, [0] * 5, 4, 16, 327680, 4228, 77),
        # Case 4: block size raised so a 80 × 4 KiB page holds the 304 KiB Mamba state
        ("Jamba-v0.1", 8, [0] * 8, 4, 80, 32768, 3284, 9),
        ("Bamba-9B", 11, [0] * 10 + [1], 3, 528, 6619, 507, 13),
        ("Llama-3.1-8B", 1, [0], 32, 16, 20480, 8192, 2),
    ],
)
def test_plan_of_catalogue_models(
    model: str,
    groups: int,
    padding: list[int],
    per_group: int,
    block_size: int,
    num_blocks: int,
    blocks: int,
    requests: int,
) -> None:
    plan = plan_json(model, *DOCUMENT)
    assert len(plan["groups"]) == groups
    assert [group["num_padding_slots"] for group in plan["groups"]] == padding
    assert plan["num_padding_slots"] == sum(padding)
    assert plan["layers_per_group"] == per_group == len(plan["tensors"])
    assert plan["block_size"] == block_size
    assert plan["num_blocks"] == num_blocks
    assert plan["blocks_per_request"] == blocks
    assert plan["max_num_requests"] == requests


def test_default_plan_is_gemma_3_27b_in_40_gib_at_128k_as_vllm_runs_it() -> None:
    plan = plan_json()
    assert plan["model"] == "google/gemma-3-27b-it"
    settings = plan["settings"]
    assert settings["memory_bytes"] == 40 * 2**30
    assert settings["max_model_len"] == 131072
    assert (
        settings["policy"],
        settings["async_scheduling"],
        settings["enable_prefix_caching"],
    ) == (
        "vllm",
        True,
        True,
    )
    # vLLM: groups in order of first layer (layer 0 slides), 52 sliding layers strided over 6
    assert [g["kind"] for g in plan["groups"]] == ["sliding_window"] * 6 + ["full"]
    first = (0, 7, 14, 21, 28, 36, 43, 50, 57)
    assert plan["groups"][0]["layer_names"] == [f"layers.{i}" for i in first]
    assert [g["num_padding_slots"] for g in plan["groups"]] == [1, 1, 1, 1, 2, 2, 0]
    assert plan["tensors"][0]["shared_by"] == [
        "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.6", "layers.5"
    ]  # fmt: skip
    assert plan["tensors"][0]["size_bytes"] == 32768 * 16 * 8192
    assert plan["padding_fraction"] == pytest.approx(8 / 70)
    # async: 2 × 8,192 tokens in flight; sliding cdiv(1,023 + 16,384, 16) + 1 = 1,089 blocks
    assert plan["max_in_flight_tokens"] == 16384
    assert [g["max_blocks_per_request"] for g in plan["groups"]] == [1089] * 6 + [8192]
    assert plan["blocks_per_request"] == 6 * 1089 + 8192
    assert plan["max_concurrency"] == pytest.approx(32768 / 14726)
    assert plan["max_tokens"] == 2 * 131072
    full_only = plan["full_attention_only"]
    assert full_only["bytes_per_request"] == 62 * 8192 * 131072
    assert full_only["max_num_requests"] == 0


def test_plan_compares_the_three_policies_and_marks_the_best() -> None:
    policies = plan_json()["policies"]
    assert {
        p: (v["num_groups"], v["num_padding_slots"], v["num_blocks"]) for p, v in policies.items()
    } == {
        "document": (7, 8, 32768),
        "vllm": (7, 8, 32768),
        "min-padding": (31, 0, 163840),
    }
    assert plan_json()["best_policy"] == "min-padding"
    result = run("plan")
    assert "min-padding ★" in result.output


def test_sync_scheduling_holds_fewer_sliding_blocks() -> None:
    """gemma-3-1b at its 32K context: async doubles the sliding groups' in-flight tokens."""
    sync = plan_json("gemma-3-1b-it", "--no-async-scheduling")
    default = plan_json("gemma-3-1b-it")
    assert sync["groups"][0]["max_blocks_per_request"] == -(-(511 + 8192) // 16) + 1 == 545
    assert default["groups"][0]["max_blocks_per_request"] == -(-(511 + 16384) // 16) + 1 == 1057
    assert (sync["max_num_requests"], default["max_num_requests"]) == (123, 78)


def test_prefix_caching_holds_two_mamba_state_blocks() -> None:
    on = plan_json("Jamba-v0.1")
    off = plan_json("Jamba-v0.1", "--no-prefix-caching")
    mamba = [i for i, g in enumerate(on["groups"]) if g["kind"] == "mamba"]
    assert {on["groups"][i]["max_blocks_per_request"] for i in mamba} == {2}
    assert {off["groups"][i]["max_blocks_per_request"] for i in mamba} == {1}
    assert on["blocks_per_request"] - off["blocks_per_request"] == len(mamba)


def test_pipeline_stages_halve_each_gpus_tensors_under_vllm_grouping() -> None:
    one, two = plan_json(), plan_json("--pp", "2")
    assert (one["num_blocks"], two["num_blocks"]) == (32768, 65536)
    assert two["policies"]["document"]["num_blocks"] == 32768
    assert two["layers_per_group"] == 5
    assert two["settings"]["pipeline_parallel_size"] == 2


def test_a_length_that_does_not_fit_prints_the_longest_that_does() -> None:
    plan = plan_json("Llama-4-Maverick-17B-128E")
    assert plan["max_num_requests"] == 0
    assert 0 < plan["max_fitting_model_len"] < plan["settings"]["max_model_len"]
    result = run("plan", "Llama-4-Maverick-17B-128E")
    longest = plan["max_fitting_model_len"]
    text = " ".join(result.output.split())
    assert f"the longest max_model_len that fits one request is {longest:,}" in text


def test_plan_json_keys_are_stable() -> None:
    assert list(plan_json()) == [
        "model", "source", "status", "settings", "layer_types", "num_layers", "kv_sharing",
        "policy", "groups", "layers_per_group", "block_size", "layer_page_size_bytes",
        "page_size_bytes", "num_blocks", "num_padding_slots", "padding_fraction", "tensors",
        "memory_bytes", "max_in_flight_tokens", "blocks_per_request", "bytes_per_request",
        "max_num_requests", "max_concurrency", "kv_cache_size_tokens", "vllm_log_line",
        "ssm_dtype", "max_fitting_model_len", "max_tokens",
        "full_attention_only", "policies", "best_policy", "notes",
    ]  # fmt: skip


def test_gemma_3n_readers_are_listed_in_their_targets_group() -> None:
    plan = plan_json("gemma-3n-E4B-it", *DOCUMENT)
    assert plan["groups"][0]["layer_names"] == [
        "layers.4", "layers.9", "layers.14", "layers.19", "layers.24", "layers.29", "layers.34"
    ]  # fmt: skip
    assert plan["groups"][0]["num_kv_sharing_layers"] == 3


@pytest.mark.parametrize(
    ("memory", "size"),
    [("40GiB", 40 * 2**30), ("40 GB", 40 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
     ("2147483648", 2**31)],
)  # fmt: skip
def test_memory_sizes(memory: str, size: int) -> None:
    assert plan_json("--memory", memory)["settings"]["memory_bytes"] == size


def test_kv_dtype_sets_the_bytes_per_element() -> None:
    fp8 = plan_json("--kv-dtype", "fp8", "--memory", "10GiB")
    assert fp8["layer_page_size_bytes"] == 16 * 16 * 128 * 2 * 1
    assert fp8["groups"][0]["spec"]["dtype_bytes"] == 1
    fp32 = plan_json("--kv-dtype", "fp32", "--memory", "10GiB")
    assert fp32["layer_page_size_bytes"] == 16 * 16 * 128 * 2 * 4


def test_plan_options_reach_the_report() -> None:
    plan = plan_json("gpt-oss-20b", "--max-model-len", "4096", "--max-num-batched-tokens", "512",
                     "--block-size", "32", "--policy", "document",
                     "--no-async-scheduling")  # fmt: skip
    assert plan["block_size"] == 32
    # full: 4096 / 32 = 128 blocks; sliding 128: cdiv(127 + 512, 32) + 1 = 21
    assert [group["max_blocks_per_request"] for group in plan["groups"]] == [128, 21]


def test_plan_of_a_config_file() -> None:
    plan = plan_json(str(CONFIGS / "jamba.json"), "--memory", "8GiB")
    assert plan["source"].startswith("config file")
    assert len(plan["groups"]) == 8
    assert plan["block_size"] == 80


def test_plan_table_shows_groups_padding_layout_and_saving() -> None:
    result = run("plan", *DOCUMENT)
    assert result.exit_code == 0, result.output
    for text in (
        "52 sliding_attention, 10 full_attention",
        "KV cache groups: 7 × 10 layer slots",
        "8 slots = 11.4% of the pool",
        "32,768 (the null block included)",
        "2 requests at once = 262,144 tokens",
        "Memory layout: 10 tensors × 7 groups",
        "pad",
        "full attention only",
    ):
        assert text in result.output


def test_svg_layout_is_a_real_svg(tmp_path: Path) -> None:
    path = tmp_path / "layout.svg"
    result = run("plan", "--svg", str(path))
    assert result.exit_code == 0, result.output
    root = ET.parse(path).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    texts = [element.text for element in root.iter("{http://www.w3.org/2000/svg}text")]
    assert texts.count("padding") == 8 + 1  # the padding slots and the legend
    assert "layers.61" in texts
    assert texts.count("sliding window") == 6 + 1  # group 1–6 headers and the legend


def test_models_lists_the_catalogue() -> None:
    result = run("models", "--format", "json")
    assert result.exit_code == 0
    assert len(json.loads(result.output)) == 25
    assert "google/gemma-3-27b-it" in run("models").output


# --- errors -----------------------------------------------------------------------------------


def assert_user_error(result: Result, message: str) -> None:
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)  # no traceback
    assert message in result.output


def test_unknown_model_lists_close_names() -> None:
    assert_user_error(run("plan", "gemma-3-72b-it"), "did you mean: google/gemma-3-27b-it")


def test_malformed_config_names_the_field(tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "gemma3.json").read_text())
    config["text_config"]["num_key_value_heads"] = "sixteen"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert_user_error(run("plan", str(path)), "field 'text_config.num_key_value_heads'")


def test_config_that_is_not_json(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{")
    assert_user_error(run("plan", str(path)), "is not valid JSON")


def test_layers_the_planner_cannot_unify_are_reported_not_raised() -> None:
    """An MLA latent (1,152 B/token) next to sliding-window layers (4 KiB/token): no page size."""
    facts = ModelFacts(
        "mixed-kv",
        ("full_attention_mla", "sliding_attention"),
        attention=AttentionFacts(num_kv_heads=8, head_dim=128, sliding_window=4096),
        mla=MLAFacts(kv_lora_rank=512, qk_rope_head_dim=64),
    )
    choice = ModelChoice("mixed-kv", "test", "test", (), facts)
    settings = PlanSettings(2**30, 4096, 512, 16, "bf16", "auto")
    with pytest.raises(UserError, match="cannot plan mixed-kv: kv_hidden_size must be the same"):
        make_plan(choice, settings)


def test_memory_too_small_for_one_block() -> None:
    assert_user_error(run("plan", "--memory", "1MiB"), "too small for one block")


def test_bad_memory_size() -> None:
    assert_user_error(run("plan", "--memory", "40 XB"), "is not a memory size")


# --- forwarding -------------------------------------------------------------------------------


def test_forward_runs_the_module_as_main_with_the_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "fake_suite.py").write_text(
        "import sys\nif __name__ == '__main__':\n    print('ran', sys.argv[1:])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    forward("fake_suite", ("--quick", "x"))
    assert capsys.readouterr().out == "ran ['--quick', 'x']\n"


def test_forward_to_a_missing_module_is_a_user_error() -> None:
    with pytest.raises(UserError, match="does not exist in this version"):
        forward("hybridkv.not_a_module", ())


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("conformance", "usage: python -m hybridkv.conformance"),
        ("bench", "usage: python -m hybridkv.bench"),
        ("vllm-check", "usage: python -m hybridkv.integrations.vllm.check"),
    ],
)
def test_conformance_and_bench_forward_to_their_modules(command: str, usage: str) -> None:
    script = Path(sys.executable).with_name("hybridkv")
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hybridkv"]
    done = subprocess.run([*argv, command, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(usage)


# --- the installed command --------------------------------------------------------------------


def test_console_script_plans_the_default_model() -> None:
    script = Path(sys.executable).with_name("hybridkv")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "hybridkv"]
    env = {**os.environ, "COLUMNS": "120"}
    done = subprocess.run([*command, "plan"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "KV cache groups: 7 × 10 layer slots" in done.stdout


def test_plan_imports_no_torch() -> None:
    code = (
        "import sys\nfrom hybridkv.__main__ import main\n"
        "main(['plan', '--format', 'json'], standalone_mode=False)\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("False")
