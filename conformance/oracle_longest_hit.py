"""The longest-hit oracle: brute force against the hybrid coordinator's fixed point.

The hybrid coordinator asks each attention type, in turn, for its longest hit within the current
length and repeats until no type lowers it (Prefix caching, Case 2, generalised to any number of
types). The claim: the result is the *longest* length that every group accepts.
``hybrid_hit_tokens`` is the algorithm under test, over the rule functions of ``spec.rules``;
``brute_force_hit_blocks`` tries every candidate length and checks each group's rule directly
(``group_accepts``), written from the rule's words and not from the scans.

Cache states here are plain flags: ``cached[i]`` says whether block ``i`` of the request is in
the prefix cache of that group (``random_cache_state`` draws them). The oracle branches on the
attention type itself instead of calling the specs' dispatch: an oracle that went through the
code it checks would share its bugs.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from hybridkv.spec import rules

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


def first_needed_block(group: GroupCacheState, num_blocks: int, block_size: int) -> int:
    """The first block of ``group`` that a hit of ``num_blocks`` blocks reads (before it: null
    positions in the hit), by the rule ``group_accepts`` checks."""
    if group.kind == "full":
        return 0
    if group.kind == "sliding_window":
        return max(0, num_blocks - -(-(group.param - 1) // block_size))
    hit_tokens = num_blocks * block_size
    return (hit_tokens - hit_tokens % group.param) // block_size


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
