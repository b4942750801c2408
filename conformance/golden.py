"""Replay the golden traces recorded from vLLM 0.33's KV cache manager against any backend.

Each trace is a scenario (KV cache groups, pool size, operations) and what vLLM observed after
every operation; ``vectors/README.md`` gives the format. The replay plays the scheduler's part
exactly as the recorder did (how ``n`` is chosen, how ``num_computed_tokens`` advances) and
compares every observation field, stopping at the first difference.

Two sets are packaged: ``gen_*`` (189 traces, vLLM's unit-test defaults) and ``eng_*`` (150
traces, what an engine runs: Mamba prefix caching, different block sizes, sparse retention,
full-prompt admission, speculative decoding; the README's "Engine features").
"""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

from hybridkv.conformance.protocol import KVCacheManagerLike, ManagerFactory
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

Json = dict[str, Any]


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


TRACE_SETS = {"unit": "gen_", "engine": "eng_"}
"""The packaged trace sets and the prefix of their names."""


def trace_names(trace_set: str | None = None) -> list[str]:
    """Names of the packaged traces of one set (``"unit"`` or ``"engine"``; all by default)."""
    if trace_set is not None and trace_set not in TRACE_SETS:
        raise ValueError(f"trace_set must be one of {sorted(TRACE_SETS)}, got {trace_set!r}")
    prefix = "" if trace_set is None else TRACE_SETS[trace_set]
    folder = resources.files("hybridkv.conformance") / "vectors"
    return sorted(
        entry.name.removesuffix(".json.gz")
        for entry in folder.iterdir()
        if entry.name.endswith(".json.gz") and entry.name.startswith(prefix)
    )


def load_trace(name: str) -> Json:
    """One packaged trace, parsed."""
    path = resources.files("hybridkv.conformance") / "vectors" / f"{name}.json.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        trace: Json = json.load(text)
    return trace


def _group_spec(group: Json) -> KVCacheSpec:
    # Layer sizes do not matter to the manager: the recorder used 1 head × size 1 × float32.
    if group["kind"] == "mamba":
        return MambaSpec(
            block_size=group["block_size"],
            state_bytes=group.get("state_bytes", 64),
            mamba_cache_mode=group.get("mamba_cache_mode", "none"),
            num_speculative_blocks=group.get("num_speculative_blocks", 0),
            num_prefill_checkpoint_blocks=group.get("num_prefill_checkpoint_blocks", 0),
            prefill_checkpoint_alignment=group.get("prefill_checkpoint_alignment"),
        )
    common = {
        "block_size": group["block_size"],
        "num_kv_heads": 1,
        "head_size": 1,
        "dtype_bytes": 4,
    }
    if group["kind"] == "full":
        return FullAttentionSpec(**common)
    if group["kind"] == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=group["sliding_window"])
    if group["kind"] == "chunked_local":
        return ChunkedLocalAttentionSpec(
            **common, attention_chunk_size=group["attention_chunk_size"]
        )
    raise ValueError(f"groups[].kind {group['kind']!r} is not a kind the traces use")


def scenario_config(scenario: Json) -> KVCacheConfig:
    """The ``KVCacheConfig`` a scenario describes (groups with equal specs stay separate)."""
    groups = tuple(
        KVCacheGroup(
            tuple(f"g{gid}.layer{i}" for i in range(group["num_layers"])),
            _group_spec(group),
            is_eagle_group=group.get("is_eagle_group", False),
        )
        for gid, group in enumerate(scenario["groups"])
    )
    return KVCacheConfig(
        num_blocks=scenario["num_blocks"],
        groups=groups,
        prefix_cache_retention_interval=scenario.get("prefix_cache_retention_interval"),
    )


def engine_options(scenario: Json) -> dict[str, Any]:
    """The manager keywords a scenario sets (none for the unit-test traces)."""
    options: dict[str, Any] = {}
    if scenario.get("max_in_flight_tokens") is not None:
        options["max_in_flight_tokens"] = scenario["max_in_flight_tokens"]
    if scenario.get("use_eagle"):
        options["use_eagle"] = True
    if scenario.get("num_hash_lookahead_tokens"):
        options["num_hash_lookahead_tokens"] = scenario["num_hash_lookahead_tokens"]
    return options


def scenario_hash_block_size(scenario: Json) -> int:
    """The hash block size vLLM resolves for a scenario: one group's block size; several
    groups' gcd, or their lcm with caching off or a Mamba group in ``"none"`` mode."""
    sizes = [group["block_size"] for group in scenario["groups"]]
    if len(sizes) == 1:
        return int(sizes[0])
    lcm_hashing = not scenario["enable_caching"] or any(
        g["kind"] == "mamba" and g.get("mamba_cache_mode", "none") == "none"
        for g in scenario["groups"]
    )
    return rules.hash_block_size(sizes, lcm_hashing=lcm_hashing)


@dataclass
class _RequestState:
    request: Request
    running: bool = False
    lookup: tuple[KVCacheBlocks, int] | None = None


class TraceReplay:
    """Plays one trace's operations on a manager, yielding (recorded, observed) per operation."""

    def __init__(self, trace: Json, factory: ManagerFactory) -> None:
        scenario = trace["scenario"]
        self.trace = trace
        self.hash_block_size = scenario_hash_block_size(scenario)
        self.max_model_len: int = scenario["max_model_len"]
        self.num_blocks: int = scenario["num_blocks"]
        self.num_hash_lookahead_tokens: int = scenario.get("num_hash_lookahead_tokens", 0)
        self.record_boundary: bool = scenario.get("record_shared_prefix_boundary", False)
        self.manager: KVCacheManagerLike = factory(
            scenario_config(scenario),
            self.max_model_len,
            scenario["enable_caching"],
            **engine_options(scenario),
        )
        self.requests: dict[str, _RequestState] = {}

    def steps(self) -> Iterator[tuple[int, Json, Json, Json]]:
        """(index, op, recorded observation, observed) for each operation, in order."""
        for index, (op, expected) in enumerate(
            zip(self.trace["scenario"]["ops"], self.trace["observations"], strict=True)
        ):
            observed = {"op": op["op"], "rid": op.get("rid"), **self.apply(op)}
            yield index, op, expected, observed

    def apply(self, op: Json) -> Json:
        """Perform one operation as the recorder's scheduler did; return what it observes."""
        kind = op["op"]
        m = self.manager
        if kind == "add":
            request = Request(
                op["rid"],
                op["prompt"],
                hash_block_size=self.hash_block_size,
                cache_salt=op.get("cache_salt"),
                skip_reading_prefix_cache=op.get("skip_reading_prefix_cache", False),
                num_hash_lookahead_tokens=self.num_hash_lookahead_tokens,
            )
            self.requests[op["rid"]] = _RequestState(request)
            return {}
        if kind == "new_step":
            m.new_step_starts()
            return {}
        if kind == "lookup":
            return self._lookup(op)
        if kind == "allocate":
            return self._allocate(op)
        if kind == "append":
            request = self.requests[op["rid"]].request
            request.append_output_token_ids(op["tokens"])
            # Accepted drafts were computed by the step that proposed them.
            request.num_computed_tokens += op.get("num_accepted_draft_tokens", 0)
            return {}
        if kind in ("free", "preempt"):
            state = self.requests[op["rid"]]
            m.free(state.request)
            if kind == "free":
                del self.requests[op["rid"]]
            else:
                state.request.num_computed_tokens = 0
                state.running = False
                state.lookup = None
            return {"num_free_blocks": m.num_free_blocks}
        if kind == "reset_prefix_cache":
            return {"ok": m.reset_prefix_cache()}
        if kind == "state":
            snap = m.snapshot()
            return {
                "free_queue": list(snap.free_block_ids),
                "num_cached_keys": snap.num_cached_keys,
                "cached_block_ids": [list(ids) for ids in snap.cached_block_ids],
                "ref_cnt": {str(k): v for k, v in sorted(snap.ref_counts.items())},
                "num_free_blocks": m.num_free_blocks,
            }
        raise ValueError(f"op {kind!r} is not an operation the traces use")

    def _lookup(self, op: Json) -> Json:
        state = self.requests[op["rid"]]
        blocks, hit, boundary = self.manager.get_computed_blocks(state.request)
        state.lookup = (blocks, hit)
        observed: Json = {
            "hit_tokens": hit,
            "hit_block_ids": [list(g) for g in blocks.get_block_ids()],
        }
        if self.record_boundary:
            state.request.shared_prefix_boundary = boundary
            observed["shared_prefix_boundary"] = boundary
        return observed

    def _allocate(self, op: Json) -> Json:
        state = self.requests[op["rid"]]
        request = state.request
        lookup, state.lookup = state.lookup, None
        hit_blocks, hit = lookup if (op["use_hit"] and lookup is not None) else (None, 0)
        observed: Json = {}
        n = op["num_new_tokens"]
        if n is None:
            n = min(request.num_tokens - (request.num_computed_tokens + hit), op["token_budget"])
            if state.running:
                n = min(n, self.max_model_len - request.num_computed_tokens - 1)
            observed["num_new_tokens"] = max(n, 0)
            if n <= 0:
                observed.update(skipped=True, num_new_tokens=0, new_block_ids=None)
                return {**observed, **self._table_and_usage(request.request_id)}
        new = self.manager.allocate_slots(
            request,
            n,
            num_new_computed_tokens=hit,
            new_computed_blocks=hit_blocks,
            num_lookahead_tokens=op["num_lookahead_tokens"],
            **({"full_sequence_must_fit": True} if op.get("full_sequence_must_fit") else {}),
        )
        if new is None:
            observed["new_block_ids"] = None
        else:
            observed["new_block_ids"] = [list(g) for g in new.get_block_ids()]
            request.num_computed_tokens = min(
                request.num_computed_tokens + hit + n, request.num_tokens
            )
            state.running = True
        return {**observed, **self._table_and_usage(request.request_id)}

    def _table_and_usage(self, request_id: str) -> Json:
        return {
            "block_table": [list(g) for g in self.manager.get_block_ids(request_id)],
            "num_free_blocks": self.manager.num_free_blocks,
            "usage": self.manager.usage,
        }


def observations_match(expected: Json, observed: Json) -> bool:
    """Every recorded field equal (usage to within float rounding)."""
    for key, value in expected.items():
        if key == "usage":
            if not math.isclose(value, observed.get(key, math.nan), rel_tol=0, abs_tol=1e-12):
                return False
        elif observed.get(key) != value:
            return False
    return True


def replay_trace(
    name: str, factory: ManagerFactory, *, check_invariants: bool = True
) -> tuple[int, Divergence | None]:
    """Replay one packaged trace; return (operations matched, first divergence or None)."""
    replay = TraceReplay(load_trace(name), factory)
    matched = 0
    for index, op, expected, observed in replay.steps():
        if not observations_match(expected, observed):
            return matched, Divergence(name, index, op, expected, observed)
        if check_invariants:
            replay.manager.check_invariants()
        matched += 1
    return matched, None
