"""``hybrid-arc``: what can serve no hit first, then adaptive replacement over the rest.

Rule: free blocks without a key and blocks that can serve no hit go first, in ``hybrid``'s
order (its tiers 0 and 1, ``HybridPolicy``: a window or chunk block no cached prefix end reads,
a full-attention block whose chain is broken, a Mamba state at a prefix the full-attention
groups no longer cache, a second holder of a key); every other free block in ARC's order
(``ARCPolicy``: T1 and T2 steered by the ghost lists, Megiddo & Modha, FAST'03).

Why both: ARC keeps the prefixes that are hit again and again (a shared system prompt) against
a stream of one-off long prompts, which LRU lets flush them, but being blind to the attention
type it spends room on blocks no hit can read, and on a full + Mamba layout it keeps the
full-attention chains every hit touches while the Mamba states they end leave first. Taking
the useless blocks out first gives ARC only blocks that can still serve a hit
(``docs/eviction.md``: the policy table). Sources: vllm#40268 (ARC asked for vLLM's queue),
vllm#51909 (never-hit blocks first), and ``hybrid``'s for which blocks a hit reads.

The two policies hear every call; each keeps its own O(log n) or amortised O(1) state, and
``choose`` asks ``hybrid`` for its useless blocks, then ARC for as many more as it skips.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.policies.arc import ARCPolicy
from hybridkv.policies.hybrid import USELESS, HybridPolicy
from hybridkv.policies.protocol import CachedBlock


class HybridARCPolicy:
    """``hybrid``'s useless blocks first, then ARC over every block that can serve a hit."""

    name = "hybrid-arc"

    def __init__(self, *, duplicates_first: bool = True) -> None:
        self.hybrid = HybridPolicy(tails_last=False, duplicates_first=duplicates_first)
        self.arc = ARCPolicy()

    def cached(self, block: CachedBlock) -> None:
        self.hybrid.cached(block)
        self.arc.cached(block)

    def released(self, without_hash: Sequence[int], with_hash: Sequence[int]) -> None:
        self.hybrid.released(without_hash, with_hash)
        self.arc.released(without_hash, with_hash)

    def touched(self, block_ids: Sequence[int]) -> None:
        self.hybrid.touched(block_ids)
        self.arc.touched(block_ids)

    def choose(self, n: int) -> Sequence[int]:
        hybrid = self.hybrid
        first = [b for b in hybrid.choose(n) if hybrid.tier(b) <= USELESS]
        if len(first) == n:
            return first
        skip = set(first)
        more = self.arc.choose(min(n + len(first), self.arc.num_free))
        return first + [b for b in more if b not in skip][: n - len(first)]

    def taken(self, block_ids: Sequence[int]) -> None:
        self.hybrid.taken(block_ids)
        self.arc.taken(block_ids)

    def uncached(self, block_id: int) -> None:
        self.hybrid.uncached(block_id)
        self.arc.uncached(block_id)

    def reset(self) -> None:
        self.hybrid.reset()
        self.arc.reset()
