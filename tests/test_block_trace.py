"""Block-hash traces (Mooncake FAST'25): the token map, the infinite-cache bound, bad lines."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.block_trace import (
    BlockTraceError,
    BlockTraceRequest,
    infinite_cache_bound,
    prompt_tokens,
    read_block_trace,
)

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-synthetic.jsonl"


def _write(tmp_path: Path, *records: object) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in records), "utf-8")
    return path


def _line(
    timestamp: Any, input_length: Any, hash_ids: list[Any], output: Any = 4
) -> dict[str, Any]:
    return {
        "timestamp": timestamp,
        "input_length": input_length,
        "output_length": output,
        "hash_ids": hash_ids,
    }


def test_each_hash_id_and_offset_is_one_token() -> None:
    assert prompt_tokens([3, 7], 6, 4) == [12, 13, 14, 15, 28, 29]
    assert prompt_tokens([5], 1, 512) == [2560]


def test_requests_with_equal_leading_ids_share_exactly_those_tokens() -> None:
    a = prompt_tokens([1, 2, 3], 3 * 512, 512)
    b = prompt_tokens([1, 2, 9], 2 * 512 + 100, 512)
    assert a[:1024] == b[:1024]
    assert all(x != y for x, y in zip(a[1024:], b[1024:], strict=False))


@given(
    st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
    st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
)
def test_blocks_of_different_ids_never_collide_at_16_token_blocks(
    first: list[int], second: list[int]
) -> None:
    """A 16-token manager block is equal in two prompts exactly when its trace ids are."""
    a = prompt_tokens(first, 64 * len(first), 64)
    b = prompt_tokens(second, 64 * len(second), 64)
    for i in range(0, min(len(a), len(b)), 16):
        assert (a[i : i + 16] == b[i : i + 16]) == (first[i // 64] == second[i // 64])


def test_the_bound_on_a_hand_made_trace(tmp_path: Path) -> None:
    """Request 2 shares request 1's first block (8 tokens) and 4 of its second block's tokens;
    request 3 repeats request 1 whole but must compute its last token; request 4 shares
    nothing."""
    path = _write(
        tmp_path,
        _line(0, 14, [1, 2]),  # blocks of 8 tokens: 8 + 6
        _line(5, 12, [1, 2]),  # the second block's first 4 tokens were covered by request 1
        _line(5, 14, [1, 2]),  # all 14 tokens seen: at most (14 - 1) // 4 * 4 = 12 hit
        _line(9, 3, [7]),
    )
    bound = infinite_cache_bound(read_block_trace(path, block_tokens=8), block_size=4)
    assert (bound.hit_tokens, bound.prompt_tokens, bound.requests) == (0 + 8 + 12 + 0, 43, 4)
    assert bound.hit_rate == pytest.approx(20 / 43)


def test_a_partial_block_hits_only_its_whole_manager_blocks(tmp_path: Path) -> None:
    path = _write(tmp_path, _line(0, 6, [4]), _line(1, 8, [4]))
    bound = infinite_cache_bound(read_block_trace(path, block_tokens=8), block_size=4)
    assert bound.hit_tokens == 4  # the first prompt's 6 tokens cover one whole 4-token block


def test_a_manager_block_straddling_trace_blocks_is_shared_only_when_both_are(
    tmp_path: Path,
) -> None:
    """6-token manager blocks over 8-token trace blocks: request 2 shares trace block 1 and
    not block 2, so only its first 6-token block (tokens 0-5) hits, not tokens 6-11; request 3
    repeats request 1 (16 tokens: two full 6-token blocks cached), so it hits 12 tokens."""
    path = _write(tmp_path, _line(0, 16, [1, 2]), _line(1, 16, [1, 3]), _line(2, 16, [1, 2]))
    bound = infinite_cache_bound(read_block_trace(path, block_tokens=8), block_size=6)
    assert bound.hit_tokens == 6 + 12


def test_a_prompt_covers_only_its_full_manager_blocks(tmp_path: Path) -> None:
    """Request 1 (10 tokens, 6-token blocks) caches tokens 0-5 only: request 2 hits 6."""
    path = _write(tmp_path, _line(0, 10, [1, 2]), _line(1, 16, [1, 2]))
    bound = infinite_cache_bound(read_block_trace(path, block_tokens=8), block_size=6)
    assert bound.hit_tokens == 6


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not beside")
def test_the_shared_trace_bound_is_the_published_figure() -> None:
    """``shared/traces/README.md``: 39,850,800 of 61,194,628 prompt tokens (65.12 %) at 16-token
    blocks, 17.26 % over the first 1,000 requests."""
    bound = infinite_cache_bound(read_block_trace(SHARED_TRACE), 16)
    assert (bound.hit_tokens, bound.prompt_tokens, bound.requests) == (39_850_800, 61_194_628, 3993)
    assert f"{100 * bound.hit_rate:.2f}" == "65.12"
    first = infinite_cache_bound(read_block_trace(SHARED_TRACE, max_requests=1000), 16)
    assert f"{100 * first.hit_rate:.2f}" == "17.26"


def test_max_requests_takes_a_prefix_of_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, _line(0, 3, [1]), _line(1, 3, [2]), _line(2, 3, [3]))
    requests = list(read_block_trace(path, block_tokens=4, max_requests=2))
    assert requests == [
        BlockTraceRequest(0, 0, 3, 4, (1,), 4),
        BlockTraceRequest(1, 1, 3, 4, (2,), 4),
    ]
    assert requests[1].prompt_tokens() == [8, 9, 10]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"timestamp": 0, "input_length": 3, "output_length": 1},
            "trace.jsonl:1: missing field 'hash_ids'",
        ),
        (
            {**_line(0, 3, [1]), "hash_id": [1]},
            "trace.jsonl:1: unknown field 'hash_id'",
        ),
        (_line(0, "3", [1]), "'input_length' must be an int >= 1, got '3'"),
        (_line(0, 0, []), "'input_length' must be an int >= 1, got 0"),
        (_line(-1, 3, [1]), "'timestamp' must be an int >= 0, got -1"),
        (_line(0, 3, [1], output=True), "'output_length' must be an int >= 0, got True"),
        (_line(0, 3, [1, "x"]), "'hash_ids'[1] must be an int >= 0, got 'x'"),
        (_line(0, 9, [1]), "'hash_ids' has 1 ids but 'input_length' 9 needs ceil(9 / 4) = 3"),
        ([1, 2], "trace.jsonl:1: a trace line is a JSON object"),
    ],
)
def test_a_bad_line_is_one_error_naming_the_line_and_field(
    tmp_path: Path, record: object, message: str
) -> None:
    path = _write(tmp_path, record)
    with pytest.raises(BlockTraceError, match=re.escape(message)):
        list(read_block_trace(path, block_tokens=4))


def test_decreasing_timestamps_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, _line(5, 3, [1]), _line(4, 3, [2]))
    with pytest.raises(BlockTraceError, match=r"trace.jsonl:2: 'timestamp' 4 is before the"):
        list(read_block_trace(path, block_tokens=4))


def test_an_empty_trace_and_a_missing_file_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", "utf-8")
    with pytest.raises(BlockTraceError, match=r"empty\.jsonl holds no requests"):
        list(read_block_trace(empty))
    with pytest.raises(BlockTraceError, match=r"cannot read .*missing\.jsonl"):
        list(read_block_trace(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"\xff\xfe{}\n")
    with pytest.raises(BlockTraceError, match="is not UTF-8 text"):
        list(read_block_trace(bad))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n", "utf-8")
    with pytest.raises(BlockTraceError, match=r"broken\.jsonl:1: not valid JSON"):
        list(read_block_trace(broken))


def test_reader_arguments_are_checked() -> None:
    with pytest.raises(BlockTraceError, match="block_tokens must be an int >= 1, got 0"):
        list(read_block_trace("x", block_tokens=0))
    with pytest.raises(BlockTraceError, match="max_requests must be an int >= 1, got 0"):
        list(read_block_trace("x", max_requests=0))
