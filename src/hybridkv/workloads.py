"""Seeded synthetic workloads with realistic prefix sharing, for the simulator
(``hybridkv.simulate``) and the policy lab: chat sessions under a few shared system prompts,
retrieval over popular documents, agent loops under a long tool preamble, or a mix.

The same seed gives the same requests, so the simulator's numbers are a function of it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

WORKLOADS = ("chat", "rag", "agent", "mixed")
VOCAB_SIZE = 32_000


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
