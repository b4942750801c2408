"""Bad input: a ``ValueError`` naming the field and the value, and nothing changed."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import pytest

from hybridkv.reference import KVCacheBlocks, Request
from hybridkv.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    MambaSpec,
    SlidingWindowSpec,
)

FULL = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4)
SLIDING = SlidingWindowSpec(
    block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=4, sliding_window=8
)
CONFIG = KVCacheConfig(20, (KVCacheGroup(("full",), FULL), KVCacheGroup(("sw",), SLIDING)))

if TYPE_CHECKING:
    from conftest import BackendManager, ManagerFactory


@pytest.fixture
def manager(make_manager: ManagerFactory) -> BackendManager:
    """A manager (of each backend) holding one running request ``a`` and a cached prefix."""
    m = make_manager(CONFIG, max_model_len=64)
    a = Request("a", list(range(10)), hash_block_size=4)
    assert m.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    return m


def exactly(message: str) -> str:
    """A ``pytest.raises`` pattern matching the whole message, not a part of it."""
    return f"^{re.escape(message)}$"


def request(token_ids: list[int], request_id: str = "b") -> Request:
    return Request(request_id, token_ids, hash_block_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_new_tokens": -1}, "num_new_tokens must be a non-negative int, got -1"),
        (
            {"num_new_tokens": 0},
            "num_new_tokens must be positive with nothing computed to adopt, got 0",
        ),
        ({"num_new_tokens": 2.5}, "num_new_tokens must be a non-negative int, got 2.5"),
        (
            {"num_new_tokens": 1, "num_lookahead_tokens": -2},
            "num_lookahead_tokens must be a non-negative int, got -2",
        ),
        (
            {"num_new_tokens": 1, "num_new_computed_tokens": -4},
            "num_new_computed_tokens must be a non-negative int, got -4",
        ),
        (
            {"num_new_tokens": 1, "num_new_computed_tokens": 4},
            "new_computed_blocks must be given with num_new_computed_tokens=4, got None",
        ),
        (
            {"num_new_tokens": 1, "new_computed_blocks": KVCacheBlocks(((),))},
            "new_computed_blocks must have one list per KV cache group (2), got 1",
        ),
        (
            {
                "num_new_tokens": 1,
                "num_new_computed_tokens": 4,
                "new_computed_blocks": KVCacheBlocks(((1, 2), (0, 6))),
            },
            "num_new_computed_tokens=4 must be the 2 blocks of new_computed_blocks group 0 "
            "× block_size 4",
        ),
        (
            {
                "num_new_tokens": 1,
                "num_new_computed_tokens": 4,
                "new_computed_blocks": KVCacheBlocks(((99,), (0,))),
            },
            "new_computed_blocks group 0 has invalid ids [99]",
        ),
        (
            {
                "num_new_tokens": 1,
                "num_new_computed_tokens": 4,
                "new_computed_blocks": KVCacheBlocks(((20,), (0,))),
            },
            "new_computed_blocks group 0 has invalid ids [20]",
        ),
    ],
)
def test_bad_allocation_arguments_raise_and_change_nothing(
    manager: BackendManager, kwargs: dict[str, object], message: str
) -> None:
    before = manager.snapshot()
    with pytest.raises(ValueError, match=exactly(message)):
        manager.allocate_slots(request([1, 2, 3, 4, 5]), **kwargs)  # type: ignore[arg-type]
    assert manager.snapshot() == before
    assert manager.get_block_ids("b") == ([], [])
    manager.check_invariants()


def test_a_running_request_cannot_adopt_a_cache_hit(manager: BackendManager) -> None:
    a = request(list(range(10)), "a")
    a.num_computed_tokens = 10
    before = manager.snapshot()
    with pytest.raises(
        ValueError,
        match=exactly(
            "request 'a' already holds blocks; only a request being admitted adopts a cache hit "
            "(new_computed_blocks must be empty)"
        ),
    ):
        manager.allocate_slots(a, 1, 4, KVCacheBlocks(((1,), (0,))))
    assert manager.snapshot() == before


def test_a_request_hashed_at_another_block_size_is_rejected(manager: BackendManager) -> None:
    wrong = Request("b", list(range(10)), hash_block_size=2)
    before = manager.snapshot()
    message = "request 'b' has 5 block_hashes, expected 2 (hash_block_size must be 4)"
    with pytest.raises(ValueError, match=exactly(message)):
        manager.get_computed_blocks(wrong)
    with pytest.raises(ValueError, match=exactly(message)):
        manager.allocate_slots(wrong, 10)
    assert manager.snapshot() == before


def test_a_failed_allocation_returns_none_and_changes_nothing(manager: BackendManager) -> None:
    before = manager.snapshot()
    assert manager.allocate_slots(request(list(range(60))), 60) is None
    assert manager.snapshot() == before
    assert manager.get_block_ids("b") == ([], [])


def test_freeing_a_request_that_holds_nothing_is_a_no_op(manager: BackendManager) -> None:
    before = manager.snapshot()
    manager.free(request([1, 2, 3]))
    assert manager.snapshot() == before


@pytest.mark.parametrize(
    ("token_ids", "message"),
    [
        ([1, -2], "prompt_token_ids[1] must be a non-negative int, got -2"),
        ([1, "x"], "prompt_token_ids[1] must be a non-negative int, got 'x'"),
        ([True], "prompt_token_ids[0] must be a non-negative int, got True"),
    ],
)
def test_bad_token_ids_are_rejected(token_ids: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=exactly(message)):
        Request("r", token_ids, hash_block_size=4)  # type: ignore[arg-type]


def test_bad_output_tokens_are_rejected_and_the_request_is_unchanged() -> None:
    r = request([1, 2, 3])
    with pytest.raises(
        ValueError, match=exactly("token_ids[1] must be a non-negative int, got -1")
    ):
        r.append_output_token_ids([4, -1])
    assert list(r.all_token_ids) == [1, 2, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hash_block_size": 0}, "hash_block_size must be a positive int, got 0"),
        ({"hash_block_size": 4, "cache_salt": 7}, "cache_salt must be a str or None, got 7"),
        ({"hash_block_size": 4, "request_id": 5}, "request_id must be a str, got 5"),
    ],
)
def test_bad_request_settings_are_rejected(kwargs: dict[str, object], message: str) -> None:
    settings: dict[str, object] = {"request_id": "r", "prompt_token_ids": [1], **kwargs}
    with pytest.raises(ValueError, match=exactly(message)):
        Request(**settings)  # type: ignore[arg-type]


def test_bad_manager_settings_are_rejected(make_manager: ManagerFactory) -> None:
    with pytest.raises(ValueError, match=exactly("max_model_len must be a positive int, got 0")):
        make_manager(CONFIG, max_model_len=0)
    with pytest.raises(ValueError, match=exactly("config must be a KVCacheConfig, got 3")):
        make_manager(3, max_model_len=64)  # type: ignore[arg-type]


def test_prefix_caching_with_a_mamba_group_needs_align_mode(
    make_manager: ManagerFactory,
) -> None:
    mamba = KVCacheConfig(
        8,
        (
            KVCacheGroup(("attn",), FULL),
            KVCacheGroup(("mamba",), MambaSpec(block_size=4, state_bytes=16)),
        ),
    )
    message = (
        "mamba_cache_mode must be 'align' for a Mamba group when prefix caching is on "
        "(enable_caching=True), got 'none': plan with plan_kv_cache(..., enable_caching=True), "
        "or convert a plan with hybridkv.reference.planner.with_mamba_cache_mode(config, True)"
    )
    with pytest.raises(ValueError, match=exactly(message)):
        make_manager(mamba, max_model_len=64)


def test_cache_blocks_beyond_the_request_is_rejected(manager: BackendManager) -> None:
    a = request(list(range(10)), "a")
    before = manager.snapshot()
    with pytest.raises(
        ValueError,
        match=exactly("num_computed_tokens must be at most the request's 10 tokens, got 11"),
    ):
        manager.cache_blocks(a, 11)
    with pytest.raises(
        ValueError, match=exactly("num_computed_tokens must be a non-negative int, got -1")
    ):
        manager.cache_blocks(a, -1)
    assert manager.snapshot() == before


def test_cache_blocks_up_to_the_whole_request_is_accepted(manager: BackendManager) -> None:
    """``num_computed_tokens`` may equal the request's length: every full block is cached."""
    a = request(list(range(10)), "a")
    manager.cache_blocks(a, 10)
    manager.check_invariants()
    assert manager.get_computed_blocks(request(list(range(9))))[1] == 8
