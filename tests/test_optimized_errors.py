"""Bad input to the optimized backend: the reference's ``ValueError`` (same message), raised
before anything changes, for every case the reference's own error tests cover."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import KVCacheBlocks, KVCacheManager, Request
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
BAD_CALLS: list[dict[str, object]] = [
    {"num_new_tokens": -1},
    {"num_new_tokens": 0},
    {"num_new_tokens": 2.5},
    {"num_new_tokens": True},
    {"num_new_tokens": 1, "num_lookahead_tokens": -2},
    {"num_new_tokens": 1, "num_new_computed_tokens": -4},
    {"num_new_tokens": 1, "num_new_computed_tokens": 4},
    {"num_new_tokens": 1, "new_computed_blocks": KVCacheBlocks(((),))},
    {
        "num_new_tokens": 1,
        "num_new_computed_tokens": 4,
        "new_computed_blocks": KVCacheBlocks(((1, 2), (0, 6))),
    },
    {
        "num_new_tokens": 1,
        "num_new_computed_tokens": 4,
        "new_computed_blocks": KVCacheBlocks(((99,), (0,))),
    },
    {
        "num_new_tokens": 1,
        "num_new_computed_tokens": 4,
        "new_computed_blocks": KVCacheBlocks(((-1,), (0,))),
    },
    {
        "num_new_tokens": 1,
        "num_new_computed_tokens": 3,
        "new_computed_blocks": KVCacheBlocks(((1,), (0,))),
    },
]


def managers() -> tuple[KVCacheManager, TorchKVCacheManager]:
    out: tuple[KVCacheManager, TorchKVCacheManager] = (
        KVCacheManager(CONFIG, max_model_len=64),
        TorchKVCacheManager(CONFIG, max_model_len=64),
    )
    for m in out:
        a = Request("a", list(range(10)), hash_block_size=4)
        assert m.allocate_slots(a, 10) is not None
    return out


Manager = KVCacheManager | TorchKVCacheManager


def error_of(call: Callable[[], object]) -> str:
    with pytest.raises(ValueError) as info:  # noqa: PT011 (the message is compared below)
        call()
    return str(info.value)


@pytest.mark.parametrize("kwargs", BAD_CALLS)
def test_bad_allocation_arguments_raise_the_reference_error(kwargs: dict[str, Any]) -> None:
    ref, opt = managers()
    before = opt.snapshot()
    new = Request("b", [1, 2, 3, 4, 5], hash_block_size=4)
    messages = [error_of(partial(m.allocate_slots, new, **kwargs)) for m in (ref, opt)]
    assert messages[0] == messages[1]
    assert opt.snapshot() == before == ref.snapshot()
    assert opt.get_block_ids("b") == ([], [])
    opt.check_invariants()


ZERO_LIKE_COUNTS = [
    {name: value}
    for name in (
        "num_new_computed_tokens",
        "num_lookahead_tokens",
        "reserved_blocks",
        "watermark_blocks",
        "num_encoder_tokens",
    )
    for value in (0.0, False)
]


@pytest.mark.parametrize("kwargs", ZERO_LIKE_COUNTS)
def test_a_running_requests_quiet_step_refuses_a_zero_that_is_not_an_int(
    kwargs: dict[str, Any],
) -> None:
    """The quiet exit matches the int 0 by identity; ``0.0`` and ``False`` equal it but are
    not ints, so they take the checked path and get the reference's error."""
    ref, opt = managers()
    before = opt.snapshot()
    messages = []
    for m in (ref, opt):
        running = Request("a", list(range(10)), hash_block_size=4)
        running.num_computed_tokens = 10
        messages.append(error_of(partial(m.allocate_slots, running, 1, **kwargs)))
    assert messages[0] == messages[1]
    assert messages[1].startswith(f"{next(iter(kwargs))} must be a non-negative int")
    assert opt.snapshot() == before == ref.snapshot()


def test_other_bad_input_raises_the_reference_error() -> None:
    ref, opt = managers()
    running = Request("a", list(range(10)), hash_block_size=4)
    running.num_computed_tokens = 10
    wrong_size = Request("w", list(range(10)), hash_block_size=2)

    def calls(m: Manager) -> list[Callable[[], object]]:
        return [
            partial(m.allocate_slots, running, 1, 4, KVCacheBlocks(((1,), (0,)))),
            partial(m.get_computed_blocks, wrong_size),
            partial(m.allocate_slots, wrong_size, 10),
            partial(m.cache_blocks, running, 11),
            partial(m.cache_blocks, running, -1),
        ]

    for a, b in zip(calls(ref), calls(opt), strict=True):
        assert error_of(a) == error_of(b)
    assert opt.snapshot() == ref.snapshot()


def test_bad_configurations_raise_the_reference_error() -> None:
    mamba = KVCacheConfig(
        8,
        (
            KVCacheGroup(("attn",), FULL),
            KVCacheGroup(("mamba",), MambaSpec(block_size=4, state_bytes=16)),
        ),
    )
    mixed = KVCacheConfig(
        8,
        (
            KVCacheGroup(("a",), FULL),
            KVCacheGroup(
                ("b",), FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, dtype_bytes=4)
            ),
        ),
    )
    bad: list[tuple[Any, int]] = [(CONFIG, 0), (mamba, 64), (3, 64)]
    for config, max_model_len in bad:
        assert error_of(partial(KVCacheManager, config, max_model_len)) == error_of(
            partial(TorchKVCacheManager, config, max_model_len)
        )
    # Groups with different block sizes are taken, as the reference takes them.
    assert TorchKVCacheManager(mixed, 64).block_table(1).shape[1] == 16
    assert KVCacheManager(mixed, 64).block_size == 8
