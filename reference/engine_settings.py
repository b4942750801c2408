"""``EngineSettings``: the engine's side of a manager, resolved once from its keywords.

Beyond the KV cache layout, a serving engine tells the manager how long a request may get, how
many tokens are in flight, and how it hashes and drafts. Two of these follow from the layout:
the *scheduler block size* (the lcm of the groups' block sizes: every hit ends on a block
boundary of every group) and the *hash block size* (their gcd, so every group's block is a
whole number of hashes; the lcm when nothing will be looked up finer).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineSettings:
    """What the manager's keywords tell the coordinator (vLLM's names)."""

    max_model_len: int
    max_in_flight_tokens: int
    scheduler_block_size: int
    hash_block_size: int
    use_eagle: bool = False
    num_hash_lookahead_tokens: int = 0
    num_prefill_lookahead: int = 0

    @property
    def num_reprefillable_tokens(self) -> int:
        """Tokens at the end of the computed ones that multi-module MTP may prefill again
        (its ``num_prefill_lookahead`` draft modules read the next prompt tokens): their KV
        is not final, so they are not cached yet (vLLM's ``num_reprefillable_tokens``)."""
        return max(0, self.num_prefill_lookahead - 1)
