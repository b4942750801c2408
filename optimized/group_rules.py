"""``GroupRule``: each KV cache group's attention-type hooks, as plain values.

The reference gives every attention type its own ``SingleTypeKVCacheManager`` subclass, whose
hooks say how many blocks a number of tokens needs and which leading blocks a request no longer
reads (a sliding window's, a chunk's, a Mamba group's older states). The optimized backend reads
the same rules (``hybridkv.spec.rules``) through one frozen value per group, so that its flat
per-row state can be updated without a call through a manager object per group: ``kind`` says
which rule applies, ``span`` is the window (widened by the ``extra_retained_tokens`` a
multi-module MTP window keeps below it) or chunk size. A cross-attention group's table is
sized by the encoder tokens (``hybridkv.optimized.admission.required_positions``), never by the
decoder's: its rule needs no position for them and none for a KV connector's tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.spec import KVCacheSpec, MambaSpec, rules

FULL, SLIDING, CHUNKED, MAMBA, CROSS = range(5)  # MAMBA: a Mamba group in "align" mode
NEVER = 1 << 50
"""Stands for "never" in the row thresholds (and the window of a group that never releases)."""


@dataclass(frozen=True)
class GroupRule:
    """The hooks of one group's attention type (``SingleTypeKVCacheManager``'s), as values."""

    kind: int
    block_size: int
    span: int = 0  # sliding window (plus its extra retained tokens) or attention chunk size
    spec_blocks: int = 0  # a Mamba group's speculative blocks, after its state

    @staticmethod
    def of(spec: KVCacheSpec) -> GroupRule:
        """The hooks of ``spec``'s attention type, from ``GROUP_RULES``."""
        return GROUP_RULES[spec.kind](spec)

    def skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens the next token no longer reads (``skipped_tokens`` of the type)."""
        if self.kind == SLIDING:
            return rules.sliding_window_skipped_tokens(num_computed_tokens, self.span)
        if self.kind == CHUNKED:
            return rules.chunked_local_skipped_tokens(num_computed_tokens, self.span)
        if self.kind == MAMBA:
            return rules.mamba_skipped_tokens(num_computed_tokens)
        return 0  # full attention skips nothing

    def skipped_positions(self, num_computed_tokens: int) -> int:
        if self.kind == FULL:
            return 0
        skipped = self.skipped_tokens(num_computed_tokens)
        return rules.skipped_block_positions(skipped, self.block_size)

    def external_positions(self, num_local_computed: int, num_external: int) -> int:
        """Positions a table holds once it has blocks for ``num_external`` tokens a KV
        connector supplies after ``num_local_computed`` (0: none needed, every one is skipped;
        ``allocate_external_computed_blocks`` of the reference)."""
        if self.kind == CROSS:
            return 0
        total = num_local_computed + num_external
        skipped = self.skipped_tokens(total)
        if skipped > 0:
            num_external = min(total - skipped, num_external)
        if num_external <= 0:
            return 0
        return rules.cdiv(total, self.block_size)

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Positions ``num_tokens`` decoder tokens need (none in a cross-attention table)."""
        if self.kind == CROSS:
            return 0
        blocks = rules.attention_blocks_for_tokens(num_tokens, self.block_size)
        return blocks + self.spec_blocks

    @property
    def releases(self) -> bool:
        return self.kind in (SLIDING, CHUNKED)


def _mamba_rule(spec: MambaSpec) -> GroupRule:
    if spec.mamba_cache_mode == "align":
        return GroupRule(MAMBA, spec.block_size, 0, spec.num_speculative_blocks)
    # One running state ("none" mode): the states before the one holding the last computed
    # token are released, exactly as a window of two tokens releases.
    return GroupRule(SLIDING, spec.block_size, 2, spec.num_speculative_blocks)


GROUP_RULES: dict[str, Callable[[Any], GroupRule]] = {
    "full": lambda spec: GroupRule(FULL, spec.block_size),
    # A window's trailing edge extended by ``extra_retained_tokens`` releases as a wider window
    # (``rules.sliding_window_skipped_tokens``): the span is the tokens it keeps.
    "sliding_window": lambda spec: GroupRule(
        SLIDING, spec.block_size, spec.sliding_window + spec.extra_retained_tokens
    ),
    "chunked_local": lambda spec: GroupRule(CHUNKED, spec.block_size, spec.attention_chunk_size),
    "cross_attention": lambda spec: GroupRule(CROSS, spec.block_size),
    "mamba": _mamba_rule,
}
"""Each attention type's hooks, by ``spec.kind``: the one place this backend dispatches on it."""


OneWindow = tuple[int, int, int, int]
"""The releasing groups as one slice of a row's counters, when they are neighbours under one
sliding-window rule (Gemma's, gpt-oss's): (first group, end group, block size, window)."""
ReleaseColumn = tuple[int, int, int, bool]
"""A releasing group: (group, block size, window or chunk size, chunked?)."""


def release_columns(rules: Sequence[GroupRule]) -> list[ReleaseColumn]:
    """The groups whose windows or chunks release blocks, in group order."""
    return [
        (g, rule.block_size, rule.span, rule.kind == CHUNKED)
        for g, rule in enumerate(rules)
        if rule.releases
    ]


def one_window(rules: Sequence[GroupRule]) -> OneWindow | None:
    """The releasing groups as one ``OneWindow``, or ``None`` unless they are neighbours that
    all follow one sliding-window rule."""
    releasing = [g for g, rule in enumerate(rules) if rule.releases]
    distinct = {rules[g] for g in releasing}
    if len(distinct) != 1:
        return None
    (rule,) = distinct
    if rule.kind != SLIDING or releasing != list(range(releasing[0], releasing[-1] + 1)):
        return None
    return releasing[0], releasing[-1] + 1, rule.block_size, rule.span
