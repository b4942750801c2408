"""``scripts/tile_trace.py``: copies of a trace one after another share nothing across copies,
so the infinite-cache bound of ``k`` copies is ``k`` times the trace's own."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from script_modules import load_script

from hybridkv.block_trace import infinite_cache_bound, read_block_trace


def _script() -> ModuleType:
    return load_script("tile_trace")


def _write(path: Path, *lines: tuple[int, int, list[int]]) -> Path:
    records = [
        {"timestamp": t, "input_length": n, "output_length": 2, "hash_ids": ids}
        for t, n, ids in lines
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_copies_shift_time_and_ids_and_multiply_the_bound(tmp_path: Path) -> None:
    source = _write(tmp_path / "in.jsonl", (0, 1024, [0, 1]), (10, 1024, [0, 2]))
    out = tmp_path / "out.jsonl"
    assert _script().main([str(source), str(out), "--requests", "6"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["timestamp"] for line in lines] == [0, 10, 11, 21, 22, 32]
    assert [line["hash_ids"] for line in lines][:4] == [[0, 1], [0, 2], [3, 4], [3, 5]]
    one = infinite_cache_bound(read_block_trace(source), 16)
    three = infinite_cache_bound(read_block_trace(out), 16)
    assert one.hit_tokens == 512
    assert (three.hit_tokens, three.prompt_tokens) == (3 * 512, 3 * one.prompt_tokens)


def test_the_output_stops_before_the_prompt_token_limit(tmp_path: Path) -> None:
    source = _write(tmp_path / "in.jsonl", (0, 1024, [0, 1]), (10, 600, [0, 2]))
    out = tmp_path / "out.jsonl"
    assert _script().main([str(source), str(out), "--prompt-tokens", "3000"]) == 0
    lengths = [json.loads(x)["input_length"] for x in out.read_text().splitlines()]
    assert lengths == [1024, 600, 1024]  # the next 600 would pass 3,000


def test_no_limit_is_a_usage_error(tmp_path: Path) -> None:
    source = _write(tmp_path / "in.jsonl", (0, 1024, [0, 1]))
    with pytest.raises(SystemExit):
        _script().main([str(source), str(tmp_path / "out.jsonl")])
