"""Real models, as the facts a KV cache plan needs: their vocabulary and the embedded catalogue.

A model is described by ``ModelFacts``: the kind of every decoder layer plus the numbers that size
its KV cache or recurrent state. The facts come either from the embedded catalogue (25 real
models distilled from the project's model catalogue, each with its source line) or from a
Hugging Face ``config.json`` (``hybridkv.hf_config``). ``model_layers`` turns facts into the
``{layer name: spec}`` mapping the planner takes (``hybridkv.model_layers``).
"""

from __future__ import annotations

import difflib
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

DTYPE_BYTES: Mapping[str, int] = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of the cache dtypes ``--kv-dtype`` accepts."""

CONV_STATE_DTYPE_BYTES = 2
"""vLLM keeps the conv state in the model dtype, bf16 for every recurrent model catalogued."""

ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
RECURRENT_KINDS = frozenset(
    {"mamba", "mamba2", "linear_attention_gdn", "linear_attention_lightning"}
)
LAYER_KINDS = (
    ATTENTION_KINDS
    | RECURRENT_KINDS
    | {
        "full_attention_mla",
        "hybrid_parallel_attention_mamba2",
        "mlp_only",
    }
)


class ModelError(ValueError):
    """A model the planner cannot be given exactly: the message says what and why."""


class UnknownModelError(ModelError):
    """A name that is in neither the catalogue's ids nor its other names."""


@dataclass(frozen=True)
class AttentionFacts:
    """KV heads and head size of every attention layer (they are equal in every model here)."""

    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    attention_chunk_size: int | None = None


@dataclass(frozen=True)
class RecurrentFacts:
    """The fixed-size state of one recurrent layer for one request, in elements.

    ``conv_state_elems`` is vLLM's conv state ((d_conv − 1) × conv_dim; 0 for lightning
    attention) and ``ssm_state_elems`` the SSM / temporal state. ``ssm_dtype_bytes`` is what
    vLLM's ``auto`` SSM dtype gives (the model dtype, float32 for Nemotron-H), ``ssm_dtype``
    its name.
    """

    kind: str
    conv_state_elems: int
    ssm_state_elems: int
    ssm_dtype_bytes: int = 2
    ssm_dtype: str = "bfloat16"

    def state_bytes(self, ssm_dtype_bytes: int | None = None) -> int:
        """Bytes of the state: conv in bf16, SSM in ``ssm_dtype_bytes`` (default: the model's)."""
        ssm_bytes = self.ssm_dtype_bytes if ssm_dtype_bytes is None else ssm_dtype_bytes
        return self.conv_state_elems * CONV_STATE_DTYPE_BYTES + self.ssm_state_elems * ssm_bytes


@dataclass(frozen=True)
class MLAFacts:
    """DeepSeek's multi-head latent attention: one latent of rank + rope elements per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def latent_elems(self) -> int:
        """Elements cached per token per layer, shared by every head, with no K/V factor 2."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class ModelFacts:
    """What sizes a model's KV cache: the kind of each decoder layer and its numbers.

    ``kv_sharing`` maps a decoder layer that reads another layer's KV (Gemma-3n) to that layer.
    """

    name: str
    layer_kinds: tuple[str, ...]
    attention: AttentionFacts | None = None
    recurrent: RecurrentFacts | None = None
    mla: MLAFacts | None = None
    kv_sharing: Mapping[int, int] = field(default_factory=dict)
    max_position_embeddings: int | None = None
    notes: tuple[str, ...] = ()


# --- The embedded catalogue -------------------------------------------------------------------


@dataclass(frozen=True)
class CatalogueEntry:
    """One catalogued model: its ids, how sure the numbers are, where they come from, its facts."""

    model_id: str
    aka: tuple[str, ...]
    family: str
    status: str
    source: str
    unconfirmed: tuple[str, ...]
    facts: ModelFacts

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that finds this model: ids with and without their organisation."""
        ids = (self.model_id, *self.aka)
        return ids + tuple(name.split("/", 1)[1] for name in ids if "/" in name)


@functools.cache
def load_catalogue() -> tuple[CatalogueEntry, ...]:
    """The models of ``hybridkv/data/catalogue.json``, in catalogue order (read once)."""
    text = resources.files("hybridkv").joinpath("data/catalogue.json").read_text("utf-8")
    return tuple(_entry(record) for record in json.loads(text)["models"])


def find_model(name: str) -> CatalogueEntry:
    """The model called ``name`` (case-insensitive, organisation optional).

    ``UnknownModelError`` lists the closest names, so a typo is one look away from its fix.
    """
    wanted = name.strip().lower()
    for entry in load_catalogue():
        if wanted in (known.lower() for known in entry.names):
            return entry
    raise UnknownModelError(f"unknown model {name!r}; {_suggestions(wanted)}")


_VARIANT_SUFFIXES = ("-instruct", "-it", "-thinking", "-base")


def find_variant(name: str) -> CatalogueEntry | None:
    """The one catalogue model that ``name`` is a variant of, or ``None``.

    Hub ids of one model differ by a suffix (``google/gemma-3-27b`` and ``-it``,
    ``Qwen3-Next-80B-A3B-Thinking`` and ``-Instruct``, ``Falcon-H1-7B-Base`` and
    ``-Instruct``): names match when they are equal, organisation aside, once such a suffix is
    dropped from each. ``None`` when no model, or more than one, matches.
    """
    stem = _variant_stem(name.strip().lower().split("/")[-1])
    found = {
        entry.model_id: entry
        for entry in load_catalogue()
        for known in entry.names
        if _variant_stem(known.lower().split("/")[-1]) == stem
    }
    return next(iter(found.values())) if len(found) == 1 else None


def _variant_stem(name: str) -> str:
    """``name`` without one trailing variant suffix."""
    for suffix in _VARIANT_SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def _suggestions(wanted: str) -> str:
    """The closest catalogue ids, by spelling and by substring."""
    by_lower = {}
    for entry in load_catalogue():
        for known in entry.names:
            by_lower[known.lower()] = entry.model_id
    close = [known for known in by_lower if wanted and wanted in known]
    close += difflib.get_close_matches(wanted, list(by_lower), n=5, cutoff=0.5)
    ids = list(dict.fromkeys(by_lower[known] for known in close))[:5]
    if not ids:
        return "run `hybridkv models` to list the catalogue"
    return "did you mean: " + ", ".join(ids) + "?"


def _entry(record: Mapping[str, Any]) -> CatalogueEntry:
    """A catalogue record as an entry; the record's keys are those of the data file."""
    aka = tuple(name.split(" ", 1)[0] for name in record["aka"])
    return CatalogueEntry(
        model_id=record["model_id"],
        aka=aka,
        family=record["family"],
        status=record["status"],
        source=record["source"],
        unconfirmed=tuple(record["unconfirmed"]),
        facts=_facts(record),
    )


def _facts(record: Mapping[str, Any]) -> ModelFacts:
    """The planning facts of a record (attention, recurrent state, MLA latent, KV sharing)."""
    attn = record["attention"]
    attention = None
    if attn["head_dim"] is not None:
        attention = AttentionFacts(
            num_kv_heads=attn["num_key_value_heads"],
            head_dim=attn["head_dim"],
            sliding_window=attn["sliding_window"],
            attention_chunk_size=attn["attention_chunk_size"],
        )
    rec = record["recurrent"]
    recurrent = None
    if rec is not None:
        recurrent = RecurrentFacts(
            kind=rec["kind"],
            conv_state_elems=rec["conv_state_elems_vllm"],
            ssm_state_elems=rec["ssm_state_elems"],
            ssm_dtype_bytes=4 if rec["ssm_dtype_auto"] == "float32" else 2,
            ssm_dtype=rec["ssm_dtype_auto"],
        )
    mla = record["mla"]
    sharing = record["kv_sharing"]
    return ModelFacts(
        name=record["model_id"],
        layer_kinds=tuple(record["layer_types"]),
        attention=attention,
        recurrent=recurrent,
        mla=None if mla is None else MLAFacts(mla["kv_lora_rank"], mla["qk_rope_head_dim"]),
        kv_sharing={}
        if sharing is None
        else {int(k): int(v) for k, v in sharing["consumer_to_producer"].items()},
        max_position_embeddings=record["max_position_embeddings"],
        notes=tuple(record["notes"]),
    )
