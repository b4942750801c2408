"""Cross-attention (encoder-decoder models): both backends, and both inside vLLM 0.33's API.

A Whisper-like layout: a self-attention group and a cross-attention group of 4-token blocks in
a pool of 15 usable blocks. The encoder tokens (``num_encoder_tokens``) size the cross table
once; the decoder tokens size the self-attention table; nothing is looked up or cached. The
vLLM tests (skipped without vLLM) run the same calls on vLLM's own ``KVCacheManager``.
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Any

import pytest

from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import (
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    SlidingWindowSpec,
    event_metadata,
)

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.cores import Backend
    from hybridkv.optimized import TorchKVCacheManager

    Manager = KVCacheManager | TorchKVCacheManager

SIZES: dict[str, int] = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
CROSS = CrossAttentionSpec(**SIZES)
CONFIG = KVCacheConfig(
    16, (KVCacheGroup(("self",), FullAttentionSpec(**SIZES)), KVCacheGroup(("cross",), CROSS))
)
BACKENDS: list[Backend] = ["reference", "optimized"]


def _manager(backend: str, config: KVCacheConfig = CONFIG, **kwargs: Any) -> Manager:
    settings: dict[str, Any] = {"enable_caching": False, **kwargs}
    if backend == "reference":
        return KVCacheManager(config, 64, **settings)
    pytest.importorskip("torch")
    from hybridkv.optimized import TorchKVCacheManager

    return TorchKVCacheManager(config, 64, **{"max_num_reqs": 4, **settings})


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(num_tokens)), hash_block_size=4)


def _state(manager: Manager, *request_ids: str) -> list[Any]:
    return [manager.snapshot(), *(manager.get_block_ids(rid) for rid in request_ids)]


def test_a_cross_attention_spec_reserves_the_longest_encoder_input() -> None:
    whisper = CrossAttentionSpec(block_size=16, num_kv_heads=20, head_size=64, dtype_bytes=2)
    assert whisper.page_size_bytes == 16 * 2 * 20 * 64 * 2
    # vLLM's rule: cdiv(max_num_encoder_input_tokens, block_size) × page_size_bytes.
    assert whisper.max_memory_usage_bytes(1500) == 94 * 81920
    assert whisper.max_blocks_per_request(448, 1500, enable_prefix_caching=False) == 94
    assert whisper.skipped_tokens(1000) == 0
    assert whisper.admission_cap(448, 1500) is None
    assert whisper.null_positions == "none"
    assert event_metadata(whisper) == ("cross_attention", None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefix_caching_is_refused_with_a_cross_attention_group(backend: str) -> None:
    with pytest.raises(ValueError, match=r"^enable_caching must be False with a cross-attention"):
        _manager(backend, enable_caching=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_encoder_tokens_size_the_cross_attention_table_once(backend: str) -> None:
    m = _manager(backend)
    a = _request("a", 6)
    new = m.allocate_slots(a, 6, num_encoder_tokens=9)
    assert new is not None
    assert new.block_ids == ((1, 2), (3, 4, 5))  # self: 6 tokens; cross: 9 encoder tokens
    a.num_computed_tokens = 6
    steps = []
    for token in range(3):
        a.append_output_token_ids([100 + token])
        step = m.allocate_slots(a, 1)
        assert step is not None
        steps.append(step.block_ids)
        a.num_computed_tokens = a.num_tokens
    assert steps == [((), ()), ((), ()), ((6,), ())]  # decoding never grows the cross table
    b = m.allocate_slots(_request("b", 4), 4)
    assert b is not None
    assert b.block_ids == ((7,), ())  # no encoder input: no cross-attention block
    assert m.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])
    m.check_invariants()
    m.free(a)
    # Uncached blocks go to the head of the free queue, self-attention's first, then cross's.
    assert m.snapshot().free_block_ids == (5, 4, 3, 6, 2, 1, *range(8, 16))
    assert m.take_events() == []  # nothing is ever cached


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_running_request_given_more_encoder_tokens_grows_its_cross_table_in_group_order(
    backend: str,
) -> None:
    m = _manager(backend)
    a = _request("a", 4)
    assert m.allocate_slots(a, 4, num_encoder_tokens=4) is not None
    a.num_computed_tokens = 4
    a.append_output_token_ids([9])
    new = m.allocate_slots(a, 1, num_encoder_tokens=10)
    assert new is not None
    assert new.block_ids == ((3,), (4, 5))  # one take: self-attention first, then cross
    assert m.get_block_ids("a") == ([1, 3], [2, 4, 5])
    m.check_invariants()


@pytest.mark.parametrize("backend", BACKENDS)
def test_encoder_blocks_count_in_the_fit_and_a_failed_allocation_changes_nothing(
    backend: str,
) -> None:
    m = _manager(backend)
    a = _request("a", 8)
    assert m.allocate_slots(a, 8, num_encoder_tokens=16) is not None  # 2 + 4 blocks
    before = _state(m, "a", "c")
    c = _request("c", 4)
    assert m.get_num_blocks_to_allocate("c", 4, 0, 4, num_encoder_tokens=33) == 1 + 9
    assert m.allocate_slots(c, 4, num_encoder_tokens=33) is None  # 10 > 9 free
    assert m.allocate_slots(c, 4, num_encoder_tokens=36, full_sequence_must_fit=True) is None
    assert _state(m, "a", "c") == before
    new = m.allocate_slots(c, 4, num_encoder_tokens=32)
    assert new is not None
    assert new.block_ids == ((7,), (8, 9, 10, 11, 12, 13, 14, 15))
    assert m.num_free_blocks == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("value", [-1, 2.5, True, None])
def test_bad_encoder_token_counts_are_refused_by_name_and_change_nothing(
    backend: str, value: object
) -> None:
    m = _manager(backend)
    a = _request("a", 4)
    assert m.allocate_slots(a, 4, num_encoder_tokens=4) is not None
    a.num_computed_tokens = 4
    before = _state(m, "a", "b")
    message = f"^num_encoder_tokens must be a non-negative int, got {value!r}$"
    for request in (a, _request("b", 4)):
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            m.allocate_slots(request, 1, num_encoder_tokens=value)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        m.get_num_blocks_to_allocate("b", 4, 0, 4, num_encoder_tokens=value)  # type: ignore[arg-type]
    assert _state(m, "a", "b") == before


def test_the_optimized_backend_refuses_encoder_input_beyond_its_table_width() -> None:
    m = _manager("optimized", max_blocks_per_req=16)
    before = _state(m, "a")
    with pytest.raises(ValueError, match=r"^num_encoder_tokens must fit .* got 65: build"):
        m.allocate_slots(_request("a", 4), 4, num_encoder_tokens=65)
    assert _state(m, "a") == before
    assert m.allocate_slots(_request("a", 4), 4, num_encoder_tokens=64) is None  # 17 > 15 free


def test_batched_steps_and_frees_equal_the_references_single_calls() -> None:
    """``allocate_slots_batch`` and ``free_batch`` of 20 requests (a batch the optimized
    backend may vectorise) beside a sliding window: the reference's blocks, one call at a
    time."""
    window = SlidingWindowSpec(sliding_window=8, **SIZES)
    groups = (*CONFIG.groups[:1], KVCacheGroup(("sw",), window), *CONFIG.groups[1:])
    config = KVCacheConfig(400, groups)

    def run(m: Manager, batched: bool) -> list[Any]:
        requests = [_request(f"r{i}", 5 + i) for i in range(20)]
        seen: list[Any] = []
        for i, r in enumerate(requests):
            new = m.allocate_slots(r, r.num_tokens, num_encoder_tokens=3 * i)
            seen.append(None if new is None else new.block_ids)
            r.num_computed_tokens = r.num_tokens
        for _ in range(6):
            for r in requests:
                r.append_output_token_ids([7])
            if batched and not isinstance(m, KVCacheManager):
                steps = m.allocate_slots_batch(requests, 1)
            else:
                steps = [m.allocate_slots(r, 1) for r in requests]
            seen.append([None if new is None else new.block_ids for new in steps])
            for r in requests:
                r.num_computed_tokens = r.num_tokens
        m.check_invariants()
        if batched and not isinstance(m, KVCacheManager):
            m.free_batch(requests[:18])
        else:
            for r in requests[:18]:
                m.free(r)
        m.check_invariants()
        return [*seen, m.snapshot(), [m.get_block_ids(r.request_id) for r in requests]]

    expected = run(_manager("reference", config), False)
    assert expected[:2] == [((1, 2), (3, 4), ()), ((5, 6), (7, 8), (9,))]
    assert expected[19] == (tuple(range(284, 290)), tuple(range(290, 296)), tuple(range(296, 311)))
    assert run(_manager("optimized", config, max_num_reqs=32), True) == expected


# --- Inside vLLM 0.33's API ---------------------------------------------------------------------


def _import_vllm() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM 0.33 is not installed")


def _vllm_run(manager: Any) -> list[Any]:
    """The calls above on a manager of vLLM's API: block ids, counts, events, the views."""
    from vllm import SamplingParams
    from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager
    from vllm.v1.request import Request as VllmRequest

    def request(request_id: str, num_tokens: int) -> Any:
        return VllmRequest(request_id, list(range(num_tokens)), SamplingParams(max_tokens=8), None)

    def ids(blocks: Any) -> Any:
        return None if blocks is None else blocks.get_block_ids()

    seen: list[Any] = []
    a = request("a", 6)
    seen.append(ids(manager.allocate_slots(a, 6, num_encoder_tokens=9)))
    a.num_computed_tokens = 6
    for token in range(3):
        a.append_output_token_ids([100 + token])
        seen.append(ids(manager.allocate_slots(a, 1)))
        a.num_computed_tokens = a.num_tokens
    seen.append(ids(manager.allocate_slots(request("b", 4), 4)))
    c = request("c", 4)
    seen.append(manager.coordinator.get_num_blocks_to_allocate("c", 4, ((), ()), 40, 0, 0, 4))
    seen.append(ids(manager.allocate_slots(c, 4, num_encoder_tokens=40)))
    manager.free(a)
    seen.append(manager.block_pool.get_num_free_blocks())
    seen.append(ids(manager.allocate_slots(c, 4, num_encoder_tokens=30)))
    seen.append(manager.get_block_ids_for_computed_tokens("c", 2))
    seen.append(manager.take_events())
    groups = manager.coordinator.single_type_managers
    seen.append([isinstance(group, CrossAttentionManager) for group in groups])
    seen.append({rid: [b.block_id for b in t] for rid, t in groups[1].req_to_blocks.items()})
    return seen


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_block_ids_counts_and_views_equal_vllms_own_manager(backend: Backend) -> None:
    _import_vllm()
    if backend == "optimized":
        pytest.importorskip("torch")
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    from hybridkv.integrations.vllm import KVCacheManager as Integrated
    from hybridkv.integrations.vllm import to_vllm_config

    settings: dict[str, Any] = {"max_model_len": 64, "scheduler_block_size": 4}
    settings |= {"hash_block_size": 4, "enable_caching": False, "enable_kv_cache_events": True}
    expected = _vllm_run(VllmManager(to_vllm_config(CONFIG), **settings))
    assert expected == [
        ([1, 2], [3, 4, 5]),
        ([], []),
        ([], []),
        ([6], []),
        ([7], []),
        11,  # 1 self-attention block and 10 cross-attention blocks for 40 encoder tokens
        None,
        14,
        ([5], [4, 3, 6, 2, 1, 8, 9, 10]),
        ([5], [4, 3, 6, 2, 1, 8, 9, 10]),  # clipped to 2 computed tokens: not the cross table
        [],
        [False, True],
        {"b": [], "c": [4, 3, 6, 2, 1, 8, 9, 10]},
    ]
    assert _vllm_run(Integrated(to_vllm_config(CONFIG), backend=backend, **settings)) == expected


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_cross_attention_group_converts_to_vllms_spec_and_back() -> None:
    _import_vllm()
    from vllm.v1.kv_cache_interface import CrossAttentionSpec as VllmCross

    from hybridkv.integrations.vllm import from_vllm_config, to_vllm_config

    vllm_config = to_vllm_config(CONFIG)
    assert type(vllm_config.kv_cache_groups[1].kv_cache_spec) is VllmCross
    assert from_vllm_config(vllm_config) == CONFIG
