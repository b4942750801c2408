"""KV and recurrent-state sizes from a ``config.json``: attention heads and head size, window
and chunk, each family's recurrent state in vLLM's shapes, the MLA latent and KV sharing."""

from __future__ import annotations

from hybridkv.catalogue import AttentionFacts, MLAFacts, RecurrentFacts
from hybridkv.hf_fields import ConfigError, Fields


def attention(fields: Fields, kinds: tuple[str, ...]) -> AttentionFacts | None:
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


def recurrent(fields: Fields, kinds: tuple[str, ...]) -> RecurrentFacts | None:
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


def mla(fields: Fields) -> MLAFacts:
    """DeepSeek MLA: the cached latent is ``kv_lora_rank + qk_rope_head_dim`` per token."""
    return MLAFacts(fields.integer("kv_lora_rank"), fields.integer("qk_rope_head_dim"))


def kv_sharing(fields: Fields, kinds: tuple[str, ...]) -> dict[int, int]:
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
