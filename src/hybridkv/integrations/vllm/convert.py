"""vLLM 0.33's ``KVCacheConfig`` → hybridkv's: the groups' specs, one by one, or a refusal naming
the spec kind or field hybridkv does not model; and back (``to_vllm_config``), built with vLLM's
own classes."""

from __future__ import annotations

from typing import Any

from hybridkv.integrations.vllm.errors import refuse
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def _dtype_bytes(dtype: Any) -> int:
    itemsize = getattr(dtype, "itemsize", None)
    return int(itemsize) if isinstance(itemsize, int) and itemsize > 0 else 2


def _check_common(spec: Any, where: str) -> None:
    refuse(
        bool(getattr(spec, "prefix_replay_tokens", 0)),
        f"{where}: prefix_replay_tokens (SWA bounded replay)",
        "hybridkv's managers have no replay window",
    )
    refuse(
        not getattr(spec, "prefix_cacheable", True),
        f"{where}: a group that is not prefix cacheable (scratch groups)",
        "every hybridkv group takes part in prefix caching",
    )
    refuse(
        bool(getattr(spec, "is_draft", False)),
        f"{where}: is_draft",
        "draft-model KV groups are not modelled",
    )


def _page_fields(spec: Any, where: str) -> dict[str, int]:
    """An attention group's page for hybridkv, whose page is ``block_size × 2 × heads ×
    head_size × dtype`` bytes (K and V). A plain group is written with its own heads, head size
    and dtype. Any other page, the same manager's blocks with other bytes in them, becomes one
    head of half the per-token bytes: the same page, memory and blocks. That covers MLA groups
    (``MLAAttentionSpec``, ``SlidingWindowMLASpec``: one latent vector per token, no separate V,
    ``fp8_ds_mla``), quantized KV (``kv_quant_mode``: scales in the page), a V head of another
    size, packed heads and alignment padding: vLLM's managers read none of these, only
    ``page_size_bytes``. A page that is not a multiple of ``2 × block_size`` bytes cannot be
    written so and is refused. (Events keep vLLM's kind, ``mla_attention`` or
    ``sliding_window_mla``: the manager hands the core vLLM's event metadata.)"""
    page = int(spec.page_size_bytes)
    dtype_bytes = _dtype_bytes(spec.dtype)
    plain = 2 * spec.block_size * spec.num_kv_heads * spec.head_size * dtype_bytes
    if page == plain:
        return {
            "block_size": spec.block_size,
            "num_kv_heads": spec.num_kv_heads,
            "head_size": spec.head_size,
            "dtype_bytes": dtype_bytes,
        }
    per_token, odd = divmod(page, 2 * spec.block_size)
    refuse(
        odd != 0 or per_token == 0,
        f"{where}: {type(spec).__name__} with a {page}-byte page of {spec.block_size} tokens",
        "hybridkv's page is block_size × 2 × heads × head_size × dtype bytes",
    )
    if per_token % dtype_bytes:
        dtype_bytes = 1
    return {
        "block_size": spec.block_size,
        "num_kv_heads": 1,
        "head_size": per_token // dtype_bytes,
        "dtype_bytes": dtype_bytes,
    }


def spec_from_vllm(spec: Any, where: str = "kv_cache_spec") -> KVCacheSpec:
    """One vLLM layer spec as hybridkv's, or ``UnsupportedSetting`` naming its kind."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec as VChunked,
    )
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec as VCross,
    )
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec as VFull,
    )
    from vllm.v1.kv_cache_interface import (
        MambaSpec as VMamba,
    )
    from vllm.v1.kv_cache_interface import (
        MLAAttentionSpec as VMLA,
    )
    from vllm.v1.kv_cache_interface import (
        SlidingWindowMLASpec as VSlidingMLA,
    )
    from vllm.v1.kv_cache_interface import (
        SlidingWindowSpec as VSliding,
    )

    kind = type(spec)
    _check_common(spec, where)
    if kind is VMamba:
        return MambaSpec(
            block_size=spec.block_size,
            state_bytes=max(1, spec.state_content_size_bytes),
            page_size_padded=spec.page_size_padded,
            mamba_cache_mode=spec.mamba_cache_mode,
            num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
        )
    refuse(
        kind not in (VFull, VSliding, VChunked, VCross, VMLA, VSlidingMLA),
        f"{where}: {kind.__name__}",
        "hybridkv models full attention, sliding window, chunked local attention, "
        "cross-attention, Mamba and MLA (full or sliding window)",
    )
    common = _page_fields(spec, where)
    if kind in (VFull, VMLA):
        refuse(
            spec.sliding_window is not None or spec.attention_chunk_size is not None,
            f"{where}: FullAttentionSpec with sliding_window/attention_chunk_size",
            "this is vLLM's fallback when the hybrid allocator is off; hybridkv is hybrid",
        )
        refuse(bool(spec.non_causal), f"{where}: non_causal", "encoder layers are not modelled")
        return FullAttentionSpec(**common)
    if kind is VCross:
        return CrossAttentionSpec(**common)
    if kind in (VSliding, VSlidingMLA):
        return SlidingWindowSpec(
            **common,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    return ChunkedLocalAttentionSpec(**common, attention_chunk_size=spec.attention_chunk_size)


def from_vllm_config(kv_cache_config: Any) -> KVCacheConfig:
    """vLLM's ``KVCacheConfig`` as hybridkv's (``UnsupportedSetting`` names what cannot be)."""
    refuse(
        kv_cache_config.hisparse_host_num_blocks is not None,
        "KVCacheConfig.hisparse_host_num_blocks",
        "HiSparse host blocks are not modelled",
    )
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        where = f"kv_cache_groups[{index}]"
        refuse(
            bool(getattr(group, "host_resident", False)),
            f"{where}.host_resident",
            "host-resident groups are not modelled",
        )
        role = getattr(group, "role", None)
        refuse(
            role is not None and getattr(role, "value", role) != "default",
            f"{where}.role={getattr(role, 'value', role)!r}",
            "only default-role groups are modelled",
        )
        groups.append(
            KVCacheGroup(
                layer_names=tuple(group.layer_names) or (f"group{index}",),
                spec=spec_from_vllm(group.kv_cache_spec, f"{where}.kv_cache_spec"),
                is_eagle_group=bool(group.is_eagle_group),
            )
        )
    return KVCacheConfig(
        num_blocks=kv_cache_config.num_blocks,
        groups=tuple(groups),
        prefix_cache_retention_interval=kv_cache_config.prefix_cache_retention_interval,
    )


def _torch_dtype(dtype_bytes: int) -> Any:
    import torch

    dtypes = {1: torch.float8_e4m3fn, 2: torch.bfloat16, 4: torch.float32}
    if dtype_bytes not in dtypes:
        raise ValueError(f"dtype_bytes must be one of {sorted(dtypes)} for vLLM, got {dtype_bytes}")
    return dtypes[dtype_bytes]


def to_vllm_config(config: KVCacheConfig) -> Any:
    """hybridkv's ``KVCacheConfig`` of attention groups as vLLM 0.33's, built with vLLM's
    ``KVCacheConfig``, ``KVCacheGroupSpec``, ``FullAttentionSpec``, ``SlidingWindowSpec``,
    ``ChunkedLocalAttentionSpec``, ``CrossAttentionSpec``, ``MambaSpec`` and ``KVCacheTensor``:
    the same groups (layer names, specs, EAGLE flags), the same number of blocks and retention
    interval, and one layer-outermost tensor per group as vLLM's planner lays them out (groups
    alias from byte 0; each block of the pool is as large as the largest group's page). A dtype
    of 2 bytes becomes bfloat16.

    hybridkv knows a Mamba state by its size only, so a Mamba group's state becomes one flat
    ``uint8`` tensor of ``state_bytes``: vLLM's manager reads the state's bytes, the padded page,
    the cache mode and the extra blocks, never the shapes, and ``from_vllm_config`` gives the
    same spec back. ``ValueError`` for a dtype size torch has no float type of."""
    from vllm.v1.kv_cache_interface import KVCacheConfig as VConfig
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec as VGroup
    from vllm.v1.kv_cache_interface import KVCacheTensor as VTensor

    groups = [
        VGroup(list(g.layer_names), _vllm_spec(g.spec), is_eagle_group=g.is_eagle_group)
        for g in config.groups
    ]
    n = config.num_blocks
    block_bytes = max(len(g.layer_names) * g.kv_cache_spec.page_size_bytes for g in groups)
    tensors = [
        VTensor(
            size=block_bytes * n,
            layers=list(g.layer_names),
            layer_stride=g.kv_cache_spec.page_size_bytes * n,
            block_stride=g.kv_cache_spec.page_size_bytes,
        )
        for g in groups
    ]
    return VConfig(
        num_blocks=n,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
    )


def _vllm_spec(spec: KVCacheSpec) -> Any:
    """One hybridkv layer spec as vLLM 0.33's (a Mamba state as one flat byte tensor)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec as VChunked
    from vllm.v1.kv_cache_interface import CrossAttentionSpec as VCross
    from vllm.v1.kv_cache_interface import FullAttentionSpec as VFull
    from vllm.v1.kv_cache_interface import SlidingWindowSpec as VSliding

    if isinstance(spec, MambaSpec):
        return _vllm_mamba_spec(spec)
    common = {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype": _torch_dtype(spec.dtype_bytes),
    }
    if isinstance(spec, SlidingWindowSpec):
        return VSliding(
            **common,
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return VChunked(**common, attention_chunk_size=spec.attention_chunk_size)
    if isinstance(spec, CrossAttentionSpec):
        return VCross(**common)
    return VFull(**common)


def _vllm_mamba_spec(spec: MambaSpec) -> Any:
    """vLLM's ``MambaSpec`` with hybridkv's state size, padding, cache mode and extra blocks."""
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec as VMamba

    return VMamba(
        block_size=spec.block_size,
        shapes=((spec.state_bytes,),),
        dtypes=(torch.uint8,),
        page_size_padded=spec.page_size_padded,
        mamba_cache_mode=spec.mamba_cache_mode,
        num_speculative_blocks=spec.num_speculative_blocks,
        num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
        prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
    )
