"""Golden traces of requests with LoRA adapters, multimodal items, prompt embeddings and cache
salts, recorded from vLLM 0.33's ``KVCacheManager`` (``scripts/record_extra_key_traces.py``),
replayed through an adapter whose manager publishes KV events.

The format is the golden traces' (``vectors/README.md``) with, under "Extra-key traces" there:
``add`` fields ``lora``, ``mm_features`` and ``prompt_embeds``; a ``block_hashes`` observation
(the request's hashes, hex) after ``add`` and ``append``; and an ``events`` operation observing
every KV event since the last one, each field as vLLM publishes it (``event_json``).
``KeyedTraceReplay`` plays them (``TraceReplay`` with events on and the keys passed to
``new_request``); ``replay_keyed_trace`` stops at the first ``Divergence``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from hybridkv.conformance.adapters import AdapterFactory
from hybridkv.conformance.golden_replay import Divergence, TraceReplay, observations_match
from hybridkv.conformance.golden_traces import Json
from hybridkv.reference.request_keys import LoRA, MultiModalFeature, PromptEmbeds

STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
"""``BlockStored``'s fields, in vLLM 0.33's order (the core's ``BlockStored`` has the same)."""
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx", "locality", "ownership")
"""``BlockRemoved``'s fields."""
HASH_FIELDS = frozenset({"block_hashes", "parent_block_hash"})


def request_keys(op: Json) -> dict[str, Any]:
    """The ``Request`` keywords of an ``add`` operation's ``lora``, ``mm_features`` and
    ``prompt_embeds`` (only those it sets)."""
    keys: dict[str, Any] = {}
    lora = op.get("lora")
    if lora is not None:
        keys["lora"] = LoRA(lora["name"], lora["id"], lora["path"])
    if op.get("mm_features"):
        keys["mm_features"] = tuple(
            MultiModalFeature(f["identifier"], f["offset"], f["length"]) for f in op["mm_features"]
        )
    embeds = op.get("prompt_embeds")
    if embeds is not None:
        keys["prompt_embeds"] = PromptEmbeds(bytes.fromhex(embeds["data"]), embeds["num_tokens"])
    return keys


def json_value(value: object) -> Any:
    """A value as JSON: sequences as arrays, ``bytes`` (a prompt-embedding digest) as
    ``{"bytes": hex}``, anything else unchanged."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    return value


def _hash_hex(value: object) -> str:
    if not isinstance(value, bytes):
        raise ValueError(f"an event's block hash must be bytes, got {value!r}")
    return value.hex()


def event_json(event: object) -> Json:
    """One KV event as JSON, whatever its class (the core's dataclass, vLLM's struct): its class
    name as ``type`` and every field by name, hashes as hex."""
    kind = type(event).__name__
    fields = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(kind, ())
    out: Json = {"type": kind}
    for field in fields:
        value = getattr(event, field)
        if field == "parent_block_hash":
            out[field] = None if value is None else _hash_hex(value)
        elif field in HASH_FIELDS:
            out[field] = [_hash_hex(h) for h in value]
        else:
            out[field] = json_value(value)
    return out


class KeyedTraceReplay(TraceReplay):
    """``TraceReplay`` of an extra-key trace: the adapter's manager publishes events (read from
    its ``manager``, as ``ProtocolAdapter`` and vLLM's adapter hold it), ``add`` passes the keys,
    and request handles show their ``block_hashes``."""

    events = True

    def request_options(self, op: Json) -> dict[str, Any]:
        return request_keys(op)

    def apply(self, op: Json) -> Json:
        if op["op"] == "events":
            manager: Any = getattr(self.adapter, "manager", None)
            if manager is None:
                raise ValueError(f"adapter {self.adapter.name!r} shows no manager to read events")
            return {"events": [event_json(event) for event in manager.take_events()]}
        observed = super().apply(op)
        if op["op"] in ("add", "append"):
            handle = self.requests[op["rid"]].handle
            observed["block_hashes"] = [bytes(h).hex() for h in handle.block_hashes]
        return observed


def load_keyed_trace(path: str | Path) -> Json:
    """An extra-key trace file (gzip-compressed JSON), parsed."""
    with gzip.open(path, "rt", encoding="utf-8") as text:
        trace: Json = json.load(text)
    return trace


def replay_keyed_trace(
    path: str | Path, factory: AdapterFactory, *, check_invariants: bool = True
) -> tuple[int, Divergence | None]:
    """Replay an extra-key trace through an adapter; (operations matched, first divergence or
    ``None``). The implementation's exceptions propagate."""
    trace = load_keyed_trace(path)
    replay = KeyedTraceReplay(trace, factory)
    matched = 0
    for index, op, expected, observed in replay.steps():
        if not observations_match(expected, observed):
            return matched, Divergence(trace["scenario"]["name"], index, op, expected, observed)
        if check_invariants:
            replay.adapter.check_invariants()
        matched += 1
    return matched, None
