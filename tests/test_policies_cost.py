"""``cost``: the free block saving the fewest recompute FLOPs per byte, mixed with recency,
is reused first; α weighs the two."""

from __future__ import annotations

import math

import pytest
from policy_workload import KV, admit, document_config, useless_cache

from hybridkv.policies import CachedBlock, CostPolicy
from hybridkv.policies.cost import recompute_flops
from hybridkv.reference import KVCacheManager
from hybridkv.spec import FullAttentionSpec, MambaSpec, SlidingWindowSpec

FULL = FullAttentionSpec(**KV)
WINDOW = SlidingWindowSpec(**KV, sliding_window=8)
MAMBA = MambaSpec(block_size=4, state_bytes=64, mamba_cache_mode="align")


def _per_byte(spec: object, tokens: int) -> float:
    block = CachedBlock(1, b"x", 0, spec, None, tokens)  # type: ignore[arg-type]
    return recompute_flops(block, 6.0) / block.spec.page_size_bytes


def test_the_flops_model_grows_with_the_context_each_type_reads() -> None:
    """Width 8, 4-token blocks of 32-byte tokens: attention saves 4·(24·64 + 4·8·c) FLOPs per
    128 bytes, c the middle token's context (capped at the window of 8); a 64-byte Mamba
    state saves 6 FLOPs per state byte for every token of its prefix."""
    assert [_per_byte(FULL, t) for t in (4, 8, 16, 24)] == [50.0, 54.0, 62.0, 70.0]
    assert [_per_byte(WINDOW, t) for t in (4, 8, 16, 24)] == [50.0, 54.0, 56.0, 56.0]
    assert [_per_byte(MAMBA, t) for t in (4, 8, 16, 24)] == [24.0, 48.0, 96.0, 144.0]


@pytest.mark.parametrize(
    ("alpha", "order"),
    [(1.0, [5, 2, 1, 3, 4]), (0.0, [5, 1, 2, 3, 4]), (0.5, [5, 2, 1, 3, 4])],
)
def test_alpha_weighs_flops_per_byte_against_recency(alpha: float, order: list[int]) -> None:
    """Blocks 1-4 (full at 4 tokens, Mamba at 4, full at 24, Mamba at 24; no chain, so all are
    candidates) released in that order; block 5 holds no key. α = 1 ranks by FLOPs per byte
    alone, α = 0 by release."""
    policy = CostPolicy(alpha=alpha)
    policy.released([1, 2, 3, 4, 5], [])
    for block_id, name, group, spec, tokens in (
        (1, b"p", 0, FULL, 4),
        (2, b"p", 1, MAMBA, 4),  # the full group holds both prefixes: no state is useless
        (3, b"q", 0, FULL, 24),
        (4, b"q", 1, MAMBA, 24),
    ):
        policy.cached(CachedBlock(block_id, name, group, spec, None, tokens))
    policy.touched([1, 2, 3, 4])
    policy.released([], [1, 2, 3, 4])
    assert list(policy.choose(5)) == order
    stamp, horizon = 2, 5  # block 3 released third; five blocks announced at start
    assert policy.score(3, stamp) == alpha * math.log2(1 + 70.0) + (1 - alpha) * stamp / horizon


def test_with_marconis_candidates_chain_interiors_go_last_on_the_document_example() -> None:
    """``candidates_first`` at Marconi's α = 0.5, after a and b (a's first three blocks, then
    its own) are freed: the 13 blocks without a key, then the candidates by score (every window
    block, and the last full block of each chain: a's 6 and b's 28), then the full-attention
    blocks with a cached child by score."""
    policy = CostPolicy(alpha=0.5, candidates_first=True)
    manager = KVCacheManager(document_config(41), max_model_len=64, eviction_policy=policy)
    a = admit(manager, "a", [*range(24), 7])
    b = admit(manager, "b", [*range(12), *range(500, 512), 7])
    assert a is not None
    assert b is not None
    manager.free(a)
    manager.free(b)
    order = list(policy.choose(manager.block_pool.num_free_blocks))
    assert order[:13] == [33, 29, 25, 21, 14, 7, 34, 35, 36, 37, 38, 39, 40]
    assert order[13:33] == [8, 13, 15, 12, 11, 20, 19, 18, 6, 28, 27, 9, 26, 10, 32, 31, 24,
                            16, 30, 17]  # fmt: skip
    assert order[33:] == [4, 1, 5, 2, 3, 22, 23]
    manager.check_invariants()


@pytest.mark.parametrize(
    ("candidates_first", "order"), [(False, [5, 1, 2, 3]), (True, [5, 2, 3, 1])]
)
def test_an_older_chain_interior_goes_before_a_newer_leaf_by_default(
    candidates_first: bool, order: list[int]
) -> None:
    """A two-block chain (1, then 2 under it) freed before a one-block prompt (3); block 5
    holds no key. By default every keyed block ranks by score, so the older chain goes first,
    interior included; with Marconi's candidates the interior 1 waits behind the newer leaf 3."""
    policy = CostPolicy(candidates_first=candidates_first)
    policy.released([1, 2, 3, 5], [])
    for block_id, name, parent, tokens in ((1, b"a0", None, 4), (2, b"a1", b"a0", 8)):
        policy.cached(CachedBlock(block_id, name, 0, FULL, parent, tokens))
    policy.cached(CachedBlock(3, b"b0", 0, FULL, None, 4))
    policy.touched([1, 2, 3])
    policy.released([], [1, 2])
    policy.released([], [3])
    assert list(policy.choose(4)) == order


def test_the_default_alpha_is_recency_first() -> None:
    """α = 0.02: a whole pool's worth of releases outweighs 49 bits of FLOPs per byte."""
    assert CostPolicy().alpha == 0.02
    assert CostPolicy().candidates_first is False


def test_a_bad_alpha_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^alpha must be in \[0, 1\], got 1.5$"):
        CostPolicy(alpha=1.5)


def test_without_duplicates_first_a_second_holder_is_scored_with_the_rest() -> None:
    """``duplicates_first=False``: h1's second holder (block 10 of ``hybrid``'s useless-block
    cache) is no longer reused first; the other useless blocks still are."""
    from hybridkv.policies.hybrid import OTHER, USELESS

    for first, tier, order in ((True, USELESS, [7, 9, 10, 1]), (False, OTHER, [7, 9, 1, 2])):
        policy = CostPolicy(duplicates_first=first)
        for block in useless_cache():
            policy.cached(block)
        policy.released([], list(range(1, 11)))
        assert (policy.tier(7), policy.tier(9), policy.tier(10)) == (USELESS, USELESS, tier)
        assert list(policy.choose(4)) == order
