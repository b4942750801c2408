"""The extra-key golden traces replay identically on both backends.

``tests/fixtures/extra_keys`` holds four traces recorded from vLLM 0.33's own ``KVCacheManager``
by ``scripts/record_extra_key_traces.py`` (full attention with a sliding window, the same with
lookahead hashes, with chunked local attention, and with Mamba in ``"align"`` mode): requests with
two LoRA adapters (and one name re-pointed at another path), images across block boundaries and
at other offsets, prompt embeddings (equal, sharing a prefix, different) and cache salts, beside
plain requests with the same tokens. Each replay compares every observation: hits and their
block ids, new blocks, tables, the free queue and cached blocks, the requests' block hashes after
every ``add`` and ``append``, and every KV event field by field (``extra_keys`` untagged,
``lora_id``, ``lora_name``, …).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from hybridkv.conformance.adapters import manager_backend
from hybridkv.conformance.golden_keyed import load_keyed_trace, replay_keyed_trace

if TYPE_CHECKING:
    from conftest import ManagerFactory

FIXTURES = Path(__file__).parent / "fixtures" / "extra_keys"
TRACES = sorted(FIXTURES.glob("*.json.gz"))
RECORDER = Path(__file__).parent.parent / "scripts" / "record_extra_key_traces.py"


def test_the_traces_are_small_and_exercise_every_key() -> None:
    assert [path.name.removesuffix(".json.gz") for path in TRACES] == [
        "keys_full_chunked",
        "keys_full_mamba",
        "keys_full_swa",
        "keys_full_swa_lookahead",
    ]
    assert sum(path.stat().st_size for path in TRACES) < 200_000
    for path in TRACES:
        trace = load_keyed_trace(path)
        ops, observations = trace["scenario"]["ops"], trace["observations"]
        adds = Counter(key for op in ops if op["op"] == "add" for key in op if key not in {"op"})
        counts = [adds[k] for k in ("lora", "mm_features", "prompt_embeds", "cache_salt")]
        assert counts == [6, 6, 3, 5], path.name
        stored = [
            event
            for seen in observations
            for event in seen.get("events", ())
            if event["type"] == "BlockStored"
        ]
        blocks = [block for event in stored for block in event["extra_keys"] or ()]
        keys = [key for block in blocks for key in block or ()]
        assert any(event["lora_name"] == "adapter-a" and event["lora_id"] == 3 for event in stored)
        assert any(isinstance(key, list) and key[1] < 0 for key in keys), path.name  # an image
        assert any(isinstance(key, dict) for key in keys), path.name  # an embedding digest
        assert {"x", "adapter-b"} <= {key for key in keys if isinstance(key, str)}, path.name
        rids = {op["rid"]: op for op in ops if op["op"] == "add"}
        hit = {
            key
            for op, seen in zip(ops, observations, strict=True)
            if op["op"] == "lookup" and seen["hit_tokens"]
            for key in ("lora", "mm_features", "prompt_embeds", "cache_salt")
            if key in rids[op["rid"]]
        }
        assert hit == {"lora", "mm_features", "prompt_embeds", "cache_salt"}, path.name


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.removesuffix(".json.gz"))
def test_extra_key_trace_replays_identically(
    backend: str, make_manager: ManagerFactory, path: Path
) -> None:
    _, factory = manager_backend(backend, make_manager)
    matched, divergence = replay_keyed_trace(path, factory, check_invariants=True)
    assert divergence is None, str(divergence)
    assert matched == len(load_keyed_trace(path)["observations"])


@pytest.mark.slow(15)
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_recorder_gives_the_fixture_again_from_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixtures are what vLLM 0.33 records now: the recorder run again on one scenario
    gives its trace byte for byte (skipped without vLLM)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("record_extra_key_traces", RECORDER)
    assert spec is not None
    assert spec.loader is not None
    recorder: Any = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recorder)  # its dataclasses look it up
    spec.loader.exec_module(recorder)
    scenario, seed = next(s for s in recorder.SCENARIOS if s[0]["name"] == "keys_full_swa")
    recorded = recorder.run(scenario, seed)
    expected = load_keyed_trace(FIXTURES / "keys_full_swa.json.gz")
    assert recorded["observations"] == expected["observations"]
    assert recorded["scenario"] == expected["scenario"]
