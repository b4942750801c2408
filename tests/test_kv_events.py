"""KV cache events in vLLM 0.33's schema, built by the core: every field has the value vLLM's own
manager gives it (medium, per-block extra keys, the group's spec kind and window, the request's
session, lookahead tokens), on both backends."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from hybridkv.conformance.adapters import (
    EngineOptions,
    ManagerAdapter,
    ProtocolAdapter,
    optimized_backend,
    reference_backend,
)
from hybridkv.reference import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVCacheManager,
    Request,
    hash_block_tokens,
)
from hybridkv.reference.block_hash import hash_full_blocks_lookahead
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    event_metadata,
)

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


def make(backend: str, config: KVCacheConfig, **kwargs: Any) -> Any:
    """A manager of ``backend`` (the optimized one skips without torch)."""
    if backend == "reference":
        return KVCacheManager(config, 64, enable_kv_cache_events=True, **kwargs)
    pytest.importorskip("torch")
    from hybridkv.optimized import TorchKVCacheManager

    return TorchKVCacheManager(config, 64, enable_kv_cache_events=True, **kwargs)


def one_group(spec: KVCacheSpec, num_blocks: int = 8) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (KVCacheGroup(("layer",), spec),))


def stored_events(events: Sequence[KVCacheEvent]) -> list[BlockStored]:
    return [event for event in events if isinstance(event, BlockStored)]


BACKENDS = ["reference", "optimized"]

VLLM_WARNINGS = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
"""vLLM's modules warn when imported (deprecations in torch and in vLLM itself)."""


def import_vllm() -> None:
    """Skip the test, saying why, where vLLM does not import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("vllm", reason="vLLM 0.33 is not installed: nothing to compare with")


# --- The spec metadata ------------------------------------------------------------------------

SPECS: list[KVCacheSpec] = [
    FullAttentionSpec(block_size=4, **SIZES),
    SlidingWindowSpec(block_size=4, sliding_window=6, **SIZES),
    ChunkedLocalAttentionSpec(block_size=4, attention_chunk_size=8, **SIZES),
    MambaSpec(block_size=4, state_bytes=16),
    MambaSpec(block_size=4, state_bytes=16, mamba_cache_mode="align"),
]


def test_event_metadata_names_each_kind_and_only_a_sliding_window_has_a_window() -> None:
    assert [event_metadata(spec) for spec in SPECS] == [
        ("full_attention", None),
        ("sliding_window", 6),
        ("chunked_local_attention", None),
        ("mamba", None),
        ("mamba", None),
    ]


@VLLM_WARNINGS
@pytest.mark.parametrize("spec", SPECS, ids=lambda spec: f"{spec.kind}")
def test_event_metadata_equals_vllms_for_every_spec_kind(spec: KVCacheSpec) -> None:
    import_vllm()
    from vllm.v1.kv_cache_interface import (
        get_kv_cache_spec_kind,
        get_kv_cache_spec_sliding_window,
    )

    from hybridkv.integrations.vllm.convert import to_vllm_config

    vllm_spec = to_vllm_config(one_group(spec)).kv_cache_groups[0].kv_cache_spec
    assert event_metadata(spec) == (
        get_kv_cache_spec_kind(vllm_spec).value,
        get_kv_cache_spec_sliding_window(vllm_spec),
    )


# --- Field values -----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_salted_requests_first_stored_block_carries_its_salt_as_extra_keys(
    backend: str,
) -> None:
    m = make(backend, one_group(FullAttentionSpec(block_size=2, **SIZES)))
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], hash_block_size=2, cache_salt="tenant-1")
    assert m.allocate_slots(a, 7) is not None
    (event,) = m.take_events()
    h0 = hash_block_tokens(None, [1, 2], (("cache_salt", "tenant-1"),))
    h1 = hash_block_tokens(h0, [3, 4])
    h2 = hash_block_tokens(h1, [5, 6])
    assert event == BlockStored(
        block_hashes=(h0, h1, h2),
        parent_block_hash=None,
        token_ids=(1, 2, 3, 4, 5, 6),
        block_size=2,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=(("tenant-1",), None, None),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        locality=None,
        ownership=None,
        session_id=None,
        lookahead_token_ids=None,
    )
    # Later blocks of the same request start past token 0: no salt.
    a.append_output_token_ids([8])
    a.num_computed_tokens = 7
    assert m.allocate_slots(a, 1) is not None
    (later,) = m.take_events()
    assert (later.parent_block_hash, later.extra_keys) == (h2, (None,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_unsalted_request_has_one_none_extra_key_per_stored_block(backend: str) -> None:
    m = make(backend, one_group(FullAttentionSpec(block_size=2, **SIZES)))
    a = Request("a", [1, 2, 3, 4], hash_block_size=2)
    assert m.allocate_slots(a, 4) is not None
    (event,) = m.take_events()
    assert event.extra_keys == (None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_groups_stored_events_carry_its_spec_kind_and_window(backend: str) -> None:
    groups = (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=2, **SIZES)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=2, sliding_window=4, **SIZES)),
        KVCacheGroup(
            ("chunk",), ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4, **SIZES)
        ),
    )
    m = make(backend, KVCacheConfig(32, groups))
    a = Request("a", list(range(1, 10)), hash_block_size=2)
    assert m.allocate_slots(a, 9) is not None
    assert [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
        for e in stored_events(m.take_events())
    ] == [
        (0, "full_attention", None),
        (1, "sliding_window", 4),
        (2, "chunked_local_attention", None),
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stored_events_carry_the_requests_session(backend: str) -> None:
    m = make(backend, one_group(FullAttentionSpec(block_size=2, **SIZES)))
    a = Request("a", [1, 2, 3, 4], hash_block_size=2, session_id="chat-7")
    b = Request("b", [5, 6, 7, 8], hash_block_size=2)
    assert m.allocate_slots(a, 4) is not None
    assert m.allocate_slots(b, 4) is not None
    assert [e.session_id for e in stored_events(m.take_events())] == ["chat-7", None]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lookahead_hashing_reports_the_tokens_each_stored_block_hash_covers(
    backend: str,
) -> None:
    m = make(
        backend, one_group(FullAttentionSpec(block_size=2, **SIZES)), num_hash_lookahead_tokens=1
    )
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], hash_block_size=2, num_hash_lookahead_tokens=1)
    assert m.allocate_slots(a, 7) is not None
    (event,) = m.take_events()
    hashes = hash_full_blocks_lookahead(
        [1, 2, 3, 4, 5, 6, 7],
        2,
        start_block=0,
        parent_hash=None,
        cache_salt=None,
        num_lookahead_tokens=1,
    )
    assert event.block_hashes == tuple(hashes)
    assert event.token_ids == (1, 2, 3, 4, 5, 6)
    assert event.lookahead_token_ids == ((3,), (5,), (7,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_evicted_block_is_one_removed_event_with_its_medium_and_group(backend: str) -> None:
    m = make(backend, one_group(FullAttentionSpec(block_size=2, **SIZES), num_blocks=4))
    a = Request("a", [1, 2, 3, 4, 5], hash_block_size=2)
    assert m.allocate_slots(a, 5) is not None
    h0 = hash_block_tokens(None, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    m.take_events()
    m.free(a)
    b = Request("b", [9, 9, 9, 9, 9], hash_block_size=2)
    assert m.allocate_slots(b, 5) is not None  # takes the unhashed block, then h1's and h0's
    events = m.take_events()
    assert events[:2] == [
        BlockRemoved(block_hashes=(h1,), medium="GPU", group_idx=0, locality=None, ownership=None),
        BlockRemoved(block_hashes=(h0,), medium="GPU", group_idx=0, locality=None, ownership=None),
    ]
    m.free(b)
    assert m.reset_prefix_cache()
    assert m.take_events() == [AllBlocksCleared()]


# --- Equal to vLLM 0.33's own manager ---------------------------------------------------------

HYBRID = KVCacheConfig(
    20,
    (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4, **SIZES)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=5, **SIZES)),
    ),
)
MIXED_SIZES = KVCacheConfig(
    14,
    (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=8, **SIZES)),
        KVCacheGroup(("swa",), SlidingWindowSpec(block_size=4, sliding_window=5, **SIZES)),
    ),
)
MAMBA_HYBRID = KVCacheConfig(
    14,
    (
        KVCacheGroup(("full",), FullAttentionSpec(block_size=4, **SIZES)),
        KVCacheGroup(("mamba",), MambaSpec(block_size=4, state_bytes=16, mamba_cache_mode="align")),
    ),
)


def core_event(event: Any) -> KVCacheEvent:
    """vLLM's event (byte hashes) as the core's dataclass: lists become tuples."""
    name = type(event).__name__
    if name == "BlockStored":
        return BlockStored(
            block_hashes=tuple(BlockHash(bytes(h)) for h in event.block_hashes),
            parent_block_hash=(
                None if event.parent_block_hash is None else BlockHash(event.parent_block_hash)
            ),
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else tuple(event.extra_keys),
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
            ownership=event.ownership,
            session_id=event.session_id,
            lookahead_token_ids=(
                None
                if event.lookahead_token_ids is None
                else tuple(tuple(ids) for ids in event.lookahead_token_ids)
            ),
        )
    if name == "BlockRemoved":
        return BlockRemoved(
            tuple(BlockHash(bytes(h)) for h in event.block_hashes),
            event.medium,
            event.group_idx,
            event.locality,
            event.ownership,
        )
    assert name == "AllBlocksCleared", name
    return AllBlocksCleared()


def workload(adapter: ManagerAdapter, take: Callable[[], list[KVCacheEvent]]) -> list[Any]:
    """A small scheduler workload with events on: salted and session requests, a shared prefix
    hit, decode steps, preemption-free eviction and a reset; the events after every step."""
    steps: list[Any] = []

    def admit(rid: str, prompt: list[int], salt: str | None, session: str | None) -> Any:
        request = adapter.new_request(rid, prompt, salt)
        if session is not None:
            request.session_id = session
        hit = adapter.lookup(request)
        adapter.new_step()
        new = adapter.allocate(request, len(prompt) - hit.num_hit_tokens, hit, 0, False)
        assert new is not None, rid
        adapter.set_num_computed_tokens(request, len(prompt))
        steps.append(take())
        return request

    def decode(request: Any, token: int) -> None:
        adapter.append_tokens(request, [token])
        adapter.new_step()
        assert adapter.allocate(request, 1, None, 0, False) is not None
        adapter.set_num_computed_tokens(request, request.num_tokens)
        steps.append(take())

    a = admit("a", list(range(1, 12)), "tenant-1", "chat-1")
    for token in (12, 13, 14, 15, 16):
        decode(a, token)
    b = admit("b", [*range(1, 10), 90, 91, 92, 93], "tenant-1", None)
    adapter.free(a)
    steps.append(take())
    c = admit("c", [7] * 14, None, "chat-2")
    decode(c, 8)
    adapter.free(b)
    adapter.free(c)
    steps.append(take())
    d = admit("d", [5] * 32, None, None)
    adapter.free(d)
    assert adapter.reset_prefix_cache()
    steps.append(take())
    return steps


@VLLM_WARNINGS
@pytest.mark.parametrize("lookahead", [0, 1], ids=["plain", "lookahead"])
@pytest.mark.parametrize(
    "config", [HYBRID, MIXED_SIZES, MAMBA_HYBRID], ids=["swa", "block-sizes", "mamba-align"]
)
def test_both_backends_events_equal_vllms_own_managers_field_by_field(
    config: KVCacheConfig, lookahead: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    import_vllm()
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    from hybridkv.conformance.adapters import vllm as vllm_adapter

    engine = EngineOptions(num_hash_lookahead_tokens=lookahead)
    vllm = vllm_adapter.make_adapter(config, 64, True, True, engine)
    expected = workload(vllm, lambda: [core_event(e) for e in vllm.manager.take_events()])
    assert any(isinstance(e, BlockRemoved) for step in expected for e in step)
    assert any(
        isinstance(e, BlockStored) and e.extra_keys and e.extra_keys[0] == ("tenant-1",)
        for step in expected
        for e in step
    )
    backends = [reference_backend()]
    optimized = optimized_backend()
    if optimized is not None:
        backends.append(optimized)
    for name, factory in backends:
        adapter = factory(config, 64, True, True, engine)
        assert isinstance(adapter, ProtocolAdapter), name
        assert workload(adapter, adapter.manager.take_events) == expected, name
