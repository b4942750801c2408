"""The plan report: what a plan costs and how many requests it serves (for sizing memory).

``plan_report`` runs ``plan_kv_cache`` and adds what a person sizing a deployment asks next: how
much memory padding wastes (Allocation, Case 3), how many blocks one request of the longest length
holds at most in each group, how many such requests fit at once, and what the same requests
would cost if every layer were full attention (a non-hybrid manager).

The request bounds are an engine's: with async scheduling or pipeline stages several steps are
in flight at once, and a sliding-window or chunked-local group holds blocks for all of them;
with prefix caching a Mamba group holds two state blocks per request. ``max_concurrency`` and
``max_fitting_model_len`` are vLLM 0.33's "maximum concurrency" and auto-fitted
``max_model_len`` for the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from hybridkv.reference.grouping import GroupingPolicy
from hybridkv.reference.pipeline import layer_stages as layer_stages_of
from hybridkv.reference.planner import own_layer_names, plan_kv_cache
from hybridkv.spec import rules
from hybridkv.spec.errors import check_positive
from hybridkv.spec.kv_cache_config import KVCacheConfig, KVCacheGroup
from hybridkv.spec.kv_cache_spec import KVCacheSpec
from hybridkv.spec.spec_metadata import spec_kind

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
    """Tensor slices this group leaves unused, over all stages: slots − own layers (Case 3)."""
    max_blocks_per_request: int
    """Most real blocks one request of ``max_model_len`` tokens holds in this group at once."""


@dataclass(frozen=True)
class PlanReport:
    """A plan and its cost; every size in bytes, every block a block of the shared pool."""

    config: KVCacheConfig
    """What the manager needs: num_blocks, groups and tensors."""
    groups: tuple[GroupPlan, ...]
    """One entry per KV cache group, in ``config.groups`` order."""
    policy: str
    """The grouping policy: ``document``, ``vllm`` or ``min-padding`` (``reference.grouping``)."""
    pipeline_parallel_size: int
    """Pipeline stages; each has the memory, its own tensors and every group's block ids."""
    layers_per_group: int
    """Layer slots of a group per stage: the most own layers of one group on one stage.

    Also the number of tensors of the fullest stage. The document's policy: g, the smallest
    own-layer count of any attention type."""
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
    async_scheduling: bool
    """Whether the engine schedules a step before the previous one settles (vLLM's default)."""
    enable_prefix_caching: bool
    """Whether prefix caching is on: a Mamba group then holds two state blocks per request."""
    max_in_flight_tokens: int
    """Tokens scheduled but not settled: concurrent steps × ``max_num_batched_tokens``."""
    blocks_per_request: int
    """Most blocks one request of ``max_model_len`` tokens holds at once, over all groups."""
    max_num_requests: int
    """Requests of ``max_model_len`` tokens that fit at once: (num_blocks − 1) // blocks."""
    max_concurrency: float
    """vLLM's "maximum concurrency": num_blocks / blocks_per_request (null block included)."""
    kv_cache_size_tokens: int
    """vLLM's "KV cache size" in tokens: int(max_concurrency × max_model_len), as vLLM 0.33's
    ``get_kv_cache_capacity`` computes it for its log line."""
    max_fitting_model_len: int
    """The longest ``max_model_len`` (at most the given one) one request of which fits, as
    vLLM's auto-fit finds it; 0 when not even one token fits."""
    max_tokens: int
    """max_num_requests × max_model_len: tokens of that many longest requests held at once.

    A lower bound on the pool's capacity in tokens: shorter requests need fewer blocks in full
    attention groups, so more of them may fit.
    """
    memory_bytes: int
    """Bytes the tensors take: num_blocks × page_size_bytes (the rest of the memory is unused)."""
    bytes_per_request: int
    """blocks_per_request × page_size_bytes: one longest request's share of the pool."""
    tensor_stages: tuple[int, ...]
    """The pipeline stage (GPU) of each of ``config.tensors``: all 0 with one stage."""
    full_attention_bytes_per_token: int
    """KV bytes of one token in every own attention layer of one GPU (the fullest pipeline
    stage): what a non-hybrid manager keeps there."""
    full_attention_bytes_per_request: int
    """One longest request on one GPU (the fullest pipeline stage) if every own attention layer
    were full attention (Mamba: one state), comparable with ``bytes_per_request``, which is
    per GPU too.

    Uses the planned block size, so the two managers differ only in which blocks they keep.
    """
    full_attention_memory_bytes: int
    """Bytes per GPU a non-hybrid manager needs for max_num_requests longest requests."""
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
    policy: GroupingPolicy = "document",
    pipeline_parallel_size: int = 1,
    layer_stages: Mapping[str, int] | None = None,
    async_scheduling: bool = False,
    enable_prefix_caching: bool = False,
) -> PlanReport:
    """Plan ``layers`` into ``available_memory_bytes`` and report what the plan serves.

    ``policy``, ``pipeline_parallel_size`` and ``layer_stages`` go to ``plan_kv_cache``;
    ``async_scheduling`` and ``enable_prefix_caching`` are the engine's settings the request
    bounds assume (both off by default: one step in flight, one Mamba state block). Raises
    ``ValueError`` for what ``plan_kv_cache`` rejects, and for a ``max_model_len`` or
    ``max_num_batched_tokens`` that is not a positive int.
    """
    check_positive("max_model_len", max_model_len)
    check_positive("max_num_batched_tokens", max_num_batched_tokens)
    config = plan_kv_cache(
        layers,
        available_memory_bytes,
        kv_sharing=kv_sharing,
        policy=policy,
        pipeline_parallel_size=pipeline_parallel_size,
        layer_stages=layer_stages,
        enable_caching=enable_prefix_caching,
    )
    stages = layer_stages_of(layers, pipeline_parallel_size, layer_stages)
    slots = _own_layers_per_stage(config.groups, kv_sharing, stages)
    layers_per_group = max(max(per_stage) for per_stage in slots)
    in_flight = (
        rules.max_concurrent_batches(pipeline_parallel_size, async_scheduling)
        * max_num_batched_tokens
    )
    bounds = _RequestBounds(max_model_len, in_flight, enable_prefix_caching)
    groups = tuple(
        _group_plan(i, group, layers_per_group * len(slots), kv_sharing, bounds)
        for i, group in enumerate(config.groups)
    )
    layer_page = config.groups[0].spec.page_size_bytes
    page = layers_per_group * layer_page
    num_padding = sum(group.num_padding_slots for group in groups)
    blocks_per_request = sum(group.max_blocks_per_request for group in groups)
    max_num_requests = rules.max_num_requests(config.num_blocks, blocks_per_request)
    full_bytes_per_request = _full_attention_bytes_per_request(groups, slots, max_model_len)
    return PlanReport(
        config=config,
        groups=groups,
        policy=policy,
        pipeline_parallel_size=pipeline_parallel_size,
        layers_per_group=layers_per_group,
        block_size=config.groups[0].spec.block_size,
        layer_page_size_bytes=layer_page,
        page_size_bytes=page,
        num_blocks=config.num_blocks,
        num_padding_slots=num_padding,
        padding_fraction=num_padding / (len(groups) * layers_per_group * len(slots)),
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        async_scheduling=async_scheduling,
        enable_prefix_caching=enable_prefix_caching,
        max_in_flight_tokens=in_flight,
        blocks_per_request=blocks_per_request,
        max_num_requests=max_num_requests,
        max_concurrency=config.num_blocks / blocks_per_request,
        kv_cache_size_tokens=int(config.num_blocks / blocks_per_request * max_model_len),
        max_fitting_model_len=_max_fitting_model_len(config, bounds),
        max_tokens=max_num_requests * max_model_len,
        memory_bytes=config.num_blocks * page,
        bytes_per_request=blocks_per_request * page,
        tensor_stages=tuple(stages[tensor.shared_by[0]] for tensor in config.tensors),
        full_attention_bytes_per_token=_full_attention_bytes_per_token(groups, slots),
        full_attention_bytes_per_request=full_bytes_per_request,
        full_attention_memory_bytes=max_num_requests * full_bytes_per_request,
        memory_saved_bytes=max_num_requests * (full_bytes_per_request - blocks_per_request * page),
        full_attention_max_num_requests=(config.num_blocks - 1) * page // full_bytes_per_request,
    )


@dataclass(frozen=True)
class _RequestBounds:
    """What bounds one request's blocks: its length, the tokens in flight, prefix caching."""

    max_model_len: int
    max_in_flight_tokens: int
    enable_prefix_caching: bool

    def blocks(self, spec: KVCacheSpec, max_model_len: int | None = None) -> int:
        """Most blocks one request holds at once in a ``spec`` group."""
        return max_blocks_per_request(
            spec,
            max_model_len or self.max_model_len,
            self.max_in_flight_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
        )


def _own_layers_per_stage(
    groups: tuple[KVCacheGroup, ...], kv_sharing: Mapping[str, str], stages: Mapping[str, int]
) -> list[list[int]]:
    """For every stage, the own layers of every group on it (a stage's slots per group)."""
    per_stage = [[0] * len(groups) for _ in range(max(stages.values()) + 1)]
    for i, group in enumerate(groups):
        for name in own_layer_names(group, kv_sharing):
            per_stage[stages[name]][i] += 1
    return per_stage


def _max_fitting_model_len(config: KVCacheConfig, bounds: _RequestBounds) -> int:
    """vLLM's auto-fit: the longest length ≤ ``max_model_len`` whose request fits in the
    usable blocks (all but the null block), by binary search; 0 if not even one token fits."""

    def fits(length: int) -> bool:
        blocks = sum(bounds.blocks(group.spec, length) for group in config.groups)
        return blocks <= config.num_blocks - 1

    low, high, best = 1, bounds.max_model_len, 0
    while low <= high:
        middle = (low + high) // 2
        if fits(middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def _group_plan(
    group_id: int,
    group: KVCacheGroup,
    layers_per_group: int,
    kv_sharing: Mapping[str, str],
    bounds: _RequestBounds,
) -> GroupPlan:
    """One group's entry; its padding slots are the tensor slices it has no own layer for.

    ``layers_per_group`` counts the group's slots over all pipeline stages.
    """
    num_own = len(own_layer_names(group, kv_sharing))
    return GroupPlan(
        group_id=group_id,
        kind=spec_kind(group.spec),
        spec=group.spec,
        layer_names=group.layer_names,
        num_own_layers=num_own,
        num_kv_sharing_layers=len(group.layer_names) - num_own,
        num_padding_slots=layers_per_group - num_own,
        max_blocks_per_request=bounds.blocks(group.spec),
    )


def max_blocks_per_request(
    spec: KVCacheSpec,
    max_model_len: int,
    max_num_batched_tokens: int,
    *,
    enable_prefix_caching: bool = False,
) -> int:
    """Most real blocks one request of ``max_model_len`` tokens holds at once in a ``spec`` group.

    Full attention keeps every block; sliding window keeps the window behind the in-flight
    tokens (``max_num_batched_tokens``: one step's, or every in-flight step's), plus one block
    for a step that starts mid-block; chunked local keeps the current chunk and the in-flight
    tokens; Mamba keeps one state block (Case 4), two with prefix caching.
    """
    return spec.max_blocks_per_request(
        max_model_len, max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching
    )


# --- Against a non-hybrid manager -------------------------------------------------------------


def _full_attention_bytes_per_token(groups: tuple[GroupPlan, ...], slots: list[list[int]]) -> int:
    """One token's KV in every own attention layer of the fullest stage (Mamba: no growth)."""
    return max(
        sum(n * group.spec.kv_bytes_per_token for n, group in zip(per_stage, groups, strict=True))
        for per_stage in slots
    )


def _full_attention_bytes_per_request(
    groups: tuple[GroupPlan, ...], slots: list[list[int]], max_model_len: int
) -> int:
    """One longest request when every own attention layer keeps all its blocks, layer by
    layer, on the fullest stage: each GPU holds only its stage's layers (``slots``: the own
    layers of every group on each stage)."""
    return max(
        sum(
            n * group.spec.blocks_without_release(max_model_len) * group.spec.page_size_bytes
            for n, group in zip(per_stage, groups, strict=True)
        )
        for per_stage in slots
    )
