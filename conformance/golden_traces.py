"""The golden traces as packaged: their names and sets, a trace parsed, and what its scenario
describes (the ``KVCacheConfig``, the engine's keywords, the hash block size vLLM resolves).

Each trace is a scenario (KV cache groups, pool size, operations) and what vLLM 0.33 observed
after every operation; ``vectors/README.md`` gives the format. ``golden_replay`` plays one.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from typing import Any

from hybridkv.conformance.adapters import EngineOptions
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


def scenario_engine(scenario: Json) -> EngineOptions:
    """The engine options a scenario sets, as the adapter factory receives them."""
    return EngineOptions(**engine_options(scenario))
