"""Tile a Mooncake-format block-hash trace into a longer one, for timing a replay of an hour.

``python scripts/tile_trace.py IN.jsonl OUT.jsonl --requests 12000`` writes copies of ``IN``
one after another: copy ``k`` arrives ``k`` spans later (the span is the last timestamp plus
one millisecond) and its ``hash_ids`` are shifted past every id of the copies before it, so
each copy shares prefixes within itself exactly as ``IN`` does and never with another copy.
``--requests`` and ``--prompt-tokens`` stop the output at that many requests or before the
request that would pass that many prompt tokens (either or both; at least one). The summary
line (requests, prompt tokens, span) goes to stderr. docs/replay.md ("Speed") uses it to time
an hour of traffic: the shared synthetic trace is 17 minutes and 61 M prompt tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def read(path: Path) -> list[dict[str, Any]]:
    """The trace's lines as objects (blank lines skipped)."""
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def tiled(lines: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Copies of ``lines`` without end, each shifted in time and in hash ids."""
    if not lines:
        raise ValueError("the trace holds no requests")
    span = int(lines[-1]["timestamp"]) + 1
    ids = 1 + max((max(line["hash_ids"], default=-1) for line in lines), default=-1)
    copy = 0
    while True:
        for line in lines:
            yield {
                **line,
                "timestamp": line["timestamp"] + copy * span,
                "hash_ids": [i + copy * ids for i in line["hash_ids"]],
            }
        copy += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("output", type=Path)
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    if args.requests is None and args.prompt_tokens is None:
        parser.error("give --requests, --prompt-tokens or both")
    for name in ("requests", "prompt_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    count = tokens = last = 0
    with args.output.open("w", encoding="utf-8") as out:
        for line in tiled(read(args.source)):
            if args.requests is not None and count >= args.requests:
                break
            limit = args.prompt_tokens
            if limit is not None and tokens + line["input_length"] > limit:
                break
            out.write(json.dumps(line) + "\n")
            count += 1
            tokens += line["input_length"]
            last = line["timestamp"]
    print(f"{count:,} requests, {tokens:,} prompt tokens, 0 … {last:,} ms", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
