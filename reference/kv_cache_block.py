"""``KVCacheBlock``: the bookkeeping of one block of the pool (not its memory).

A block is a slice of every KV cache tensor (Memory Layout: "one logical block maps to one
slice in each buffer"). The block pool owns every block; requests and the prefix cache only
hold references to them.
"""

from __future__ import annotations

from hybridkv.reference.block_hash import BlockHash

BlockHashWithGroupId = tuple[BlockHash, int]
"""A prefix-cache key: the same tokens are cached independently per KV cache group
(Prefix caching, "High level idea": ``tuple(block_hash, group_id) -> block``)."""


class KVCacheBlock:
    """One block: its id, how many requests hold it, and the cache key it holds, if any.

    ``block_hash`` is the block's primary prefix-cache key and ``block_hash_num_tokens`` the
    prefix length it names (a full block's right edge, or an earlier hash boundary inside the
    block for a partial entry: Mamba checkpoints, a prompt tail in a group whose block is
    larger than the hash block). The pool keeps any further keys of the block beside it.

    ``prev_free``/``next_free`` link the block into the free queue while its reference count
    is 0 (an intrusive list, so a cache hit can take a block out of the queue in O(1)).
    """

    __slots__ = (
        "block_hash",
        "block_hash_num_tokens",
        "block_id",
        "next_free",
        "prev_free",
        "ref_cnt",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashWithGroupId | None = None
        self.block_hash_num_tokens: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        """Block 0 is the null block: it fills table positions that need no KV."""
        return self.block_id == 0

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"
