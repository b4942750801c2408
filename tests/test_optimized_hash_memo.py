"""The optimized manager's block hasher adopts the hashes of cached requests, exactly.

``TorchKVCacheManager.block_hasher`` (``hybridkv.optimized.hash_memo``) adopts, for a prompt
that starts with the tokens of a request whose blocks are cached, that request's hashes: a
request built with it must carry the hashes of one hashed from scratch (salts, evictions and
resets included), the memo must hold no source without a cached block (nor more branches than
sources), and lookups with its hashes must still be verified against the cached tokens.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized import same_ids as same_ids_module
from hybridkv.optimized.hash_memo import HashMemo, agreeing_blocks
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.optimized.same_ids import NUMPY_COMPARE_MIN
from hybridkv.reference import KVCacheManager
from hybridkv.reference.block_hash import BlockHash, hash_full_blocks
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

B = 4


def config(num_blocks: int = 64) -> KVCacheConfig:
    sizes = {"block_size": B, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
    return KVCacheConfig(
        num_blocks,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=8, **sizes)),
        ),
    )


def memo_request(
    manager: TorchKVCacheManager, rid: str, tokens: list[int], salt: str | None = None
) -> Request:
    return Request(
        rid, tokens, hash_block_size=B, cache_salt=salt, block_hasher=manager.block_hasher
    )


def plain_hashes(tokens: Sequence[int], salt: str | None = None) -> list[bytes]:
    return list(hash_full_blocks(tokens, B, start_block=0, parent_hash=None, cache_salt=salt))


def admit(manager: TorchKVCacheManager, request: Request) -> None:
    hits, hit, _ = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - hit, hit, hits) is not None


def cached_blocks(manager: TorchKVCacheManager) -> int:
    return sum(map(len, manager.pool.cached_blocks()))


def sources_with_cached_blocks(manager: TorchKVCacheManager) -> set[int]:
    """The pool's memo sources that a cached block names."""
    pool = manager.pool
    return {src for src in pool.memo_srcs if (s := pool.sources[src]) is not None and s.refs > 0}


def assert_memo_bounded(manager: TorchKVCacheManager) -> None:
    """The memo registers only sources with a cached block, by identity, and holds no more
    branches than sources."""
    memo = manager.block_hasher
    assert set(memo.registered) <= sources_with_cached_blocks(manager)
    assert all(manager.pool.sources[src] is s for src, (s, _) in memo.registered.items())
    assert len(memo) <= len(memo.registered)
    memo.check_invariants()


def test_a_request_built_with_the_memo_has_the_hashes_of_one_hashed_from_scratch() -> None:
    manager = TorchKVCacheManager(config(), 64)
    prompt = list(range(100, 122))  # 5 full blocks and 2 tokens
    first = memo_request(manager, "a", prompt)
    admit(manager, first)
    assert len(manager.block_hasher) == 1  # one branch: the one source, its 5 hashes
    second = memo_request(manager, "b", [*prompt[:12], 7, 8, 9, 10, 11, 12, 13])
    assert list(second.block_hashes) == plain_hashes(second.all_token_ids)
    again = memo_request(manager, "c", prompt)
    assert list(again.block_hashes) == list(first.block_hashes) == plain_hashes(prompt)


def test_the_memo_adopts_the_cached_prefix_and_hashes_only_the_rest() -> None:
    calls: list[int] = []

    def counting(tokens, block_size, *, start_block, parent_hash, cache_salt):  # type: ignore[no-untyped-def]
        calls.append(start_block)
        return hash_full_blocks_torch(
            tokens, block_size, start_block=start_block, parent_hash=parent_hash,
            cache_salt=cache_salt,
        )  # fmt: skip

    manager = TorchKVCacheManager(config(), 64)
    manager.block_hasher.hasher = counting
    prompt = list(range(40))  # 10 blocks
    admit(manager, memo_request(manager, "a", prompt))
    assert calls == [0]
    follower = memo_request(manager, "b", prompt[:24] + [1] * 8)
    assert calls == [0, 6]  # blocks 0-5 adopted, 6 and 7 hashed
    assert list(follower.block_hashes) == plain_hashes(follower.all_token_ids)


def test_a_prompt_continuing_a_decoding_request_adopts_its_output_blocks_too() -> None:
    calls: list[int] = []

    def counting(tokens, block_size, *, start_block, parent_hash, cache_salt):  # type: ignore[no-untyped-def]
        calls.append(start_block)
        return hash_full_blocks_torch(
            tokens, block_size, start_block=start_block, parent_hash=parent_hash,
            cache_salt=cache_salt,
        )  # fmt: skip

    manager = TorchKVCacheManager(config(), 64)
    manager.block_hasher.hasher = counting
    first = memo_request(manager, "a", list(range(100, 110)))  # 2 full blocks
    admit(manager, first)
    first.num_computed_tokens = first.num_tokens
    first.append_output_token_ids([7, 8, 9, 10, 11, 12])  # fills blocks 2 and 3
    assert len(first.block_hashes) == 4
    assert calls == [0, 2]
    turn = [*first.all_token_ids, 40, 41, 42, 43]
    second = memo_request(manager, "b", turn)
    assert calls == [0, 2, 4]  # its first 4 blocks adopted, the source's run grew with it
    assert list(second.block_hashes) == plain_hashes(turn)


def test_salted_requests_adopt_only_their_own_salts_hashes() -> None:
    manager = TorchKVCacheManager(config(), 64)
    prompt = list(range(16))
    admit(manager, memo_request(manager, "a", prompt, salt="s1"))
    for rid, salt in (("b", "s1"), ("c", "s2"), ("d", None)):
        request = memo_request(manager, rid, prompt, salt=salt)
        assert list(request.block_hashes) == plain_hashes(prompt, salt)


def test_a_source_leaves_the_memo_with_its_last_cached_block_and_hashes_stay_exact() -> None:
    manager = TorchKVCacheManager(config(num_blocks=17), 64)  # 16 usable blocks
    memo = manager.block_hasher
    first = memo_request(manager, "a", list(range(32)))  # 8 blocks per group: all 16
    admit(manager, first)
    manager.free(first)
    assert len(memo.registered) == len(memo) == 1
    other = memo_request(manager, "b", list(range(500, 516)))  # 4 blocks per group: evicts 8
    admit(manager, other)
    manager.free(other)
    assert cached_blocks(manager) == 16
    assert len(memo.registered) == len(memo) == 2  # "a" keeps 8 cached blocks
    assert_memo_bounded(manager)
    last = memo_request(manager, "c", list(range(900, 932)))  # all 16 blocks: evicts the rest
    admit(manager, last)
    assert sources_with_cached_blocks(manager) == set(memo.registered)
    assert len(memo.registered) == len(memo) == 1
    assert_memo_bounded(manager)
    again = memo_request(manager, "d", list(range(32)))
    assert list(again.block_hashes) == plain_hashes(list(range(32)))


def test_a_reset_prefix_cache_empties_the_memo() -> None:
    manager = TorchKVCacheManager(config(), 64)
    first = memo_request(manager, "a", list(range(20)))
    admit(manager, first)
    manager.free(first)
    assert len(manager.block_hasher) == 1
    assert manager.reset_prefix_cache()
    assert len(manager.block_hasher) == 0
    assert not manager.block_hasher.registered
    again = memo_request(manager, "b", list(range(20)))
    assert list(again.block_hashes) == plain_hashes(list(range(20)))


def test_requests_hashed_by_another_named_function_never_fill_the_memo() -> None:
    manager = TorchKVCacheManager(config(), 64)
    named = Request("a", list(range(20)), hash_block_size=B, block_hasher=hash_full_blocks)
    admit(manager, named)
    assert named.block_hasher is hash_full_blocks
    assert len(manager.block_hasher) == 0


def test_a_request_built_without_a_hasher_takes_the_memo_of_the_manager_it_meets() -> None:
    """The obvious ``Request(rid, tokens, hash_block_size=B)`` is on the fast path: the
    manager offers its memo at the lookup, the first request fills it, the next adopts."""
    manager = TorchKVCacheManager(config(), 64)
    first = Request("a", list(range(20)), hash_block_size=B)
    assert first.block_hasher is hash_full_blocks  # until a manager offers its own
    admit(manager, first)
    assert first.block_hasher is manager.block_hasher
    assert len(manager.block_hasher) == 1
    second = Request("b", [*range(16), 99, 98, 97, 96], hash_block_size=B)
    _, hit, _ = manager.get_computed_blocks(second)
    assert second.block_hasher is manager.block_hasher
    assert hit == 16
    assert list(second.block_hashes) == plain_hashes([*range(16), 99, 98, 97, 96])


def test_a_request_whose_hashes_were_read_keeps_the_default_hasher() -> None:
    """Hashes already computed are not recomputed by a later offer: the request keeps
    ``hash_full_blocks`` (same hashes) and the memo does not learn its prompt."""
    manager = TorchKVCacheManager(config(), 64)
    read = Request("a", list(range(20)), hash_block_size=B)
    assert list(read.block_hashes) == plain_hashes(list(range(20)))
    admit(manager, read)
    assert read.block_hasher is hash_full_blocks
    assert len(manager.block_hasher) == 0


def test_a_memo_request_still_misses_a_colliding_cached_prompt() -> None:
    """A prompt cached by a request whose hasher collides everything is not adopted by a memo
    request, and lookups with the memo's hashes are still verified against cached tokens."""

    def constant(tokens, block_size, *, start_block, parent_hash, cache_salt):  # type: ignore[no-untyped-def]
        return [b"\x01" * 32] * (len(tokens) // block_size - start_block)

    manager = TorchKVCacheManager(config(), 64)
    admit(manager, Request("a", list(range(20)), hash_block_size=B, block_hasher=constant))
    probe = memo_request(manager, "b", list(range(50, 70)))
    assert list(probe.block_hashes) == plain_hashes(list(range(50, 70)))
    _, hit, _ = manager.get_computed_blocks(probe)
    assert hit == 0


def test_the_memo_remembers_which_ids_it_compared_for_the_last_prompt_only() -> None:
    """The walk compared the prompt's ids with its first source's: ``agreed_blocks`` says how
    many blocks, for that prompt's packed ids and that source only, and for nothing after the
    next prompt's walk or a reset."""
    manager = TorchKVCacheManager(config(), 64)
    first = memo_request(manager, "a", list(range(20)))
    admit(manager, first)
    memo, source = manager.block_hasher, manager.pool.sources[0]
    assert source is not None
    probe = memo_request(manager, "b", [*range(12), 99, 98, 97, 96, 5, 5])
    ids = probe.packed_token_ids
    assert ids is not None
    assert memo.agreed_blocks(ids, source) == 3  # blocks 0-2 equal, block 3 differs
    assert memo.agreed_blocks(array("Q", ids), source) == 0  # equal ids, another array
    assert memo.agreed_blocks(ids, object()) == 0
    memo_request(manager, "c", list(range(8)))
    assert memo.agreed_blocks(ids, source) == 0  # another prompt walked since
    again = memo_request(manager, "d", list(range(20)))
    assert memo.agreed_blocks(again.packed_token_ids, source) == 5
    manager.free(first)
    assert manager.reset_prefix_cache()
    assert memo.agreed_blocks(again.packed_token_ids, source) == 0


def test_a_lookup_right_after_the_memo_hashed_the_prompt_compares_no_id_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The default request's lookup: the memo compares the prompt with the cached one when it
    hashes it, and the verification that follows trusts that comparison (and no hash alone):
    the same hit, no second comparison; a prompt that parts after block 2 still hits 3 blocks
    and compares only past them."""
    from hybridkv.optimized import verification

    compared: list[tuple[int, int]] = []
    first_difference = verification.first_difference

    def counted(ours: Sequence[int], theirs: Sequence[int], lo: int, hi: int) -> int:
        compared.append((lo, hi))
        return first_difference(ours, theirs, lo, hi)

    monkeypatch.setattr(verification, "first_difference", counted)
    monkeypatch.setattr(verification, "same_items", lambda a, b: pytest.fail("compared"))
    manager = TorchKVCacheManager(config(), 64)
    admit(manager, Request("a", list(range(21)), hash_block_size=B))
    _, hit, _ = manager.get_computed_blocks(Request("b", list(range(21)), hash_block_size=B))
    assert (hit, compared) == (20, [])
    parted = [*range(12), 99, 98, 97, 96, 16, 17, 18, 19, 20]
    _, hit, _ = manager.get_computed_blocks(Request("c", parted, hash_block_size=B))
    assert hit == 12
    assert all(lo >= 12 for lo, _ in compared)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    steps=st.lists(
        st.tuples(st.integers(0, 3), st.integers(1, 30), st.sampled_from([None, "x"])),
        min_size=1,
        max_size=12,
    ),
)
def test_memo_hashes_equal_the_definition_and_the_memo_stays_bounded(
    seed: int, steps: list[tuple[int, int, str | None]]
) -> None:
    """Admissions, frees and evictions in a small pool: every request's hashes equal the
    definition's, results equal the reference's, and the memo never outgrows the cache."""
    rng = random.Random(seed)
    bases = [[rng.randrange(6) for _ in range(40)] for _ in range(4)]
    manager = TorchKVCacheManager(config(num_blocks=25), 64)
    reference = KVCacheManager(config(num_blocks=25), 64)
    live: list[tuple[Request, Request]] = []
    for index, (base, length, salt) in enumerate(steps):
        tokens = bases[base][:length]
        ours = memo_request(manager, f"r{index}", tokens, salt)
        theirs = Request(f"r{index}", tokens, hash_block_size=B, cache_salt=salt)
        assert list(ours.block_hashes) == list(theirs.block_hashes) == plain_hashes(tokens, salt)
        got = manager.get_computed_blocks(ours)
        want = reference.get_computed_blocks(theirs)
        assert got == want
        out = manager.allocate_slots(ours, ours.num_tokens - got[1], got[1], got[0])
        expected = reference.allocate_slots(theirs, theirs.num_tokens - want[1], want[1], want[0])
        assert out == expected
        if out is not None:
            live.append((ours, theirs))
        if len(live) > 2 or (live and rng.random() < 0.5):
            a, b = live.pop(0)
            manager.free(a)
            reference.free(b)
        assert_memo_bounded(manager)
        assert len(manager.block_hasher.registered) <= cached_blocks(manager)
        manager.check_invariants()


def test_the_memo_alone_hashes_as_the_torch_hasher() -> None:
    memo = HashMemo(B)
    tokens = [5, 2**32 + 1, 3, 4, 1, 2, 3, 4]
    got = memo(tokens, B, start_block=0, parent_hash=None, cache_salt=None)
    assert got == hash_full_blocks_torch(
        tokens, B, start_block=0, parent_hash=None, cache_salt=None
    )


@pytest.mark.parametrize("bad", [-1, 2**32, "7"])
def test_a_memo_request_with_ids_the_memo_cannot_pack_hashes_from_scratch(bad: object) -> None:
    manager = TorchKVCacheManager(config(), 64)
    admit(manager, memo_request(manager, "a", list(range(8))))
    tokens: list[object] = [0, 1, 2, 3, bad, 5, 6, 7]
    if bad == -1 or bad == "7":
        with pytest.raises(ValueError, match="prompt_token_ids"):
            memo_request(manager, "b", tokens)  # type: ignore[arg-type]
        return
    request = memo_request(manager, "b", tokens)  # type: ignore[arg-type]
    assert list(request.block_hashes) == plain_hashes(tokens)  # type: ignore[arg-type]


# --- The memo's tree, on sources made by hand ------------------------------------------------


@dataclass
class HandSource:
    """A memo source as the pool holds one: a request's hashes, packed ids and salt."""

    tokens: list[int]
    salt: str | None = None
    hashes: list[BlockHash] = field(init=False)
    packed: array[int] | None = field(init=False)

    def __post_init__(self) -> None:
        self.hashes = list(
            hash_full_blocks(self.tokens, B, start_block=0, parent_hash=None, cache_salt=self.salt)
        )
        self.packed = array("Q", self.tokens)


class CountingHasher:
    """``hash_full_blocks_torch``, recording the block each call starts at."""

    def __init__(self) -> None:
        self.starts: list[int] = []

    def __call__(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        self.starts.append(start_block)
        return hash_full_blocks_torch(
            token_ids,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )


def adopted_blocks(memo: HashMemo, tokens: list[int], salt: str | None = None) -> int:
    """How many blocks of a prompt the memo adopts (checking the hashes on the way)."""
    counter = CountingHasher()
    memo.hasher = counter
    got = memo(tokens, B, start_block=0, parent_hash=None, cache_salt=salt)
    assert got == plain_hashes(tokens, salt)
    return counter.starts[0] if counter.starts else len(tokens) // B


P = list(range(1000, 1016))  # 4 shared blocks
X, Y, Z = list(range(10, 18)), list(range(20, 28)), list(range(30, 38))  # 2 blocks each


def test_a_prompt_adopts_along_the_branches_of_two_cached_prompts() -> None:
    memo = HashMemo(B)
    memo.remember(0, HandSource(P + X))
    memo.remember(1, HandSource(P + Y + Z))  # branches off "P + X" after P
    assert len(memo) == 2
    parent = BlockHash(plain_hashes(P)[-1])
    assert memo.branches[(parent, array("Q", Y[:B]).tobytes(), None)].start == 4
    assert adopted_blocks(memo, P + Y + X) == 6  # P from source 0, Y from source 1
    assert adopted_blocks(memo, P + X + Z) == 6
    assert adopted_blocks(memo, P[:8] + Z) == 2
    assert adopted_blocks(memo, Z + P) == 0
    memo.check_invariants()


def tree_shape(memo: HashMemo) -> dict[object, tuple[int, int, object]]:
    """Each branch's key → its source index, start and parent's key."""
    return {
        key: (b.src, b.start, None if b.parent is None else b.parent.key)
        for key, b in memo.branches.items()
    }


@pytest.mark.parametrize("grows", [False, True])
def test_registering_the_prompt_the_memo_just_walked_adds_the_branch_a_new_walk_would(
    grows: bool,
) -> None:
    """``remember`` of the request whose prompt the memo just hashed takes that walk's end
    instead of walking again, unless a source's length decided it: here source 0 holds P
    alone when the prompt P + X + Y is hashed, then grows by X, so P + X + Y now continues it
    for six blocks and branches off at block 6, not at 4 (where a source P + X + Z, as long
    as the prompt, has it branch off at 6 at once)."""
    memo, fresh = HashMemo(B), HashMemo(B)
    first = P if grows else P + X + Z
    sources = [HandSource(list(first)), HandSource(list(first))]
    memo.remember(0, sources[0])
    fresh.remember(0, sources[1])
    ours = HandSource(P + X + Y)
    assert ours.packed is not None
    memo.hash_packed(ours.tokens, ours.packed, B, start_block=0, parent_hash=None, cache_salt=None)
    assert (memo.last_walk is None) is grows
    if grows:
        for source in sources:  # as a decoding request's lists grow in place
            grown = HandSource(P + X)
            source.tokens[:], source.hashes[:] = grown.tokens, grown.hashes
            assert source.packed is not None
            assert grown.packed is not None
            source.packed.extend(grown.packed[len(source.packed) :])
    walks: list[int] = []
    walk = memo.walk

    def counted(*args: Any) -> Any:
        walks.append(1)
        return walk(*args)

    memo.walk = counted  # type: ignore[method-assign,assignment]
    memo.remember(1, ours)
    fresh.remember(1, HandSource(P + X + Y))
    assert len(walks) == (1 if grows else 0)
    assert tree_shape(memo) == tree_shape(fresh)
    assert [b.start for b in memo.branches.values()] == [0, 6]
    memo.check_invariants()


def test_a_prompt_whose_hashes_lie_on_the_tree_adds_no_branch() -> None:
    memo = HashMemo(B)
    memo.remember(0, HandSource(P + X))
    memo.remember(1, HandSource(P))
    memo.remember(1, HandSource(P))  # registered once per index and source
    assert len(memo) == 1
    assert len(memo.registered) == 2
    memo.check_invariants()


def test_a_forgotten_branch_passes_to_the_child_that_leaves_it_last() -> None:
    memo = HashMemo(B)
    memo.remember(0, HandSource(P + X + Z))
    memo.remember(1, HandSource(P + Y))  # off source 0 after block 4
    memo.remember(2, HandSource(P + X + Y))  # off source 0 after block 6
    memo.forget(0)
    assert len(memo) == 2
    assert set(memo.registered) == {1, 2}
    root = memo.branches[(None, array("Q", P[:B]).tobytes(), None)]
    assert root.src == 2
    assert {child.src for child in root.children} == {1}
    assert adopted_blocks(memo, P + Y) == 6
    assert adopted_blocks(memo, P + X + Y) == 8
    assert adopted_blocks(memo, P + X + Z) == 6  # source 0's last blocks left with it
    memo.forget(2)
    assert adopted_blocks(memo, P + Y) == 6
    assert len(memo) == 1
    memo.forget(1)
    assert len(memo) == 0
    assert not memo.registered
    memo.check_invariants()


def test_salted_and_unsalted_prompts_have_separate_roots() -> None:
    memo = HashMemo(B)
    memo.remember(0, HandSource(P, salt="s"))
    assert adopted_blocks(memo, P) == 0
    assert adopted_blocks(memo, P, salt="t") == 0
    assert adopted_blocks(memo, P, salt="s") == 4
    memo.remember(1, HandSource(P, salt=""))  # an empty salt is none, as in the hash
    assert adopted_blocks(memo, P) == 4


def test_a_source_whose_ids_changed_form_stops_the_walk() -> None:
    memo = HashMemo(B)
    source = HandSource(P + X)
    memo.remember(0, source)
    source.packed = None  # as a request whose later id did not fit 64 bits
    assert adopted_blocks(memo, P + X) == 0


def test_the_first_difference_is_found_wherever_it_is() -> None:
    ours = array("Q", range(64))
    for first in range(16):
        theirs = array("Q", ours)
        theirs[first * 4 + 2] += 1
        for hint in (-1, 3, first, first + 1, 15):
            found = agreeing_blocks(ours, theirs, 4, 0, 16, hint)
            assert found == first
    assert agreeing_blocks(ours, array("Q", ours), 4, 2, 16, 9) == 16


PIECES = [list(range(50, 54)), list(range(60, 64)), list(range(70, 74))]  # one block each


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["remember", "remember", "forget", "ask", "ask"]),
            st.integers(0, 4),
            st.tuples(
                st.sampled_from([[0], [0, 1], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1]]),
                st.lists(st.integers(0, 2), max_size=4),
            ).map(lambda stem_rest: [*stem_rest[0], *stem_rest[1]]),
            st.sampled_from([None, None, "s"]),
        ),
        max_size=40,
    )
)
def test_the_memo_equals_the_definition_and_keeps_its_tree(
    ops: list[tuple[str, int, list[int], str | None]],
) -> None:
    """Random sources (prompts made of three blocks, so that they share prefixes) register
    and leave (or are replaced under their index); every prompt's hashes equal the
    definition's, the tree stays consistent, and while no source has left a prompt adopts its
    longest common prefix with any source."""
    memo = HashMemo(B)
    sources: dict[int, HandSource] = {}
    forgotten = False
    for op, index, pieces, salt in ops:
        tokens = [t for piece in pieces for t in PIECES[piece]]
        if op == "remember":
            source = HandSource(tokens, salt)
            memo.remember(index, source)
            # Another source under a registered index: the one it replaces has left (the pool
            # forgets an index before reusing it; a source whose blocks lay on the leaver's
            # run is then found no more, and hashes them itself).
            forgotten |= index in sources
            sources[index] = source
        elif op == "forget":
            memo.forget(index)
            forgotten |= sources.pop(index, None) is not None
        else:
            adopted = adopted_blocks(memo, tokens, salt)
            longest = 0
            for source in sources.values():
                if source.salt != salt:
                    continue
                common = 0
                while (
                    common < min(len(tokens), len(source.tokens)) // B
                    and tokens[common * B : (common + 1) * B]
                    == source.tokens[common * B : (common + 1) * B]
                ):
                    common += 1
                longest = max(longest, common)
            assert adopted <= longest
            if not forgotten:
                assert adopted == longest
        memo.check_invariants()
        assert set(memo.registered) == set(sources)


@pytest.mark.parametrize("memcmp", [True, False], ids=["memcmp", "portable"])
@pytest.mark.parametrize("first", [0, 1, 1023, 1024, 2047, 4095, 4096])
def test_the_first_difference_is_found_in_long_prompts_by_either_comparison(
    first: int, memcmp: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Long ranges compare with ``memcmp``, or without it by numpy views from
    ``NUMPY_COMPARE_MIN`` ids; the answer is the same."""
    if not memcmp:
        monkeypatch.setattr(same_ids_module, "C_MEMCMP", None)
    elif same_ids_module.C_MEMCMP is None:
        pytest.skip("ctypes finds no memcmp in this C library")
    blocks = 4097  # 65,552 ids at 16 per block: ranges on both sides of the thresholds
    ours = array("Q", range(blocks * 16))
    theirs = array("Q", ours)
    theirs[first * 16 + 15] = 2**64 - 1
    assert blocks * 16 >= NUMPY_COMPARE_MIN
    for hint in (-1, 300, first, first + 1, blocks - 1):
        found = agreeing_blocks(ours, theirs, 16, 0, blocks, hint)
        assert found == first
    assert agreeing_blocks(ours, theirs, 16, first + 1, blocks) == blocks
