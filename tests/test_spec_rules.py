"""The rules of ``hybridkv.spec.rules``: the document's examples, then each contract at scale.

CrossHair proves the contracts over small bounded inputs; these tests check the same properties
(and a brute-force equivalent where one exists) over inputs far past those bounds.
"""

from __future__ import annotations

from fractions import Fraction
from math import ceil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.spec import rules

SETTINGS = settings(max_examples=200, deadline=None)

tokens = st.integers(0, 1_000_000)
positive_tokens = st.integers(1, 1_000_000)
block_sizes = st.integers(1, 1024)
windows = st.integers(1, 100_000)
bools = st.lists(st.booleans(), max_size=64)


# --- The document's examples --------------------------------------------------------------------


def test_full_attention_hit_stops_at_the_first_miss() -> None:
    """Prefix caching, Case 0: blocks 0–6 cached, 7 missing → a hit of 7 (block size 1)."""
    cached = [True] * 7 + [False] + [True] * 4
    assert rules.full_attention_hit_blocks(cached, len(cached)) == 7


def test_sliding_window_hit_picks_14_over_5_and_6() -> None:
    """Prefix caching, Case 1: window 4, block size 1, a 15-token prompt.

    Tokens 2–5 and 11–13 are cached. A hit needs its last window − 1 = 3 tokens cached, so 5
    ([2, 3, 4]), 6 ([3, 4, 5]) and 14 ([11, 12, 13]) are the valid hits; the hit may cover at
    most 14 tokens (the last token is always computed); the right-to-left scan returns 14, with
    real blocks from 11 on.
    """
    cached = [i in {2, 3, 4, 5, 11, 12, 13} for i in range(14)]
    needed = rules.sliding_window_hit_blocks_needed(sliding_window=4, block_size=1)
    assert needed == 3
    valid = [k for k in range(1, 15) if rules.window_hit_is_valid(cached, needed, k)]
    assert valid == [5, 6, 14]
    assert rules.sliding_window_hit_blocks(cached, needed) == (14, 11)


def test_gemma3_27b_pads_its_last_sliding_group() -> None:
    """Allocation, Case 3: min(52, 10) = 10 layers per group; 6 sliding groups, 8 padding."""
    assert rules.group_size([52, 10]) == 10
    assert rules.num_groups_of_type(52, 10) == 6
    assert rules.num_padding_slots(52, 10) == 8
    assert rules.group_layer_ranges(52, 10)[-1] == (50, 52)


def test_case2_model_splits_twenty_sliding_layers_in_two_groups() -> None:
    """Allocation, Case 2: 20 sliding + 10 full → sw.0–sw.9 and sw.10–sw.19, no padding."""
    assert rules.group_layer_ranges(20, 10) == ((0, 10), (10, 20))
    assert rules.num_padding_slots(20, 10) == 0


def test_case4_raise_is_the_smallest_block_multiple_that_holds_the_state() -> None:
    """Allocation, Case 4: page 16 × 4096 = 65536 < 1_000_000 ≤ 256 × 4096."""
    assert rules.raised_block_size(16, 4096, 1_000_000) == 256
    assert rules.raised_block_size(16, 4096, 65536) == 16
    assert rules.raised_block_size(16, 4096, 65537) == 32


def test_case2_request_bounds_for_block_16_window_32() -> None:
    """The document's 112-token request: 7 full blocks; a window of 32 spans at most 3 blocks."""
    assert rules.max_blocks_full_attention(112, 16) == 7
    # One token per step: the 31 tokens before it and itself straddle at most 3 blocks.
    assert rules.max_blocks_sliding_window(112, 16, 32, 1) == 3


# --- Each rule at scale ---------------------------------------------------------------------


@SETTINGS
@given(a=tokens, b=block_sizes)
def test_cdiv_is_the_ceiling_of_the_quotient(a: int, b: int) -> None:
    assert rules.cdiv(a, b) == ceil(Fraction(a, b))


@SETTINGS
@given(n=tokens, b=block_sizes)
def test_attention_blocks_for_tokens_is_the_fewest_blocks_that_hold_them(n: int, b: int) -> None:
    blocks = rules.attention_blocks_for_tokens(n, b)
    assert blocks * b >= n
    assert blocks == 0 or (blocks - 1) * b < n


@SETTINGS
@given(n=tokens)
def test_mamba_needs_one_block_for_any_nonempty_request(n: int) -> None:
    assert rules.mamba_blocks_for_tokens(n) == (1 if n > 0 else 0)


@SETTINGS
@given(n=tokens)
def test_full_attention_skips_no_token(n: int) -> None:
    assert rules.full_attention_skipped_tokens(n) == 0


@SETTINGS
@given(n=tokens, window=windows)
def test_sliding_window_keeps_exactly_the_window_before_the_next_token(n: int, window: int) -> None:
    skipped = rules.sliding_window_skipped_tokens(n, window)
    assert 0 <= skipped <= n
    assert n - skipped == min(n, window - 1)


@SETTINGS
@given(n=tokens, chunk=windows)
def test_chunked_local_keeps_only_the_current_chunk(n: int, chunk: int) -> None:
    skipped = rules.chunked_local_skipped_tokens(n, chunk)
    assert skipped % chunk == 0
    assert 0 <= n - skipped < chunk


@SETTINGS
@given(n=tokens)
def test_mamba_skips_all_but_the_last_computed_token(n: int) -> None:
    assert rules.mamba_skipped_tokens(n) == max(n - 1, 0)


@SETTINGS
@given(skipped=tokens, b=block_sizes)
def test_skipped_block_positions_are_the_whole_blocks_of_skipped_tokens(
    skipped: int, b: int
) -> None:
    positions = rules.skipped_block_positions(skipped, b)
    assert positions * b <= skipped < (positions + 1) * b


@SETTINGS
@given(window=windows, b=block_sizes)
def test_window_hit_needs_the_blocks_of_window_minus_one_tokens(window: int, b: int) -> None:
    needed = rules.sliding_window_hit_blocks_needed(window, b)
    assert needed * b >= window - 1
    assert needed == 0 or (needed - 1) * b < window - 1


@SETTINGS
@given(cached=bools, data=st.data())
def test_full_attention_hit_is_the_cached_run_from_block_zero(
    cached: list[bool], data: st.DataObject
) -> None:
    max_num_blocks = data.draw(st.integers(0, len(cached)))
    hit = rules.full_attention_hit_blocks(cached, max_num_blocks)
    assert 0 <= hit <= max_num_blocks
    assert all(cached[:hit])
    assert hit == max_num_blocks or not cached[hit]


@SETTINGS
@given(cached=bools, needed=st.integers(0, 16), k=st.integers(0, 80))
def test_window_hit_is_valid_when_the_needed_blocks_before_it_are_cached(
    cached: list[bool], needed: int, k: int
) -> None:
    expected = k <= len(cached) and all(cached[max(0, k - max(needed, 1)) : k])
    assert rules.window_hit_is_valid(cached, needed, k) == expected


@SETTINGS
@given(cached=bools, needed=st.integers(0, 16))
def test_sliding_window_hit_is_the_longest_valid_hit(cached: list[bool], needed: int) -> None:
    hit, first_real = rules.sliding_window_hit_blocks(cached, needed)
    longest = max(k for k in range(len(cached) + 1) if rules.window_hit_is_valid(cached, needed, k))
    assert hit == longest
    assert 0 <= first_real <= hit <= len(cached)
    assert all(cached[first_real:hit])
    assert first_real == 0 or hit - first_real == max(needed, 1)


@pytest.mark.parametrize(
    ("cached", "expected"),
    [
        ([True, False, True, False], (3, 2)),
        ([True, True, True], (3, 2)),
        ([False, False], (0, 0)),
        ([], (0, 0)),
    ],
)
def test_a_one_token_window_hits_up_to_its_last_cached_block_as_vllms_scan(
    cached: list[bool], expected: tuple[int, int]
) -> None:
    """A window of one token needs no block before the hit (``needed`` 0); vLLM's scan still
    stops only at a cached block, the rightmost one, and hits nothing when none is cached."""
    assert rules.sliding_window_hit_blocks_needed(1, 16) == 0
    assert rules.sliding_window_hit_blocks(cached, 0) == expected
    assert rules.sliding_window_hit_blocks_skip(cached, 0) == expected
    assert rules.sliding_window_hit_blocks(cached, 0) == rules.sliding_window_hit_blocks(cached, 1)


@SETTINGS
@given(cached=bools, needed=st.integers(0, 16))
def test_sliding_window_hit_skip_scan_equals_the_plain_scan(
    cached: list[bool], needed: int
) -> None:
    skip = rules.sliding_window_hit_blocks_skip(cached, needed)
    assert skip == rules.sliding_window_hit_blocks(cached, needed)


@SETTINGS
@given(
    cached=bools,
    block_size=st.integers(1, 16),
    chunk=st.integers(1, 256),
    data=st.data(),
)
def test_chunked_local_hit_is_the_cached_run_from_the_current_chunk(
    cached: list[bool], block_size: int, chunk: int, data: st.DataObject
) -> None:
    max_length = data.draw(st.integers(0, len(cached) * block_size))
    hit, first_real = rules.chunked_local_hit_blocks(cached, max_length, block_size, chunk)
    assert first_real == max_length // chunk * chunk // block_size
    assert first_real <= hit <= max_length // block_size
    assert all(cached[first_real:hit])
    assert hit == max_length // block_size or not cached[hit]


@SETTINGS
@given(counts=st.lists(st.integers(1, 10_000), min_size=1, max_size=16))
def test_group_size_is_the_smallest_type(counts: list[int]) -> None:
    g = rules.group_size(counts)
    assert g in counts
    assert all(g <= c for c in counts)


@SETTINGS
@given(n=st.integers(1, 10_000), g=st.integers(1, 10_000))
def test_a_type_fills_the_fewest_groups_that_hold_it(n: int, g: int) -> None:
    groups = rules.num_groups_of_type(n, g)
    assert (groups - 1) * g < n <= groups * g


@SETTINGS
@given(n=st.integers(1, 10_000), g=st.integers(1, 10_000))
def test_padding_fills_the_last_group(n: int, g: int) -> None:
    padding = rules.num_padding_slots(n, g)
    assert 0 <= padding < g
    assert (n + padding) % g == 0
    assert n + padding == rules.num_groups_of_type(n, g) * g


@SETTINGS
@given(n=st.integers(1, 5_000), g=st.integers(1, 5_000))
def test_group_layer_ranges_cut_the_type_into_consecutive_groups(n: int, g: int) -> None:
    ranges = rules.group_layer_ranges(n, g)
    assert len(ranges) == rules.num_groups_of_type(n, g)
    assert [i for start, stop in ranges for i in range(start, stop)] == list(range(n))
    assert all(stop - start == g for start, stop in ranges[:-1])
    last_start, last_stop = ranges[-1]
    assert last_stop - last_start + rules.num_padding_slots(n, g) == g


@SETTINGS
@given(
    block_size=st.integers(1, 1024),
    kv_hidden_size=st.integers(1, 1 << 20),
    state_bytes=st.integers(1, 1 << 32),
)
def test_raised_block_size_is_the_smallest_multiple_whose_page_holds_the_state(
    block_size: int, kv_hidden_size: int, state_bytes: int
) -> None:
    raised = rules.raised_block_size(block_size, kv_hidden_size, state_bytes)
    assert raised % block_size == 0
    assert raised * kv_hidden_size >= state_bytes
    assert raised == block_size or (raised - block_size) * kv_hidden_size < state_bytes


@SETTINGS
@given(length=positive_tokens, b=block_sizes)
def test_full_attention_request_holds_a_block_per_block_of_its_length(length: int, b: int) -> None:
    assert rules.max_blocks_full_attention(length, b) == rules.cdiv(length, b)


@SETTINGS
@given(length=positive_tokens, b=block_sizes, window=windows, batched=st.integers(1, 100_000))
def test_sliding_window_request_holds_its_window_and_one_step(
    length: int, b: int, window: int, batched: int
) -> None:
    blocks = rules.max_blocks_sliding_window(length, b, window, batched)
    assert blocks >= 1
    assert blocks == rules.cdiv(min(window - 1 + batched, length), b) + 1
    # Never more than one block past a full-attention request of the same length.
    assert blocks <= rules.max_blocks_full_attention(length, b) + 1


@SETTINGS
@given(length=positive_tokens, b=block_sizes, chunk=windows, batched=st.integers(1, 100_000))
def test_chunked_local_request_holds_a_chunk_and_one_step(
    length: int, b: int, chunk: int, batched: int
) -> None:
    blocks = rules.max_blocks_chunked_local(length, b, chunk, batched)
    assert blocks == rules.cdiv(min(chunk + batched, length), b)
    assert blocks <= rules.cdiv(length, b)


@SETTINGS
@given(length=positive_tokens)
def test_mamba_request_holds_one_state_block(length: int) -> None:
    assert rules.max_blocks_mamba(length) == 1


@SETTINGS
@given(
    memory=st.integers(0, 1 << 40),
    num_tensors=st.integers(1, 256),
    page=st.integers(1, 1 << 24),
)
def test_num_blocks_is_the_blocks_whose_slices_fit(
    memory: int, num_tensors: int, page: int
) -> None:
    blocks = rules.num_blocks_for_memory(memory, num_tensors, page)
    assert blocks >= 0
    assert blocks * num_tensors * page <= memory < (blocks + 1) * num_tensors * page


@SETTINGS
@given(num_blocks=st.integers(2, 1 << 24), per_request=st.integers(1, 100_000))
def test_max_num_requests_leaves_out_the_null_block(num_blocks: int, per_request: int) -> None:
    requests = rules.max_num_requests(num_blocks, per_request)
    assert requests >= 0
    assert requests * per_request <= num_blocks - 1 < (requests + 1) * per_request
