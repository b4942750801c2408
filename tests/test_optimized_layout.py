"""``GroupLayout``: the per-group constants a manager computes once from its config."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from lookup_layouts import FULL, SIZES, WINDOWS

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.spec import ChunkedLocalAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

WIDER = KVCacheGroup(("sw.wide",), SlidingWindowSpec(sliding_window=13, **SIZES))
CHUNKED = KVCacheGroup(("chunk",), ChunkedLocalAttentionSpec(attention_chunk_size=8, **SIZES))
LAYOUT = TorchKVCacheManager(
    KVCacheConfig(64, (WINDOWS[0], FULL, WIDER, CHUNKED, WINDOWS[1])), 4096, enable_caching=False
).state.layout


def test_groups_under_one_rule_share_it_in_the_distinct_rules() -> None:
    """Two 8-token windows (groups 0 and 4) follow one rule: five groups, four distinct rules,
    in the order they first appear."""
    assert len(LAYOUT.distinct_rules) == 4
    assert LAYOUT.rule_plan == (0, 1, 2, 3, 0)
    assert [LAYOUT.distinct_rules[i] for i in LAYOUT.rule_plan] == list(LAYOUT.rules)


@given(st.integers(0, 300))
def test_each_groups_skipped_positions_are_its_own_rules(num_computed_tokens: int) -> None:
    """Each distinct rule asked once gives every group what its own rule gives."""
    expected = [rule.skipped_positions(num_computed_tokens) for rule in LAYOUT.rules]
    assert LAYOUT.skipped_positions(num_computed_tokens) == expected


def test_the_skipped_positions_of_the_documents_window_case() -> None:
    """40 computed tokens, blocks of 4: the next token reads tokens 33 … 40 under an 8-token
    window (positions 0 … 7 skipped: tokens 0 … 31), 28 … 40 under a 13-token window
    (positions 0 … 6), chunk 40 … 47 of 8-token chunks (positions 0 … 9); full attention
    skips nothing."""
    assert LAYOUT.skipped_positions(40) == [8, 0, 7, 10, 8]
