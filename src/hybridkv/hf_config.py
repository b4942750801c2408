"""Read a Hugging Face ``config.json`` into the facts a KV cache plan needs (``ModelFacts``).

Each family spells the layer pattern its own way: an explicit ``layer_types`` list where the
config has one, otherwise the family's rule (``sliding_window_pattern``, ``attn_layer_period``,
``attn_layer_indices``, ``hybrid_override_pattern``, ``no_rope_layers``,
``full_attention_interval``, ``attn_type_list``…), with transformers' defaults where a config
leaves a key out. Multimodal configs nest the language model under ``text_config``. Anything
that cannot be read exactly is a ``ConfigError`` naming the field, never a guess.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from hybridkv.catalogue import ModelFacts
from hybridkv.hf_fields import ConfigError, Fields
from hybridkv.hf_state import attention, kv_sharing, mla, recurrent

__all__ = ["ConfigError", "facts_from_config", "known_model_types", "load_config"]

# model_type (top level or text_config) → the family whose rules read it.
_FAMILIES: Mapping[str, str] = {
    "gemma3_text": "gemma3",
    "gemma3n_text": "gemma3n",
    "llama4_text": "llama4",
    "minimax_text_01": "minimax",
    "minimax_m1": "minimax",
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
}


# --- Entry points -----------------------------------------------------------------------------


def load_config(path: str | Path, *, assume_full_attention: bool = False) -> ModelFacts:
    """Read ``path`` (a config.json) into facts; ``ConfigError`` for unreadable JSON or fields.

    ``assume_full_attention`` plans a ``model_type`` this module does not know as all full
    attention (the user asserts it); without it such a config is refused.
    """
    try:
        text = Path(path).read_text("utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror}") from None
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte 0x{error.object[error.start]:02x} at offset "
            f"{error.start}): a config.json is UTF-8 JSON; give the file from the model's "
            "snapshot, or re-save it as UTF-8"
        ) from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"{path} is not valid JSON (line {error.lineno}, column {error.colno}: {error.msg})"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return facts_from_config(config, name=str(path), assume_full_attention=assume_full_attention)


def facts_from_config(
    config: Mapping[str, Any], *, name: str, assume_full_attention: bool = False
) -> ModelFacts:
    """The facts of one config.json object (its ``text_config`` when it has one).

    A ``model_type`` with no rule here and no ``layer_types`` list is a ``ConfigError`` naming
    it, unless ``assume_full_attention``; every field a default filled is listed in the notes.
    """
    fields = _text_fields(config, name)
    notes = []
    assumed = _check_known(fields, assume_full_attention)
    if assumed:
        notes.append(
            f"model_type {fields.family!r} is not one hybridkv reads: every layer is planned as "
            "full attention, as --assume-full-attention asserts"
        )
    kinds = _layer_kinds(fields, assumed)
    if fields.family == "mistral" and "layer_types" not in fields.config:
        notes.append(
            "config.json has no layer_types: every layer runs as the HF format reads it "
            "(sliding_window set → all layers sliding, as transformers and vLLM do)"
        )
    facts = ModelFacts(
        name=name,
        layer_kinds=kinds,
        attention=attention(fields, kinds),
        recurrent=recurrent(fields, kinds),
        mla=mla(fields) if "full_attention_mla" in kinds else None,
        kv_sharing=kv_sharing(fields, kinds),
        max_position_embeddings=fields.optional_integer("max_position_embeddings"),
    )
    if fields.defaulted:
        filled = ", ".join(f"{key} = {value!r}" for key, value in fields.defaulted.items())
        notes.append(f"{name} leaves out fields the plan needs; filled with defaults: {filled}")
    return dataclasses.replace(facts, notes=tuple(notes))


def known_model_types() -> tuple[str, ...]:
    """The ``model_type`` values whose layer kinds this module reads from their own fields."""
    return tuple(sorted({*_RULES, *_KNOWN_UNIFORM, *_FAMILIES}))


def _check_known(fields: Fields, assume_full_attention: bool) -> bool:
    """Whether the layers are assumed full attention: ``ConfigError`` for a ``model_type`` with
    no rule and no ``layer_types`` list, unless the user asserts full attention."""
    if fields.family in _RULES or fields.family in _KNOWN_UNIFORM:
        return False
    if "layer_types" in fields.config:
        return False
    if assume_full_attention:
        return True
    raise ConfigError(
        f"{fields.source}: field {fields.name('model_type')!r} is {fields.family!r}, which "
        f"hybridkv does not know: it reads the layer kinds of model_type "
        f"{', '.join(known_model_types())}, and of any model from a 'layer_types' list "
        f"({', '.join(sorted(_EXPLICIT))}, one per layer); add layer_types to the config, or "
        "pass --assume-full-attention (assume_full_attention=True) if every layer is full "
        "attention"
    )


def _text_fields(config: Mapping[str, Any], source: str) -> Fields:
    """The language model's fields: ``text_config`` when present, else the top level."""
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' must be an object, got {text!r}")
    model_type = (text or {}).get("model_type") or config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: field 'model_type' must be a string, got {model_type!r}")
    family = _FAMILIES.get(model_type, model_type)
    if text is not None:
        return Fields(text, "text_config.", family, source)
    return Fields(config, "", family, source)


# --- Layer kinds ------------------------------------------------------------------------------


def _layer_kinds(fields: Fields, assumed_full: bool) -> tuple[str, ...]:
    """The kind of every decoder layer, from ``layer_types`` or the family's rule."""
    num_layers = fields.integer("num_hidden_layers")
    explicit = fields.sequence("layer_types")
    if assumed_full:
        kinds: tuple[str, ...] = ("full_attention",) * num_layers
    elif explicit is not None:
        kinds = tuple(_explicit_kind(fields, i, value) for i, value in enumerate(explicit))
    else:
        kinds = _RULES.get(fields.family, _uniform_rule)(fields, num_layers)
    if len(kinds) != num_layers:
        raise ConfigError(
            f"{fields.source}: the layer pattern gives {len(kinds)} layers but field "
            f"{fields.name('num_hidden_layers')!r} is {num_layers}"
        )
    return kinds


_EXPLICIT: Mapping[str, str] = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "sliding_attention": "sliding_attention",
    "chunked_attention": "chunked_attention",
    "mamba2": "mamba2",
    "mlp": "mlp_only",
}


def _explicit_kind(fields: Fields, index: int, value: object) -> str:
    """One ``layer_types`` entry in the catalogue's vocabulary (some names depend on family)."""
    family_kinds = {
        ("linear_attention", "qwen3_next"): "linear_attention_gdn",
        ("linear_attention", "minimax"): "linear_attention_lightning",
        ("mamba", "jamba"): "mamba",
        ("mamba", "bamba"): "mamba2",
        ("mamba", "granitemoehybrid"): "mamba2",
        ("mamba", "nemotron_h"): "mamba2",
        ("hybrid", "falcon_h1"): "hybrid_parallel_attention_mamba2",
    }
    kind = family_kinds.get((str(value), fields.family)) or _EXPLICIT.get(str(value))
    if kind is None:
        raise fields.error(
            "layer_types",
            f"is {value!r}, which is not a layer type hybridkv can plan for model_type "
            f"{fields.family!r}",
            index,
        )
    return kind


def _every_nth_full(fields: Fields, num_layers: int, pattern_key: str) -> tuple[str, ...]:
    """Layer i is full attention iff (i + 1) % pattern == 0, else sliding (Gemma-3, Cohere2)."""
    pattern = fields.integer(pattern_key)
    return tuple(
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    )


def _alternating(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Sliding on even layers, full on odd ones (Gemma-2, gpt-oss)."""
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers))


def _uniform_rule(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Llama-like models: every layer full attention, or every layer sliding (Mistral format)."""
    window = fields.get("sliding_window", None)
    if window is not None and fields.config.get("use_sliding_window", True) is not False:
        fields.check_int("sliding_window", window)
        return ("sliding_attention",) * num_layers
    return ("full_attention",) * num_layers


_KNOWN_UNIFORM = frozenset({"llama", "mistral", "ministral", "qwen2", "qwen3"})


def _llama4(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Llama 4: RoPE layers (``no_rope_layers[i] == 1``) are chunked local, NoPE layers global."""
    flags = fields.sequence("no_rope_layers")
    if not flags:  # transformers: an empty list means the default rule
        interval = fields.integer("no_rope_layer_interval")
        flags = [int((i + 1) % interval != 0) for i in range(num_layers)]
    kinds = []
    for i, flag in enumerate(flags):
        if flag not in (0, 1):
            raise fields.error("no_rope_layers", f"must be 0 or 1, got {flag!r}", i)
        kinds.append("chunked_attention" if flag else "full_attention")
    return tuple(kinds)


def _jamba(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Jamba: attention iff i % attn_layer_period == attn_layer_offset, Mamba-1 elsewhere."""
    period = fields.integer("attn_layer_period")
    offset = fields.get("attn_layer_offset")
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < period:
        raise fields.error(
            "attn_layer_offset", f"must be an integer in [0, {period}), got {offset!r}"
        )
    return tuple("full_attention" if i % period == offset else "mamba" for i in range(num_layers))


def _bamba(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Bamba: attention at ``attn_layer_indices``, Mamba-2 elsewhere."""
    indices = fields.sequence("attn_layer_indices")
    if indices is None:
        raise fields.error("attn_layer_indices", "is missing")
    return tuple("full_attention" if i in indices else "mamba2" for i in range(num_layers))


def _nemotron_h(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Nemotron-H: one character per layer, M = Mamba-2, * = attention, - / E = MLP or MoE."""
    pattern = fields.get("hybrid_override_pattern")
    kinds = {"M": "mamba2", "*": "full_attention", "-": "mlp_only", "E": "mlp_only"}
    if not isinstance(pattern, str) or set(pattern) - set(kinds):
        raise fields.error(
            "hybrid_override_pattern", f"must be a string of M, *, - and E, got {pattern!r}"
        )
    return tuple(kinds[char] for char in pattern)


def _qwen3_next(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """Qwen3-Next: full attention every ``full_attention_interval`` layers, Gated DeltaNet else."""
    interval = fields.integer("full_attention_interval")
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention_gdn"
        for i in range(num_layers)
    )


def _minimax(fields: Fields, num_layers: int) -> tuple[str, ...]:
    """MiniMax-Text-01 and MiniMax-M1: ``attn_type_list`` 1 = softmax (full) attention,
    0 = lightning (linear) attention."""
    flags = fields.sequence("attn_type_list")
    if flags is None:
        raise fields.error("attn_type_list", "is missing")
    kinds = {0: "linear_attention_lightning", 1: "full_attention"}
    for i, flag in enumerate(flags):
        if flag not in kinds:
            raise fields.error("attn_type_list", f"must be 0 or 1, got {flag!r}", i)
    return tuple(kinds[flag] for flag in flags)


_RULES: Mapping[str, Callable[[Fields, int], tuple[str, ...]]] = {
    "gemma2": _alternating,
    "gpt_oss": _alternating,
    "gemma3": lambda f, n: _every_nth_full(f, n, "sliding_window_pattern"),
    "gemma3n": lambda f, n: _every_nth_full(f, n, "sliding_window_pattern"),
    "cohere2": lambda f, n: _every_nth_full(f, n, "sliding_window_pattern"),
    "llama4": _llama4,
    "jamba": _jamba,
    "bamba": _bamba,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
    "minimax": _minimax,
    "falcon_h1": lambda f, n: ("hybrid_parallel_attention_mamba2",) * n,
    "deepseek": lambda f, n: ("full_attention_mla",) * n,
    "mamba": lambda f, n: ("mamba",) * n,
    "mamba2": lambda f, n: ("mamba2",) * n,
}
