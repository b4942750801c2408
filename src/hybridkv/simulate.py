"""A small but real scheduler loop that drives a KV cache manager with requests.

The loop is vLLM v1's in miniature, so the manager sees the calls a serving engine makes:

* each step has a budget of ``max_num_batched_tokens`` tokens;
* running requests go first, in admission order: a decode needs one token, an unfinished
  prefill its next chunk (chunked prefill); when ``allocate_slots`` returns ``None`` the
  latest-admitted running request is preempted (freed, ``num_computed_tokens = 0``, put back at
  the front of the queue) and the allocation is retried;
* waiting requests are admitted first come, first served, while budget and ``max_num_seqs``
  allow and no request was preempted this step: ``get_computed_blocks`` finds the cached prefix,
  ``allocate_slots`` adopts it and takes blocks for the first chunk;
* a request whose tokens are all computed produces its next output token; one that has all its
  output tokens is finished and freed.

Workloads are synthetic (``make_workload``) or read from a JSONL trace (``load_trace``). Both are
seeded, so the same seed gives the same requests and the same numbers.
"""

from __future__ import annotations

import difflib
import json
import random
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from hybridkv.reference import Request
from hybridkv.scheduling import Manager, mamba_aligned_chunk

_P = ParamSpec("_P")
_T = TypeVar("_T")

WORKLOADS = ("chat", "rag", "agent", "mixed")
VOCAB_SIZE = 32_000


# --- Requests and workloads -------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload: its prompt, the output the "model" will produce, and when.

    A request with a ``parent`` (the next turn of a chat, the next step of an agent) arrives
    ``arrival_step`` steps after its parent finishes; any other at step ``arrival_step``.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    arrival_step: int = 0
    parent: str | None = None


class _Tokens:
    """Seeded token streams: fresh random text, and named texts reused across requests."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def fresh(self, length: int) -> tuple[int, ...]:
        """``length`` tokens of new text (a user message, an answer, a tool result)."""
        return tuple(self.rng.randrange(VOCAB_SIZE) for _ in range(length))

    def between(self, low: int, high: int) -> tuple[int, ...]:
        """Fresh text of a length drawn from ``[low, high]``."""
        return self.fresh(self.rng.randint(low, high))


@dataclass
class _Builder:
    """Collects sessions of requests until the workload has ``num_requests`` of them."""

    num_requests: int
    max_model_len: int
    tokens: _Tokens
    requests: list[RequestSpec] = field(default_factory=list)
    clock: float = 0.0

    @property
    def full(self) -> bool:
        return len(self.requests) >= self.num_requests

    def next_arrival(self, mean_gap: float) -> int:
        """The next session's arrival step: a Poisson process with ``mean_gap`` steps apart."""
        self.clock += self.tokens.rng.expovariate(1 / mean_gap)
        return int(self.clock)

    def add_session(self, name: str, turns: Iterator[tuple[tuple[int, ...], int, int]]) -> None:
        """Add one session: each turn is (new prompt text, output length, delay after parent).

        Every turn's prompt is the previous prompt, its output and the new text, which is how
        chats and agent loops reuse their prefix. The session stops before the context would
        pass ``max_model_len``.
        """
        context: tuple[int, ...] = ()
        parent: str | None = None
        for turn, (text, output_len, delay) in enumerate(turns):
            prompt = context + text
            if self.full or len(prompt) + output_len > self.max_model_len:
                return
            request_id = f"{name}.{turn}"
            output = self.tokens.fresh(output_len)
            arrival = delay if parent else self.next_arrival(2.0)
            self.requests.append(RequestSpec(request_id, prompt, output, arrival, parent))
            context, parent = prompt + output, request_id


def make_workload(
    kind: str, num_requests: int, *, seed: int, max_model_len: int
) -> tuple[RequestSpec, ...]:
    """A seeded synthetic workload of ``num_requests`` requests with realistic prefix sharing.

    chat: a few shared system prompts, multi-turn conversations; rag: popular documents reused
    across questions; agent: a long shared tool preamble and loops that extend their context;
    mixed: sessions of all three.
    """
    if kind not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {kind!r}")
    rng = random.Random(seed)
    tokens = _Tokens(rng)
    shared = _SharedTexts(tokens)
    builder = _Builder(num_requests, max_model_len, tokens)
    session = 0
    while not builder.full:
        session_kind = kind if kind != "mixed" else rng.choices(WORKLOADS[:3], (5, 3, 2))[0]
        turns = _SESSIONS[session_kind](shared, tokens)
        before = len(builder.requests)
        builder.add_session(f"{session_kind}{session}", turns)
        if len(builder.requests) == before:
            raise ValueError(f"max_model_len {max_model_len} is too short for the {kind} workload")
        session += 1
    return tuple(builder.requests)


class _SharedTexts:
    """Texts many requests start with: system prompts, documents, an agent's tool preamble."""

    def __init__(self, tokens: _Tokens) -> None:
        self.system_prompts = [tokens.between(256, 1024) for _ in range(3)]
        self.documents = [tokens.between(512, 2048) for _ in range(12)]
        self.agent_preamble = tokens.between(1024, 2048)
        self.rng = tokens.rng

    def system_prompt(self) -> tuple[int, ...]:
        """One of the system prompts, the first far more popular than the others."""
        return self.rng.choices(self.system_prompts, (6, 3, 1))[0]

    def popular_documents(self) -> tuple[int, ...]:
        """One to three documents, Zipf-popular, most relevant first."""
        weights = [1 / (rank + 1) for rank in range(len(self.documents))]
        count = self.rng.randint(1, 3)
        picked = self.rng.choices(range(len(self.documents)), weights, k=count)
        return tuple(token for index in dict.fromkeys(picked) for token in self.documents[index])


def _chat(shared: _SharedTexts, tokens: _Tokens) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """A conversation of 1–5 turns under one system prompt; the user thinks 1–8 steps."""
    rng = tokens.rng
    yield shared.system_prompt() + tokens.between(32, 256), rng.randint(32, 256), 0
    for _ in range(rng.randint(0, 4)):
        yield tokens.between(16, 192), rng.randint(32, 256), rng.randint(1, 8)


def _rag(shared: _SharedTexts, tokens: _Tokens) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """One question over retrieved documents: system prompt + documents + question."""
    question = tokens.between(16, 96)
    yield (
        shared.system_prompt() + shared.popular_documents() + question,
        tokens.rng.randint(32, 192),
        0,
    )


def _agent(shared: _SharedTexts, tokens: _Tokens) -> Iterator[tuple[tuple[int, ...], int, int]]:
    """An agent loop of 3–8 steps: each tool call's result extends the context."""
    rng = tokens.rng
    yield shared.agent_preamble + tokens.between(64, 256), rng.randint(16, 128), 0
    for _ in range(rng.randint(2, 7)):
        yield tokens.between(64, 512), rng.randint(16, 128), rng.randint(0, 3)


_SESSIONS: Mapping[
    str, Callable[[_SharedTexts, _Tokens], Iterator[tuple[tuple[int, ...], int, int]]]
] = {"chat": _chat, "rag": _rag, "agent": _agent}


# --- Traces -----------------------------------------------------------------------------------


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


# --- The scheduler loop -----------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits: tokens per step, running requests, longest request."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    max_model_len: int = 16384
    full_prompt_admission: bool = False
    """Admit a request only if its whole sequence fits (``full_sequence_must_fit``), as a vLLM
    0.33 engine does; off: only the first chunk must fit, as vLLM's unit tests admit."""


@dataclass
class SimulationResult:
    """What a run measured. Everything but the ``manager_*`` times is a function of the seed."""

    num_requests: int
    num_finished: int = 0
    num_rejected: int = 0
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    first_prompt_tokens: int = 0
    """Prompt tokens of each request at its first admission only (a preempted request admitted
    again counts in ``prompt_tokens`` once more, not here)."""
    first_hit_tokens: int = 0
    computed_tokens: int = 0
    usage_per_step: list[float] = field(default_factory=list)
    hit_rate_per_step: list[float] = field(default_factory=list)
    manager_seconds_per_step: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache at admission / prompt tokens admitted."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache at each request's first admission / those
        requests' prompt tokens (re-admissions after a preemption left out)."""
        if not self.first_prompt_tokens:
            return 0.0
        return self.first_hit_tokens / self.first_prompt_tokens

    @property
    def peak_usage(self) -> float:
        return max(self.usage_per_step, default=0.0)

    @property
    def mean_usage(self) -> float:
        steps = self.usage_per_step
        return sum(steps) / len(steps) if steps else 0.0

    @property
    def manager_seconds(self) -> float:
        return sum(self.manager_seconds_per_step)

    def summary(self, *, timing: bool = True) -> dict[str, Any]:
        """The numbers as a flat dict with stable keys (``timing=False``: deterministic only)."""
        numbers: dict[str, Any] = {
            "requests": self.num_requests,
            "finished": self.num_finished,
            "rejected": self.num_rejected,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "computed_tokens": self.computed_tokens,
            "saved_tokens": self.hit_tokens,
            "peak_usage": round(self.peak_usage, 6),
            "mean_usage": round(self.mean_usage, 6),
        }
        if timing:
            per_step = self.manager_seconds / self.steps if self.steps else 0.0
            numbers["manager_seconds"] = round(self.manager_seconds, 6)
            numbers["manager_ms_per_step"] = round(per_step * 1e3, 6)
        return numbers


class Scheduler:
    """FCFS admission, chunked prefill, decode, preemption and freeing around one manager."""

    def __init__(
        self,
        manager: Manager,
        requests: Sequence[RequestSpec],
        *,
        block_size: int,
        config: SchedulerConfig,
        mamba_block_size: int | None = None,
    ) -> None:
        self.manager = manager
        self.config = config
        self.block_size = block_size
        # With a Mamba "align" group a state is cached only where a chunk ends on its block
        # boundary, so prefill chunks end there (as an engine's scheduler ends them).
        self.mamba_block_size = mamba_block_size
        self.specs = {spec.request_id: spec for spec in requests}
        self.pending = list(requests)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_at: dict[str, int] = {}
        self.admitted_once: set[str] = set()
        self.result = SimulationResult(num_requests=len(requests))
        self.step = 0
        self._clock = 0.0

    @property
    def done(self) -> bool:
        return len(self.finished_at) == len(self.specs)

    def run(self, on_step: Callable[[SimulationResult], None] | None = None) -> SimulationResult:
        """Step until every request has finished (or was rejected as too large for the pool)."""
        while not self.done:
            self._arrive()
            if not self.running and not self.waiting:
                self.step = self._next_arrival_step()
                continue
            self._clock = 0.0
            self._timed(self.manager.new_step_starts)
            scheduled = self._schedule()
            self._advance(scheduled)
            self._record()
            if on_step is not None:
                on_step(self.result)
        return self.result

    # --- One step ---------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[Request, int]]:
        """The requests that compute this step and how many tokens each computes."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = self._chunk(
                request,
                request.num_computed_tokens,
                min(request.num_tokens - request.num_computed_tokens, budget),
            )
            allocated, preempted_now = self._allocate_or_preempt(request, num_new)
            preempted = preempted or preempted_now
            if not allocated:
                break
            scheduled.append((request, num_new))
            budget -= num_new
            index += 1
        if not preempted:
            scheduled += self._admit(budget)
        return scheduled

    def _chunk(self, request: Request, start: int, num_new: int) -> int:
        return mamba_aligned_chunk(request, start, num_new, self.mamba_block_size)

    def _allocate_or_preempt(self, request: Request, num_new: int) -> tuple[bool, bool]:
        """Slots for a running request, preempting the latest-admitted ones until they fit.

        Returns (allocated, preempted any). A request that must preempt itself while it runs
        alone can never fit in this pool: it is rejected rather than retried forever.
        """
        preempted = False
        while self._timed(self.manager.allocate_slots, request, num_new) is None:
            victim = self.running.pop()
            self._timed(self.manager.free, victim)
            victim.num_computed_tokens = 0
            self.result.preemptions += 1
            preempted = True
            if victim is request:
                if not self.running:
                    self._finish(victim, rejected=True)
                else:
                    self.waiting.appendleft(victim)
                return False, preempted
            self.waiting.appendleft(victim)
        return True, preempted

    def _admit(self, budget: int) -> list[tuple[Request, int]]:
        """Admit waiting requests in order while the budget, the seat limit and the pool allow."""
        admitted: list[tuple[Request, int]] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            blocks, num_hits, boundary = self._timed(self.manager.get_computed_blocks, request)
            request.shared_prefix_boundary = boundary
            num_new = self._chunk(request, num_hits, min(request.num_tokens - num_hits, budget))
            new_blocks = self._timed(
                self.manager.allocate_slots,
                request,
                num_new,
                num_hits,
                blocks,
                full_sequence_must_fit=self.config.full_prompt_admission,
            )
            if new_blocks is None:
                if self.running or admitted:
                    break
                self.waiting.popleft()  # it needs more than the whole pool: it can never run
                self._timed(self.manager.free, request)
                self._finish(request, rejected=True)
                continue
            self.waiting.popleft()
            self.running.append(request)
            request.num_computed_tokens = num_hits
            self.result.prompt_tokens += request.num_tokens
            self.result.hit_tokens += num_hits
            if request.request_id not in self.admitted_once:
                self.admitted_once.add(request.request_id)
                self.result.first_prompt_tokens += request.num_tokens
                self.result.first_hit_tokens += num_hits
            admitted.append((request, num_new))
            budget -= num_new
        return admitted

    def _advance(self, scheduled: list[tuple[Request, int]]) -> None:
        """The "model" runs: computed tokens advance; complete requests emit their next token."""
        for request, num_new in scheduled:
            request.num_computed_tokens += num_new
            self.result.computed_tokens += num_new
            if request.num_computed_tokens < request.num_tokens:
                continue  # a prefill chunk: no output yet
            spec = self.specs[request.request_id]
            emitted = request.num_tokens - len(spec.prompt_token_ids)
            request.append_output_token_ids(spec.output_token_ids[emitted])
            if emitted + 1 == len(spec.output_token_ids):
                self.running.remove(request)
                self._timed(self.manager.free, request)
                self._finish(request, rejected=False)

    def _record(self) -> None:
        """Per-step series: usage, cumulative hit rate, manager time."""
        self.result.steps += 1
        self.result.usage_per_step.append(self.manager.usage)
        self.result.hit_rate_per_step.append(self.result.hit_rate)
        self.result.manager_seconds_per_step.append(self._clock)
        self.step += 1

    # --- Arrivals and bookkeeping -----------------------------------------------------------

    def _arrive(self) -> None:
        """Move the requests that have arrived by this step to the waiting queue, in order."""
        still_pending = []
        for spec in self.pending:
            arrival = self._arrival_step(spec)
            if arrival is not None and arrival <= self.step:
                request = Request(
                    spec.request_id, spec.prompt_token_ids, hash_block_size=self.block_size
                )
                self.waiting.append(request)
            else:
                still_pending.append(spec)
        self.pending = still_pending

    def _arrival_step(self, spec: RequestSpec) -> int | None:
        """When ``spec`` arrives; ``None`` while its parent has not finished."""
        if spec.parent is None:
            return spec.arrival_step
        parent_done = self.finished_at.get(spec.parent)
        return None if parent_done is None else parent_done + spec.arrival_step

    def _next_arrival_step(self) -> int:
        """The idle loop skips ahead to the next arrival instead of counting empty steps."""
        arrivals = [step for spec in self.pending if (step := self._arrival_step(spec)) is not None]
        return max(self.step + 1, min(arrivals, default=self.step + 1))

    def _finish(self, request: Request, *, rejected: bool) -> None:
        self.finished_at[request.request_id] = self.step
        if rejected:
            self.result.num_rejected += 1
        else:
            self.result.num_finished += 1

    def _timed(self, call: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run one manager call and add its wall time to this step's manager time."""
        start = time.perf_counter()
        value = call(*args, **kwargs)
        self._clock += time.perf_counter() - start
        return value
