"""``cost``: Marconi's eviction score, adapted to a block pool.

Rule (Marconi, Pan et al., MLSys'25, "Marconi: Prefix Caching for the Era of Hybrid LLMs";
``ruipeterpan/marconi`` ``radix_cache_hybrid.py:503-560``): every candidate gets
``α · efficiency + (1 − α) · recency`` and the minimum is evicted, where efficiency is the
recompute FLOPs the cached entry saves per byte it frees. Free blocks without a key go first
(nothing to lose, as in vLLM's queue), least recently released first.

Adapted so that each block's score is fixed when it is released (a heap then orders the free
blocks in O(log n); Marconi min-max normalises both terms over the current candidates, which
costs a pass over them per eviction):

* efficiency is ``log2(1 + FLOPs ÷ bytes)`` of the block's keys (bits), bytes being the spec's
  page size (``page_size_bytes``: one block of one layer, or one padded Mamba state);
* recency is the release stamp divided by the pool's block count: one more unit per pool's
  worth of releases, so a block released a whole pool later is worth ``(1 − α) / α`` bits
  of efficiency (one bit at the default ``α = 0.5``).

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

from hybridkv.policies.free_set import ReleaseClock, ScoredFreeSet
from hybridkv.policies.key_tree import window_of
from hybridkv.policies.protocol import CachedBlock

DEFAULT_ALPHA = 0.5
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


class CostPolicy:
    """Evict the free block of least ``α · log2(1 + FLOPs/byte) + (1 − α) · recency``."""

    name = "cost"

    def __init__(
        self,
        alpha: float = DEFAULT_ALPHA,
        mamba_flops_per_state_byte: float = DEFAULT_MAMBA_FLOPS_PER_STATE_BYTE,
    ) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
        if mamba_flops_per_state_byte <= 0:
            raise ValueError(
                f"mamba_flops_per_state_byte must be positive, got {mamba_flops_per_state_byte!r}"
            )
        self.alpha = alpha
        self.mamba_flops_per_state_byte = mamba_flops_per_state_byte
        self._clock = ReleaseClock()
        self._free = ScoredFreeSet()
        self._stamp: dict[int, int] = {}
        self._efficiency: dict[int, float] = {}  # block -> FLOPs per byte of its keys
        self._horizon = 0

    def cached(self, block: CachedBlock) -> None:
        flops = recompute_flops(block, self.mamba_flops_per_state_byte)
        per_byte = flops / block.spec.page_size_bytes
        block_id = block.block_id
        self._efficiency[block_id] = self._efficiency.get(block_id, 0.0) + per_byte
        self._rank(block_id)

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        if not self._horizon:
            self._horizon = len(without_hash) + len(with_hash)
        for ids, stamps in (
            (without_hash, self._clock.at_head(without_hash)),
            (with_hash, self._clock.at_tail(with_hash)),
        ):
            for block_id, stamp in zip(ids, stamps, strict=True):
                self._stamp[block_id] = stamp
                self._rank(block_id)

    def touched(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            self._free.discard(block_id)
            self._stamp.pop(block_id, None)

    def choose(self, n: int) -> Sequence[int]:
        return self._free.smallest(n)

    def taken(self, block_ids: Sequence[int]) -> None:
        self.touched(block_ids)
        for block_id in block_ids:
            self._efficiency.pop(block_id, None)

    def uncached(self, block_id: int) -> None:
        self._efficiency.pop(block_id, None)
        self._rank(block_id)

    def reset(self) -> None:
        self._efficiency = {}
        for block_id in self._stamp:
            self._rank(block_id)

    def score(self, block_id: int) -> float | None:
        """The free block's score (``None`` for a free block without a key)."""
        key = self._free.key(block_id)
        return None if key[0] == 0 else key[1]

    def _rank(self, block_id: int) -> None:
        stamp = self._stamp.get(block_id)
        if stamp is None:
            return
        efficiency = self._efficiency.get(block_id)
        if efficiency is None:
            self._free.put(block_id, (0, stamp))
            return
        recency = stamp / max(self._horizon, 1)
        score = self.alpha * math.log2(1.0 + efficiency) + (1.0 - self.alpha) * recency
        self._free.put(block_id, (1, score, stamp))
