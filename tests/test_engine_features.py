"""vLLM 0.33's engine features on the reference manager, with the golden README's own numbers.

Each example of ``/work/shared/golden/README.md`` ("Behaviour notes (engine features)") is one
test, its values derived by running the reference; then every new error path (exact message,
nothing changed), ``NONE_HASH`` and ``PYTHONHASHSEED``, properties of the new rules in
``hybridkv.spec.rules``, and the optimized backend's refusal of what it has not ported yet.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.reference import KVCacheBlocks, KVCacheManager, Request
from hybridkv.reference.block_hash import DEFAULT_NONE_HASH_SEED, none_hash_seed
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

SETTINGS = settings(max_examples=200, deadline=None)
PROMPT = list(range(100, 200))


def exactly(message: str) -> str:
    """A ``pytest.raises`` pattern matching the whole message, not a part of it."""
    return f"^{re.escape(message)}$"


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=4)


def sliding(block_size: int, window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=4, sliding_window=window
    )


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=1,
        dtype_bytes=4,
        attention_chunk_size=chunk,
    )


def mamba(block_size: int, **fields: int) -> MambaSpec:
    return MambaSpec(block_size=block_size, state_bytes=64, mamba_cache_mode="align", **fields)


def config(
    *specs: KVCacheSpec,
    num_blocks: int = 64,
    retention: int | None = None,
    eagle: Sequence[int] = (),
) -> KVCacheConfig:
    groups = tuple(
        KVCacheGroup((f"layer{i}",), spec, is_eagle_group=i in eagle)
        for i, spec in enumerate(specs)
    )
    return KVCacheConfig(num_blocks, groups, prefix_cache_retention_interval=retention)


def prefill(
    manager: KVCacheManager,
    request_id: str,
    token_ids: list[int],
    chunks: Sequence[int],
    *,
    hash_block_size: int,
    lookahead: int = 0,
) -> Request:
    """Admit a request with its cache hit and prefill it in ``chunks``, one step per chunk, as
    the engine's scheduler does (``new_step_starts`` first, the boundary stored on the
    request)."""
    request = Request(
        request_id,
        token_ids,
        hash_block_size=hash_block_size,
        num_hash_lookahead_tokens=lookahead,
    )
    manager.new_step_starts()
    hits, num_hit, boundary = manager.get_computed_blocks(request)
    request.shared_prefix_boundary = boundary
    for index, chunk in enumerate(chunks):
        if index:
            manager.new_step_starts()
        adopted = num_hit if index == 0 else 0
        blocks = hits if index == 0 else None
        assert manager.allocate_slots(request, chunk, adopted, blocks) is not None
        request.num_computed_tokens += chunk + adopted
        manager.check_invariants()
    return request


def lookup(
    manager: KVCacheManager, token_ids: list[int], *, hash_block_size: int, lookahead: int = 0
) -> tuple[int, int]:
    """A new step's lookup of a fresh request: (hit tokens, shared-prefix boundary)."""
    manager.new_step_starts()
    probe = Request(
        "probe", token_ids, hash_block_size=hash_block_size, num_hash_lookahead_tokens=lookahead
    )
    _, num_hit, boundary = manager.get_computed_blocks(probe)
    return num_hit, boundary


# --- Mamba "align" ------------------------------------------------------------------------------


def test_mamba_align_single_55_token_prefill_caches_no_state() -> None:
    manager = KVCacheManager(config(full(16), mamba(16)), 256)
    prefill(manager, "a", PROMPT[:55], [55], hash_block_size=16)
    assert manager.snapshot().cached_block_ids == ((1, 2, 3), ())
    # Full attention alone has 48 tokens; the Mamba group bounds the hit to 0.
    assert lookup(manager, PROMPT[:60], hash_block_size=16) == (0, 48)


def test_mamba_align_48_plus_7_prefill_caches_the_state_after_48() -> None:
    manager = KVCacheManager(config(full(16), mamba(16)), 256)
    prefill(manager, "a", PROMPT[:55], [48, 7], hash_block_size=16)
    assert manager.snapshot().cached_block_ids == ((1, 2, 3), (4,))
    assert lookup(manager, PROMPT[:60], hash_block_size=16) == (48, 0)


def test_mamba_align_hit_of_a_state_cached_this_step_waits_for_the_next_step() -> None:
    manager = KVCacheManager(config(full(16), mamba(16)), 256)
    a = Request("a", PROMPT[:55], hash_block_size=16)
    manager.new_step_starts()
    assert manager.allocate_slots(a, 48) is not None
    a.num_computed_tokens = 48
    b = Request("b", PROMPT[:60], hash_block_size=16)
    hits, num_hit, boundary = manager.get_computed_blocks(b)
    assert (hits, num_hit, boundary) == (KVCacheBlocks(((1, 2, 3), (0, 0, 4))), 48, 0)
    before = manager.snapshot()
    assert manager.num_free_blocks == 59  # plenty: the same-step rule alone refuses
    assert manager.allocate_slots(b, 60 - num_hit, num_hit, hits) is None
    assert manager.snapshot() == before
    assert manager.get_block_ids("b") == ([], [])
    manager.new_step_starts()
    assert manager.allocate_slots(b, 60 - num_hit, num_hit, hits) == KVCacheBlocks(((5,), (6,)))
    manager.check_invariants()


def test_mamba_checkpoint_block_caches_the_state_after_48_in_one_55_token_prefill() -> None:
    spec = mamba(16, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    manager = KVCacheManager(config(full(16), spec), 256)
    prefill(manager, "a", PROMPT[:55], [55], hash_block_size=16)
    assert manager.snapshot().cached_block_ids == ((1, 2, 3), (5,))
    assert lookup(manager, PROMPT[:60], hash_block_size=16) == (48, 0)


def test_mamba_retention_0_keeps_only_the_replay_state_after_32_of_a_40_token_prompt() -> None:
    manager = KVCacheManager(config(full(8), mamba(8), retention=0), 256)
    prefill(manager, "a", PROMPT[:40], [16, 16, 8], hash_block_size=8)
    assert manager.get_block_ids("a") == ([1, 2, 4, 5, 3], [0, 0, 0, 6, 7])
    assert manager.snapshot().cached_block_ids[1] == (6,)  # position 3: the state after 32
    hits = {n: lookup(manager, PROMPT[:n], hash_block_size=8)[0] for n in (17, 33, 41)}
    assert hits == {17: 0, 33: 32, 41: 32}


def test_mamba_dense_retention_keeps_the_states_after_16_32_and_40() -> None:
    manager = KVCacheManager(config(full(8), mamba(8)), 256)
    prefill(manager, "a", PROMPT[:40], [16, 16, 8], hash_block_size=8)
    assert manager.snapshot().cached_block_ids[1] == (3, 6, 8)
    hits = {n: lookup(manager, PROMPT[:n], hash_block_size=8)[0] for n in (17, 33, 41)}
    assert hits == {17: 16, 33: 32, 41: 40}


def test_mamba_retention_interval_16_adds_the_state_after_16_to_the_replay_state() -> None:
    manager = KVCacheManager(config(full(8), mamba(8), retention=16), 256)
    prefill(manager, "a", PROMPT[:40], [16, 16, 8], hash_block_size=8)
    assert manager.snapshot().cached_block_ids[1] == (3, 6)  # after 16 and 32, not 40
    hits = {n: lookup(manager, PROMPT[:n], hash_block_size=8)[0] for n in (17, 33, 41)}
    assert hits == {17: 16, 33: 32, 41: 32}


# --- Speculative decoding ------------------------------------------------------------------------


def test_use_eagle_resend_of_48_tokens_hits_16_with_one_group() -> None:
    manager = KVCacheManager(config(full(16)), 256, use_eagle=True)
    prefill(manager, "a", PROMPT[:48], [48], hash_block_size=16)
    assert lookup(manager, PROMPT[:48], hash_block_size=16) == (16, 0)


@pytest.mark.parametrize(
    ("specs", "eagle"),
    [
        ((full(16), full(16)), ()),
        ((full(16), full(16)), (1,)),
        ((full(16), sliding(16, 16)), ()),
        ((full(16), sliding(16, 16)), (0,)),
    ],
    ids=["two-full", "two-full-one-flagged", "full-sliding", "full-sliding-full-flagged"],
)
def test_use_eagle_resend_of_48_tokens_hits_32_with_several_groups(
    specs: tuple[KVCacheSpec, ...], eagle: tuple[int, ...]
) -> None:
    manager = KVCacheManager(config(*specs, eagle=eagle), 256, use_eagle=True)
    prefill(manager, "a", PROMPT[:48], [48], hash_block_size=16)
    assert lookup(manager, PROMPT[:48], hash_block_size=16) == (32, 0)


def test_use_eagle_resend_of_65_tokens_hits_48_with_one_group() -> None:
    manager = KVCacheManager(config(full(16)), 256, use_eagle=True)
    prefill(manager, "a", PROMPT[:65], [65], hash_block_size=16)
    assert lookup(manager, PROMPT[:65], hash_block_size=16) == (48, 0)


@pytest.mark.parametrize(
    "specs", [(full(16),), (full(16), sliding(16, 16))], ids=["one-group", "full-sliding"]
)
def test_lookahead_hashes_48_token_prompt_has_2_hashes_and_its_resend_hits_32(
    specs: tuple[KVCacheSpec, ...],
) -> None:
    manager = KVCacheManager(config(*specs), 256, num_hash_lookahead_tokens=1)
    a = prefill(manager, "a", PROMPT[:48], [48], hash_block_size=16, lookahead=1)
    assert len(a.block_hashes) == 2
    assert lookup(manager, PROMPT[:48], hash_block_size=16, lookahead=1) == (32, 0)


@pytest.mark.parametrize(
    "specs", [(full(16),), (full(16), sliding(16, 16))], ids=["one-group", "full-sliding"]
)
def test_lookahead_hashes_resend_of_65_tokens_hits_64(specs: tuple[KVCacheSpec, ...]) -> None:
    manager = KVCacheManager(config(*specs), 256, num_hash_lookahead_tokens=1)
    a = prefill(manager, "a", PROMPT[:65], [65], hash_block_size=16, lookahead=1)
    assert len(a.block_hashes) == 4
    assert lookup(manager, PROMPT[:65], hash_block_size=16, lookahead=1) == (64, 0)


# --- Different block sizes -----------------------------------------------------------------------


def test_different_block_sizes_hash_at_the_gcd_and_hit_at_multiples_of_the_lcm() -> None:
    manager = KVCacheManager(config(full(32), sliding(16, 16)), 512)
    assert (manager.hash_block_size, manager.scheduler_block_size) == (16, 32)
    a = prefill(manager, "a", PROMPT, [100], hash_block_size=16)
    assert len(a.block_hashes) == 6  # one per 16 tokens
    hits = {n: lookup(manager, PROMPT[:n], hash_block_size=16)[0] for n in range(1, 101)}
    assert all(hit % 32 == 0 for hit in hits.values())
    assert {n: hits[n] for n in (1, 32, 33, 36, 64, 65, 71, 96, 97, 100)} == {
        1: 0,
        32: 0,
        33: 32,
        36: 32,
        64: 32,
        65: 64,
        71: 64,
        96: 64,
        97: 96,
        100: 96,
    }


# --- Shared-prefix boundary ----------------------------------------------------------------------


def test_shared_prefix_boundary_is_full_attentions_longer_hit_under_retention_0() -> None:
    manager = KVCacheManager(config(full(16), sliding(16, 32), retention=0), 512)
    prefill(manager, "a", PROMPT, [100], hash_block_size=16)
    # The window keeps only its tail at the replay boundary 96: blocks 4 and 5.
    assert manager.snapshot().cached_block_ids == ((1, 2, 3, 4, 5, 6), (12, 13))
    sibling = PROMPT[:60] + [7] * 10
    assert lookup(manager, sibling, hash_block_size=16) == (0, 48)
    # Stored on the request, the boundary makes the window cache its tail there as well.
    b = prefill(manager, "b", sibling, [70], hash_block_size=16)
    assert b.shared_prefix_boundary == 48
    assert lookup(manager, PROMPT[:60] + [9] * 5, hash_block_size=16) == (48, 0)


@pytest.mark.parametrize(
    ("specs", "retention"),
    [((full(16),), 0), ((full(16), sliding(16, 32)), None)],
    ids=["one-group", "dense-retention"],
)
def test_shared_prefix_boundary_is_0_when_the_final_hit_is_the_longest(
    specs: tuple[KVCacheSpec, ...], retention: int | None
) -> None:
    manager = KVCacheManager(config(*specs, retention=retention), 512)
    prefill(manager, "a", PROMPT, [100], hash_block_size=16)
    assert lookup(manager, PROMPT[:60] + [7] * 10, hash_block_size=16) == (48, 0)


# --- Full-prompt admission -----------------------------------------------------------------------


def test_full_prompt_admission_refuses_a_prompt_that_does_not_fit_and_changes_nothing() -> None:
    manager = KVCacheManager(config(full(16), num_blocks=6), 1024)
    other = Request("other", PROMPT[:30], hash_block_size=16)
    assert manager.allocate_slots(other, 30) is not None
    other.num_computed_tokens = 30
    long = Request("long", PROMPT, hash_block_size=16)  # 100 tokens: 7 blocks, 3 free
    before = manager.snapshot()
    assert manager.allocate_slots(long, 32, full_sequence_must_fit=True) is None
    assert manager.snapshot() == before
    assert manager.get_block_ids("long") == ([],)
    assert manager.allocate_slots(long, 32) == KVCacheBlocks(((3, 4),))
    manager.check_invariants()


def test_full_prompt_admission_counts_a_window_by_its_in_flight_cap() -> None:
    manager = KVCacheManager(config(sliding(16, 16), num_blocks=6), 1024, max_in_flight_tokens=16)
    long = Request("long", list(range(300)), hash_block_size=16)  # 19 blocks, window needs 3
    assert manager.allocate_slots(long, 16, full_sequence_must_fit=True) == KVCacheBlocks(((1,),))


# --- Errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"mamba_cache_mode": "all"},
            "mamba_cache_mode must be one of ('none', 'align'), got 'all'",
        ),
        (
            {"num_speculative_blocks": -1},
            "num_speculative_blocks must be a non-negative int, got -1",
        ),
        (
            {"num_prefill_checkpoint_blocks": 2},
            "num_prefill_checkpoint_blocks must be 0 or 1, got 2",
        ),
        (
            {"num_prefill_checkpoint_blocks": True},
            "num_prefill_checkpoint_blocks must be 0 or 1, got True",
        ),
        (
            {"prefill_checkpoint_alignment": 0},
            "prefill_checkpoint_alignment must be a positive int, got 0",
        ),
    ],
)
def test_bad_mamba_spec_fields_raise(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        MambaSpec(block_size=16, state_bytes=64, **fields)  # type: ignore[arg-type]


def test_non_bool_is_eagle_group_raises() -> None:
    with pytest.raises(ValueError, match=exactly("is_eagle_group must be a bool, got 'yes'")):
        KVCacheGroup(("layer0",), full(16), is_eagle_group="yes")  # type: ignore[arg-type]


def test_negative_retention_interval_raises() -> None:
    with pytest.raises(
        ValueError,
        match=exactly("prefix_cache_retention_interval must be a non-negative int, got -1"),
    ):
        config(full(16), retention=-1)


@pytest.mark.parametrize(
    ("layout", "kwargs", "message"),
    [
        (
            config(full(16), MambaSpec(block_size=16, state_bytes=64)),
            {},
            "mamba_cache_mode must be 'align' for a Mamba group when prefix caching is on "
            "(enable_caching=True), got 'none': plan with plan_kv_cache(..., enable_caching=True),"
            " or convert a plan with "
            "hybridkv.reference.planner.with_mamba_cache_mode(config, True)",
        ),
        (
            config(full(16), mamba(32)),
            {},
            "a Mamba 'align' group's block_size (32) must equal the hash block size (16): hits "
            "inside a Mamba block are not supported; give every group the Mamba block size",
        ),
        (
            config(full(16), chunked(32, 64)),
            {},
            "a chunked local attention group needs every group to share its block size when "
            "prefix caching is on, got block sizes [16, 32]",
        ),
        (
            config(full(16), chunked(16, 64)),
            {"use_eagle": True},
            "use_eagle=True cannot drop a block from a chunked local attention group; flag the "
            "drafter's groups with is_eagle_group",
        ),
        (
            config(full(16), chunked(16, 64), eagle=(1,)),
            {"use_eagle": True},
            "use_eagle=True cannot drop a block from a chunked local attention group; flag the "
            "drafter's groups with is_eagle_group",
        ),
        (
            config(full(16), retention=32),
            {},
            "prefix_cache_retention_interval applies to sliding-window and Mamba groups only "
            "and this layout has none; set it to 0 or None, got 32",
        ),
        (
            config(full(16), sliding(32, 64), retention=48),
            {},
            "prefix_cache_retention_interval must be a multiple of the scheduler block size "
            "(32), got 48",
        ),
        (
            config(full(16), sliding(32, 64)),
            {"hash_block_size": 12},
            "hash_block_size must divide every group's block size [16, 32] (and their lcm 32), "
            "got 12",
        ),
        (
            config(full(16)),
            {"max_in_flight_tokens": 0},
            "max_in_flight_tokens must be a positive int, got 0",
        ),
    ],
    ids=[
        "caching-with-mamba-none",
        "mamba-block-above-hash-block",
        "chunked-local-mixed-block-sizes",
        "use-eagle-chunked-local-unflagged",
        "use-eagle-chunked-local-flagged",
        "retention-without-sparse-group",
        "retention-not-a-scheduler-block-multiple",
        "hash-block-not-dividing",
        "max-in-flight-zero",
    ],
)
def test_unsupported_engine_layouts_raise(
    layout: KVCacheConfig, kwargs: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        KVCacheManager(layout, 256, **kwargs)  # type: ignore[arg-type]


def test_supported_neighbours_of_the_refused_layouts_are_accepted() -> None:
    """The edges of the checks above: each is one step from a refused layout."""
    KVCacheManager(config(full(16), MambaSpec(block_size=256, state_bytes=64)), 256, False)
    KVCacheManager(config(full(16), chunked(32, 64)), 256, enable_caching=False)
    KVCacheManager(config(full(16), chunked(16, 64), eagle=(0,)), 256, use_eagle=True)
    KVCacheManager(config(full(16), retention=0), 256)
    KVCacheManager(config(full(16), sliding(32, 64), retention=64), 256)
    KVCacheManager(config(full(16), sliding(32, 64)), 256, hash_block_size=8)


def test_request_hashed_without_the_managers_lookahead_raises_and_changes_nothing() -> None:
    manager = KVCacheManager(config(full(16)), 256, num_hash_lookahead_tokens=1)
    prefill(manager, "a", PROMPT[:40], [40], hash_block_size=16, lookahead=1)
    wrong = Request("r", PROMPT[:48], hash_block_size=16)  # 3 hashes; lookahead gives 2
    message = (
        "request 'r' has 3 block_hashes, expected 2 "
        "(hash_block_size must be 16 and num_hash_lookahead_tokens 1)"
    )
    before = manager.snapshot()
    with pytest.raises(ValueError, match=exactly(message)):
        manager.get_computed_blocks(wrong)
    with pytest.raises(ValueError, match=exactly(message)):
        manager.allocate_slots(wrong, 48)
    assert manager.snapshot() == before
    assert manager.get_block_ids("r") == ([],)
    manager.check_invariants()


# --- NONE_HASH ------------------------------------------------------------------------------------


def _none_hash_in_subprocess(environ: dict[str, str]) -> bytes:
    script = "from hybridkv.reference.block_hash import NONE_HASH; print(NONE_HASH.hex())"
    result = subprocess.run(
        [sys.executable, "-c", script], env=environ, capture_output=True, text=True, check=True
    )
    return bytes.fromhex(result.stdout.strip())


def test_none_hash_seed_is_pythonhashseed_when_set_else_the_default() -> None:
    assert none_hash_seed({"PYTHONHASHSEED": "7"}) == "7"
    assert none_hash_seed({"PYTHONHASHSEED": "0", "OTHER": "1"}) == "0"
    assert none_hash_seed({}) == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"


def test_none_hash_follows_pythonhashseed() -> None:
    def seed_hash(seed: str) -> bytes:
        return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()

    without = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    default = _none_hash_in_subprocess(without)
    seeded = _none_hash_in_subprocess({**os.environ, "PYTHONHASHSEED": "0"})
    assert default == seed_hash("vllm-none-hash")
    assert seeded == seed_hash("0")
    assert seeded != default


# --- Properties of the new rules ----------------------------------------------------------------

sizes = st.lists(st.integers(1, 64), min_size=1, max_size=4)


@SETTINGS
@given(sizes)
def test_scheduler_block_is_the_lcm_and_hash_block_the_gcd(block_sizes: list[int]) -> None:
    scheduler = rules.scheduler_block_size(block_sizes)
    finest = rules.hash_block_size(block_sizes, lcm_hashing=False)
    assert scheduler == math.lcm(*block_sizes)
    assert finest == math.gcd(*block_sizes)
    assert all(scheduler % b == 0 and b % finest == 0 for b in block_sizes)
    assert scheduler % finest == 0
    assert rules.hash_block_size(block_sizes, lcm_hashing=True) == scheduler


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 256), st.booleans())
def test_replay_boundaries_are_the_capped_resend_or_eagle_aligned(
    num_prompt_tokens: int, block: int, use_eagle: bool
) -> None:
    boundaries = rules.replay_boundaries(num_prompt_tokens, block, use_eagle)
    if not use_eagle:
        assert boundaries == (num_prompt_tokens - 1,)
        return
    assert 1 <= len(boundaries) <= 2
    assert list(boundaries) == sorted(set(boundaries))
    assert all(b % block == 0 and 0 <= b <= max(num_prompt_tokens - block, 0) for b in boundaries)
    assert boundaries[0] == max((num_prompt_tokens - 1) // block * block - block, 0)


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 64), st.booleans(), st.integers(0, 4))
def test_mamba_prefill_checkpoint_position_is_a_hash_boundary_before_the_end(
    num_tokens: int, hash_block: int, drop: bool, lookahead: int
) -> None:
    position = rules.mamba_prefill_checkpoint_position(num_tokens, hash_block, drop, lookahead)
    assert position % hash_block == 0
    assert 0 <= position < max(num_tokens, 1)
    if drop:
        assert position == max(num_tokens // hash_block * hash_block - hash_block, 0)
    else:
        limit = max(num_tokens - max(1, lookahead), 0)
        assert position == limit // hash_block * hash_block


def test_mamba_prefill_checkpoint_position_of_the_readme_examples() -> None:
    assert rules.mamba_prefill_checkpoint_position(55, 16, False, 0) == 48
    assert rules.mamba_prefill_checkpoint_position(48, 16, False, 0) == 32
    assert rules.mamba_prefill_checkpoint_position(48, 16, False, 1) == 32
    assert rules.mamba_prefill_checkpoint_position(65, 16, False, 1) == 64
    assert rules.mamba_prefill_checkpoint_position(48, 16, True, 0) == 32


@SETTINGS
@given(
    st.integers(0, 500),
    st.integers(0, 500),
    st.integers(0, 1000),
    st.integers(1, 64),
    st.integers(1, 4),
    st.none() | st.integers(1, 64),
)
def test_mamba_prefill_checkpoint_valid_only_strictly_inside_an_aligned_chunk(
    start: int,
    length: int,
    position: int,
    hash_block: int,
    mamba_factor: int,
    alignment: int | None,
) -> None:
    end = start + length
    mamba_block = hash_block * mamba_factor
    valid = rules.mamba_prefill_checkpoint_valid(
        start, end, position, hash_block, mamba_block, alignment
    )
    if alignment is None:
        assert not valid
    if valid:
        assert alignment is not None
        assert start % hash_block == 0
        assert start + hash_block <= position < end
        assert (position - start) % alignment == 0


def test_mamba_prefill_checkpoint_valid_for_the_55_token_prefill() -> None:
    assert rules.mamba_prefill_checkpoint_valid(0, 55, 48, 16, 16, 1)
    assert rules.mamba_prefill_checkpoint_valid(0, 55, 48, 16, 16, 16)
    assert not rules.mamba_prefill_checkpoint_valid(0, 55, 48, 16, 16, 5)
    assert not rules.mamba_prefill_checkpoint_valid(0, 55, 48, 16, 16, None)
    assert not rules.mamba_prefill_checkpoint_valid(40, 55, 48, 16, 16, 1)  # not on a boundary
    assert not rules.mamba_prefill_checkpoint_valid(48, 55, 48, 16, 16, 1)  # at the start


boundaries_st = st.lists(st.integers(0, 200), max_size=3)


@SETTINGS
@given(
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(1, 8),
    st.integers(1, 4),
    st.integers(0, 6),
    st.booleans(),
    st.none() | st.integers(0, 8),
    boundaries_st,
)
def test_sliding_window_retention_mask_keeps_segment_tails(
    start: int,
    extra: int,
    block: int,
    blocks_per_alignment: int,
    contiguous: int,
    use_eagle: bool,
    interval_blocks: int | None,
    boundaries: list[int],
) -> None:
    end = start + extra
    alignment = block * blocks_per_alignment
    interval = None if interval_blocks is None else interval_blocks * alignment
    mask = rules.sliding_window_retention_mask(
        start,
        end,
        alignment_tokens=alignment,
        block_size=block,
        contiguous_blocks=contiguous,
        use_eagle=use_eagle,
        retention_interval=interval,
        reachable_boundaries=boundaries,
    )
    segment = alignment if interval is None else interval
    if interval != 0 and contiguous >= segment // block:
        assert mask is None  # every block of a segment is part of its tail
        return
    assert mask is not None
    assert len(mask) == end - start
    shift = 1 if use_eagle else 0
    expected = set()
    if interval != 0:
        per = segment // block
        expected |= {i for i in range(shift, end) if (i - shift) % per >= per - contiguous}
    if interval is not None:
        for b in boundaries:
            tail_end = b // alignment * alignment // block + shift
            expected |= set(range(tail_end - contiguous, tail_end))
    assert {start + i for i, kept in enumerate(mask) if kept} == expected & set(range(start, end))


def test_sliding_window_retention_mask_of_dense_and_sparse_segments() -> None:
    def mask(retention: int | None) -> tuple[bool, ...] | None:
        return rules.sliding_window_retention_mask(
            0,
            8,
            alignment_tokens=16,
            block_size=4,
            contiguous_blocks=2,
            use_eagle=False,
            retention_interval=retention,
            reachable_boundaries=[30],
        )

    assert mask(None) == (False, False, True, True) * 2  # the tail of every 16-token segment
    assert mask(0) == (False, False, True, True, False, False, False, False)  # only 16's tail
    assert mask(32) == (False, False, True, True, False, False, True, True)  # and 32's


@SETTINGS
@given(
    st.integers(0, 12),
    st.integers(0, 12),
    st.integers(1, 8),
    st.integers(1, 4),
    st.none() | st.integers(0, 8),
    st.lists(st.integers(-8, 200), max_size=3),
)
def test_mamba_retention_mask_keeps_boundary_and_interval_states(
    start: int,
    extra: int,
    block: int,
    blocks_per_alignment: int,
    interval_blocks: int | None,
    boundaries: list[int],
) -> None:
    end = start + extra
    alignment = block * blocks_per_alignment
    interval = None if interval_blocks is None else interval_blocks * block
    mask = rules.mamba_retention_mask(
        start,
        end,
        alignment_tokens=alignment,
        block_size=block,
        retention_interval=interval,
        reachable_boundaries=boundaries,
    )
    if interval is None or interval_blocks == 1:
        assert mask is None  # dense, or an interval of one block: every state
        return
    assert mask is not None
    assert len(mask) == end - start
    expected = {b // alignment * alignment // block - 1 for b in boundaries}
    if interval_blocks:
        expected |= {i for i in range(start, end) if (i + 1) % interval_blocks == 0}
    assert {start + i for i, kept in enumerate(mask) if kept} == expected & set(range(start, end))


def test_mamba_retention_0_mask_of_the_40_token_prompt() -> None:
    mask = rules.mamba_retention_mask(
        0, 5, alignment_tokens=8, block_size=8, retention_interval=0, reachable_boundaries=[39]
    )
    assert mask == (False, False, False, True, False)  # the state after 32


# --- The optimized backend ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "kwargs", "feature"),
    [
        (config(full(32), sliding(16, 16)), {}, "groups with different block sizes [16, 32]"),
        (config(full(16), mamba(16)), {}, "mamba_cache_mode='align'"),
        (
            config(full(16), sliding(16, 32), retention=0),
            {},
            "prefix_cache_retention_interval=0",
        ),
        (config(full(16)), {"use_eagle": True}, "use_eagle=True"),
        (config(full(16)), {"num_hash_lookahead_tokens": 1}, "num_hash_lookahead_tokens=1"),
    ],
    ids=["mixed-block-sizes", "mamba-align", "retention-sliding", "use-eagle", "lookahead"],
)
def test_the_optimized_backend_takes_every_engine_layout_the_reference_takes(
    layout: KVCacheConfig, kwargs: dict[str, object], feature: str
) -> None:
    """Each engine feature runs on both backends: the same admission of a 100-token prompt
    returns the same blocks, and both are left in the same state."""
    pytest.importorskip("torch")
    from hybridkv.optimized import TorchKVCacheManager

    results = []
    for manager_class in (KVCacheManager, TorchKVCacheManager):
        manager = manager_class(layout, 256, **kwargs)  # type: ignore[arg-type]
        request = Request(
            "r",
            list(range(100)),
            hash_block_size=manager.hash_block_size,
            num_hash_lookahead_tokens=int(kwargs.get("num_hash_lookahead_tokens", 0)),  # type: ignore[call-overload]
        )
        new = manager.allocate_slots(request, 100)
        manager.check_invariants()
        results.append((new, manager.snapshot()))
    assert results[0] == results[1], feature


def test_a_checkpoint_beyond_the_known_tokens_is_transient_on_both_backends() -> None:
    """A speculative step can reserve a Mamba prefill checkpoint past the request's known
    tokens (1 known + 2 drafts with block 1): that boundary has no hash yet, so the block is
    kept as a transient slot and nothing is cached there (vLLM 0.33 fails an assertion at this
    point). Found by the differential machine; both backends agree block for block."""
    from hybridkv.optimized import TorchKVCacheManager

    kv = {"block_size": 1, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    mamba = MambaSpec(
        block_size=1,
        state_bytes=4,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=1,
        num_speculative_blocks=1,
    )
    config = KVCacheConfig(
        64,
        (
            KVCacheGroup(("m",), mamba),
            KVCacheGroup(("f",), FullAttentionSpec(**kv), is_eagle_group=True),
            KVCacheGroup(("s",), SlidingWindowSpec(sliding_window=2, **kv)),
        ),
    )
    observed = []
    for manager_class in (KVCacheManager, TorchKVCacheManager):
        manager = manager_class(config, 64, use_eagle=True)
        request = Request("r", [5], hash_block_size=1)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens = 1
        request.append_output_token_ids(6)
        new = manager.allocate_slots(request, 3, num_lookahead_tokens=2)
        assert new is not None
        manager.check_invariants()
        observed.append((new.get_block_ids(), manager.get_block_ids("r"), manager.snapshot()))
    assert observed[0] == observed[1]
    assert observed[0][1] == ([1, 0, 2, 5, 6], [3, 7, 8, 9, 10, 11], [4, 12, 13, 14, 15, 16])


def test_a_checkpoint_reserved_by_a_failed_allocation_is_not_cached_later() -> None:
    """A speculative step reserves a Mamba prefill checkpoint (position 10 of a 12-token query)
    while counting blocks, then fails for want of blocks; a delayed ``cache_blocks`` afterwards
    must not use that reservation (no block was taken for it; vLLM 0.33 fails an assertion).
    Found by the long conformance run; both backends agree."""
    from hybridkv.optimized import TorchKVCacheManager

    kv = {"block_size": 2, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    mamba = MambaSpec(
        block_size=2,
        state_bytes=4,
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=2,
    )
    config = KVCacheConfig(
        7, (KVCacheGroup(("f",), FullAttentionSpec(**kv)), KVCacheGroup(("m",), mamba))
    )
    observed = []
    for manager_class in (KVCacheManager, TorchKVCacheManager):
        manager = manager_class(config, 64)
        request = Request("r", list(range(8)), hash_block_size=2)
        assert manager.allocate_slots(request, 8, delay_cache_blocks=True) is not None
        assert manager.num_free_blocks == 0
        request.num_computed_tokens = 8
        request.append_output_token_ids(8)
        assert manager.allocate_slots(request, 4, num_lookahead_tokens=3) is None
        manager.cache_blocks(request, 8)
        manager.check_invariants()
        observed.append((manager.get_block_ids("r"), manager.snapshot()))
    assert observed[0] == observed[1]
    assert observed[0][0] == ([1, 2, 3, 4], [0, 0, 0, 6])


def test_max_cache_hit_length_caps_the_hit_and_never_passes_the_last_token() -> None:
    """vLLM's argument caps the hit; a cap at or past the prompt still leaves the last token to
    compute (65 tokens: 64 may hit, exactly the hit without a cap)."""
    manager = KVCacheManager(config(full(16)), 256)
    prefill(manager, "a", PROMPT[:65], [65], hash_block_size=16)
    probe = Request("p", PROMPT[:65], hash_block_size=16)
    hits = {cap: manager.get_computed_blocks(probe, cap)[1] for cap in (0, 17, 48, 63, 64, 100)}
    assert hits == {0: 0, 17: 16, 48: 48, 63: 48, 64: 64, 100: 64}
    assert manager.get_computed_blocks(probe)[1] == 64
