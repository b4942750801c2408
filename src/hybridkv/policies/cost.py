"""``cost``: Marconi's eviction score, adapted to a block pool.

Rule (Marconi, Pan et al., MLSys'25, "Marconi: Prefix Caching for the Era of Hybrid LLMs";
``ruipeterpan/marconi`` ``radix_cache_hybrid.py:503-560``): every candidate gets
``α · efficiency + (1 − α) · recency`` and the minimum is evicted, where efficiency is the
recompute FLOPs the cached entry saves per byte it frees. Here, in order: free blocks without a
key (nothing to lose, as in vLLM's queue), then blocks that can serve no hit (``hybrid``'s
rule, least recently released first), then every other free block by score.

Marconi's candidates are the radix nodes with at most one child (evicting one never cuts
another entry's prefix); ``candidates_first=True`` keeps that split, the blocks with no
full-attention key that has a cached child (window blocks, Mamba states, the ends of
full-attention chains) by score before the chain interiors by score. It is off by default, and
α is 0.02, not Marconi's 0.5, because both were measured to lose hits on this project's policy
table (``python -m hybridkv.lab.policy_table``, docs/eviction.md): with the split, at α from 0.5
down to 0.02, gpt-oss-120b ``mixed`` at 2 GiB hit 46.9-47.5 % against LRU's 70.0 % (a chain's
interior, kept until no leaf is left, outlives the recent prompts' leaves); without it, α = 0.1
and 0.2 still lost 2 points at 1 GiB, and at α = 0.02 no cell of gpt-oss-120b, gemma-3-27b-it
or Jamba-v0.1 fell more than 0.4 points below LRU while Jamba-v0.1 kept +9.5 to +16.9 points.
At 0.02 the efficiency term (6-17 bits for these models' blocks and states) weighs as a tenth
to a third of a pool's worth of releases: LRU, with Mamba states and long-prefix blocks kept a
little longer.

Adapted so that each block's score is fixed when it is released (a heap then orders the free
blocks in O(log n); the structure comes from ``hybrid``'s incremental key trees; Marconi
min-max normalises both terms over the current candidates, which costs a pass over them per
eviction):

* efficiency is ``log2(1 + FLOPs ÷ bytes)`` of the block's keys (bits), bytes being the spec's
  page size (``page_size_bytes``: one block of one layer, or one padded Mamba state);
* recency is the release stamp divided by the pool's block count: one more unit per pool's
  worth of releases, so a block released a whole pool later is worth ``(1 − α) / α`` bits
  of efficiency (49 bits at the default ``α = 0.02``, one bit at Marconi's 0.5).

FLOPs model, per layer, for a block whose key names a prefix of ``P`` tokens (``w`` =
``num_kv_heads × head_size``, ``b`` = tokens in the block): attention recomputes ``b`` tokens
at ``24·w²`` (projections and MLP, the usual ``24·d²`` per token and layer) plus ``4·w·c``
(scores and values over the ``c`` tokens each attends to: ``P`` for full attention, at most the
window for a sliding window, the tokens of its chunk for chunked local attention, taken at the
block's middle token); a Mamba state saves rerunning the whole ``P``-token prefix through the
layer at ``mamba_flops_per_state_byte`` FLOPs per state byte per token (the state is read and
written once per token). Marconi counts a state's saving against its radix parent; a pool knows
no parent state, so the whole prefix is counted. Ties break on the release stamp, then the id.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridkv.policies.hybrid import NO_KEY, USELESS, HybridPolicy
from hybridkv.policies.key_tree import window_of
from hybridkv.policies.protocol import CachedBlock

DEFAULT_ALPHA = 0.02
CANDIDATE, CHAIN = 2, 3
DEFAULT_MAMBA_FLOPS_PER_STATE_BYTE = 6.0


def recompute_flops(block: CachedBlock, mamba_flops_per_state_byte: float) -> float:
    """The FLOPs one layer spends to recompute what ``block``'s key holds (model above)."""
    spec = block.spec
    prefix = block.prefix_tokens
    if spec.kind == "mamba":
        return float(prefix) * mamba_flops_per_state_byte * spec.page_size_bytes
    width = int(getattr(spec, "num_kv_heads", 1)) * int(getattr(spec, "head_size", 1))
    tokens = min(spec.block_size, prefix)
    middle = max(prefix - tokens // 2, 1)
    if spec.kind == "sliding_window":
        context = min(middle, window_of(block))
    elif spec.kind == "chunked_local":
        context = middle % window_of(block) or window_of(block)
    else:
        context = middle
    return float(tokens) * (24.0 * width * width + 4.0 * width * context)


class CostPolicy(HybridPolicy):
    """Evict the block of least ``α · log2(1 + FLOPs/byte) + (1 − α) · recency`` (with
    ``candidates_first``, Marconi's candidates before the chain interiors)."""

    name = "cost"

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        mamba_flops_per_state_byte: float = DEFAULT_MAMBA_FLOPS_PER_STATE_BYTE,
        *,
        candidates_first: bool = False,
        duplicates_first: bool = True,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        if mamba_flops_per_state_byte <= 0:
            raise ValueError(
                f"mamba_flops_per_state_byte must be positive, got {mamba_flops_per_state_byte!r}"
            )
        self.alpha = alpha
        self.mamba_flops_per_state_byte = mamba_flops_per_state_byte
        self.candidates_first = candidates_first
        self._efficiency: dict[int, float] = {}  # block -> FLOPs per byte of its keys
        self._horizon = 0
        super().__init__(duplicates_first=duplicates_first)

    def cached(self, block: CachedBlock) -> None:
        flops = recompute_flops(block, self.mamba_flops_per_state_byte)
        per_byte = flops / block.spec.page_size_bytes
        block_id = block.block_id
        self._efficiency[block_id] = self._efficiency.get(block_id, 0.0) + per_byte
        super().cached(block)

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        if not self._horizon:
            self._horizon = len(without_hash) + len(with_hash)
        super().released(without_hash, with_hash)

    def taken(self, block_ids: Sequence[int]) -> None:
        super().taken(block_ids)
        for block_id in block_ids:
            self._efficiency.pop(block_id, None)

    def uncached(self, block_id: int) -> None:
        self._efficiency.pop(block_id, None)
        super().uncached(block_id)

    def reset(self) -> None:
        self._efficiency = {}
        super().reset()

    def score(self, block_id: int, stamp: int) -> float:
        """The block's score were it released at ``stamp``."""
        recency = stamp / max(self._horizon, 1)
        efficiency = self._efficiency.get(block_id, 0.0)
        return self.alpha * math.log2(1.0 + efficiency) + (1.0 - self.alpha) * recency

    def sort_key(self, block_id: int, stamp: int) -> tuple[float, ...]:
        """No key, then useless (release order), then the rest by score (with
        ``candidates_first``: candidates, then chain interiors, each by score)."""
        tier = self.tier(block_id)
        if tier in (NO_KEY, USELESS):
            return (tier, stamp)
        if self.candidates_first and not self._candidate(block_id):
            return (CHAIN, self.score(block_id, stamp), stamp)
        return (CANDIDATE, self.score(block_id, stamp), stamp)

    def _candidate(self, block_id: int) -> bool:
        """Marconi's candidates: no full-attention key of the block has a cached child."""
        nodes = self.tree.nodes
        return not any(
            nodes[key].kind == "full" and nodes[key].cached_children
            for key in self.keys_of(block_id)
        )
