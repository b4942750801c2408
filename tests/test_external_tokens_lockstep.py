"""Tokens a KV connector supplies, on both backends in lockstep: random admissions with
external tokens (loads done at once or later), decode steps, frees and deferred frees on the
design document's layout, a chunked layout and a Mamba hybrid; the same block ids, new blocks
and pool after every call, and each backend's invariants."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")

from policy_workload import chunked_config, document_config, mamba_config

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import KVCacheConfig

CONFIGS = {"document": document_config, "chunked": chunked_config, "mamba": mamba_config}

STEPS = st.lists(
    st.tuples(
        st.sampled_from(["admit", "decode", "free", "defer"]),
        st.integers(0, 3),  # prefix
        st.integers(0, 32),  # local tokens beyond the hit, or which request
        st.integers(0, 24),  # external tokens
        st.booleans(),  # the load finishes later (delay_cache_blocks)
    ),
    max_size=25,
)


class Lockstep:
    """One call on both backends; their answers and pools must agree."""

    def __init__(self, config: KVCacheConfig) -> None:
        self.managers: list[Any] = [
            KVCacheManager(config, max_model_len=96),
            TorchKVCacheManager(config, max_model_len=96),
        ]

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        answers = [getattr(m, name)(*args, **kwargs) for m in self.managers]
        ids = [None if a is None else getattr(a, "block_ids", a) for a in answers]
        assert ids[0] == ids[1], name
        snapshots = [m.snapshot() for m in self.managers]
        assert snapshots[0] == snapshots[1], name
        for manager in self.managers:
            manager.check_invariants()
        return answers[0]


def _admit(both: Lockstep, number: int, step: tuple[str, int, int, int, bool]) -> Request | None:
    _, prefix, local, external, later = step
    tokens = [1000 * prefix + t for t in range(8 + local + external)] + [number]
    request = Request(f"r{number}", tokens, hash_block_size=4)
    hit, num_hit, _ = both.call("get_computed_blocks", request)
    external = min(external, request.num_tokens - num_hit - 1)
    later = later and external > 0  # an async load has tokens to load
    new_tokens = 0 if later else request.num_tokens - num_hit - external
    blocks = both.call(
        "allocate_slots",
        request,
        new_tokens,
        num_hit,
        hit,
        num_external_computed_tokens=external,
        delay_cache_blocks=later,
    )
    if blocks is None:
        return None
    if later:  # the load is done: cache it, then compute the rest
        request.num_computed_tokens = num_hit + external
        both.call("cache_blocks", request, request.num_computed_tokens)
        both.call("new_step_starts")
        if both.call("allocate_slots", request, request.num_tokens - num_hit - external) is None:
            both.call("free", request)
            return None
    request.num_computed_tokens = request.num_tokens
    return request


@pytest.mark.parametrize("layout", sorted(CONFIGS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=STEPS)
def test_external_tokens_give_both_backends_the_same_blocks(
    layout: str, steps: list[tuple[str, int, int, int, bool]]
) -> None:
    both = Lockstep(CONFIGS[layout]())
    running: list[Request] = []
    for number, step in enumerate(steps):
        both.call("new_step_starts")
        op, _, which, _, _ = step
        if op == "admit":
            request = _admit(both, number, step)
            if request is not None:
                running.append(request)
        elif op == "decode" and running:
            request = running[which % len(running)]
            request.append_output_token_ids(7)
            if both.call("allocate_slots", request, 1) is not None:
                request.num_computed_tokens = request.num_tokens
        elif op == "free" and running:
            both.call("free", running.pop(which % len(running)))
        elif op == "defer" and running:
            held = both.call("pop_blocks_for_free", running.pop(which % len(running)).request_id)
            both.call("free_blocks", held[::-1])


@pytest.mark.parametrize("manager_class", [KVCacheManager, TorchKVCacheManager])
def test_external_tokens_for_a_running_request_are_refused_and_change_nothing(
    manager_class: type[Any],
) -> None:
    manager = manager_class(document_config(), max_model_len=96)
    request = Request("r", list(range(20)), hash_block_size=4)
    manager.allocate_slots(request, 20)
    request.num_computed_tokens = 20
    before = manager.snapshot()
    with pytest.raises(ValueError, match=r"num_external_computed_tokens=8 must be 0"):
        manager.allocate_slots(request, 1, num_external_computed_tokens=8)
    with pytest.raises(ValueError, match=r"num_external_computed_tokens must be a non-neg"):
        manager.allocate_slots(request, 1, num_external_computed_tokens=-1)
    assert manager.snapshot() == before
    manager.check_invariants()
