"""The plan report: what a plan costs and how many requests it serves (for sizing memory).

``plan_report`` runs ``plan_kv_cache`` and adds what a person sizing a deployment asks next: how
much memory padding wastes (Allocation, Case 3), how many blocks one request of the longest length
holds at most in each group, how many such requests fit at once, and what the same requests
would cost if every layer were full attention (a non-hybrid manager).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hybridkv.reference.planner import own_layer_names, plan_kv_cache
from hybridkv.spec import rules
from hybridkv.spec.errors import check_positive
from hybridkv.spec.kv_cache_config import KVCacheConfig, KVCacheGroup
from hybridkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    spec_kind,
)

_NO_SHARING: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True)
class GroupPlan:
    """One KV cache group of the plan, with what one request needs from it."""

    group_id: int
    """Position of the group in ``KVCacheConfig.groups`` (and in every block-id tuple)."""
    kind: str
    """The attention type, as ``spec_kind`` names it: full, sliding_window, chunked_local, mamba."""
    spec: KVCacheSpec
    """The planned spec (Case 4's raised block size and padded Mamba state included)."""
    layer_names: tuple[str, ...]
    """Own layers in model order, then the layers that read their KV (Case 5)."""
    num_own_layers: int
    """Layers of the group that hold KV cache: one per tensor, from tensor 0 on."""
    num_kv_sharing_layers: int
    """Layers of the group that read another layer's KV and hold none (Case 5)."""
    num_padding_slots: int
    """Tensors whose slices this group leaves unused: layers per group − own layers (Case 3)."""
    max_blocks_per_request: int
    """Most real blocks one request of ``max_model_len`` tokens holds in this group at once."""


@dataclass(frozen=True)
class PlanReport:
    """A plan and its cost; every size in bytes, every block a block of the shared pool."""

    config: KVCacheConfig
    """What the manager needs: num_blocks, groups and tensors."""
    groups: tuple[GroupPlan, ...]
    """One entry per KV cache group, in ``config.groups`` order."""
    layers_per_group: int
    """g: the smallest own-layer count of any attention type; also the number of tensors."""
    block_size: int
    """Tokens per block in every group (raised by Case 4 when the model has Mamba layers)."""
    layer_page_size_bytes: int
    """Bytes of one block of one layer (the code's ``page_size_bytes``)."""
    page_size_bytes: int
    """Bytes of one block of one group: layers_per_group × layer page (the document's page size)."""
    num_blocks: int
    """Blocks in the pool, the null block included."""
    num_padding_slots: int
    """Padding slots over all groups: group slots that hold no layer (Case 3)."""
    padding_fraction: float
    """Padding slots / all slots of all groups: the fraction of the pool that padding wastes.

    Exact when every group holds as many blocks; a padded group holding fewer blocks than the
    others (a sliding-window group next to full attention) wastes less.
    """
    max_model_len: int
    """The longest request, in tokens, that the request bounds below assume."""
    max_num_batched_tokens: int
    """Tokens one scheduler step computes at most (sliding window and chunked local need it)."""
    blocks_per_request: int
    """Most blocks one request of ``max_model_len`` tokens holds at once, over all groups."""
    max_num_requests: int
    """Requests of ``max_model_len`` tokens that fit at once: (num_blocks − 1) // blocks."""
    max_tokens: int
    """max_num_requests × max_model_len: tokens of that many longest requests held at once.

    A lower bound on the pool's capacity in tokens: shorter requests need fewer blocks in full
    attention groups, so more of them may fit.
    """
    memory_bytes: int
    """Bytes the tensors take: num_blocks × page_size_bytes (the rest of the memory is unused)."""
    bytes_per_request: int
    """blocks_per_request × page_size_bytes: one longest request's share of the pool."""
    full_attention_bytes_per_token: int
    """KV bytes of one token in every own attention layer: what a non-hybrid manager keeps."""
    full_attention_bytes_per_request: int
    """One longest request if every own attention layer were full attention (Mamba: one state).

    Uses the planned block size, so the two managers differ only in which blocks they keep.
    """
    full_attention_memory_bytes: int
    """Bytes a non-hybrid manager needs for max_num_requests longest requests."""
    memory_saved_bytes: int
    """full_attention_memory_bytes − max_num_requests × bytes_per_request.

    The memory the hybrid manager saves for the same concurrent longest requests; negative when
    padding and the sliding window's extra block cost more than the forgotten tokens save.
    """
    full_attention_max_num_requests: int
    """Longest requests a non-hybrid manager fits in the same memory, less the null block."""


def plan_report(
    layers: Mapping[str, KVCacheSpec],
    available_memory_bytes: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    kv_sharing: Mapping[str, str] = _NO_SHARING,
) -> PlanReport:
    """Plan ``layers`` into ``available_memory_bytes`` and report what the plan serves.

    Raises ``ValueError`` for what ``plan_kv_cache`` rejects, and for a ``max_model_len`` or
    ``max_num_batched_tokens`` that is not a positive int.
    """
    check_positive("max_model_len", max_model_len)
    check_positive("max_num_batched_tokens", max_num_batched_tokens)
    config = plan_kv_cache(layers, available_memory_bytes, kv_sharing=kv_sharing)
    layers_per_group = len(config.tensors)
    groups = tuple(
        _group_plan(i, group, layers_per_group, kv_sharing, max_model_len, max_num_batched_tokens)
        for i, group in enumerate(config.groups)
    )
    layer_page = config.groups[0].spec.page_size_bytes
    page = layers_per_group * layer_page
    num_padding = sum(group.num_padding_slots for group in groups)
    blocks_per_request = sum(group.max_blocks_per_request for group in groups)
    max_num_requests = rules.max_num_requests(config.num_blocks, blocks_per_request)
    full_bytes_per_request = _full_attention_bytes_per_request(groups, max_model_len)
    return PlanReport(
        config=config,
        groups=groups,
        layers_per_group=layers_per_group,
        block_size=config.groups[0].spec.block_size,
        layer_page_size_bytes=layer_page,
        page_size_bytes=page,
        num_blocks=config.num_blocks,
        num_padding_slots=num_padding,
        padding_fraction=num_padding / (len(groups) * layers_per_group),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        blocks_per_request=blocks_per_request,
        max_num_requests=max_num_requests,
        max_tokens=max_num_requests * max_model_len,
        memory_bytes=config.num_blocks * page,
        bytes_per_request=blocks_per_request * page,
        full_attention_bytes_per_token=_full_attention_bytes_per_token(groups),
        full_attention_bytes_per_request=full_bytes_per_request,
        full_attention_memory_bytes=max_num_requests * full_bytes_per_request,
        memory_saved_bytes=max_num_requests * (full_bytes_per_request - blocks_per_request * page),
        full_attention_max_num_requests=(config.num_blocks - 1) * page // full_bytes_per_request,
    )


def _group_plan(
    group_id: int,
    group: KVCacheGroup,
    layers_per_group: int,
    kv_sharing: Mapping[str, str],
    max_model_len: int,
    max_num_batched_tokens: int,
) -> GroupPlan:
    """One group's entry; its padding slots are the tensors it has no own layer for."""
    num_own = len(own_layer_names(group, kv_sharing))
    return GroupPlan(
        group_id=group_id,
        kind=spec_kind(group.spec),
        spec=group.spec,
        layer_names=group.layer_names,
        num_own_layers=num_own,
        num_kv_sharing_layers=len(group.layer_names) - num_own,
        num_padding_slots=layers_per_group - num_own,
        max_blocks_per_request=max_blocks_per_request(
            group.spec, max_model_len, max_num_batched_tokens
        ),
    )


def max_blocks_per_request(
    spec: KVCacheSpec, max_model_len: int, max_num_batched_tokens: int
) -> int:
    """Most real blocks one request of ``max_model_len`` tokens holds at once in a ``spec`` group.

    Full attention keeps every block; sliding window keeps the window behind one step of
    ``max_num_batched_tokens`` tokens, plus one block for a step that starts mid-block; chunked
    local keeps the current chunk and one step; Mamba keeps one state block (Case 4).
    """
    if isinstance(spec, SlidingWindowSpec):
        return rules.max_blocks_sliding_window(
            max_model_len, spec.block_size, spec.sliding_window, max_num_batched_tokens
        )
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return rules.max_blocks_chunked_local(
            max_model_len, spec.block_size, spec.attention_chunk_size, max_num_batched_tokens
        )
    if isinstance(spec, MambaSpec):
        return rules.max_blocks_mamba(max_model_len)
    return rules.max_blocks_full_attention(max_model_len, spec.block_size)


# --- Against a non-hybrid manager -------------------------------------------------------------


def _full_attention_bytes_per_token(groups: tuple[GroupPlan, ...]) -> int:
    """One token's KV in every own attention layer; a Mamba layer's state does not grow."""
    return sum(
        group.num_own_layers * group.spec.kv_hidden_size
        for group in groups
        if not isinstance(group.spec, MambaSpec)
    )


def _full_attention_bytes_per_request(groups: tuple[GroupPlan, ...], max_model_len: int) -> int:
    """One longest request when every own attention layer keeps all its blocks, layer by layer."""
    return sum(
        group.num_own_layers
        * _full_attention_blocks(group.spec, max_model_len)
        * group.spec.page_size_bytes
        for group in groups
    )


def _full_attention_blocks(spec: KVCacheSpec, max_model_len: int) -> int:
    """Blocks a non-hybrid manager gives one layer of ``spec`` for the longest request."""
    if isinstance(spec, MambaSpec):
        return rules.max_blocks_mamba(max_model_len)
    return rules.max_blocks_full_attention(max_model_len, spec.block_size)
