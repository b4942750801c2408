"""A cache hit is never wrong, even when block hashes collide.

The requests here hash their blocks with injected functions that collide on purpose: every
block the same hash, hashes that ignore the parent (so a block's hash does not name its prefix),
or hashes that differ only after the first 4 bytes (the optimized table's key). The optimized
backend verifies a candidate's source (its hash at that position, its cache salt and all its
tokens up to the end of the block) and must never return another prompt's blocks; true hits
must still be found. The reference, which trusts the hashes as vLLM does, is shown to be fooled
by the same requests, so the test really exercises collisions.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.reference import KVCacheManager
from hybridkv.reference.block_hash import BlockHash
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
HashFn = Callable[[BlockHash | None, Sequence[int], str | None], BlockHash]


def constant(parent: BlockHash | None, tokens: Sequence[int], salt: str | None) -> BlockHash:
    """Every block of every prompt collides."""
    return BlockHash(b"\x42" * 32)


def parentless(parent: BlockHash | None, tokens: Sequence[int], salt: str | None) -> BlockHash:
    """A block's hash names only its own tokens: equal blocks after different prefixes or
    salts collide."""
    return BlockHash(hashlib.sha256(repr(list(tokens)).encode()).digest())


def same_key(parent: BlockHash | None, tokens: Sequence[int], salt: str | None) -> BlockHash:
    """Correct hashes whose first 4 bytes (the optimized table's key) are all equal."""
    data = repr((parent, list(tokens), salt)).encode()
    return BlockHash(b"\0\0\0\0" + hashlib.sha256(data).digest()[4:])


class HashedRequest:
    """A scheduler's request object (``RequestLike``) hashing its blocks with ``hash_fn``."""

    def __init__(
        self, request_id: str, tokens: list[int], hash_fn: HashFn, cache_salt: str | None = None
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(tokens)
        self.cache_salt = cache_salt
        self.num_computed_tokens = 0
        # The engine attributes a ``RequestLike`` carries, at their defaults.
        self.num_prompt_tokens = len(tokens)
        self.num_in_flight_tokens = 0
        self.shared_prefix_boundary = 0
        self.skip_reading_prefix_cache = False
        self.session_id: str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(len(tokens) // 4):
            parent = hash_fn(parent, tokens[4 * i : 4 * i + 4], cache_salt if i == 0 else None)
            self.block_hashes.append(parent)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def config(*specs: FullAttentionSpec | SlidingWindowSpec) -> KVCacheConfig:
    return KVCacheConfig(64, tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs)))


FULL = config(FullAttentionSpec(**SIZES))
SLIDING = config(SlidingWindowSpec(sliding_window=3, **SIZES))  # a hit needs 1 block


def cache(manager: KVCacheManager | TorchKVCacheManager, request: HashedRequest) -> None:
    assert manager.allocate_slots(request, request.num_tokens) is not None


def test_a_hash_shared_by_every_block_never_returns_another_prompts_blocks() -> None:
    for cls in (KVCacheManager, TorchKVCacheManager):
        m = cls(FULL, 64)
        cache(m, HashedRequest("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], constant))
        other = HashedRequest("b", [9, 9, 9, 9, 8, 8, 8, 8, 7], constant)
        same = HashedRequest("c", [1, 2, 3, 4, 5, 6, 7, 8, 0], constant)
        if cls is KVCacheManager:
            assert m.get_computed_blocks(other)[1] == 8  # the reference is fooled
        else:
            blocks, hit, _ = m.get_computed_blocks(other)
            assert (blocks.get_block_ids(), hit) == (([],), 0)
            blocks, hit, _ = m.get_computed_blocks(same)
            assert hit == 8
            assert blocks.get_block_ids() == (m.get_block_ids("a")[0][:2],)


def test_a_hash_that_ignores_the_prefix_or_the_salt_cannot_fool_a_lookup() -> None:
    m = TorchKVCacheManager(SLIDING, 64)
    ref = KVCacheManager(SLIDING, 64)
    first = [1, 1, 1, 1, 2, 2, 2, 2, 3]
    for manager in (m, ref):
        cache(manager, HashedRequest("a", first, parentless))
    # Same second block after another first block: a sliding window needs only the last
    # block cached, so only a check of the whole prefix rejects it.
    other_prefix = HashedRequest("b", [5, 5, 5, 5, 2, 2, 2, 2, 3], parentless)
    assert ref.get_computed_blocks(other_prefix)[1] == 8  # fooled
    assert m.get_computed_blocks(other_prefix)[1] == 0
    # Same tokens under another salt.
    for manager in (m, ref):
        cache(manager, HashedRequest("s", [7, 7, 7, 7, 6, 6, 6, 6, 5], parentless, "x"))
    salted = HashedRequest("t", [7, 7, 7, 7, 6, 6, 6, 6, 5], parentless, "y")
    assert ref.get_computed_blocks(salted)[1] == 8  # fooled
    assert m.get_computed_blocks(salted)[1] == 0
    assert m.get_computed_blocks(HashedRequest("u", first, parentless))[1] == 8


def test_keys_that_collide_in_the_table_still_find_the_right_block() -> None:
    """All hashes share the table key: every lookup walks one chain and must pick by the whole
    hash and the tokens, including when a colliding block was cached first."""
    for vector_min in (10_000, 1):
        m = TorchKVCacheManager(FULL, 64)
        m.vector_min = vector_min
        ref = KVCacheManager(FULL, 64)
        prompts = [[i, i, i, i, i + 1, i + 1, i + 1, i + 1, 0] for i in range(1, 6)]
        for index, prompt in enumerate(prompts):
            for manager in (m, ref):
                cache(manager, HashedRequest(f"r{index}", prompt, same_key))
        for index, prompt in enumerate(prompts):
            probe = HashedRequest(f"p{index}", [*prompt[:-1], 9], same_key)
            assert m.get_computed_blocks(probe) == ref.get_computed_blocks(probe)
            assert m.get_computed_blocks(probe)[1] == 8
        m.check_invariants()


def test_a_wrong_first_candidate_does_not_hide_a_right_later_one() -> None:
    """Two blocks cached under one (constant) hash: the first-inserted is another prompt's; the
    lookup skips it and returns the later block whose tokens match."""
    for vector_min in (10_000, 1):
        m = TorchKVCacheManager(FULL, 64)
        m.vector_min = vector_min
        cache(m, HashedRequest("a", [1, 2, 3, 4, 0], constant))
        cache(m, HashedRequest("b", [5, 6, 7, 8, 0], constant))
        blocks, hit, _ = m.get_computed_blocks(HashedRequest("c", [5, 6, 7, 8, 1], constant))
        assert hit == 4
        assert blocks.get_block_ids() == (m.get_block_ids("b")[0][:1],)


def test_long_prompts_of_equal_length_are_verified_to_the_first_differing_token() -> None:
    """Long prompts (tensor probes, chains longer than the tail walk) of equal length: one
    colliding hash for every block, so only the tokens decide where a hit ends."""
    rng = random.Random(3)
    base = [rng.randrange(50) for _ in range(400)]
    cfg = KVCacheConfig(512, (KVCacheGroup(("l0",), FullAttentionSpec(**SIZES)),))
    for vector_min in (10_000, 1):
        m = TorchKVCacheManager(cfg, 1024)
        m.vector_min = vector_min
        cache(m, HashedRequest("a", base, constant))
        ids = m.get_block_ids("a")[0]
        m.free(HashedRequest("a", base, constant))
        for differ, expected in ((None, 396), (399, 396), (397, 396), (200, 200), (3, 0)):
            tokens = list(base)
            if differ is not None:
                tokens[differ] += 1
            blocks, hit, _ = m.get_computed_blocks(HashedRequest("p", tokens, constant))
            assert hit == expected, (differ, hit)
            assert blocks.get_block_ids() == (ids[: expected // 4],)
        m.check_invariants()


def test_long_prompts_whose_keys_all_collide_match_the_reference() -> None:
    """Every block in one table chain per group: the tensor probe walks it, then the tail."""
    rng = random.Random(4)
    cfg = KVCacheConfig(1024, (KVCacheGroup(("l0",), FullAttentionSpec(**SIZES)),))
    prompts = [[rng.randrange(9) for _ in range(240)] for _ in range(3)]
    prompts.append([*prompts[0][:120], *prompts[1][120:]])
    for vector_min in (10_000, 1):
        m = TorchKVCacheManager(cfg, 1024)
        m.vector_min = vector_min
        ref = KVCacheManager(cfg, 1024)
        for index, prompt in enumerate(prompts[:3]):
            for manager in (m, ref):
                cache(manager, HashedRequest(f"r{index}", prompt, same_key))
        for index, prompt in enumerate(prompts):
            probe = HashedRequest(f"p{index}", [*prompt[:-1], 99], same_key)
            assert m.get_computed_blocks(probe) == ref.get_computed_blocks(probe)
        m.check_invariants()
