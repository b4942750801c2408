"""Facts → layer specs: the ``{layer name: spec}`` mapping the planner takes for a model
(``model_layers``), each layer kind mapped to the manager's nearest spec only where that is
exact, and refused otherwise; and the pipeline stage of each planned layer
(``decoder_layer_stages``). The facts come from the embedded catalogue or a Hugging Face
config (``hybridkv.catalogue``, ``hybridkv.hf_config``).

Layer kinds (the catalogue's vocabulary):

=================================== ===========================================================
``full_attention``                  ``FullAttentionSpec``
``sliding_attention``               ``SlidingWindowSpec(sliding_window)``
``chunked_attention``               ``ChunkedLocalAttentionSpec(attention_chunk_size)``
``full_attention_mla``              ``FullAttentionSpec(num_kv_heads=1, head_size=latent / 2)``:
                                    the same bytes per token as the one 576-element latent
``mamba``, ``mamba2``,              ``MambaSpec(state_bytes)``: vLLM's conv state in bf16 plus
``linear_attention_gdn``,           the SSM / temporal state in the SSM dtype
``linear_attention_lightning``
``hybrid_parallel_attention_mamba2`` two layers, ``layers.i.attn`` and ``layers.i.mamba``
``mlp_only``                        no layer: it holds neither KV nor state
=================================== ===========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from hybridkv.catalogue import ATTENTION_KINDS, RECURRENT_KINDS, ModelError, ModelFacts
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

_T = TypeVar("_T")


@dataclass(frozen=True)
class ModelLayers:
    """The planner's input for one model: specs in model order, KV sharing, and caveats."""

    layers: Mapping[str, KVCacheSpec]
    kv_sharing: Mapping[str, str]
    notes: tuple[str, ...]


def model_layers(
    facts: ModelFacts, *, block_size: int, kv_dtype_bytes: int, ssm_dtype_bytes: int | None = None
) -> ModelLayers:
    """The ``{layer name: spec}`` of ``facts``; ``ModelError`` for a kind with no exact spec.

    Layers are named ``layers.i`` after their decoder layer; a Falcon-H1 decoder layer holds
    two, ``layers.i.attn`` and ``layers.i.mamba``. MLP-only layers hold nothing and are left out.
    """
    recurrent = set(facts.layer_kinds) & (RECURRENT_KINDS | {"hybrid_parallel_attention_mamba2"})
    mamba = _mamba_spec(facts, block_size, ssm_dtype_bytes) if recurrent else None
    layers: dict[str, KVCacheSpec] = {}
    for index, kind in enumerate(facts.layer_kinds):
        layers.update(_decoder_layer(facts, index, kind, block_size, kv_dtype_bytes, mamba))
    if not layers:
        raise ModelError(f"{facts.name}: no layer holds KV cache or state")
    sharing = {
        f"layers.{reader}": f"layers.{target}" for reader, target in facts.kv_sharing.items()
    }
    return ModelLayers(layers, sharing, facts.notes + _mapping_notes(facts))


def decoder_layer_stages(
    facts: ModelFacts, layers: ModelLayers, pipeline_parallel_size: int
) -> dict[str, int]:
    """The pipeline stage of every planned layer, as vLLM places it: the decoder layers (MLP-only
    ones included) split evenly over the stages, the remainder to the stages before the last;
    ``layers.i`` and ``layers.i.attn`` / ``layers.i.mamba`` go with decoder layer i."""
    num_decoder_layers = len(facts.layer_kinds)
    if pipeline_parallel_size > num_decoder_layers:
        raise ModelError(
            f"{facts.name}: {pipeline_parallel_size} pipeline stages need at least as many "
            f"decoder layers, it has {num_decoder_layers}"
        )
    sizes = rules.pipeline_stage_sizes(num_decoder_layers, pipeline_parallel_size)
    stage_of = [stage for stage, size in enumerate(sizes) for _ in range(size)]
    return {name: stage_of[int(name.split(".")[1])] for name in layers.layers}


def _decoder_layer(
    facts: ModelFacts,
    index: int,
    kind: str,
    block_size: int,
    dtype_bytes: int,
    mamba: MambaSpec | None,
) -> list[tuple[str, KVCacheSpec]]:
    """The layers (name, spec) that decoder layer ``index`` of ``kind`` contributes."""
    name = f"layers.{index}"
    if kind == "mlp_only":
        return []
    if kind in RECURRENT_KINDS and mamba is not None:
        return [(name, mamba)]
    if kind == "full_attention_mla":
        return [(name, _mla_spec(facts, block_size, dtype_bytes))]
    if kind == "hybrid_parallel_attention_mamba2" and mamba is not None:
        attn = _attention_spec(facts, "full_attention", block_size, dtype_bytes)
        return [(f"{name}.attn", attn), (f"{name}.mamba", mamba)]
    if kind in ATTENTION_KINDS:
        return [(name, _attention_spec(facts, kind, block_size, dtype_bytes))]
    raise ModelError(f"{facts.name}: layer {index} has kind {kind!r}, which is not modelled")


def _attention_spec(facts: ModelFacts, kind: str, block_size: int, dtype_bytes: int) -> KVCacheSpec:
    """A paged attention layer; the window or chunk comes from the model's attention facts."""
    attn = _need(facts.attention, facts.name, "attention (num_key_value_heads, head_dim)")
    common = {
        "block_size": block_size,
        "num_kv_heads": attn.num_kv_heads,
        "head_size": attn.head_dim,
        "dtype_bytes": dtype_bytes,
    }
    if kind == "sliding_attention":
        window = _need(attn.sliding_window, facts.name, "sliding_window")
        return SlidingWindowSpec(**common, sliding_window=window)
    if kind == "chunked_attention":
        chunk = _need(attn.attention_chunk_size, facts.name, "attention_chunk_size")
        return ChunkedLocalAttentionSpec(**common, attention_chunk_size=chunk)
    return FullAttentionSpec(**common)


def _mla_spec(facts: ModelFacts, block_size: int, dtype_bytes: int) -> KVCacheSpec:
    """MLA as full attention with one head of half the latent: the spec's K + V = the latent.

    The manager only counts bytes and blocks, and an MLA layer keeps every token like full
    attention, so this is exact exactly when the latent has an even number of elements.
    """
    mla = _need(facts.mla, facts.name, "kv_lora_rank / qk_rope_head_dim")
    if mla.latent_elems % 2:
        raise ModelError(
            f"{facts.name}: the MLA latent has {mla.latent_elems} elements per token (odd); "
            "a FullAttentionSpec stores 2 × heads × head_size, so it cannot be modelled exactly"
        )
    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=mla.latent_elems // 2,
        dtype_bytes=dtype_bytes,
    )


def _mamba_spec(facts: ModelFacts, block_size: int, ssm_dtype_bytes: int | None) -> MambaSpec:
    """One recurrent layer's state; the planner raises the block size and pads it (Case 4)."""
    recurrent = _need(facts.recurrent, facts.name, "the recurrent state sizes")
    return MambaSpec(block_size=block_size, state_bytes=recurrent.state_bytes(ssm_dtype_bytes))


def _mapping_notes(facts: ModelFacts) -> tuple[str, ...]:
    """Say where a layer kind was mapped to a spec that is exact in bytes but not in shape."""
    notes: list[str] = []
    kinds = set(facts.layer_kinds)
    if "full_attention_mla" in kinds and facts.mla is not None:
        notes.append(
            f"MLA: one {facts.mla.latent_elems}-element latent per token (K = V = latent), "
            f"planned as full attention with 1 KV head of head_size {facts.mla.latent_elems // 2}: "
            "the same bytes per token and blocks; the K/V split is notional"
        )
    if kinds & RECURRENT_KINDS or "hybrid_parallel_attention_mamba2" in kinds:
        notes.append(
            "recurrent layers are planned as MambaSpec: vLLM conv state in bf16 + SSM state in "
            "the SSM dtype; the plan counts two state blocks per request with prefix caching "
            "(vLLM's align mode), one without; simulate runs them the same way (align with "
            "--prefix-caching, the default)"
        )
    if "hybrid_parallel_attention_mamba2" in kinds:
        notes.append(
            "every decoder layer holds KV and a Mamba-2 state: layers.i.attn + layers.i.mamba"
        )
    if "mlp_only" in kinds:
        notes.append(
            f"{facts.layer_kinds.count('mlp_only')} MLP-only layers hold no KV and no state"
        )
    return tuple(notes)


def _need(value: _T | None, model: str, what: str) -> _T:
    """``value``, or a ``ModelError`` saying which fact the model lacks."""
    if value is None:
        raise ModelError(f"{model}: its layers need {what}, which the model does not give")
    return value
