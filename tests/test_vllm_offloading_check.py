"""``hybridkv vllm-check --connector offloading``: vLLM 0.33's ``OffloadingConnector`` (CPU tier)
in vLLM's scheduler over vLLM's manager and over each backend, with a worker stand-in that
copies and checks every transferred block (skipped when vLLM is not installed)."""

from __future__ import annotations

import functools
import os
import random
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

from hybridkv.integrations.vllm.check import VOCAB, Arrival, RunConfig, RunResult, Workload, main
from hybridkv.integrations.vllm.connector_check import compare
from hybridkv.integrations.vllm.cores import Backend
from hybridkv.integrations.vllm.offload_drive import (
    NUM_BLOCKS,
    OffloadRun,
    drive,
    drive_with_worker,
)
from hybridkv.integrations.vllm.offload_worker import OffloadWorker

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _evicted(records: list[dict[str, Any]], key: str) -> int:
    return sum(len(e[1]["block_hashes"]) for r in records for e in r[key] if e[0] == "BlockRemoved")


@pytest.mark.slow(seconds=6)
@pytest.mark.parametrize("run", ["sync", "async"])
@pytest.mark.parametrize("layout", ["gemma3", "llama4", "jamba"])
def test_every_step_equals_vllms_with_the_offloading_connector(layout: str, run: str) -> None:
    """16 requests over a small GPU pool and a CPU tier that evicts: on both backends every
    step's record equals vLLM's, and the run loaded blocks back from the CPU tier."""
    cfg = RunConfig(layout=layout, run=run, num_requests=16, num_blocks=NUM_BLOCKS[layout])
    offload = OffloadRun(cfg)
    expected = drive(offload, "vllm")
    assert expected.error is None
    for backend in ("reference", "optimized"):
        comparison = compare(offload.name, expected, drive(offload, backend))
        assert comparison.divergence is None
        assert comparison.equal_steps == comparison.steps > 100
    records = expected.records
    assert sum(len(r["loads"]) for r in records) > 0
    assert sum(o[3][2] for r in records for o in r["outputs"] if o[3]) > 0  # connector hits
    assert _evicted(records, "cpu_events") > 0  # the CPU tier evicted too
    assert sum(1 for r in records if r["reset"]) == 1  # the GPU prefix cache was reset


# --- A prefix evicted from the GPU pool comes back from the CPU tier -------------------------

_RNG = random.Random(7)
DOCUMENT = [_RNG.randrange(VOCAB) for _ in range(160)]  # ten blocks
ROUND_TRIP = Workload(
    [
        Arrival(0, "a", DOCUMENT + [_RNG.randrange(VOCAB) for _ in range(8)], 2, 0, None),
        *(
            Arrival(10 + 10 * i, f"d{i}", [_RNG.randrange(VOCAB) for _ in range(240)], 2, 0, None)
            for i in range(3)  # 3 x 240 tokens: more than the GPU pool holds
        ),
        Arrival(60, "b", DOCUMENT + [_RNG.randrange(VOCAB) for _ in range(8)], 2, 0, None),
    ]
)
# Per layout, b's load job: each group's first block index and block count (a sliding window
# of 64 tokens reads the last 4 of the 10 blocks, a Mamba group the last state).
EXPECTED_LOAD = {
    "gemma3": [(0, 10), (6, 4), (6, 4)],
    "jamba": [(0, 10), (9, 1)],
}


@functools.cache
def _round_trip(layout: str, manager: str) -> tuple[RunResult, OffloadWorker | None]:
    cfg = RunConfig(layout=layout, num_blocks=NUM_BLOCKS[layout])
    return drive_with_worker(OffloadRun(cfg), manager, ROUND_TRIP)


@pytest.mark.slow(seconds=3)
@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("layout", ["gemma3", "jamba"])
def test_an_evicted_prefix_comes_back_from_the_cpu_tier_intact(layout: str, backend: str) -> None:
    result, worker = _round_trip(layout, backend)
    assert result.error is None
    assert worker is not None
    assert compare(layout, _round_trip(layout, "vllm")[0], result).ok
    records = result.records
    # a computed the document; the distractors pushed it out of the GPU pool, not the CPU tier.
    prefills = {o[0]: o[3] for r in records for o in r["outputs"] if o[3] is not None}
    assert prefills["a"] == (0, 0, 0, 160)  # (cached, local, external, cache-creation) tokens
    assert prefills["b"] == (160, 0, 160, 0)  # all ten blocks from the connector, none local
    assert _evicted(records, "events") > 0
    assert _evicted(records, "cpu_events") == 0
    loads = [(r["step"], job) for r in records for job in r["loads"]]
    assert len(loads) == 1
    step, (_, request_id, sync, groups) = loads[0]
    assert (step, request_id, sync) == (60, "b", False)
    assert [(first, len(ids)) for first, ids, _ in groups] == EXPECTED_LOAD[layout]
    assert all(len(chunks) == len(ids) for _, ids, chunks in groups)
    # The loaded blocks hold what computing b's tokens writes, which is what a computed.
    for group, (first, ids, _) in enumerate(groups):
        for k, block in enumerate(ids):
            held = worker.gpu[group][block]
            assert (held == worker.expected("b", group, first + k)).all()
            assert (held == worker.expected("a", group, first + k)).all()
            assert held.any()
    assert worker.counts.load_jobs == 1
    assert worker.counts.loaded_blocks == sum(n for _, n in EXPECTED_LOAD[layout])
    assert worker.counts.stored_blocks > worker.counts.loaded_blocks


# --- The command line ------------------------------------------------------------------------


def test_the_command_runs_the_connector_check(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--connector", "offloading", "--layout", "jamba", "--run", "sync", "--requests", "6"]
    assert main([*args, "--backend", "reference"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "steps" in line]
    assert len(lines) == 1
    assert lines[0].startswith("jamba/sync/engine/offloading  reference ")
    assert " steps equal (" in lines[0]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "gpt-oss-20b"], "takes --layout, not --model"),
        (["--run", "spec"], "runs sync and async only"),
        (["--cpu-chunks", "0"], "--cpu-chunks: at least 1"),
    ],
)
def test_the_command_refuses_what_it_does_not_take(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        main(["--connector", "offloading", *extra])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


# --- The admission the check found different --------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_a_full_sequence_check_counts_no_block_for_the_external_mamba_state(
    backend: Backend,
) -> None:
    """Jamba-like, four free blocks, a 40-token prompt with 32 tokens to load asynchronously:
    vLLM's full-sequence check counts 3 full-attention blocks and 1 Mamba block and admits; the
    load then takes 2 + 1. Both backends admit alike (they counted a second Mamba block)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from hybridkv.integrations.vllm import KVCacheManager
    from hybridkv.integrations.vllm.check import kv_cache_config_for

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
    }
    config = kv_cache_config_for("jamba", 5, retention=None)
    managers = [
        VllmManager(config, **settings),
        KVCacheManager(config, backend=backend, **settings),
    ]
    answers = []
    for manager in managers:
        prompt = list(range(1, 41))
        request = Request("r", prompt, SamplingParams(max_tokens=4), None, block_hasher=hasher)
        new = manager.allocate_slots(
            request,
            0,
            num_external_computed_tokens=32,
            delay_cache_blocks=True,
            full_sequence_must_fit=True,
        )
        assert new is not None
        answers.append((manager.get_block_ids("r"), manager.block_pool.get_num_free_blocks()))
    assert answers[0] == (([1, 2], [0, 3]), 1)
    assert answers[1] == answers[0]
