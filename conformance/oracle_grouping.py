"""The grouping oracle: ``check_grouping`` checks a planner's KV cache groups against
Allocation Cases 1–5 by brute force, independently of the planner's code (every layer placed
once, one attention type per group, type order, the group size rule, page sizes and the block
size a Mamba state raises). ``kind_key`` says which layers share an attention type (the padding
oracle counts with it).

The oracle branches on the spec classes themselves instead of calling the specs' dispatch: an
oracle that went through the code it checks would share its bugs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)


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
        kinds = {kind_key(layers[n]) for n in own if n in layers}
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
        key = kind_key(spec)
        if name not in sharing and key not in appearance:
            appearance.append(key)
    appearance.sort(key=lambda key: key[0] != "FullAttentionSpec")
    seen: list[tuple[object, ...]] = []
    for group in groups:
        own = [n for n in group.layer_names if n not in sharing and n in layers]
        if own and (not seen or seen[-1] != kind_key(layers[own[0]])):
            seen.append(kind_key(layers[own[0]]))
    if seen != appearance:
        return [
            f"groups ordered by type {[k[0] for k in seen]}, expected full attention "
            f"first, then first appearance {[k[0] for k in appearance]}"
        ]
    return []


def kind_key(spec: KVCacheSpec) -> tuple[object, ...]:
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
        per_type.setdefault(kind_key(layers[name]), []).append(name)
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
