"""The fields of a Hugging Face ``config.json``, read with a type check that names the field.

``Fields`` is the one reader ``hybridkv.hf_config`` (layer kinds) and ``hybridkv.hf_state``
(KV and state sizes) share: it falls back on transformers' defaults for keys a config leaves
out and records every default it used, so the plan can list them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.catalogue import ModelError

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
