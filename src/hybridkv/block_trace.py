"""Block-hash traces of real traffic (Mooncake FAST'25 and its kind): requests, tokens, bound.

A block-hash trace records no text. Each line gives an arrival time in milliseconds, the prompt
and output lengths, and ``hash_ids``: one id per ``block_tokens``-token block of the prompt
(512 in the Mooncake release, 16 in Alibaba's Bailian traces, 64 in SemiAnalysis's), where an
id names the whole prefix up to and including its block, so two requests whose first ``k`` ids
agree share their first ``k × block_tokens`` tokens::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, …, 2354]}

To replay such a trace through a KV cache manager the prompt needs token ids, and prefix sharing
in the manager must be exactly the trace's. ``prompt_tokens`` gives token
``hash_id × block_tokens + offset`` to position ``offset`` of a block with id ``hash_id``: the same
``(hash id, offset)`` is the same token everywhere, and any other pair is another token, so two
manager blocks (of any block size dividing ``block_tokens``) hold equal tokens exactly when they
lie at the same offsets of blocks with the same id. Tokens are made per request when it is
admitted, never for the whole trace at once (the Mooncake conversation trace holds 145 M).

``infinite_cache_bound`` is the hit a cache that never evicts would give the same requests in
file order, computed from the ids alone: the figure every replay's hit rate is read against.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

MOONCAKE_BLOCK_TOKENS = 512
"""The Mooncake FAST'25 release hashes prompts in 512-token blocks."""

FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
"""The fields a block-hash trace line must hold (and the only ones it may hold)."""


class BlockTraceError(ValueError):
    """A block-hash trace that cannot be replayed: the message names the line and the field."""


@dataclass(frozen=True)
class BlockTraceRequest:
    """One line of a block-hash trace.

    ``index`` is the line's position among the trace's requests (0-based), ``timestamp_ms`` its
    arrival in milliseconds from the trace's start.
    """

    index: int
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    block_tokens: int

    def prompt_tokens(self) -> list[int]:
        """The prompt's token ids: ``hash_id × block_tokens + offset`` at each position."""
        return prompt_tokens(self.hash_ids, self.input_length, self.block_tokens)


def prompt_tokens(hash_ids: Sequence[int], input_length: int, block_tokens: int) -> list[int]:
    """Token ids for a prompt of ``input_length`` tokens whose blocks have ids ``hash_ids``.

    Position ``offset`` of the block with id ``h`` gets ``h × block_tokens + offset``: equal
    ``(h, offset)`` pairs give equal tokens, unequal pairs unequal ones (the map is injective
    for ``0 <= offset < block_tokens``), so the manager shares exactly what the trace shares.

    >>> prompt_tokens([3, 7], 6, 4)
    [12, 13, 14, 15, 28, 29]
    """
    last = input_length - block_tokens * (len(hash_ids) - 1)
    ranges = (
        range(
            h * block_tokens, h * block_tokens + (block_tokens if i < len(hash_ids) - 1 else last)
        )
        for i, h in enumerate(hash_ids)
    )
    return list(chain.from_iterable(ranges))


def read_block_trace(
    path: str | Path,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    max_requests: int | None = None,
) -> Iterator[BlockTraceRequest]:
    """The requests of a block-hash trace, in file order, read one line at a time.

    Every line is checked before it is yielded: the four fields present and no other, each an
    int (``hash_ids`` a list of ints ``>= 0``), lengths ``>= 1`` for the prompt and ``>= 0`` for
    the output, ``len(hash_ids) == ceil(input_length / block_tokens)``, and timestamps that never
    decrease. ``max_requests`` stops after that many requests (a prefix of the file).
    """
    if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens < 1:
        raise BlockTraceError(f"block_tokens must be an int >= 1, got {block_tokens!r}")
    if max_requests is not None and (
        not isinstance(max_requests, int) or isinstance(max_requests, bool) or max_requests < 1
    ):
        raise BlockTraceError(f"max_requests must be an int >= 1, got {max_requests!r}")
    try:
        with Path(path).open(encoding="utf-8") as handle:
            yield from _requests(handle, str(path), block_tokens, max_requests)
    except OSError as error:
        raise BlockTraceError(f"cannot read {path}: {error.strerror}") from None


def _requests(
    lines: Iterator[str], path: str, block_tokens: int, max_requests: int | None
) -> Iterator[BlockTraceRequest]:
    """Parse and check each non-blank line; an empty trace is an error, not an empty replay."""
    index = 0
    last_timestamp = 0
    try:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            request = parse_line(line, f"{path}:{number}", index, block_tokens)
            if request.timestamp_ms < last_timestamp:
                raise BlockTraceError(
                    f"{path}:{number}: 'timestamp' {request.timestamp_ms} is before the previous "
                    f"line's {last_timestamp}: a trace's arrivals never go back in time"
                )
            last_timestamp = request.timestamp_ms
            yield request
            index += 1
            if max_requests is not None and index == max_requests:
                return
    except UnicodeDecodeError as error:
        raise BlockTraceError(
            f"{path} is not UTF-8 text (offset {error.start}): a trace is UTF-8 JSON lines"
        ) from None
    if index == 0:
        raise BlockTraceError(f"{path} holds no requests")


def parse_line(line: str, where: str, index: int, block_tokens: int) -> BlockTraceRequest:
    """One trace line as a request; ``where`` (``file:line``) starts every error message."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise BlockTraceError(f"{where}: not valid JSON: {error.msg}") from None
    if not isinstance(record, dict):
        raise BlockTraceError(f"{where}: a trace line is a JSON object, got {line.strip()[:40]!r}")
    _check_fields(record, where)
    timestamp = _int_field(record, "timestamp", where, minimum=0)
    input_length = _int_field(record, "input_length", where, minimum=1)
    output_length = _int_field(record, "output_length", where, minimum=0)
    hash_ids = _hash_ids(record, where)
    expected = -(-input_length // block_tokens)
    if len(hash_ids) != expected:
        raise BlockTraceError(
            f"{where}: 'hash_ids' has {len(hash_ids)} ids but 'input_length' {input_length} "
            f"needs ceil({input_length} / {block_tokens}) = {expected} (one per "
            f"{block_tokens}-token block; is --trace-block-tokens right?)"
        )
    return BlockTraceRequest(index, timestamp, input_length, output_length, hash_ids, block_tokens)


def _check_fields(record: dict[str, Any], where: str) -> None:
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise BlockTraceError(
            f"{where}: missing field {missing[0]!r} (a block-hash trace line holds "
            f"{', '.join(FIELDS)})"
        )
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise BlockTraceError(
            f"{where}: unknown field {unknown[0]!r} (a block-hash trace line holds "
            f"{', '.join(FIELDS)})"
        )


def _int_field(record: dict[str, Any], name: str, where: str, *, minimum: int) -> int:
    value = record[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise BlockTraceError(f"{where}: {name!r} must be an int >= {minimum}, got {value!r}")
    return value


def _hash_ids(record: dict[str, Any], where: str) -> tuple[int, ...]:
    value = record["hash_ids"]
    if not isinstance(value, list):
        raise BlockTraceError(f"{where}: 'hash_ids' must be a list of ints, got {value!r:.40}")
    for position, item in enumerate(value):
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise BlockTraceError(
                f"{where}: 'hash_ids'[{position}] must be an int >= 0, got {item!r}"
            )
    return tuple(value)


@dataclass(frozen=True)
class CacheBound:
    """What a cache that never evicts would hit, requests in file order."""

    hit_tokens: int
    prompt_tokens: int
    requests: int

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens hit (0 for no prompt tokens)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def infinite_cache_bound(
    requests: Iterator[BlockTraceRequest] | Sequence[BlockTraceRequest], block_size: int
) -> CacheBound:
    """The infinite-cache hit of ``requests`` in order, at manager blocks of ``block_size``.

    A request hits its longest token prefix that an earlier request's prompt held in whole
    ``block_size``-token blocks (a manager caches a prompt's full blocks only), rounded down to
    whole blocks and at most ``((L − 1) // block_size) × block_size`` tokens of a prompt of
    ``L`` (the last token is always computed, as every engine does). ``covered[h]`` is how many
    leading tokens of the trace block with id ``h`` some earlier prompt's full manager blocks
    held: a common prefix ends inside a trace block where that count ends.

    Any block size works: the tokens of ``prompt_tokens`` make two prompts agree exactly on
    their common prefix of trace blocks, so a manager block straddling two trace blocks is
    shared exactly when both are.
    """
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise BlockTraceError(f"block_size must be an int >= 1, got {block_size!r}")
    covered: dict[int, int] = {}
    hit_tokens = prompt = count = 0
    for request in requests:
        hit_tokens += prefix_hit_tokens(request, covered, block_size)
        prompt += request.input_length
        count += 1
    return CacheBound(hit_tokens, prompt, count)


def prefix_hit_tokens(request: BlockTraceRequest, covered: dict[int, int], block_size: int) -> int:
    """The infinite-cache hit of ``request`` after the prompts ``covered`` records, which then
    records this one too (one step of ``infinite_cache_bound``, for a replay that computes the
    bound as it reads the trace)."""
    hit = covered_prefix_tokens(request, covered, block_size)
    cover_prefix(request, covered, block_size, request.input_length)
    return hit


def covered_prefix_tokens(
    request: BlockTraceRequest, covered: dict[int, int], block_size: int
) -> int:
    """Leading tokens of ``request`` that the prompts ``covered`` records held, in whole manager
    blocks of ``block_size`` and at most ``((L − 1) // block_size) × block_size``."""
    hit = 0
    for h in request.hash_ids:
        seen = covered.get(h, 0)
        if seen < request.block_tokens:
            hit += seen
            break
        hit += request.block_tokens
    hit = min(hit, request.input_length - 1)
    return hit // block_size * block_size


def cover_prefix(
    request: BlockTraceRequest,
    covered: dict[int, int],
    block_size: int,
    end: int,
    start: int = 0,
) -> None:
    """Record in ``covered`` how far the full manager blocks of the prompt's first ``end``
    tokens reach into each of its trace blocks (``end`` capped at the prompt's length).

    ``start`` skips the trace blocks wholly below it, for a caller that covers a prompt chunk
    by chunk as a scheduler computes it (each chunk costs its own trace blocks, not the
    prompt's)."""
    cached = min(end, request.input_length) // block_size * block_size
    size = request.block_tokens
    for i in range(start // size, len(request.hash_ids)):
        reach = min(size, cached - size * i)
        if reach <= 0:
            break
        h = request.hash_ids[i]
        if covered.get(h, 0) < reach:
            covered[h] = reach
