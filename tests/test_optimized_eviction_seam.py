"""The eviction seam of the optimized backend: the same policy, the same blocks, on both.

``TorchKVCacheManager(..., eviction_policy=...)`` must make exactly the reference pool's calls
in the same order, so that one policy reuses the same blocks, finds the same hits and emits the
same events on both backends. The differential machine runs every shipped policy on both in
lockstep (each call's result, the pool snapshot, events and statistics compared, and both
invariant checkers run, after every operation); ``LRUPolicy`` through the seam replays every
golden trace; a policy that fails is named and nothing is lost.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import pytest

from hybridkv.conformance import __main__ as conformance_command
from hybridkv.conformance.adapters import EngineOptions, backends_named, manager_backend
from hybridkv.conformance.adapters.backends import small_thresholds_on_odd_pools
from hybridkv.conformance.adapters.protocol_adapter import ProtocolAdapter
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.conformance.machine import run_differential
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.policies import CachedBlock, LRUPolicy, PolicyError
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

LRU_SEAM = "hybridkv.policies.lru:LRUPolicy"
SHIPPED = (LRU_SEAM, "hybrid", "cost", "arc", "hybrid-arc")
BACKENDS: tuple[type[Any], ...] = (KVCacheManager, TorchKVCacheManager)
KV = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}


def _config(num_blocks: int = 9) -> KVCacheConfig:
    return KVCacheConfig(num_blocks, (KVCacheGroup(("l0",), FullAttentionSpec(**KV)),))


def _hybrid_config(num_blocks: int = 17) -> KVCacheConfig:
    """One full group and two sliding-window groups of window 8 (the document's example in
    miniature, as ``test_eviction_seam`` builds it)."""
    sw = SlidingWindowSpec(**KV, sliding_window=8)
    groups = (
        KVCacheGroup(("full",), FullAttentionSpec(**KV)),
        KVCacheGroup(("sw0",), sw),
        KVCacheGroup(("sw1",), sw),
    )
    return KVCacheConfig(num_blocks, groups)


class Recorder(LRUPolicy):
    """LRU, writing down every call it hears (with each cached block's keys)."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []

    def cached(self, block: CachedBlock) -> None:
        self.calls.append(("cached", block.block_id, block.block_hash, block.group_id,
                           block.parent_hash, block.prefix_tokens))  # fmt: skip
        super().cached(block)

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        self.calls.append(("released", tuple(without_hash), tuple(with_hash)))
        super().released(without_hash, with_hash)

    def touched(self, block_ids: Sequence[int]) -> None:
        self.calls.append(("touched", tuple(block_ids)))
        super().touched(block_ids)

    def choose(self, n: int) -> Sequence[int]:
        answer = super().choose(n)
        self.calls.append(("choose", n, tuple(answer)))
        return answer

    def taken(self, block_ids: Sequence[int]) -> None:
        self.calls.append(("taken", tuple(block_ids)))
        super().taken(block_ids)

    def uncached(self, block_id: int) -> None:
        self.calls.append(("uncached", block_id))
        super().uncached(block_id)

    def reset(self) -> None:
        self.calls.append(("reset",))
        super().reset()


class Choosing(LRUPolicy):
    """Answers ``choose`` with a fixed list (to plant wrong answers)."""

    name = "planted"

    def __init__(self, answer: list[object]) -> None:
        super().__init__()
        self.answer = answer

    def choose(self, n: int) -> Sequence[int]:
        return self.answer  # type: ignore[return-value]


@pytest.mark.slow(seconds=7)
@pytest.mark.parametrize("policy", SHIPPED)
def test_each_shipped_policy_gives_the_same_blocks_hits_and_events_on_both_backends(
    policy: str,
) -> None:
    backends = [
        manager_backend("reference", KVCacheManager, eviction_policy=policy),
        manager_backend(
            "optimized",
            TorchKVCacheManager,
            # The machine's thresholds: vectorised lookups on half the layouts (the
            # vectorised steps and batches stay off under a policy).
            configure=small_thresholds_on_odd_pools,
            eviction_policy=policy,
            max_num_reqs=32,
        ),
    ]
    stats = run_differential(backends, max_examples=120, steps=40)
    assert stats.examples > 0
    assert stats.steps > stats.examples


def test_another_order_on_one_backend_is_caught_by_the_lockstep_run() -> None:
    """The lockstep run can fail: LRU against newest-first differs at the first reuse."""
    backends = [
        manager_backend("reference", KVCacheManager),
        manager_backend(
            "optimized",
            TorchKVCacheManager,
            eviction_policy="test_eviction_seam:NewestFirst",
            max_num_reqs=32,
        ),
    ]
    with pytest.raises(Exception, match="optimized differs from reference"):
        run_differential(backends, max_examples=40, steps=30, shrink=False)


@pytest.mark.slow(seconds=20)
@pytest.mark.parametrize("trace_set", ["unit", "engine"])
def test_lru_through_the_seam_replays_every_golden_trace_on_the_optimized_backend(
    trace_set: str,
) -> None:
    _, factory = manager_backend(
        "optimized-lru-seam", TorchKVCacheManager, eviction_policy=LRU_SEAM
    )
    names = trace_names(trace_set)
    assert len(names) > 100
    for name in names:
        matched, divergence = replay_trace(name, factory)
        assert divergence is None, str(divergence)
        assert matched > 0


def test_the_default_holds_no_policy() -> None:
    manager = TorchKVCacheManager(_config(), max_model_len=64)
    assert manager.eviction_policy == "lru"
    assert manager.pool.policy is None
    assert manager.state.layout.columns.defers
    seam = TorchKVCacheManager(_config(), max_model_len=64, eviction_policy=LRU_SEAM)
    assert seam.eviction_policy == "lru"
    assert seam.pool.policy is not None
    assert not seam.state.layout.columns.defers


def _traffic(manager: Any) -> None:
    """Two requests share a prefix, one is freed and hit again, a third evicts, then a reset."""
    a = Request("a", list(range(9)), hash_block_size=4)
    hit, num_hit, _ = manager.get_computed_blocks(a)
    assert manager.allocate_slots(a, 9 - num_hit, num_hit, hit) is not None
    manager.free(a)
    b = Request("b", list(range(9)), hash_block_size=4)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, 9 - num_hit, num_hit, hit) is not None
    for _ in range(3):
        b.append_output_token_ids(7)
        assert manager.allocate_slots(b, 1) is not None
    manager.free(b)
    c = Request("c", list(range(100, 113)), hash_block_size=4)
    assert manager.allocate_slots(c, 13) is not None
    manager.free(c)
    assert manager.reset_prefix_cache()
    manager.check_invariants()


@pytest.mark.parametrize("config", [_config(6), _hybrid_config(17)], ids=["full", "hybrid"])
def test_a_policy_hears_the_same_calls_in_the_same_order_on_both_backends(
    config: KVCacheConfig,
) -> None:
    calls = []
    for backend in BACKENDS:
        policy = Recorder()
        _traffic(backend(config, max_model_len=64, eviction_policy=policy))
        calls.append(policy.calls)
    assert calls[0] == calls[1]
    assert ("reset",) in calls[0]
    assert any(call[0] == "touched" for call in calls[0])


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        ([1], "eviction policy 'planted' chose 1 blocks for 2 new blocks"),
        ([1, 1], "eviction policy 'planted' chose block 1 twice"),
        ([0, 1], "eviction policy 'planted' chose block 0, which is not free"),
        ([1, 99], "eviction policy 'planted' chose block 99, which is not free"),
        ([1, "2"], "eviction policy 'planted' chose '2', not a block id"),
    ],
)
def test_a_wrong_answer_is_named_and_changes_nothing_on_the_optimized_backend(
    answer: list[object], message: str
) -> None:
    manager = TorchKVCacheManager(_config(5), max_model_len=64, eviction_policy=Choosing(answer))
    before = manager.snapshot()
    request = Request("r", list(range(8)), hash_block_size=4)
    with pytest.raises(PolicyError, match=re.escape(message)):
        manager.allocate_slots(request, 8)
    assert manager.snapshot() == before
    manager.check_invariants()


def test_a_held_block_is_not_free_on_the_optimized_backend() -> None:
    manager = TorchKVCacheManager(_config(5), max_model_len=64, eviction_policy=Choosing([1, 2]))
    a = Request("a", list(range(8)), hash_block_size=4)
    assert manager.allocate_slots(a, 8) is not None  # takes 1 and 2
    with pytest.raises(PolicyError, match="chose block 1, which is not free"):
        manager.allocate_slots(Request("b", list(range(50, 58)), hash_block_size=4), 8)
    manager.check_invariants()
    assert manager.num_free_blocks == 2
    manager.free(a)
    assert manager.num_free_blocks == 4


class FailsOnSecondChoice(LRUPolicy):
    """LRU that raises from its second ``choose`` on: a later group of one step fails."""

    name = "fails-second"

    def __init__(self) -> None:
        super().__init__()
        self.choices = 0

    def choose(self, n: int) -> Sequence[int]:
        self.choices += 1
        if self.choices > 1:
            raise RuntimeError("no more")
        return super().choose(n)


@pytest.mark.parametrize("backend", BACKENDS, ids=["reference", "optimized"])
def test_a_policy_failing_for_a_later_group_loses_no_block(backend: type[Any]) -> None:
    """Three groups take a block each in one step; the policy raises for the second: the error
    names it, the invariants hold and freeing the request gives every block back."""
    manager = backend(_hybrid_config(17), max_model_len=64, eviction_policy=FailsOnSecondChoice())
    request = Request("r", list(range(4)), hash_block_size=4)
    with pytest.raises(PolicyError, match=r"'fails-second' raised in choose: RuntimeError"):
        manager.allocate_slots(request, 4)
    manager.check_invariants()
    manager.free(request)
    manager.check_invariants()
    assert manager.num_free_blocks == 16


def test_a_policy_that_raises_is_named_on_the_optimized_backend() -> None:
    class Broken(LRUPolicy):
        name = "broken"

        def touched(self, block_ids: Sequence[int]) -> None:
            raise KeyError("oops")

    manager = TorchKVCacheManager(_config(6), max_model_len=64, eviction_policy=Broken())
    a = Request("a", list(range(9)), hash_block_size=4)
    assert manager.allocate_slots(a, 9) is not None
    manager.free(a)
    b = Request("b", list(range(9)), hash_block_size=4)
    hit, num_hit, _ = manager.get_computed_blocks(b)
    with pytest.raises(PolicyError, match=r"'broken' raised in touched: KeyError: 'oops'"):
        manager.allocate_slots(b, 9 - num_hit, num_hit, hit)
    manager.check_invariants()


def test_the_conformance_command_checks_both_backends_under_a_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--eviction", "arc", "--examples", "12", "--steps", "20", "--hit-states", "20"]
    status = conformance_command.main(argv)
    out = capsys.readouterr().out
    assert status == 0, out
    assert "golden traces skipped: they record vLLM's LRU order, not arc" in out
    assert "under test reference, optimized[cpu]" in out
    assert "PASS  differential machine" in out


def test_the_conformance_command_refuses_an_unknown_policy_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert conformance_command.main(["--eviction", "fifo"]) == 2
    assert "eviction_policy 'fifo' is not a policy name" in capsys.readouterr().err


def test_the_conformance_backends_take_the_policy() -> None:
    reference, optimized = backends_named("both", eviction_policy="cost")
    adapters = [
        factory(_config(), 64, True, False, EngineOptions())
        for _, factory in (reference, optimized)
    ]
    managers = [adapter.manager for adapter in adapters if isinstance(adapter, ProtocolAdapter)]
    assert [getattr(m, "eviction_policy", None) for m in managers] == ["cost", "cost"]
