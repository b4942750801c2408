"""The eviction seam of the reference block pool: ``eviction_policy=`` and what a policy hears.

The default ``"lru"`` is vLLM's free queue untouched; ``LRUPolicy`` is the same order through
the seam, so every golden trace must replay identically with it. Another order must change
which blocks are reused, and a policy that fails must be named without breaking the pool.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from hybridkv.conformance.adapters import manager_backend
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.policies import POLICIES, CachedBlock, LRUPolicy, PolicyError, resolve_policy
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

KV = {"block_size": 4, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}


def _config(num_blocks: int = 9) -> KVCacheConfig:
    full = FullAttentionSpec(**KV)
    return KVCacheConfig(num_blocks, (KVCacheGroup(("l0",), full),))


def _hybrid_config(num_blocks: int = 17) -> KVCacheConfig:
    """The document's 10 full + 20 sliding-window layers in miniature: one full group, two
    sliding-window groups of window 8."""
    full = FullAttentionSpec(**KV)
    sw = SlidingWindowSpec(**KV, sliding_window=8)
    groups = (
        KVCacheGroup(("full",), full),
        KVCacheGroup(("sw0",), sw),
        KVCacheGroup(("sw1",), sw),
    )
    return KVCacheConfig(num_blocks, groups)


class Recorder(LRUPolicy):
    """LRU, writing down every call it hears."""

    name = "recorder"

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[object, ...]] = []

    def cached(self, block: CachedBlock) -> None:
        self.calls.append(("cached", block.block_id, block.group_id, block.prefix_tokens))

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        self.calls.append(("released", tuple(without_hash), tuple(with_hash)))
        super().released(without_hash, with_hash)

    def touched(self, block_ids: Sequence[int]) -> None:
        self.calls.append(("touched", tuple(block_ids)))
        super().touched(block_ids)

    def taken(self, block_ids: Sequence[int]) -> None:
        self.calls.append(("taken", tuple(block_ids)))
        super().taken(block_ids)

    def reset(self) -> None:
        self.calls.append(("reset",))


class NewestFirst(LRUPolicy):
    """Reuses the most recently released free block first (the opposite of LRU's tail)."""

    name = "newest-first"

    def choose(self, n: int) -> Sequence[int]:
        return list(reversed(list(self._free)))[:n]


class Choosing(LRUPolicy):
    """Answers ``choose`` with a fixed list (to plant wrong answers)."""

    name = "planted"

    def __init__(self, answer: list[object]) -> None:
        super().__init__()
        self.answer = answer

    def choose(self, n: int) -> Sequence[int]:
        return self.answer  # type: ignore[return-value]


def _admit(manager: KVCacheManager, rid: str, tokens: list[int]) -> Request:
    request = Request(rid, tokens, hash_block_size=4)
    hit, num_hit, _ = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    assert blocks is not None
    return request


@pytest.mark.slow(seconds=9)
@pytest.mark.parametrize("trace_set", ["unit", "engine"])
def test_lru_through_the_seam_replays_every_golden_trace(trace_set: str) -> None:
    """Block ids, hits, events and snapshots equal vLLM 0.33's on every recorded trace."""
    _, factory = manager_backend(
        "lru-seam", KVCacheManager, eviction_policy="hybridkv.policies.lru:LRUPolicy"
    )
    names = trace_names(trace_set)
    assert len(names) > 100
    for name in names:
        matched, divergence = replay_trace(name, factory)
        assert divergence is None, str(divergence)
        assert matched > 0


def test_another_order_changes_which_prefixes_survive() -> None:
    """Requests a and b (two cached blocks each) are freed in that order, then d takes two new
    blocks: under LRU d evicts a's blocks (released first) and b's prefix still hits; under
    newest-first d evicts b's and a's prefix hits."""
    hits = {}
    for policy in ("lru", "test_eviction_seam:NewestFirst"):
        manager = KVCacheManager(_config(5), max_model_len=64, eviction_policy=policy)
        a = _admit(manager, "a", list(range(8)))
        b = _admit(manager, "b", list(range(100, 108)))
        manager.free(a)
        manager.free(b)
        _admit(manager, "d", list(range(200, 208)))
        manager.check_invariants()
        hits[policy] = tuple(
            manager.get_computed_blocks(Request(rid, tokens, hash_block_size=4))[1]
            for rid, tokens in (("a2", [*range(8), 9]), ("b2", [*range(100, 108), 9]))
        )
    assert hits == {"lru": (0, 8), "test_eviction_seam:NewestFirst": (8, 0)}


def test_a_policy_hears_cached_released_touched_taken_and_reset() -> None:
    policy = Recorder()
    manager = KVCacheManager(_config(5), max_model_len=64, eviction_policy=policy)
    assert policy.calls == [("released", (1, 2, 3, 4), ())]
    a = _admit(manager, "a", list(range(9)))  # two full blocks cached, a third partial
    manager.free(a)
    b = _admit(manager, "b", list(range(9)))  # hits a's two blocks
    manager.free(b)
    assert manager.reset_prefix_cache()
    assert policy.calls[1:] == [
        ("taken", (1, 2, 3)),
        ("cached", 1, 0, 4),
        ("cached", 2, 0, 8),
        ("released", (3,), (2, 1)),  # walked tail first: the tail is evicted first
        ("touched", (1, 2)),
        ("taken", (3,)),
        ("released", (3,), (2, 1)),
        ("reset",),
    ]
    assert manager.eviction_policy == "recorder"


def test_a_hybrid_layout_tells_the_policy_each_groups_blocks() -> None:
    policy = Recorder()
    manager = KVCacheManager(_hybrid_config(), max_model_len=64, eviction_policy=policy)
    _admit(manager, "a", list(range(12)))
    cached = [call for call in policy.calls if call[0] == "cached"]
    assert sorted((c[2], c[3]) for c in cached) == sorted(
        (g, t) for g in (0, 1, 2) for t in (4, 8, 12)
    )
    manager.check_invariants()


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
def test_a_wrong_answer_is_named_and_changes_nothing(answer: list[object], message: str) -> None:
    manager = KVCacheManager(_config(5), max_model_len=64, eviction_policy=Choosing(answer))
    before = manager.snapshot()
    request = Request("r", list(range(8)), hash_block_size=4)
    with pytest.raises(PolicyError, match=message):
        manager.allocate_slots(request, 8)
    assert manager.snapshot() == before
    manager.check_invariants()


def test_a_held_block_is_not_free() -> None:
    policy = Choosing([1, 2])
    manager = KVCacheManager(_config(5), max_model_len=64, eviction_policy=policy)
    _admit(manager, "a", list(range(8)))  # takes 1 and 2
    with pytest.raises(PolicyError, match="chose block 1, which is not free"):
        manager.allocate_slots(Request("b", list(range(50, 58)), hash_block_size=4), 8)
    manager.check_invariants()


def test_a_policy_that_raises_is_named() -> None:
    class Broken(LRUPolicy):
        name = "broken"

        def choose(self, n: int) -> Sequence[int]:
            raise KeyError("oops")

    manager = KVCacheManager(_config(5), max_model_len=64, eviction_policy=Broken())
    with pytest.raises(PolicyError, match=r"'broken' raised in choose: KeyError: 'oops'"):
        manager.allocate_slots(Request("r", list(range(8)), hash_block_size=4), 8)
    manager.check_invariants()


def test_policy_choices_resolve_or_are_refused_by_name() -> None:
    assert resolve_policy("lru") is None
    assert isinstance(resolve_policy("hybridkv.policies.lru:LRUPolicy"), LRUPolicy)
    mine = LRUPolicy()
    assert resolve_policy(mine) is mine
    names = ", ".join(sorted(POLICIES))
    for choice, message in [
        ("fifo", f"eviction_policy 'fifo' is not a policy name ({names}) nor 'module:Class'"),
        ("no_such_module:X", "eviction_policy 'no_such_module:X': cannot import"),
        ("hybridkv.policies:Nope", "hybridkv.policies has no class 'Nope'"),
        ("collections:OrderedDict", "OrderedDict lacks the EvictionPolicy methods"),
        (42, f"eviction_policy must be one of {sorted(POLICIES)}, 'module:Class' or an"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve_policy(choice)
