"""Replay the golden traces recorded from vLLM 0.33's KV cache manager against any
implementation, through its ``ManagerAdapter`` (``hybridkv.conformance.adapters``: the one
protocol the suite speaks; the project's own managers replay as ``ProtocolAdapter``s).

Each trace is a scenario (KV cache groups, pool size, operations) and what vLLM observed after
every operation; ``vectors/README.md`` gives the format. The replay plays the scheduler's part
exactly as the recorder did (how ``n`` is chosen, how ``num_computed_tokens`` advances) and
compares every observation field, stopping at the first difference. ``replay_trace`` lets the
implementation's exceptions propagate; ``check_trace`` reports them (and refusals by name).

The traces and their scenarios are ``golden_traces``; the replay, ``golden_replay``; this module
reports a trace's outcome (``check_trace``) and re-exports their public names.

Two sets are packaged: ``gen_*`` (189 traces, vLLM's unit-test defaults) and ``eng_*`` (150
traces, what an engine runs: Mamba prefix caching, different block sizes, sparse retention,
full-prompt admission, speculative decoding; the README's "Engine features").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from hybridkv.conformance.adapters import NOT_IMPLEMENTED, AdapterFactory
from hybridkv.conformance.golden_replay import (
    NOT_SHOWN,
    SNAPSHOT_FIELDS,
    Divergence,
    TraceReplay,
    observations_match,
    replay_trace,
)
from hybridkv.conformance.golden_traces import (
    TRACE_SETS,
    Json,
    engine_options,
    load_trace,
    scenario_config,
    scenario_engine,
    scenario_hash_block_size,
    trace_names,
)

__all__ = [
    "NOT_SHOWN",
    "SNAPSHOT_FIELDS",
    "TRACE_SETS",
    "Divergence",
    "Json",
    "TraceReplay",
    "TraceResult",
    "TraceStatus",
    "check_trace",
    "engine_options",
    "load_trace",
    "observations_match",
    "replay_trace",
    "scenario_config",
    "scenario_engine",
    "scenario_hash_block_size",
    "trace_names",
]

TraceStatus = Literal["pass", "fail", "skipped"]


@dataclass(frozen=True)
class TraceResult:
    """One trace's outcome through an adapter.

    ``status`` is ``"pass"`` (every observation equal, invariants held), ``"fail"`` (``detail``
    names the operation index and what differed, or the exception and its message) or
    ``"skipped"`` (the implementation refused a feature the trace needs: a ``ValueError`` saying
    it ``does not implement`` it; ``detail`` holds its message). ``matched`` counts the
    operations that matched before the outcome, of ``num_ops``; ``states_not_shown`` the
    ``state`` operations whose pool snapshot the adapter did not show.
    """

    trace: str
    status: TraceStatus
    matched: int
    num_ops: int
    detail: str = ""
    states_not_shown: int = 0


def check_trace(
    name: str, factory: AdapterFactory, *, check_invariants: bool = True
) -> TraceResult:
    """Replay one packaged trace through an adapter and never raise: a divergence, or an
    exception from building the adapter, from an operation or from its invariant checker, is
    a ``"fail"`` naming the operation index; a refusal by name a ``"skipped"``."""
    trace = load_trace(name)
    num_ops = len(trace["scenario"]["ops"])
    matched = 0
    index = -1
    replay: TraceReplay | None = None

    def failed(text: str) -> TraceResult:
        return TraceResult(name, "fail", matched, num_ops, text, _not_shown(replay))

    try:
        replay = TraceReplay(trace, factory)
        pairs = zip(trace["scenario"]["ops"], trace["observations"], strict=True)
        for index, (op, expected) in enumerate(pairs):
            observed = replay.observe(op)
            if not observations_match(expected, observed):
                return failed(str(Divergence(name, index, op, expected, observed)))
            if check_invariants:
                replay.adapter.check_invariants()
            matched += 1
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        if isinstance(error, ValueError) and NOT_IMPLEMENTED in str(error):
            return TraceResult(name, "skipped", matched, num_ops, message, _not_shown(replay))
        where = "building the adapter" if index < 0 else f"op {index}"
        if index >= 0:
            op_text = json.dumps(trace["scenario"]["ops"][index])[:200]
            where += f" {op_text}"
        return failed(f"{name}: {where} raised {message}")
    return TraceResult(name, "pass", matched, num_ops, "", _not_shown(replay))


def _not_shown(replay: TraceReplay | None) -> int:
    return 0 if replay is None else replay.states_not_shown
