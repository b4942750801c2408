"""Requests read from a JSONL trace, for the simulator (``hybridkv.simulate``): each line a
request's prompt (its ids, or a length and a shared prefix), output length and arrival step.
A bad line is refused by line number and field; a line too long for the model is skipped and
reported, as an engine refuses that request and serves the others."""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.workloads import VOCAB_SIZE, RequestSpec


class TraceError(ValueError):
    """A trace line the simulator cannot read; the message names the line and the field."""


TRACE_KEYS = (
    "id",
    "arrival_step",
    "prompt_token_ids",
    "prompt_len",
    "prefix_id",
    "prefix_len",
    "output_len",
)
"""The keys a trace line may have; any other is a misspelling, refused by name."""


@dataclass(frozen=True)
class Trace:
    """A trace's requests, and the lines skipped as longer than ``max_model_len``.

    An engine refuses such a request and serves the others, so a run does too: the skipped
    lines are counted and reported, not an abort of the whole trace.
    """

    requests: tuple[RequestSpec, ...]
    too_long: tuple[int, ...] = ()
    """Line numbers whose prompt + output_len exceed max_model_len."""


def load_trace(path: str | Path, *, seed: int, max_model_len: int) -> Trace:
    """Requests from a JSONL trace, one JSON object per line.

    Keys: ``output_len`` (required); ``prompt_token_ids`` or ``prompt_len``; ``prefix_id`` and
    ``prefix_len`` (the first ``prefix_len`` prompt tokens are the same for every line with that
    prefix id; only with ``prompt_len``); ``arrival_step`` (default 0); ``id`` (default
    ``t<line>``). Any other key, or two ways of giving the prompt, is a ``TraceError``; a line
    longer than ``max_model_len`` is skipped (``Trace.too_long``).
    """
    rng = random.Random(seed)
    try:
        lines = Path(path).read_text("utf-8").splitlines()
    except OSError as error:
        raise TraceError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise TraceError(
            f"{path} is not UTF-8 text (offset {error.start}): a trace is UTF-8 JSON lines"
        ) from None
    requests = []
    too_long = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if line.strip():
            request = _trace_request(line, number, rng, seed)
            _check_unique_id(request.request_id, number, first_line)
            if len(request.prompt_token_ids) + len(request.output_token_ids) > max_model_len:
                too_long.append(number)
            else:
                requests.append(request)
    if not requests:
        if too_long:
            raise TraceError(
                f"every request of {path} is longer than max_model_len {max_model_len} (prompt "
                f"+ output_len; lines {_line_list(too_long)}): raise --max-model-len"
            )
        raise TraceError(f"{path} holds no requests")
    ordered = tuple(sorted(requests, key=lambda request: request.arrival_step))
    return Trace(ordered, tuple(too_long))


def _line_list(numbers: Sequence[int]) -> str:
    """Line numbers for a message: the first ten, then how many more."""
    shown = ", ".join(map(str, numbers[:10]))
    return shown + (f" and {len(numbers) - 10} more" if len(numbers) > 10 else "")


def _trace_request(line: str, number: int, rng: random.Random, seed: int) -> RequestSpec:
    """One trace line as a request."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"trace line {number} is not valid JSON: {error.msg}") from None
    if not isinstance(record, dict):
        raise TraceError(f"trace line {number} must be a JSON object")
    _check_keys(record, number)
    prompt = _trace_prompt(record, number, rng, seed)
    output = tuple(rng.randrange(VOCAB_SIZE) for _ in range(_count(record, "output_len", number)))
    arrival = record.get("arrival_step", 0)
    if not isinstance(arrival, int) or isinstance(arrival, bool) or arrival < 0:
        raise TraceError(
            f"trace line {number}: 'arrival_step' must be an int >= 0, got {arrival!r}"
        )
    return RequestSpec(_trace_id(record, number), prompt, output, arrival)


def _check_keys(record: Mapping[str, Any], number: int) -> None:
    """Every key is a trace key, and the prompt is given one way: token ids, or a length."""
    for key in record:
        if key not in TRACE_KEYS:
            close = difflib.get_close_matches(str(key), TRACE_KEYS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise TraceError(
                f"trace line {number}: unknown key {key!r}; {hint}a trace line has the keys "
                f"{', '.join(TRACE_KEYS)}"
            )
    if "prompt_token_ids" in record:
        for key in ("prompt_len", "prefix_id", "prefix_len"):
            if key in record:
                raise TraceError(
                    f"trace line {number}: 'prompt_token_ids' and {key!r} both give the prompt; "
                    "give the token ids, or prompt_len (with prefix_id and prefix_len)"
                )
    if ("prefix_id" in record) != ("prefix_len" in record):
        raise TraceError(
            f"trace line {number}: 'prefix_id' and 'prefix_len' go together; give both or neither"
        )


def _trace_id(record: Mapping[str, Any], number: int) -> str:
    """The request id: a string or an int as written, ``t<line>`` when absent."""
    value = record.get("id", f"t{number}")
    if not isinstance(value, str | int) or isinstance(value, bool):
        raise TraceError(f"trace line {number}: 'id' must be a string or an int, got {value!r}")
    return str(value)


def _check_unique_id(request_id: str, number: int, first_line: dict[str, int]) -> None:
    """Two lines with one id would be one request to the manager (``1`` and ``"1"`` too)."""
    if request_id in first_line:
        raise TraceError(
            f"trace line {number}: id {request_id!r} is already the id of line "
            f'{first_line[request_id]} (ids 1 and "1" are the same request); give every '
            "line its own id"
        )
    first_line[request_id] = number


def _trace_prompt(
    record: Mapping[str, Any], number: int, rng: random.Random, seed: int
) -> tuple[int, ...]:
    """The prompt: given token ids, or a shared prefix (by id) followed by fresh tokens."""
    if "prompt_token_ids" in record:
        ids = record["prompt_token_ids"]
        if not isinstance(ids, list) or not ids or not all(_is_token(t) for t in ids):
            raise TraceError(
                f"trace line {number}: 'prompt_token_ids' must be a non-empty list of ints >= 0"
            )
        return tuple(ids)
    length = _count(record, "prompt_len", number)
    prefix: tuple[int, ...] = ()
    if "prefix_id" in record:
        prefix_len = _count(record, "prefix_len", number)
        if prefix_len > length:
            raise TraceError(f"trace line {number}: 'prefix_len' exceeds 'prompt_len'")
        named = random.Random(f"{seed}:{record['prefix_id']}")
        prefix = tuple(named.randrange(VOCAB_SIZE) for _ in range(prefix_len))
    return prefix + tuple(rng.randrange(VOCAB_SIZE) for _ in range(length - len(prefix)))


def _count(record: Mapping[str, Any], key: str, number: int) -> int:
    """A positive int field of a trace line."""
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise TraceError(f"trace line {number}: {key!r} must be a positive int, got {value!r}")
    return value


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
