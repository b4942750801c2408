"""Independent oracles: brute force against the clever algorithms.

Two claims of the design document are checked here by trying every candidate:

* **Longest hit.** The hybrid coordinator asks each attention type, in turn, for its longest hit
  within the current length and repeats until no type lowers it (Prefix caching, Case 2,
  generalised to any number of types). The claim: the result is the *longest* length that every
  group accepts. ``brute_force_hit_blocks`` tries every candidate length and checks each group's
  rule directly, written from the rule's words and not from the scans in ``spec.rules``.
* **Grouping.** ``check_grouping`` checks a planner's output against Cases 1–5: every layer placed
  once, one attention type per group, the group size rule, padding, sharing.

Cache states here are plain flags: ``cached[i]`` says whether block ``i`` of the request is in the
prefix cache of that group. ``hit_blocks_of_manager`` builds such states inside a real manager.

The oracles branch on the spec classes themselves instead of calling the specs' dispatch
(``skipped_tokens``, ``hit_is_prefix``...): an oracle that went through the code it checks
would share its bugs.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    rules,
)

if TYPE_CHECKING:
    from hybridkv.conformance.adapters import AdapterFactory, Lookup, ManagerAdapter
    from hybridkv.reference.plan_report import PlanReport

Kind = Literal["full", "sliding_window", "chunked_local"]


@dataclass(frozen=True)
class GroupCacheState:
    """One KV cache group's attention type and which of a request's full blocks it has cached.

    ``param`` is the sliding window for ``sliding_window``, the chunk size for ``chunked_local``,
    unused for ``full``.
    """

    kind: Kind
    param: int
    cached: tuple[bool, ...]

    @property
    def type_key(self) -> tuple[Kind, int]:
        """Groups with equal keys have equal specs and are looked up jointly."""
        return (self.kind, 0 if self.kind == "full" else self.param)


# --- The algorithm under test, over the rule functions --------------------------------------------


def type_longest_hit_blocks(
    kind: Kind, param: int, cached: Sequence[bool], max_length: int, block_size: int
) -> int:
    """One attention type's longest hit within ``max_length`` tokens, in blocks (the scans).

    ``cached`` is the joint state of the type's groups (a block counts only if every group of
    the type has it). This is what the reference's single-type managers compute, through the
    same functions of ``spec.rules``.
    """
    max_blocks = min(max_length // block_size, len(cached))
    if kind == "full":
        return rules.full_attention_hit_blocks(cached, max_blocks)
    if kind == "sliding_window":
        needed = rules.sliding_window_hit_blocks_needed(param, block_size)
        return rules.sliding_window_hit_blocks(cached[:max_blocks], needed)[0]
    # Blocks past the request's full blocks are never cached; pad so the scan stays in range.
    padded = (*cached[:max_blocks], False)
    capped = min(max_length, len(padded) * block_size)
    return rules.chunked_local_hit_blocks(padded, capped, block_size, param)[0]


def joint_type_states(groups: Sequence[GroupCacheState]) -> list[GroupCacheState]:
    """Merge groups with equal specs, in order of first appearance, full attention first."""
    merged: dict[tuple[Kind, int], GroupCacheState] = {}
    for group in groups:
        key = group.type_key
        if key in merged:
            before = merged[key].cached
            both = tuple(a and b for a, b in zip(before, group.cached, strict=True))
            merged[key] = GroupCacheState(group.kind, group.param, both)
        else:
            merged[key] = group
    types = list(merged.values())
    return [t for t in types if t.kind == "full"] + [t for t in types if t.kind != "full"]


def hybrid_hit_tokens(
    groups: Sequence[GroupCacheState], num_tokens: int, block_size: int, *, iterate: bool = True
) -> int:
    """The hybrid coordinator's hit, in tokens (a multiple of ``block_size``): the intersection
    rule every backend calls, ``rules.hybrid_hit_length``, fed each type's own scan.

    Start from ``num_tokens − 1`` (the last token is always recomputed); each type, full
    attention first, gives its longest hit within the current length; the rule repeats until a
    pass lowers nothing (one pass for one full type plus one other, as vLLM does).
    ``iterate=False`` is the planted bug: one pass whatever the types.
    """
    types = joint_type_states(groups)
    max_length = max(num_tokens - 1, 0)

    def lookup(index: int, length: int, drop: bool) -> int:
        t = types[index]
        return block_size * type_longest_hit_blocks(t.kind, t.param, t.cached, length, block_size)

    if not iterate:
        length = max_length
        for index in range(len(types)):
            length = lookup(index, length, False)
        return min(length, max_length)
    hit, _ = rules.hybrid_hit_length(
        lookup, [t.kind == "full" for t in types], [False] * len(types), max_length
    )
    return hit


# --- The brute force -------------------------------------------------------------------------


def group_accepts(group: GroupCacheState, num_blocks: int, block_size: int) -> bool:
    """Whether one group's rule accepts a hit of ``num_blocks`` blocks, checked directly.

    * full attention: every block before the hit is cached;
    * sliding window: the ``window − 1`` tokens before the hit are cached, i.e. the last
      ``cdiv(window − 1, block_size)`` blocks before it (or all of them, if fewer);
    * chunked local: the blocks of the hit's own chunk are cached, from the block holding the
      chunk's first token (blocks of earlier chunks are never read).
    """
    if num_blocks > len(group.cached):
        return False
    if group.kind == "full":
        first = 0
    elif group.kind == "sliding_window":
        needed = -(-(group.param - 1) // block_size)
        first = max(0, num_blocks - needed)
    else:
        hit_tokens = num_blocks * block_size
        first = (hit_tokens - hit_tokens % group.param) // block_size
    return all(group.cached[i] for i in range(first, num_blocks))


def brute_force_hit_blocks(
    groups: Sequence[GroupCacheState], num_tokens: int, block_size: int
) -> int:
    """The longest hit, in blocks, that every group accepts: every candidate tried."""
    max_blocks = max(num_tokens - 1, 0) // block_size
    return max(
        k for k in range(max_blocks + 1) if all(group_accepts(g, k, block_size) for g in groups)
    )


# --- The planner -----------------------------------------------------------------------------


def check_grouping(
    layers: Mapping[str, KVCacheSpec],
    groups: Sequence[KVCacheGroup],
    kv_sharing: Mapping[str, str] | None = None,
) -> list[str]:
    """Every way ``groups`` breaks Allocation Cases 1–5 for ``layers``; empty when it obeys.

    Checked by brute force, independently of the planner's code:

    * every layer that owns KV appears in exactly one group, among that group's own layers, and
      a sharing layer (Case 5) appears once, after the own layers of its target's group;
    * a group's own layers have one spec (one attention type, Case 2) and are in model order;
    * the group size is the smallest layer count of any type (Case 3): every group holds exactly
      that many own layers except a type's last group, which may be short (its missing slots are
      padding: a type of ``n`` layers has ``-n % g`` padding slots);
    * the layers of one type are split into consecutive runs in model order;
    * every group has the same page size (Cases 2–4) once Mamba states are padded (Case 4), and
      attention block sizes are at least the configured ones.
    """
    sharing = dict(kv_sharing or {})
    problems: list[str] = []
    order = {name: i for i, name in enumerate(layers)}
    placed: dict[str, int] = {}
    own_per_group: list[list[str]] = []
    for gid, group in enumerate(groups):
        own = [name for name in group.layer_names if name not in sharing]
        shared = [name for name in group.layer_names if name in sharing]
        own_per_group.append(own)
        if group.layer_names[: len(own)] != tuple(own):
            problems.append(f"group {gid}: sharing layers must follow the group's own layers")
        if not own:
            problems.append(f"group {gid}: has no layer of its own")
        for name in group.layer_names:
            if name not in layers:
                problems.append(f"group {gid}: layer {name!r} is not a layer of the model")
            elif name in placed:
                problems.append(f"layer {name!r} placed in groups {placed[name]} and {gid}")
            else:
                placed[name] = gid
        for name in shared:
            target = sharing[name]
            if target not in own:
                problems.append(f"group {gid}: {name!r} shares {target!r}, not a layer of it")
        if [order.get(n, -1) for n in own] != sorted(order.get(n, -1) for n in own):
            problems.append(f"group {gid}: own layers are not in model order")
        kinds = {_kind_key(layers[n]) for n in own if n in layers}
        if len(kinds) > 1:
            problems.append(f"group {gid}: mixes attention types {sorted(map(str, kinds))}")
    for name in layers:
        if name not in placed:
            problems.append(f"layer {name!r} is in no group")
    problems += _check_type_order(layers, groups, sharing)
    problems += _check_group_sizes(layers, own_per_group)
    problems += _check_page_sizes(layers, groups)
    return problems


def _check_type_order(
    layers: Mapping[str, KVCacheSpec], groups: Sequence[KVCacheGroup], sharing: Mapping[str, str]
) -> list[str]:
    """Groups come type by type: full attention first, then in order of first appearance."""
    appearance: list[tuple[object, ...]] = []
    for name, spec in layers.items():
        key = _kind_key(spec)
        if name not in sharing and key not in appearance:
            appearance.append(key)
    appearance.sort(key=lambda key: key[0] != "FullAttentionSpec")
    seen: list[tuple[object, ...]] = []
    for group in groups:
        own = [n for n in group.layer_names if n not in sharing and n in layers]
        if own and (not seen or seen[-1] != _kind_key(layers[own[0]])):
            seen.append(_kind_key(layers[own[0]]))
    if seen != appearance:
        return [
            f"groups ordered by type {[k[0] for k in seen]}, expected full attention "
            f"first, then first appearance {[k[0] for k in appearance]}"
        ]
    return []


def check_plan_padding(
    layers: Mapping[str, KVCacheSpec],
    groups_padding: Sequence[int],
    groups_own: Sequence[int],
    total_padding: int,
    layers_per_group: int,
    kv_sharing: Mapping[str, str] | None = None,
) -> list[str]:
    """Padding by brute force: g = the smallest own-layer count of any type, each group pads to
    g, and a type of n layers has ``-n % g`` padding slots in all (Case 3)."""
    sharing = kv_sharing or {}
    counts = Counter(_kind_key(s) for n, s in layers.items() if n not in sharing)
    g = min(counts.values())
    problems: list[str] = []
    if layers_per_group != g:
        problems.append(f"layers per group {layers_per_group}, expected {g}")
    expected_total = sum(-n % g for n in counts.values())
    if total_padding != expected_total:
        problems.append(f"{total_padding} padding slots in all, expected {expected_total}")
    for gid, (pad, own) in enumerate(zip(groups_padding, groups_own, strict=True)):
        if pad != g - own:
            problems.append(f"group {gid}: {pad} padding slots for {own} own layers of {g}")
    return problems


def _kind_key(spec: KVCacheSpec) -> tuple[object, ...]:
    """Equal for layers of one attention type, whatever block size the planner raised."""
    if isinstance(spec, MambaSpec):
        return ("mamba", spec.state_bytes)
    base = (type(spec).__name__, spec.num_kv_heads, spec.head_size, spec.dtype_bytes)
    if isinstance(spec, SlidingWindowSpec):
        return (*base, spec.sliding_window)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return (*base, spec.attention_chunk_size)
    return base


def _check_group_sizes(
    layers: Mapping[str, KVCacheSpec], own_per_group: Sequence[Sequence[str]]
) -> list[str]:
    problems: list[str] = []
    owners = [n for n in layers if n in {x for own in own_per_group for x in own}]
    per_type: dict[tuple[object, ...], list[str]] = {}
    for name in owners:
        per_type.setdefault(_kind_key(layers[name]), []).append(name)
    if not per_type:
        return problems
    size = min(len(names) for names in per_type.values())
    for key, names in per_type.items():
        gids = [gid for gid, own in enumerate(own_per_group) if own and own[0] in names]
        runs = [list(own_per_group[gid]) for gid in gids]
        if [n for run in runs for n in run] != names:
            problems.append(f"type {key[0]}: groups do not split its layers into model-order runs")
        if any(len(run) != size for run in runs[:-1]) or (runs and not 0 < len(runs[-1]) <= size):
            problems.append(
                f"type {key[0]}: group sizes {[len(r) for r in runs]} break the group size {size}"
            )
        expected_padding = -len(names) % size
        padding = size - len(runs[-1]) if runs else 0
        if padding != expected_padding:
            problems.append(f"type {key[0]}: {padding} padding slots, expected {expected_padding}")
    return problems


def _check_page_sizes(
    layers: Mapping[str, KVCacheSpec], groups: Sequence[KVCacheGroup]
) -> list[str]:
    problems: list[str] = []
    pages = {group.spec.page_size_bytes for group in groups}
    if len(pages) > 1:
        problems.append(f"groups have different per-layer page sizes {sorted(pages)}")
    for gid, group in enumerate(groups):
        spec = group.spec
        for name in group.layer_names:
            original = layers.get(name)
            if original is None or isinstance(spec, MambaSpec) or isinstance(original, MambaSpec):
                continue
            if spec.block_size < original.block_size or spec.block_size % original.block_size:
                problems.append(
                    f"group {gid}: block size {spec.block_size} is not a multiple of the "
                    f"configured {original.block_size}"
                )
                break
        if isinstance(spec, MambaSpec) and spec.page_size_bytes < spec.state_bytes:
            problems.append(f"group {gid}: Mamba page smaller than its state")
    problems += _check_block_size_raise(layers, groups)
    return problems


def _check_block_size_raise(
    layers: Mapping[str, KVCacheSpec], groups: Sequence[KVCacheGroup]
) -> list[str]:
    """Case 4 by brute force: the attention block size is the smallest multiple of the
    configured one whose page holds a Mamba state (or unchanged without Mamba)."""
    attention = [s for s in layers.values() if not isinstance(s, MambaSpec)]
    states = [s.state_bytes for s in layers.values() if isinstance(s, MambaSpec)]
    if not attention:
        return []
    configured = attention[0].block_size
    kv_hidden_size = attention[0].kv_hidden_size
    expected = configured
    if states:
        while expected * kv_hidden_size < max(states):
            expected += configured
    got = {g.spec.block_size for g in groups if not isinstance(g.spec, MambaSpec)}
    if got != {expected}:
        return [f"attention block sizes {sorted(got)}, expected {expected} (Case 4)"]
    return []


def check_memory_layout(
    config: KVCacheConfig, available_memory_bytes: int, kv_sharing: Mapping[str, str] | None = None
) -> list[str]:
    """Every way ``config`` breaks the Memory Layout section; empty when it obeys.

    m = the most own layers of any group; m tensors; tensor i is shared by the i-th own layer of
    every group that has one, in group order; each holds ``num_blocks × page_size_bytes``; and
    ``num_blocks = available_memory_bytes // (m × page_size_bytes)``.
    """
    sharing = kv_sharing or {}
    own = [[n for n in g.layer_names if n not in sharing] for g in config.groups]
    m = max(len(names) for names in own)
    page = config.groups[0].spec.page_size_bytes
    problems: list[str] = []
    expected_blocks = available_memory_bytes // (m * page)
    if config.num_blocks != expected_blocks:
        problems.append(f"num_blocks {config.num_blocks}, expected {expected_blocks}")
    if len(config.tensors) != m:
        problems.append(f"{len(config.tensors)} tensors, expected {m}")
    for i, tensor in enumerate(config.tensors):
        shared = tuple(names[i] for names in own if i < len(names))
        if tensor.shared_by != shared:
            problems.append(f"tensor {i} shared by {tensor.shared_by}, expected {shared}")
        if tensor.size != config.num_blocks * page:
            problems.append(f"tensor {i} holds {tensor.size} bytes, expected num_blocks × page")
    return problems


# --- The brute force against the real reference manager ----------------------------------------


@dataclass(frozen=True)
class ManagerHit:
    """What the reference manager returned for a built cache state, and what brute force says."""

    hit_tokens: int
    brute_force_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    expected_block_ids: tuple[tuple[int, ...], ...]


def spec_of(state: GroupCacheState, block_size: int) -> KVCacheSpec:
    """The layer spec of a cache-state group (1 KV head × size 1 × 4 bytes: sizes do not matter)."""
    sizes = {"block_size": block_size, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
    if state.kind == "sliding_window":
        return SlidingWindowSpec(sliding_window=state.param, **sizes)
    if state.kind == "chunked_local":
        return ChunkedLocalAttentionSpec(attention_chunk_size=state.param, **sizes)
    return FullAttentionSpec(**sizes)


def reference_hit(
    groups: Sequence[GroupCacheState],
    prompt: Sequence[int],
    block_size: int,
    manager_class: Any = None,
) -> ManagerHit:
    """Build exactly this cache state in a reference ``KVCacheManager`` and look ``prompt`` up.

    Group ``g`` caches the request's block ``i`` iff ``groups[g].cached[i]`` (each cached block
    is its own pool block, released so that it sits evictable in the free queue, as after a
    finished request). ``manager_class`` defaults to the reference's ``KVCacheManager``; a
    variant with the same block pool (a mutant) may be given. The expected blocks per group are
    those of a lookup at the brute-force length: null positions before the rule's first needed
    block, then the cached blocks.
    """
    from hybridkv.reference import KVCacheManager, Request

    manager_class = KVCacheManager if manager_class is None else manager_class
    num_full = len(prompt) // block_size
    config = KVCacheConfig(
        num_blocks=1 + len(groups) * num_full + 1,
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), spec_of(g, block_size)) for gid, g in enumerate(groups)
        ),
    )
    manager = manager_class(config, max(len(prompt), 1), enable_caching=True)
    request = Request("probe", prompt, hash_block_size=block_size)
    pool = manager.block_pool
    position_block: list[dict[int, int]] = []
    for gid, group in enumerate(groups):
        assert len(group.cached) == num_full
        table = [pool.get_new_blocks(1)[0] if flag else pool.null_block for flag in group.cached]
        pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=0,
            num_full_blocks=num_full,
            block_size=block_size,
            group_id=gid,
        )
        position_block.append({i: b.block_id for i, b in enumerate(table) if not b.is_null})
        pool.free_blocks(table[::-1])
    blocks, hit_tokens, _ = manager.get_computed_blocks(request)
    best = brute_force_hit_blocks(groups, len(prompt), block_size)
    expected = []
    for gid, group in enumerate(groups):
        first = _first_needed_block(group, best, block_size)
        expected.append((0,) * first + tuple(position_block[gid][i] for i in range(first, best)))
    return ManagerHit(
        hit_tokens,
        best * block_size,
        tuple(tuple(ids) for ids in blocks.get_block_ids()),
        tuple(expected),
    )


def _first_needed_block(group: GroupCacheState, num_blocks: int, block_size: int) -> int:
    if group.kind == "full":
        return 0
    if group.kind == "sliding_window":
        return max(0, num_blocks - -(-(group.param - 1) // block_size))
    hit_tokens = num_blocks * block_size
    return (hit_tokens - hit_tokens % group.param) // block_size


# --- The longest hit with the engine's layouts: Mamba "align" and lcm alignment --------------

EngineKind = Literal["full", "sliding_window", "chunked_local", "mamba"]


@dataclass(frozen=True)
class EngineGroupState:
    """One group of an engine layout: its type, parameter, own block size, and which of its
    blocks it has cached (``cached[i]``: the block of tokens ``[i·B, (i+1)·B)``; for Mamba the
    state after ``(i + 1)·B`` tokens)."""

    kind: EngineKind
    param: int
    block_size: int
    cached: tuple[bool, ...]


def engine_group_accepts(group: EngineGroupState, hit_tokens: int) -> bool:
    """Whether one group's rule accepts a hit of ``hit_tokens`` (a multiple of its block size),
    written from the README's words, not from the scans:

    * full attention: every block before the hit is cached;
    * sliding window: the last ``cdiv(window − 1, B)`` blocks before the hit (or all from 0);
    * chunked local: the blocks of the hit's own chunk;
    * Mamba ``"align"``: the state at exactly that boundary is cached (nothing else is read).
    """
    size = group.block_size
    if hit_tokens % size:
        return False
    k = hit_tokens // size
    if k > len(group.cached):
        return False
    if k == 0:
        return True
    if group.kind == "mamba":
        return group.cached[k - 1]
    return all(group.cached[i] for i in range(engine_first_needed_block(group, k), k))


def engine_first_needed_block(group: EngineGroupState, num_blocks: int) -> int:
    """The first block of ``group`` a hit of ``num_blocks`` of its blocks reads."""
    size = group.block_size
    if group.kind == "full":
        return 0
    if group.kind == "sliding_window":
        return max(0, num_blocks - -(-(group.param - 1) // size))
    if group.kind == "mamba":
        return max(0, num_blocks - 1)
    hit_tokens = num_blocks * size
    return (hit_tokens - hit_tokens % group.param) // size


def brute_force_engine_hit(groups: Sequence[EngineGroupState], num_tokens: int) -> int:
    """The longest hit in tokens: a multiple of the scheduler block (the lcm of the block
    sizes), at most ``num_tokens − 1``, that every group accepts; every candidate tried."""
    scheduler_block = rules.scheduler_block_size([g.block_size for g in groups])
    top = max(num_tokens - 1, 0) // scheduler_block
    return max(
        k * scheduler_block
        for k in range(top + 1)
        if all(engine_group_accepts(g, k * scheduler_block) for g in groups)
    )


def engine_spec_of(state: EngineGroupState) -> KVCacheSpec:
    """The layer spec of an engine cache-state group."""
    if state.kind == "mamba":
        return MambaSpec(block_size=state.block_size, state_bytes=16, mamba_cache_mode="align")
    return spec_of(GroupCacheState(state.kind, state.param, ()), state.block_size)


def reference_engine_hit(
    groups: Sequence[EngineGroupState], prompt: Sequence[int], manager_class: Any = None
) -> ManagerHit:
    """Build exactly this cache state in a reference ``KVCacheManager`` (hashes at the gcd of
    the block sizes, each group caching its own blocks under the last hash each one spans) and
    look ``prompt`` up; the expected blocks are those at the brute-force length (nulls before
    the rule's first needed block; a Mamba group: nulls, then the one state)."""
    from hybridkv.reference import KVCacheManager, Request

    manager_class = KVCacheManager if manager_class is None else manager_class
    config = KVCacheConfig(
        num_blocks=2 + sum(len(g.cached) for g in groups),
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), engine_spec_of(g)) for gid, g in enumerate(groups)
        ),
    )
    manager = manager_class(config, max(len(prompt), 1), enable_caching=True)
    request = Request("probe", prompt, hash_block_size=manager.hash_block_size)
    pool = manager.block_pool
    position_block: list[dict[int, int]] = []
    for gid, group in enumerate(groups):
        assert len(group.cached) == len(prompt) // group.block_size
        table = [pool.get_new_blocks(1)[0] if flag else pool.null_block for flag in group.cached]
        pool.cache_full_blocks(
            request,
            table,
            num_cached_blocks=0,
            num_full_blocks=len(table),
            block_size=group.block_size,
            group_id=gid,
        )
        position_block.append({i: b.block_id for i, b in enumerate(table) if not b.is_null})
        pool.free_blocks(table[::-1])
    blocks, hit_tokens, _ = manager.get_computed_blocks(request)
    best = brute_force_engine_hit(groups, len(prompt))
    expected = []
    for gid, group in enumerate(groups):
        k = best // group.block_size
        first = engine_first_needed_block(group, k)
        expected.append((0,) * first + tuple(position_block[gid][i] for i in range(first, k)))
    return ManagerHit(
        hit_tokens,
        best,
        tuple(tuple(ids) for ids in blocks.get_block_ids()),
        tuple(expected),
    )


def random_engine_cache_state(
    rng: Any,
) -> tuple[list[EngineGroupState], list[int]]:
    """An engine layout the reference accepts with caching on, random cached flags, a prompt:
    either Mamba ``"align"`` groups (one block size, among full, sliding-window and
    chunked-local groups) or full and sliding-window groups of block sizes b, 2b, 4b."""
    b = rng.choice([1, 2, 3, 4])
    num_tokens = rng.randint(1, 48)
    groups: list[EngineGroupState] = []

    def group(kind: EngineKind, param: int, size: int) -> EngineGroupState:
        density = rng.random()
        cached = tuple(rng.random() < density for _ in range(num_tokens // size))
        return EngineGroupState(kind, param, size, cached)

    if rng.random() < 0.5:
        for _ in range(rng.choice([1, 1, 2])):
            groups.append(group("mamba", 0, b))
        for _ in range(rng.randint(0, 3)):
            kind = rng.choice(["full", "sliding_window", "chunked_local"])
            param = b * rng.choice([1, 2, 3]) if kind == "chunked_local" else rng.randint(2, 12)
            groups.append(group(kind, param, b))
    else:
        sizes = [b, 2 * b, 4 * b]
        for size in [rng.choice(sizes), *rng.sample(sizes, rng.randint(1, 3))]:
            kind = rng.choice(["full", "sliding_window"])
            groups.append(group(kind, rng.randint(2, 2 * size + 2), size))
    rng.shuffle(groups)
    prompt = [rng.randint(0, 100) for _ in range(num_tokens)]
    return groups, prompt


@dataclass
class EngineOracleStats:
    """What the engine longest-hit oracle checked."""

    states: int = 0
    with_mamba: int = 0
    mixed_block_sizes: int = 0
    hits: int = 0
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"  longest hit (engine layouts): {self.states - len(self.failures)} of "
            f"{self.states} cache states equal to brute force "
            f"({self.with_mamba} with Mamba 'align', {self.mixed_block_sizes} with block sizes "
            f"b/2b/4b on the lcm, {self.hits} with a hit)"
        ]


def run_engine_hit_oracle(
    num_states: int, seed: int = 0, manager_class: Any = None
) -> EngineOracleStats:
    """The reference's longest hit against brute force on random built engine cache states."""
    import random

    rng = random.Random(seed)
    stats = EngineOracleStats()
    for _ in range(num_states):
        groups, prompt = random_engine_cache_state(rng)
        hit = reference_engine_hit(groups, prompt, manager_class)
        stats.states += 1
        stats.with_mamba += any(g.kind == "mamba" for g in groups)
        stats.mixed_block_sizes += len({g.block_size for g in groups}) > 1
        stats.hits += hit.brute_force_tokens > 0
        if (hit.hit_tokens, hit.block_ids) != (hit.brute_force_tokens, hit.expected_block_ids):
            stats.failures.append(f"engine longest hit differs from brute force: {groups} {hit}")
    return stats


# --- Runs for the report -----------------------------------------------------------------------


def check_plan_report(
    layers: Mapping[str, KVCacheSpec],
    report: PlanReport,
    available_memory_bytes: int,
    kv_sharing: Mapping[str, str] | None = None,
) -> list[str]:
    """Every planner oracle on one plan: grouping (Cases 1–5), memory layout and padding."""
    problems = check_grouping(layers, report.config.groups, kv_sharing)
    problems += check_memory_layout(report.config, available_memory_bytes, kv_sharing)
    problems += check_plan_padding(
        layers,
        [g.num_padding_slots for g in report.groups],
        [g.num_own_layers for g in report.groups],
        report.num_padding_slots,
        report.layers_per_group,
        kv_sharing,
    )
    return problems


@dataclass
class OracleStats:
    """What the oracle runs checked."""

    hit_states: int = 0
    hit_states_three_types: int = 0
    hit_states_without_full: int = 0
    nonaligned_states: int = 0
    nonaligned_longer: int = 0
    planner_models: int = 0
    failures: list[str] | None = None

    def lines(self) -> list[str]:
        return [
            f"  longest hit: {self.hit_states} cache states equal to brute force "
            f"({self.hit_states_three_types} with ≥ 3 types, {self.hit_states_without_full} "
            "without full attention)",
            f"  chunk sizes not a multiple of the block size: {self.nonaligned_states} states, "
            f"{self.nonaligned_longer} hits longer than every group accepts (vLLM's behaviour, "
            "pinned by the golden traces: unitary and full + one other type stop after one pass)",
            f"  planner: {self.planner_models} models obey Cases 1–5, memory layout and padding",
        ]


def run_hit_oracle(num_states: int, seed: int = 0) -> OracleStats:
    """The reference's longest hit against brute force on random built cache states."""
    import random

    rng = random.Random(seed)
    stats = OracleStats(failures=[])
    assert stats.failures is not None
    for index in range(num_states):
        aligned = index % 4 != 3
        groups, prompt, block_size = random_cache_state(rng, aligned=aligned)
        hit = reference_hit(groups, prompt, block_size)
        exact = (hit.hit_tokens, hit.block_ids) == (hit.brute_force_tokens, hit.expected_block_ids)
        chunked = [g for g in groups if g.kind == "chunked_local"]
        if any(g.param % block_size for g in chunked):
            stats.nonaligned_states += 1
            stats.nonaligned_longer += not exact
            if hit.hit_tokens < hit.brute_force_tokens:
                stats.failures.append(f"missed a hit every group accepts: {groups} {hit}")
            continue
        stats.hit_states += 1
        types = {g.type_key for g in groups}
        stats.hit_states_three_types += len(types) >= 3
        stats.hit_states_without_full += all(g.kind != "full" for g in groups)
        if not exact:
            stats.failures.append(f"longest hit differs from brute force: {groups} {hit}")
    return stats


def run_planner_oracle(
    num_models: int, seed: int = 7, stats: OracleStats | None = None
) -> OracleStats:
    """The reference planner against the grouping, layout and padding oracles."""
    import random

    from hybridkv.conformance.strategies import document_models, random_models
    from hybridkv.reference import plan_report

    stats = OracleStats(failures=[]) if stats is None else stats
    if stats.failures is None:
        stats.failures = []
    for layers, sharing in document_models() + random_models(random.Random(seed), num_models):
        try:
            report = plan_report(
                layers, 10**9, max_model_len=4096, max_num_batched_tokens=512, kv_sharing=sharing
            )
        except ValueError:
            continue
        problems = check_plan_report(layers, report, 10**9, sharing)
        stats.planner_models += 1
        stats.failures += [f"planner: {p}" for p in problems]
    return stats


# --- The longest hit of an implementation under test, on states built through its adapter -----


@dataclass
class AdapterOracleStats:
    """What the longest-hit oracle checked on one implementation through its adapter."""

    name: str
    states: int = 0
    probes: int = 0
    hits: int = 0
    three_types: int = 0
    refused: int = 0
    not_shown: int = 0
    failures: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"  longest hit of {self.name} (states built through its adapter): "
            f"{self.probes - len(self.failures)} of {self.probes} lookups equal to brute force "
            f"over {self.states} cache states ({self.three_types} with ≥ 3 types, {self.hits} "
            f"lookups with a hit; {self.refused} layouts refused by name, {self.not_shown} states "
            "not checked: no snapshot)"
        ]


class _KeyTracker:
    """Which content each block of each group holds, read from the adapter's own block tables.

    After every successful allocation, a block at position ``j`` of group ``g`` whose tokens
    are all computed holds the request's first ``(j + 1)·B`` tokens (it was cached by that
    allocation); a block still partly empty holds nothing cacheable yet (a reused block lost its
    old content when it was evicted). ``cached`` then answers, with the adapter's snapshot of
    cached blocks, which of a probe's blocks each group has cached, and where.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.content: dict[tuple[int, int], tuple[int, ...]] = {}

    def record(self, tables: Sequence[Sequence[int]], tokens: Sequence[int], computed: int) -> None:
        size = self.block_size
        for gid, table in enumerate(tables):
            for position, block_id in enumerate(table):
                if block_id == 0:
                    continue
                if (position + 1) * size <= computed:
                    self.content[(gid, block_id)] = tuple(tokens[: (position + 1) * size])
                else:
                    self.content.pop((gid, block_id), None)

    def cached(
        self, cached_block_ids: Sequence[Sequence[int]], prompt: Sequence[int]
    ) -> list[list[set[int]]]:
        """Per group, per full block of ``prompt``: the cached blocks that hold it."""
        size = self.block_size
        where: list[list[set[int]]] = []
        for gid, ids in enumerate(cached_block_ids):
            holders: dict[tuple[int, ...], set[int]] = {}
            for block_id in ids:
                content = self.content.get((gid, block_id))
                if content is not None:
                    holders.setdefault(content, set()).add(block_id)
            where.append(
                [
                    holders.get(tuple(prompt[: (i + 1) * size]), set())
                    for i in range(len(prompt) // size)
                ]
            )
        return where


def _random_adapter_layout(rng: Any) -> tuple[list[GroupCacheState], int]:
    """1–4 attention groups of one block size (chunks a multiple of it: there the coordinator
    returns the longest hit whatever the types), with empty cached flags."""
    block_size = rng.choice([1, 2, 3, 4])
    groups = []
    for _ in range(rng.choice([1, 2, 3, 3, 4])):
        kind: Kind = rng.choice(["full", "sliding_window", "chunked_local"])
        param = (
            block_size * rng.choice([1, 2, 3]) if kind == "chunked_local" else rng.randint(2, 12)
        )
        groups.append(GroupCacheState(kind, param, ()))
    return groups, block_size


def adapter_hit_state(
    factory: AdapterFactory, rng: Any, stats: AdapterOracleStats, probes_per_state: int = 3
) -> None:
    """Build one cache state inside an implementation through its adapter's scheduler calls
    (requests sharing prefixes admitted in chunks and freed in a small pool, so that sliding
    windows release blocks and evictions leave holes), then look up a few probes and compare
    each hit with brute force on the cached flags read from the adapter's own tables and
    snapshot. Failures are appended to ``stats.failures``."""
    from hybridkv.conformance.adapters import NOT_IMPLEMENTED, EngineOptions

    layout, size = _random_adapter_layout(rng)
    max_len = size * rng.randint(3, 10)
    per_request = -(-max_len // size) * len(layout)
    config = KVCacheConfig(
        num_blocks=1 + per_request + rng.randint(0, per_request),
        groups=tuple(
            KVCacheGroup((f"layer{gid}",), spec_of(g, size)) for gid, g in enumerate(layout)
        ),
    )
    try:
        adapter = factory(config, max_len + 1, True, False, EngineOptions())
    except ValueError as error:
        if NOT_IMPLEMENTED not in str(error):
            raise
        stats.refused += 1
        return
    stats.states += 1
    stats.three_types += len({g.type_key for g in layout}) >= 3
    tracker = _KeyTracker(size)
    bases = [[rng.randint(0, 40) for _ in range(max_len)] for _ in range(2)]
    prompts: list[list[int]] = []
    for turn in range(rng.randint(2, 6)):
        cut = rng.randint(0, max_len)
        prompt = rng.choice(bases)[:cut]
        prompt += [rng.randint(0, 40) for _ in range(rng.randint(1, max_len - cut + 1))]
        prompt = prompt[:max_len]
        prompts.append(prompt)
        rid = f"state{turn}"
        handle = adapter.new_request(rid, prompt, None)
        adapter.new_step()
        hit = adapter.lookup(handle)
        computed = 0
        use: Lookup | None = hit
        while computed < len(prompt):
            n = len(prompt) - computed - (use.num_hit_tokens if use is not None else 0)
            n = min(n, size * rng.randint(1, 4))
            if n <= 0:
                break
            if adapter.allocate(handle, n, use, 0, False) is None:
                break
            computed += n + (use.num_hit_tokens if use is not None else 0)
            use = None
            adapter.set_num_computed_tokens(handle, computed)
            tracker.record(adapter.block_table(rid), prompt, computed)
            adapter.check_invariants()
        if turn == 0 or rng.random() < 0.8:
            adapter.free(handle)
            adapter.check_invariants()
    for index in range(probes_per_state):
        source = rng.choice(prompts)
        probe = source[: rng.randint(1, len(source))] + [
            rng.randint(0, 40) for _ in range(rng.randint(0, 3))
        ]
        _check_probe(adapter, tracker, layout, size, probe, f"probe{index}", stats)


def _check_probe(
    adapter: ManagerAdapter,
    tracker: _KeyTracker,
    layout: Sequence[GroupCacheState],
    size: int,
    probe: Sequence[int],
    rid: str,
    stats: AdapterOracleStats,
) -> None:
    snapshot = adapter.snapshot()
    if snapshot is None:
        stats.not_shown += 1
        return
    holders = tracker.cached(snapshot.cached_block_ids, probe)
    groups = [
        GroupCacheState(g.kind, g.param, tuple(bool(h) for h in holders[gid]))
        for gid, g in enumerate(layout)
    ]
    handle = adapter.new_request(rid, probe, None)
    found = adapter.lookup(handle)
    adapter.free(handle)
    best = brute_force_hit_blocks(groups, len(probe), size)
    stats.probes += 1
    stats.hits += best > 0
    problems = []
    if found.num_hit_tokens != best * size:
        problems.append(f"hit {found.num_hit_tokens} tokens, brute force {best * size}")
    for gid, (group, ids) in enumerate(zip(groups, found.block_ids, strict=True)):
        first = _first_needed_block(group, best, size)
        if found.num_hit_tokens == best * size and len(ids) != best:
            problems.append(f"group {gid}: {len(ids)} blocks for a {best}-block hit")
            continue
        for position, block_id in enumerate(ids[:best]):
            if position < first and block_id != 0:
                problems.append(f"group {gid}: block {block_id} at {position}, expected null")
            elif position >= first and block_id not in holders[gid][position]:
                cached = sorted(holders[gid][position])
                problems.append(
                    f"group {gid}: block {block_id} at {position} does not hold the probe's "
                    f"tokens there (cached holders: {cached})"
                )
    if problems:
        stats.failures.append(
            f"{stats.name}: longest hit of a {len(probe)}-token probe, block size {size}, "
            f"groups {[(g.kind, g.param, g.cached) for g in groups]}: {'; '.join(problems)}"
        )


def run_adapter_hit_oracle(
    name: str, factory: AdapterFactory, num_states: int, seed: int = 0
) -> AdapterOracleStats:
    """The longest hit an implementation returns, through its adapter (``factory`` an
    ``AdapterFactory``), against brute force on ``num_states`` random states built through the
    same adapter. An exception is reported as a failure naming the state, not raised."""
    import random

    rng = random.Random(seed)
    stats = AdapterOracleStats(name)
    for index in range(num_states):
        try:
            adapter_hit_state(factory, rng, stats)
        except Exception as error:
            stats.failures.append(
                f"{name}: state {index} (seed {seed}) raised {type(error).__name__}: {error}"
            )
    return stats


def random_cache_state(
    rng: random.Random, *, aligned: bool = True
) -> tuple[list[GroupCacheState], list[int], int]:
    """1–4 groups of mixed types with random cached flags, a prompt, and the block size."""
    block_size = rng.choice([1, 2, 3, 4])
    num_tokens = rng.randint(1, 30)
    groups = []
    for _ in range(rng.choice([1, 2, 3, 3, 4, 4])):
        kind = rng.choice(["full", "sliding_window", "chunked_local"])
        if kind == "chunked_local":
            choices = [1, 2, 3] if aligned else [1, 2, 3, 1.5, 2.5]
            param = int(block_size * rng.choice(choices)) or 1
        else:
            param = rng.randint(2, 12)
        density = rng.random()
        cached = tuple(rng.random() < density for _ in range(num_tokens // block_size))
        groups.append(GroupCacheState(kind, param, cached))  # type: ignore[arg-type]
    prompt = [rng.randint(0, 100) for _ in range(num_tokens)]
    return groups, prompt, block_size
