"""The planner: layers → KV cache groups → tensors and blocks ("Allocation", "Memory Layout").

One memory pool serves every layer, so every KV cache group must have the same page size
(Allocation, "High level idea"). The planner gets there in four steps:

1. Case 5 — layers that read another layer's KV (``kv_sharing``) are set aside: they get no
   memory and are listed after the own layers of their target's group.
2. Case 4 — with Mamba layers, the attention block size grows until one attention page holds a
   Mamba state, and the state is padded to that page.
3. Cases 1–3 — layers with equal specs form one attention type; every type is cut into
   consecutive groups of g layers, g being the smallest layer count of any type. A type's last
   group may be short: its missing slots are *padding*. Full attention comes first. This is
   the ``"document"`` policy; ``"vllm"`` and ``"min-padding"`` choose g and the layers of each
   group otherwise (``reference.grouping``).
4. Memory Layout — g tensors; tensor i is shared by the i-th layer of every group, and a block
   is one ``page_size_bytes`` slice of every tensor. With pipeline stages, each stage has its
   own tensors for its own layers (``reference.pipeline``).

Example (the document's): 10 full + 20 sliding-window layers → groups (full.0–full.9),
(sw.0–sw.9), (sw.10–sw.19); 10 tensors, KVCacheTensor 0 shared by full.0, sw.0 and sw.10.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from hybridkv.reference.grouping import GroupingPolicy, check_policy, split_types
from hybridkv.reference.pipeline import layer_stages as layer_stages_of
from hybridkv.spec import rules
from hybridkv.spec.errors import check_non_negative
from hybridkv.spec.kv_cache_config import (
    KVCacheConfig,
    KVCacheGroup,
    KVCacheTensor,
    full_attention_first,
)
from hybridkv.spec.kv_cache_spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

_NO_SHARING: Mapping[str, str] = MappingProxyType({})
_SPEC_CLASSES = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)


def plan_groups(
    layers: Mapping[str, KVCacheSpec],
    *,
    kv_sharing: Mapping[str, str] = _NO_SHARING,
    policy: GroupingPolicy = "document",
    pipeline_parallel_size: int = 1,
    layer_stages: Mapping[str, int] | None = None,
) -> tuple[KVCacheGroup, ...]:
    """Split the model's layers into KV cache groups of one attention type and one page size.

    ``layers`` maps layer names to specs in model order; ``kv_sharing[layer] = target`` says
    that ``layer`` reads ``target``'s KV cache (Case 5). ``policy`` picks the grouping
    (``reference.grouping``): the document's (the default), vLLM 0.33's, or the one with the
    fewest padded slots, which looks at the pipeline stages: ``layer_stages`` maps each layer
    to its stage, else the layers are split over ``pipeline_parallel_size`` stages as vLLM
    splits decoder layers. Raises ``ValueError`` naming the field and the value for an empty
    model, a spec that is not a layer spec, a bad ``kv_sharing`` entry, an unknown policy, bad
    stages, or layers that cannot share one page size.
    """
    _check_layers(layers)
    _check_kv_sharing(layers, kv_sharing)
    check_policy(policy)
    stages = layer_stages_of(layers, pipeline_parallel_size, layer_stages)
    own_specs = _unify_page_size(
        {name: spec for name, spec in layers.items() if name not in kv_sharing}
    )
    types = _attention_types(own_specs) if policy != "vllm" else _types_in_model_order(own_specs)
    return tuple(
        KVCacheGroup(own + _readers_of(own, layers, kv_sharing), spec)
        for spec, own in split_types(list(types.items()), policy, stages)
    )


def plan_kv_cache(
    layers: Mapping[str, KVCacheSpec],
    available_memory_bytes: int,
    *,
    kv_sharing: Mapping[str, str] = _NO_SHARING,
    policy: GroupingPolicy = "document",
    pipeline_parallel_size: int = 1,
    layer_stages: Mapping[str, int] | None = None,
    enable_caching: bool = True,
) -> KVCacheConfig:
    """Plan the groups, then lay ``available_memory_bytes`` out as tensors (Memory Layout).

    A block is one ``page_size_bytes`` slice of each of the m tensors, so it costs
    m × ``page_size_bytes`` (the document's page size of a group) and
    ``num_blocks = available_memory_bytes // (m × page_size_bytes)``, the null block included.
    With pipeline stages, each stage has ``available_memory_bytes`` and its own m tensors (the
    most own layers of one group on that stage); every stage must hold ``num_blocks``, so the
    fullest stage decides, and ``tensors`` lists stage 0's, then stage 1's, …
    Fewer than 2 blocks leave nothing to hand out: ``ValueError``.

    ``enable_caching`` is the prefix-caching setting the plan will run under, as
    ``KVCacheManager``'s (on by default, as in vLLM 0.33): with it Mamba groups cache their
    states in ``"align"`` mode, without it in ``"none"`` (``with_mamba_cache_mode``), so
    ``KVCacheManager(plan_kv_cache(...), max_model_len)`` accepts the plan as it is.
    """
    check_non_negative("available_memory_bytes", available_memory_bytes)
    groups = plan_groups(
        layers,
        kv_sharing=kv_sharing,
        policy=policy,
        pipeline_parallel_size=pipeline_parallel_size,
        layer_stages=layer_stages,
    )
    stages = layer_stages_of(layers, pipeline_parallel_size, layer_stages)
    per_stage = [names for names in stage_tensor_layers(groups, kv_sharing, stages) if names]
    widest = max(len(names) for names in per_stage)
    layer_page = groups[0].spec.page_size_bytes
    num_blocks = rules.num_blocks_for_memory(available_memory_bytes, widest, layer_page)
    if num_blocks < 2:
        block_bytes = widest * layer_page
        raise ValueError(
            "available_memory_bytes is too small for one block: it must hold 2 blocks (the null "
            f"block plus one) of {widest} × {layer_page} = {block_bytes} bytes, "
            f"i.e. {2 * block_bytes} bytes, got {available_memory_bytes!r}"
        )
    tensors = tuple(
        KVCacheTensor(size=num_blocks * layer_page, shared_by=names)
        for tensor_layers in per_stage
        for names in tensor_layers
    )
    config = KVCacheConfig(num_blocks=num_blocks, groups=groups, tensors=tensors)
    return with_mamba_cache_mode(config, enable_caching)


def own_layer_names(group: KVCacheGroup, kv_sharing: Mapping[str, str]) -> tuple[str, ...]:
    """The layers of ``group`` that hold KV cache themselves: all but the Case 5 readers."""
    return tuple(name for name in group.layer_names if name not in kv_sharing)


# --- Validation -------------------------------------------------------------------------------


def _check_layers(layers: Mapping[str, KVCacheSpec]) -> None:
    """Every layer needs a name and a layer spec; a model needs at least one layer."""
    if not layers:
        raise ValueError(f"layers must name at least one layer, got {dict(layers)!r}")
    for name, spec in layers.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"layers keys must be non-empty layer names, got {name!r}")
        _check_spec(name, spec)


def _check_spec(name: str, spec: object) -> None:
    """Only the four layer specs have rules (``AttentionSpec`` itself is no attention type)."""
    if type(spec) not in _SPEC_CLASSES:
        kinds = ", ".join(cls.__name__ for cls in _SPEC_CLASSES)
        raise ValueError(f"layers[{name!r}] must be one of {kinds}, got {spec!r}")


def _check_kv_sharing(layers: Mapping[str, KVCacheSpec], kv_sharing: Mapping[str, str]) -> None:
    """Case 5: a reader and its target are layers of the model, with equal specs.

    The target must hold its own KV cache: a chain (a reads b, b reads c) has no allocation to
    read from, since only layers outside ``kv_sharing`` get one.
    """
    for reader, target in kv_sharing.items():
        if reader not in layers:
            raise ValueError(f"kv_sharing keys must be layers of the model, got {reader!r}")
        if target not in layers:
            raise ValueError(f"kv_sharing[{reader!r}] must be a layer of the model, got {target!r}")
        if target in kv_sharing:
            raise ValueError(
                f"kv_sharing[{reader!r}] must be a layer with its own KV cache, got {target!r}, "
                f"which itself shares {kv_sharing[target]!r}"
            )
        if layers[reader] != layers[target]:
            raise ValueError(
                f"kv_sharing[{reader!r}] = {target!r} needs equal specs, but layer {reader!r} "
                f"has {layers[reader]!r} and layer {target!r} has {layers[target]!r}"
            )


def _the_one(field: str, values: Mapping[str, int], why: str) -> int:
    """The value every layer has for ``field``; ``ValueError`` naming two layers that differ."""
    names = iter(values)
    first = next(names)
    for name in names:
        if values[name] != values[first]:
            raise ValueError(
                f"{field} must be the same for every {why}, got {values[first]!r} for layer "
                f"{first!r} and {values[name]!r} for layer {name!r}"
            )
    return values[first]


# --- Case 4: one page size --------------------------------------------------------------------


def _unify_page_size(own: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every own layer the same ``page_size_bytes`` (Allocation, Case 4).

    The document supports one page size and one way to reach it: attention layers share one
    kv_hidden_size and one block size (Cases 1–3); Mamba layers share one state size, and the
    attention block size is raised to the smallest multiple whose page holds the state, which is
    then padded to that page. The planner decides a Mamba spec's block size and padding, so the
    ones given are replaced. A Mamba-only model needs no raise: its page is the state.
    """
    attention = {n: s for n, s in own.items() if not isinstance(s, MambaSpec)}
    mamba = {n: s for n, s in own.items() if isinstance(s, MambaSpec)}
    if not mamba:
        _the_one("kv_hidden_size", {n: s.kv_hidden_size for n, s in attention.items()}, _ATTN)
        _the_one("block_size", {n: s.block_size for n, s in attention.items()}, _ATTN)
        return dict(own)
    state_bytes = _the_one("state_bytes", {n: s.state_bytes for n, s in mamba.items()}, _MAMBA)
    if not attention:
        _the_one("block_size", {n: s.block_size for n, s in mamba.items()}, _MAMBA)
        _the_one("page_size_bytes", {n: s.page_size_bytes for n, s in mamba.items()}, _MAMBA)
        return dict(own)
    kv_hidden_size = _the_one(
        "kv_hidden_size", {n: s.kv_hidden_size for n, s in attention.items()}, _ATTN
    )
    block_size = _the_one("block_size", {n: s.block_size for n, s in attention.items()}, _ATTN)
    raised = rules.raised_block_size(block_size, kv_hidden_size, state_bytes)
    padded_mamba = MambaSpec(
        block_size=raised, state_bytes=state_bytes, page_size_padded=raised * kv_hidden_size
    )
    return {
        name: padded_mamba
        if isinstance(spec, MambaSpec)
        else dataclasses.replace(spec, block_size=raised)
        for name, spec in own.items()
    }


_ATTN = "attention layer (the document supports one page size, Allocation Cases 1–4)"
_MAMBA = "Mamba layer (the document supports one page size, Allocation Case 4)"


# --- Cases 1–3 and 5: grouping ----------------------------------------------------------------


def _attention_types(specs: Mapping[str, KVCacheSpec]) -> dict[KVCacheSpec, tuple[str, ...]]:
    """Layers with equal specs, in model order; types in order of first appearance, full first.

    Full attention first follows the document's examples (Group 0 is full attention even in
    Gemma-3, whose first layer is sliding window) and the hybrid coordinator, which asks full
    attention for its hit first.
    """
    ordered = full_attention_first(_types_in_model_order(specs))
    return dict(ordered)


def _types_in_model_order(
    specs: Mapping[str, KVCacheSpec],
) -> dict[KVCacheSpec, tuple[str, ...]]:
    """Layers with equal specs, in model order; types in order of their first layer (vLLM's)."""
    types: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        types.setdefault(spec, []).append(name)
    return {spec: tuple(names) for spec, names in types.items()}


def _readers_of(
    own: tuple[str, ...], layers: Mapping[str, KVCacheSpec], kv_sharing: Mapping[str, str]
) -> tuple[str, ...]:
    """Case 5: the layers that read one of ``own``'s KV caches, in model order."""
    return tuple(name for name in layers if kv_sharing.get(name) in own)


# --- Memory Layout ----------------------------------------------------------------------------


def stage_tensor_layers(
    groups: tuple[KVCacheGroup, ...],
    kv_sharing: Mapping[str, str],
    stages: Mapping[str, int],
) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """Per pipeline stage: tensor i is shared by the i-th own layer on that stage of every group
    that has one (Memory Layout).

    A stage has m tensors, m being the most own layers of any group on it; a group with
    padding simply leaves its last tensors' slices unused. Without pipeline parallelism there
    is one stage and m is the most own layers of any group.
    """
    tensors = []
    for stage in range(max(stages.values()) + 1):
        own = [
            [name for name in own_layer_names(group, kv_sharing) if stages[name] == stage]
            for group in groups
        ]
        num_tensors = max(len(names) for names in own)
        tensors.append(
            tuple(tuple(names[i] for names in own if i < len(names)) for i in range(num_tensors))
        )
    return tuple(tensors)


def with_mamba_cache_mode(config: KVCacheConfig, enable_caching: bool) -> KVCacheConfig:
    """The plan as an engine runs it: with prefix caching every Mamba group caches its states
    in ``"align"`` mode (Prefix caching, Case 3); without it they keep ``"none"``."""
    mode = "align" if enable_caching else "none"
    groups = tuple(
        dataclasses.replace(group, spec=dataclasses.replace(group.spec, mamba_cache_mode=mode))
        if isinstance(group.spec, MambaSpec)
        else group
        for group in config.groups
    )
    return dataclasses.replace(config, groups=groups)
