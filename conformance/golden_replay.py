"""One golden trace replayed through an implementation's ``ManagerAdapter``: ``TraceReplay``
plays the scheduler's part exactly as the recorder did (how ``n`` is chosen, how
``num_computed_tokens`` advances) and observes what vLLM observed after every operation;
``observations_match`` compares (fields the adapter cannot show, ``NOT_SHOWN``, are not);
``replay_trace`` stops at the first ``Divergence`` and lets the implementation's exceptions
propagate (``golden.check_trace`` reports them instead).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from hybridkv.conformance.adapters import AdapterFactory, Lookup, ManagerAdapter
from hybridkv.conformance.golden_traces import (
    Json,
    load_trace,
    scenario_config,
    scenario_engine,
)


@dataclass(frozen=True)
class Divergence:
    """The first observation that differs from the recorded one."""

    trace: str
    op_index: int
    op: Json
    expected: Json
    actual: Json

    def __str__(self) -> str:
        fields = sorted(k for k in self.expected if self.expected[k] != self.actual.get(k))
        return (
            f"{self.trace}: op {self.op_index} {json.dumps(self.op)[:200]} differs in {fields}:\n"
            f"  expected {json.dumps({k: self.expected[k] for k in fields})[:2000]}\n"
            f"  actual   {json.dumps({k: self.actual.get(k) for k in fields})[:2000]}"
        )


@dataclass
class _RequestState:
    """A request as the replay's scheduler sees it: the adapter's handle and its counters."""

    handle: Any
    num_tokens: int
    num_computed_tokens: int = 0
    running: bool = False
    lookup: Lookup | None = None


class TraceReplay:
    """Plays one trace's operations on an implementation through its ``ManagerAdapter``,
    yielding (recorded, observed) per operation.

    The adapter is built by ``factory(config, max_model_len, enable_caching, events, engine)``
    (``events`` off: the packaged traces record none). The replay keeps the scheduler's counters
    itself and tells the adapter (``set_num_computed_tokens``), as the differential machine
    does. A subclass may pass more keywords to ``new_request`` (``request_options``).
    """

    events = False
    """Whether the adapter's manager publishes KV events (a subclass that observes them)."""

    def __init__(self, trace: Json, factory: AdapterFactory) -> None:
        scenario = trace["scenario"]
        self.trace = trace
        self.max_model_len: int = scenario["max_model_len"]
        self.num_blocks: int = scenario["num_blocks"]
        self.record_boundary: bool = scenario.get("record_shared_prefix_boundary", False)
        self.adapter: ManagerAdapter = factory(
            scenario_config(scenario),
            self.max_model_len,
            scenario["enable_caching"],
            self.events,
            scenario_engine(scenario),
        )
        self.requests: dict[str, _RequestState] = {}
        self.states_not_shown = 0
        """``state`` operations whose pool snapshot the adapter does not show (``None``)."""

    def steps(self) -> Iterator[tuple[int, Json, Json, Json]]:
        """(index, op, recorded observation, observed) for each operation, in order."""
        for index, (op, expected) in enumerate(
            zip(self.trace["scenario"]["ops"], self.trace["observations"], strict=True)
        ):
            yield index, op, expected, self.observe(op)

    def observe(self, op: Json) -> Json:
        """Perform one operation; its observation as the trace records it."""
        return {"op": op["op"], "rid": op.get("rid"), **self.apply(op)}

    def request_options(self, op: Json) -> dict[str, Any]:
        """More ``new_request`` keywords for an ``add`` operation (none here)."""
        return {}

    def _set_computed(self, state: _RequestState, value: int) -> None:
        state.num_computed_tokens = value
        self.adapter.set_num_computed_tokens(state.handle, value)

    def apply(self, op: Json) -> Json:
        """Perform one operation as the recorder's scheduler did; return what it observes."""
        kind = op["op"]
        a = self.adapter
        if kind == "add":
            # Only when set: an adapter written without the keyword still replays the others.
            skip = (
                {"skip_reading_prefix_cache": True} if op.get("skip_reading_prefix_cache") else {}
            )
            options = self.request_options(op)
            handle = a.new_request(op["rid"], op["prompt"], op.get("cache_salt"), **skip, **options)
            self.requests[op["rid"]] = _RequestState(handle, len(op["prompt"]))
            return {}
        if kind == "new_step":
            a.new_step()
            return {}
        if kind == "lookup":
            return self._lookup(op)
        if kind == "allocate":
            return self._allocate(op)
        if kind == "append":
            state = self.requests[op["rid"]]
            a.append_tokens(state.handle, op["tokens"])
            state.num_tokens += len(op["tokens"])
            # Accepted drafts were computed by the step that proposed them.
            accepted = op.get("num_accepted_draft_tokens", 0)
            if accepted:
                self._set_computed(state, state.num_computed_tokens + accepted)
            return {}
        if kind in ("free", "preempt"):
            state = self.requests[op["rid"]]
            a.free(state.handle)
            if kind == "free":
                del self.requests[op["rid"]]
            else:
                self._set_computed(state, 0)
                state.running = False
                state.lookup = None
            return {"num_free_blocks": a.num_free_blocks()}
        if kind == "reset_prefix_cache":
            return {"ok": a.reset_prefix_cache()}
        if kind == "state":
            return self._state()
        raise ValueError(f"op {kind!r} is not an operation the traces use")

    def _state(self) -> Json:
        snap = self.adapter.snapshot()
        observed: Json = {"num_free_blocks": self.adapter.num_free_blocks()}
        if snap is None:
            # The adapter cannot show its pool: only the free count is compared.
            self.states_not_shown += 1
            return {**observed, **dict.fromkeys(SNAPSHOT_FIELDS, NOT_SHOWN)}
        return {
            "free_queue": list(snap.free_block_ids),
            "num_cached_keys": snap.num_cached_keys,
            "cached_block_ids": [list(ids) for ids in snap.cached_block_ids],
            "ref_cnt": {str(k): v for k, v in snap.ref_counts},
            **observed,
        }

    def _lookup(self, op: Json) -> Json:
        state = self.requests[op["rid"]]
        found = self.adapter.lookup(state.handle)
        state.lookup = found
        observed: Json = {
            "hit_tokens": found.num_hit_tokens,
            "hit_block_ids": [list(g) for g in found.block_ids],
        }
        if self.record_boundary:
            self.adapter.set_shared_prefix_boundary(state.handle, found.shared_prefix_boundary)
            observed["shared_prefix_boundary"] = found.shared_prefix_boundary
        return observed

    def _allocate(self, op: Json) -> Json:
        rid = op["rid"]
        state = self.requests[rid]
        lookup, state.lookup = state.lookup, None
        used = lookup if op["use_hit"] else None
        hit = 0 if used is None else used.num_hit_tokens
        observed: Json = {}
        n = op["num_new_tokens"]
        if n is None:
            n = min(state.num_tokens - (state.num_computed_tokens + hit), op["token_budget"])
            if state.running:
                n = min(n, self.max_model_len - state.num_computed_tokens - 1)
            observed["num_new_tokens"] = max(n, 0)
            if n <= 0:
                observed.update(skipped=True, num_new_tokens=0, new_block_ids=None)
                return {**observed, **self._table_and_usage(rid)}
        new = self.adapter.allocate(
            state.handle,
            n,
            used,
            op["num_lookahead_tokens"],
            False,
            **({"full_sequence_must_fit": True} if op.get("full_sequence_must_fit") else {}),
        )
        if new is None:
            observed["new_block_ids"] = None
        else:
            observed["new_block_ids"] = [list(g) for g in new]
            self._set_computed(state, min(state.num_computed_tokens + hit + n, state.num_tokens))
            state.running = True
        return {**observed, **self._table_and_usage(rid)}

    def _table_and_usage(self, request_id: str) -> Json:
        return {
            "block_table": [list(g) for g in self.adapter.block_table(request_id)],
            "num_free_blocks": self.adapter.num_free_blocks(),
            "usage": self.adapter.usage(),
        }


SNAPSHOT_FIELDS = ("free_queue", "num_cached_keys", "cached_block_ids", "ref_cnt")
"""The fields of a ``state`` observation that come from the adapter's pool snapshot."""


class _NotShown:
    """The observed value of a field the adapter cannot show: never compared."""

    def __repr__(self) -> str:
        return "NOT_SHOWN"


NOT_SHOWN: Any = _NotShown()


def observations_match(expected: Json, observed: Json) -> bool:
    """Every recorded field equal (usage to within float rounding); fields the adapter does
    not show (``NOT_SHOWN``) are not compared."""
    for key, value in expected.items():
        seen = observed.get(key)
        if seen is NOT_SHOWN:
            continue
        if key == "usage":
            if not isinstance(seen, int | float) or not math.isclose(
                value, seen, rel_tol=0, abs_tol=1e-12
            ):
                return False
        elif seen != value:
            return False
    return True


def replay_trace(
    name: str, factory: AdapterFactory, *, check_invariants: bool = True
) -> tuple[int, Divergence | None]:
    """Replay one packaged trace through an adapter; return (operations matched, first
    divergence or None). An exception from the implementation propagates (``check_trace``
    reports it instead)."""
    replay = TraceReplay(load_trace(name), factory)
    matched = 0
    for index, op, expected, observed in replay.steps():
        if not observations_match(expected, observed):
            return matched, Divergence(name, index, op, expected, observed)
        if check_invariants:
            replay.adapter.check_invariants()
        matched += 1
    return matched, None
