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

from hybridkv.catalogue import (
    AttentionFacts,
    MLAFacts,
    ModelError,
    ModelFacts,
    RecurrentFacts,
)

_MISSING: Any = object()

# transformers' defaults for keys that real configs leave out (catalogue: Gemma-3-4b's text_config
# omits heads, KV heads and head_dim; Bamba omits max_position_embeddings).
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "gemma2": {"sliding_window": 4096, "head_dim": 256},
    "gemma3": {
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
    },
    "gemma3n": {"sliding_window_pattern": 5},
    "cohere2": {"sliding_window_pattern": 4},
    "llama4": {"attention_chunk_size": 8192, "no_rope_layer_interval": 4},
    "jamba": {"attn_layer_period": 8, "attn_layer_offset": 4},
    "bamba": {"max_position_embeddings": 262144},
    "qwen3_next": {"full_attention_interval": 4},
    "mamba": {"expand": 2, "conv_kernel": 4, "state_size": 16},
    "mamba2": {"expand": 2, "conv_kernel": 4, "state_size": 128, "n_groups": 8, "head_dim": 64},
}

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


class ConfigError(ModelError):
    """A config.json the planner cannot read exactly; the message names the field."""


class Fields:
    """The (text) config's keys, read with a type check that names the field when it fails."""

    def __init__(self, config: Mapping[str, Any], prefix: str, family: str, source: str) -> None:
        self.source = source
        self.config = config
        self.prefix = prefix
        self.family = family
        self.defaulted: dict[str, object] = {}
        """Fields the config leaves out that a default filled, by name: the plan lists them."""

    def get(self, key: str, default: Any = _MISSING) -> Any:
        """The raw value of ``key``, the family's transformers default, then ``default``.

        A default that stands in for a value (not ``None``, ``0`` or ``False``: "no such
        feature") is recorded in ``defaulted``.
        """
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if key in _DEFAULTS.get(self.family, {}):
            value = _DEFAULTS[self.family][key]
        elif default is _MISSING:
            raise ConfigError(f"{self.source}: field {self.name(key)!r} is missing")
        else:
            value = default
        if value is not None and value is not False and value != 0:
            self.defaulted[self.name(key)] = value
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        """A positive int (``default`` when absent); ``ConfigError`` naming the field otherwise."""
        value = self.get(key) if default is None else self.get(key, default)
        return self.check_int(key, value)

    def optional_integer(self, key: str) -> int | None:
        """A positive int, or ``None`` when the config (and transformers) leave it out."""
        value = self.get(key, None)
        return None if value is None else self.check_int(key, value)

    def check_int(self, key: str, value: object) -> int:
        """``value`` if it is a positive int, else ``ConfigError`` naming ``key``."""
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"{self.source}: field {self.name(key)!r} must be a positive integer, got {value!r}"
            )
        return value

    def sequence(self, key: str) -> list[Any] | None:
        """A list value, ``None`` when absent; ``ConfigError`` when it is something else."""
        value = self.get(key, None)
        if value is not None and not isinstance(value, list):
            raise ConfigError(
                f"{self.source}: field {self.name(key)!r} must be a list, got {value!r}"
            )
        return value

    def error(self, key: str, problem: str, index: int | None = None) -> ConfigError:
        """A ``ConfigError`` naming the file and the field (``layer_types[3]`` with ``index``)."""
        field = self.name(key) if index is None else f"{self.name(key)}[{index}]"
        return ConfigError(f"{self.source}: field {field!r} {problem}")

    def name(self, key: str) -> str:
        """The field's path as the user sees it in the file (``text_config.head_dim``)."""
        return f"{self.prefix}{key}"


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
        attention=_attention(fields, kinds),
        recurrent=_recurrent(fields, kinds),
        mla=_mla(fields) if "full_attention_mla" in kinds else None,
        kv_sharing=_kv_sharing(fields, kinds),
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


# --- Attention, recurrent state, MLA, KV sharing ----------------------------------------------


def _attention(fields: Fields, kinds: tuple[str, ...]) -> AttentionFacts | None:
    """KV heads, head size, window and chunk of the attention layers (None without any)."""
    if not {"full_attention", "sliding_attention", "chunked_attention",
            "hybrid_parallel_attention_mamba2"} & set(kinds):  # fmt: skip
        return None
    for key in ("global_head_dim", "num_global_key_value_heads"):
        if key in fields.config:
            raise ConfigError(
                f"{fields.source}: field {fields.name(key)!r} gives global layers another KV size, "
                "which one page size cannot hold (Allocation, Case 4 covers Mamba only)"
            )
    heads = fields.integer("num_attention_heads")
    head_key = "attention_head_dim" if "attention_head_dim" in fields.config else "head_dim"
    head_dim = fields.get(head_key, None)
    if head_dim is None:
        hidden = fields.integer("hidden_size")
        if hidden % heads:
            raise fields.error("head_dim", "is missing (hidden_size is not a multiple of heads)")
        head_dim = hidden // heads
        fields.defaulted[fields.name("head_dim")] = head_dim
    return AttentionFacts(
        num_kv_heads=fields.integer("num_key_value_heads", heads),
        head_dim=fields.check_int(head_key, head_dim),
        sliding_window=fields.integer("sliding_window") if "sliding_attention" in kinds else None,
        attention_chunk_size=fields.integer("attention_chunk_size")
        if "chunked_attention" in kinds
        else None,
    )


def _recurrent(fields: Fields, kinds: tuple[str, ...]) -> RecurrentFacts | None:
    """The per-layer state of the recurrent layers, in vLLM's shapes (None without any)."""
    if "mamba" in kinds:
        return _mamba1(fields)
    if "mamba2" in kinds or "hybrid_parallel_attention_mamba2" in kinds:
        return _mamba2(fields)
    if "linear_attention_gdn" in kinds:
        return _gated_deltanet(fields)
    if "linear_attention_lightning" in kinds:
        heads, head_dim = fields.integer("num_attention_heads"), fields.integer("head_dim")
        return RecurrentFacts("lightning_linear_attention", 0, heads * head_dim * head_dim)
    return None


def _mamba1(fields: Fields) -> RecurrentFacts:
    """Mamba-1: d_inner = expand × hidden; conv (d_conv − 1) × d_inner; SSM d_inner × d_state.

    Jamba prefixes the keys with ``mamba_``; a pure Mamba config (``model_type: mamba``) names
    them ``expand``, ``conv_kernel``, ``state_size`` and may give ``intermediate_size``.
    """
    if fields.family == "mamba":
        d_inner = fields.integer(
            "intermediate_size", fields.integer("expand") * fields.integer("hidden_size")
        )
        conv = (fields.integer("conv_kernel") - 1) * d_inner
        return RecurrentFacts("mamba1", conv, d_inner * fields.integer("state_size"))
    d_inner = fields.integer("mamba_expand") * fields.integer("hidden_size")
    conv = (fields.integer("mamba_d_conv") - 1) * d_inner
    return RecurrentFacts("mamba1", conv, d_inner * fields.integer("mamba_d_state"))


def _mamba2(fields: Fields) -> RecurrentFacts:
    """Mamba-2: conv (d_conv − 1) × (d_inner + 2 × groups × d_state); SSM heads × d_head × d_state.

    Nemotron-H spells the keys differently and keeps its SSM state in float32 by default
    (vLLM's ``mamba_ssm_cache_dtype``); Falcon-H1's d_inner is ``mamba_d_ssm``.
    """
    if fields.family == "nemotron_h":
        keys = ("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel")
    elif fields.family == "mamba2":
        keys = ("num_heads", "head_dim", "n_groups", "state_size", "conv_kernel")
    else:
        keys = ("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv")
    heads = fields.integer(keys[0])
    d_head = fields.get(keys[1])
    if d_head == "auto":
        d_head = fields.integer("mamba_expand") * fields.integer("hidden_size") // heads
    d_head = fields.check_int(keys[1], d_head)
    groups, d_state, d_conv = (fields.integer(key) for key in keys[2:])
    d_inner = fields.integer("mamba_d_ssm", heads * d_head)
    conv = (d_conv - 1) * (d_inner + 2 * groups * d_state)
    dtype = _ssm_dtype(fields)
    return RecurrentFacts("mamba2", conv, heads * d_head * d_state, _SSM_SIZES[dtype], dtype)


_SSM_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _ssm_dtype(fields: Fields) -> str:
    """vLLM's ``auto`` SSM dtype: the model's (bf16 here), float32 for Nemotron-H by default."""
    default = "float32" if fields.family == "nemotron_h" else "bfloat16"
    dtype = fields.get("mamba_ssm_cache_dtype", default)
    if dtype not in _SSM_SIZES:
        raise ConfigError(
            f"{fields.source}: field {fields.name('mamba_ssm_cache_dtype')!r} must be one of "
            f"{', '.join(_SSM_SIZES)}, got {dtype!r}"
        )
    return str(dtype)


def _gated_deltanet(fields: Fields) -> RecurrentFacts:
    """Qwen3-Next: conv (kernel − 1) × (2 × k_heads × k_dim + v_heads × v_dim); v_heads × v × k."""
    k_heads, v_heads = (
        fields.integer("linear_num_key_heads"),
        fields.integer("linear_num_value_heads"),
    )
    k_dim, v_dim = fields.integer("linear_key_head_dim"), fields.integer("linear_value_head_dim")
    conv = (fields.integer("linear_conv_kernel_dim") - 1) * (2 * k_heads * k_dim + v_heads * v_dim)
    return RecurrentFacts("gated_deltanet", conv, v_heads * v_dim * k_dim)


def _mla(fields: Fields) -> MLAFacts:
    """DeepSeek MLA: the cached latent is ``kv_lora_rank + qk_rope_head_dim`` per token."""
    return MLAFacts(fields.integer("kv_lora_rank"), fields.integer("qk_rope_head_dim"))


def _kv_sharing(fields: Fields, kinds: tuple[str, ...]) -> dict[int, int]:
    """Gemma-3n: the last ``num_kv_shared_layers`` layers read the last own layer of their type."""
    shared = fields.get("num_kv_shared_layers", 0)
    if shared == 0:
        return {}
    fields.check_int("num_kv_shared_layers", shared)
    first_shared = len(kinds) - shared
    if first_shared <= 0:
        raise fields.error("num_kv_shared_layers", f"({shared}) leaves no layer that stores KV")
    last_own = {kind: i for i, kind in enumerate(kinds[:first_shared])}
    sharing = {}
    for i in range(first_shared, len(kinds)):
        if kinds[i] not in last_own:
            raise fields.error(
                "num_kv_shared_layers",
                f"makes layer {i} ({kinds[i]}) share KV, but no earlier layer of its type has KV",
            )
        sharing[i] = last_own[kinds[i]]
    return sharing
