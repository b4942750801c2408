"""``GroupLayout``: every per-group constant of a ``TorchKVCacheManager``, computed once.

The manager's paths read, on every call, what the KV cache config and the manager settings say
about the groups: each group's rule (``hybridkv.optimized.group_rules``), which groups release
blocks and which rule each follows, which take the EAGLE last-block drop, which sliding-window
groups cache only the blocks a later hit can reach, where each group's table starts in the
flat tables, the attention types in lookup order, and the per-group arrays of the vectorised
paths (``GroupColumns``). None of it changes after the manager is built, so it is one frozen
value, built here from the config and the settings, and shared by every phase module.

Data layout (G groups, R = ``max_num_reqs`` rows, W = ``max_blocks_per_req`` positions)
--------------------------------------------------------------------------------------------
::

    rules[G]               GroupRule per group (kind, block size, window or chunk span)
    distinct_rules         the distinct rules among them; rule_plan[G]: each group's index
                           into it (Gemma's six window groups share one rule)
    releasing              (g, rule) of the groups whose windows or chunks release blocks
    release_rules          the distinct rules among them; release_plan: (g, index) into it
    one_window             (first, end, block size, window) when the releasing groups are one
                           slice of neighbours under one sliding-window rule, else None
    group_bases[G]         the flat index of row 0, position 0 of group g's table (g × R × W);
                           group_base_column: the same as an int64 [G, 1] numpy column
    types                  (spec, group ids) per attention type, in lookup order
                           (``KVCacheConfig.attention_types``); type_eagle per type,
                           group_eagle per group: does it take the EAGLE drop
    admission_caps[G]      the blocks a group ever holds at once (``None``: no cap)
    cross_groups           the cross-attention groups, whose tables the encoder tokens size
    columns                ``GroupColumns``, the same facts as numpy columns
    memo_run               (full-attention groups, ((window groups, blocks a window hit ends
                           with), …)) when a hit can be read from the memo's run
                           (``hybridkv.optimized.memo_hit``), else None

and the flags that choose a path: ``uniform`` (one block size, the hash block size too),
``has_align`` (a Mamba ``"align"`` group), ``general`` (either of the two calls for the
request-by-request caching) and ``uniform_columns`` (every allocation extends all of a row's
tables to one length; never with a cross-attention group, whose table the encoder sizes: such a
layout takes the per-group paths, one request at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.optimized.group_columns import GroupColumns
from hybridkv.optimized.group_rules import (
    CHUNKED,
    CROSS,
    MAMBA,
    NEVER,
    SLIDING,
    GroupRule,
    one_window,
)
from hybridkv.optimized.lookup import GroupHit
from hybridkv.optimized.type_hits import window_blocks_needed
from hybridkv.reference.engine_settings import EngineSettings
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.spec import KVCacheConfig, KVCacheSpec, SlidingWindowSpec, rules
from hybridkv.spec.errors import check_positive

BlockIds = tuple[tuple[int, ...], ...]
MemoRun = tuple[tuple[int, ...], tuple[tuple[tuple[int, ...], int, slice | tuple[int, ...]], ...]]
"""``GroupLayout.memo_run``: the full-attention groups, then per window type its groups, the
cached blocks its hit ends with, and its groups as an index of a record's columns (a slice
where they are consecutive: a view, where a tuple of ids gathers a copy)."""


@dataclass(frozen=True)
class GroupLayout:
    """The per-group constants of one manager (see the module docstring)."""

    config: KVCacheConfig
    settings: EngineSettings
    num_groups: int
    block_size: int
    hash_block_size: int
    max_model_len: int = field(init=False)
    caching: bool
    lookahead: int = field(init=False)
    retention_interval: int | None = field(init=False)
    max_num_reqs: int
    max_blocks_per_req: int
    rules: tuple[GroupRule, ...]
    distinct_rules: tuple[GroupRule, ...] = field(init=False)
    rule_plan: tuple[int, ...] = field(init=False)
    releasing: tuple[tuple[int, GroupRule], ...] = field(init=False)
    release_rules: tuple[GroupRule, ...] = field(init=False)
    release_plan: tuple[tuple[int, int], ...] = field(init=False)
    one_window: tuple[int, int, int, int] | None = field(init=False)
    uniform: bool
    has_align: bool
    general: bool
    uniform_columns: bool
    admission_caps: tuple[int | None, ...] = field(init=False)
    cross_groups: tuple[int, ...] = field(init=False)
    eagle_groups: frozenset[int]
    types: tuple[tuple[KVCacheSpec, list[int]], ...]
    type_eagle: tuple[bool, ...]
    group_eagle: tuple[bool, ...]
    group_bases: tuple[int, ...] = field(init=False)
    group_base_column: npt.NDArray[np.int64] = field(init=False)
    columns: GroupColumns
    no_blocks: KVCacheBlocks = field(init=False)
    no_hits: BlockIds = field(init=False)
    no_group_hits: tuple[GroupHit, ...] = field(init=False)
    mixes_full_with_more_types: bool = field(init=False)
    """Full attention and at least two other attention types (a hybrid of 3–4 types)."""
    memo_run: MemoRun | None = field(init=False)

    @classmethod
    def build(
        cls,
        config: KVCacheConfig,
        settings: EngineSettings,
        max_num_reqs: int,
        max_blocks_per_req: int | None,
        *,
        caching: bool,
        events: bool,
        immediate: bool = False,
    ) -> GroupLayout:
        """The layout of ``config`` under ``settings`` for R rows of W positions (default: what
        ``max_model_len`` needs); ``ValueError`` naming ``max_num_reqs`` or
        ``max_blocks_per_req`` when not positive or W is less than ``max_model_len`` needs."""
        check_positive("max_num_reqs", max_num_reqs)
        group_rules = tuple(GroupRule.of(group.spec) for group in config.groups)
        g_count, r = len(group_rules), max_num_reqs
        w = _table_width(group_rules, settings, max_blocks_per_req)
        block_size, hash_block_size = settings.scheduler_block_size, settings.hash_block_size
        # One block size (the hash block size too): the vectorised paths and the one-key-per-
        # block caching apply. Otherwise tables differ in width, each group sees the hashes at
        # its block size, and requests go one by one.
        uniform = all(rule.block_size == block_size == hash_block_size for rule in group_rules)
        has_align = any(rule.kind == MAMBA for rule in group_rules)
        # Multi-module MTP caches behind the computed tokens: every call looks (no threshold).
        general = not uniform or has_align or settings.num_reprefillable_tokens > 0
        spec_blocks = any(rule.spec_blocks for rule in group_rules)
        # A cross-attention table's length follows the encoder, not the row's other tables.
        cross = any(rule.kind == CROSS for rule in group_rules)
        if cross and has_align:
            raise ValueError(
                "config: a cross-attention group beside a Mamba 'align' group is not supported "
                "by the optimized backend (the reference's KVCacheManager serves it)"
            )
        uniform_columns = uniform and not has_align and not spec_blocks and not cross
        types = tuple(config.attention_types())
        eagle = _eagle_groups(config, settings.use_eagle)
        type_eagle, group_eagle = _eagle_by_type(types, eagle, g_count)
        sparse_groups = _sparse_groups(config, caching, block_size, group_eagle)
        # A running request's step leaves its releases and inserts to the pool's pending work
        # (``defers``) where they are plain: one block size, no Mamba ``"align"`` group, no
        # speculative blocks, caching on without events or sparse retention.
        # ``immediate`` (an eviction policy hears each pool call in the reference's order):
        # no deferred pool work and no whole-step vectorised batches.
        defers = uniform_columns and not general and caching and not events and not sparse_groups
        defers = defers and not immediate
        vectorisable = not general and not spec_blocks and not immediate and not cross
        columns = _columns(r, group_rules, sparse_groups, vectorisable, defers)
        return cls(
            config=config,
            settings=settings,
            num_groups=g_count,
            block_size=block_size,
            hash_block_size=hash_block_size,
            caching=caching,
            max_num_reqs=r,
            max_blocks_per_req=w,
            rules=group_rules,
            uniform=uniform,
            has_align=has_align,
            general=general,
            uniform_columns=uniform_columns,
            eagle_groups=frozenset(eagle),
            types=types,
            type_eagle=type_eagle,
            group_eagle=group_eagle,
            columns=columns,
        )

    def __post_init__(self) -> None:
        """The constants derived from the others."""
        g_count, size = self.num_groups, self.max_num_reqs * self.max_blocks_per_req
        bases = tuple(g * size for g in range(g_count))
        empty: BlockIds = tuple(() for _ in range(g_count))
        settings = self.settings
        kinds = {group.spec.kind for group in self.config.groups}
        releasing = tuple((g, rule) for g, rule in enumerate(self.rules) if rule.releases)
        release_rules = tuple(dict.fromkeys(rule for _, rule in releasing))
        distinct_rules = tuple(dict.fromkeys(self.rules))
        derived = {
            "distinct_rules": distinct_rules,
            "rule_plan": tuple(distinct_rules.index(rule) for rule in self.rules),
            "max_model_len": settings.max_model_len,
            "lookahead": settings.num_hash_lookahead_tokens,
            "retention_interval": self.config.prefix_cache_retention_interval,
            "releasing": releasing,
            "release_rules": release_rules,
            "release_plan": tuple((g, release_rules.index(rule)) for g, rule in releasing),
            "one_window": one_window(self.rules),
            "admission_caps": tuple(
                group.spec.admission_cap(settings.max_model_len, settings.max_in_flight_tokens)
                for group in self.config.groups
            ),
            "cross_groups": tuple(g for g, rule in enumerate(self.rules) if rule.kind == CROSS),
            "group_bases": bases,
            "group_base_column": np.array(bases, dtype=np.int64)[:, None],
            "no_blocks": KVCacheBlocks(empty),
            "no_hits": empty,
            "no_group_hits": tuple(GroupHit.of(()) for _ in range(g_count)),
            "mixes_full_with_more_types": "full" in kinds and len(kinds) >= 3,
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "memo_run", _memo_run(self))

    def skipped_positions(self, num_computed_tokens: int) -> list[int]:
        """Each group's leading positions that ``num_computed_tokens`` computed tokens leave
        unread (``GroupRule.skipped_positions``), each distinct rule asked once."""
        per_rule = [rule.skipped_positions(num_computed_tokens) for rule in self.distinct_rules]
        return [per_rule[i] for i in self.rule_plan]


_RUN_TYPES: dict[str, Callable[[Any], int]] = {
    "full": lambda spec: 0,
    "sliding_window": lambda spec: window_blocks_needed(spec, False),
}
"""The attention types whose hits a memo's run answers, by ``spec.kind``: the cached blocks
a hit must end with (a window's, ``window_blocks_needed``), 0 for full attention, whose hit is
the run itself."""


def _memo_run(layout: GroupLayout) -> MemoRun | None:
    """The full-attention groups and the window types (their groups, and the cached blocks a
    window hit ends with) of a layout whose hits the memo's run can answer: one full-attention
    type and sliding windows of the hash block size, with caching and without EAGLE, lookahead
    hashes or reprefilled tokens; else ``None`` (two full-attention types may each find a
    different run, whose longest is the shared-prefix boundary the general lookup reports)."""
    if layout.general or layout.lookahead or any(layout.type_eagle) or not layout.caching:
        return None
    full: tuple[int, ...] = ()
    windows: list[tuple[tuple[int, ...], int, slice | tuple[int, ...]]] = []
    for spec, group_ids in layout.types:
        needed_by = _RUN_TYPES.get(spec.kind)
        if needed_by is None:
            return None
        needed = needed_by(spec)
        if needed:
            ids = tuple(group_ids)
            consecutive = ids == tuple(range(ids[0], ids[0] + len(ids)))
            windows.append((ids, needed, slice(ids[0], ids[-1] + 1) if consecutive else ids))
        elif full:
            return None  # a second full-attention type
        else:
            full = tuple(group_ids)
    return (full, tuple(windows)) if full else None


def _table_width(
    group_rules: tuple[GroupRule, ...], settings: EngineSettings, max_blocks_per_req: int | None
) -> int:
    """W: ``max_blocks_per_req``, by default the positions ``max_model_len`` needs (and a
    cross-attention table the longest encoder input's, at most ``max_in_flight_tokens``: one
    step's tokens, as ``CrossAttentionSpec.max_blocks_per_request`` counts); a ``ValueError``
    naming it unless positive and at least what ``max_model_len`` needs."""
    max_model_len = settings.max_model_len
    needed = max(rule.blocks_for_tokens(max_model_len) for rule in group_rules)
    if max_blocks_per_req is None:
        encoder = settings.max_in_flight_tokens
        return max(
            [needed]
            + [rules.cdiv(encoder, rule.block_size) for rule in group_rules if rule.kind == CROSS]
        )
    check_positive("max_blocks_per_req", max_blocks_per_req)
    if max_blocks_per_req < needed:
        raise ValueError(
            f"max_blocks_per_req must be at least the {needed} blocks of max_model_len "
            f"{max_model_len}, got {max_blocks_per_req!r}"
        )
    return max_blocks_per_req


def _columns(
    num_rows: int,
    group_rules: tuple[GroupRule, ...],
    sparse_groups: list[int],
    vectorisable: bool,
    defers: bool,
) -> GroupColumns:
    """The per-group arrays of the vectorised paths."""
    return GroupColumns.build(
        num_rows,
        [rule.span if rule.kind == SLIDING else NEVER for rule in group_rules],
        [rule.span if rule.kind == CHUNKED else 0 for rule in group_rules],
        releases=any(rule.releases for rule in group_rules),
        sparse_groups=sparse_groups,
        vectorisable=vectorisable,
        defers=defers,
        mamba_align=any(rule.kind == MAMBA for rule in group_rules),
    )


def _eagle_groups(config: KVCacheConfig, use_eagle: bool) -> set[int]:
    """Groups whose hits take the EAGLE last-block drop: the flagged drafter groups, or every
    group when none is flagged (``KVCacheCoordinator``); none without EAGLE."""
    if not use_eagle:
        return set()
    eagle = {g for g, group in enumerate(config.groups) if group.is_eagle_group}
    return eagle or set(range(len(config.groups)))


def _sparse_groups(
    config: KVCacheConfig, caching: bool, block_size: int, group_eagle: Sequence[bool]
) -> list[int]:
    """Sliding-window groups that cache only the blocks a later hit can reach
    (``reachable_block_mask``): under sparse retention, or when a hit needs fewer of their
    blocks than a scheduler block holds."""
    if not caching:
        return []
    return [
        g
        for g, group in enumerate(config.groups)
        if isinstance(group.spec, SlidingWindowSpec)
        and (
            config.prefix_cache_retention_interval is not None
            or block_size // group.spec.block_size
            > rules.sliding_window_contiguous_blocks(
                group.spec.sliding_window, group.spec.block_size, group_eagle[g]
            )
        )
    ]


def _eagle_by_type(
    types: tuple[tuple[KVCacheSpec, list[int]], ...], eagle: set[int] | frozenset[int], g_count: int
) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Whether each attention type drops its last hit block for EAGLE (any of its groups is
    flagged), and the same per group: a type's groups share their hit, so they share the flag."""
    type_eagle = tuple(any(g in eagle for g in group_ids) for _, group_ids in types)
    group_eagle = [False] * g_count
    for (_, group_ids), eagle_type in zip(types, type_eagle, strict=True):
        for group_id in group_ids:
            group_eagle[group_id] = eagle_type
    return type_eagle, tuple(group_eagle)
