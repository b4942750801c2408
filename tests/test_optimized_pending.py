"""Running steps' deferred pool work (``hybridkv.optimized.pending``) is made before anything
reads it.

A running request's ``allocate_slots`` leaves its window releases and its newly full blocks'
inserts pending; every other call must see them made. Each test drives the optimized backend
and the reference with the same calls, checks that work is indeed pending at the point that
matters, then compares what the next call returns and the pool's state. Both sizes of the
pool's passes run: the array loop and the numpy calls (``Tuning.insert_min`` and
``pending_min`` lowered to 1).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np
import pytest

from hybridkv.optimized import TorchKVCacheManager, bulk_inserts
from hybridkv.optimized import step as optimized_step
from hybridkv.optimized.hashing import hash_full_blocks_torch
from hybridkv.optimized.pending import PendingInserts
from hybridkv.optimized.state import Tuning
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}


@pytest.fixture(params=["arrays", "numpy"], autouse=True)
def pool_pass(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.param == "numpy":
        # Every pair's manager takes the numpy calls from one block on; the settle bound too.
        monkeypatch.setattr(Pair, "tuning", Tuning(insert_min=1, pending_min=1))
        monkeypatch.setattr(bulk_inserts, "INSERT_MIN", 1)


class Pair:
    """The reference and the optimized backend, driven with the same calls."""

    tuning = Tuning()

    def __init__(self, num_blocks: int, block_size: int = 2, window: int = 4) -> None:
        full = FullAttentionSpec(block_size=block_size, **SIZES)
        sliding = SlidingWindowSpec(block_size=block_size, sliding_window=window, **SIZES)
        groups = (KVCacheGroup(("full",), full), KVCacheGroup(("sw",), sliding))
        config = KVCacheConfig(num_blocks, groups)
        self.ref = KVCacheManager(config, 64)
        self.opt = TorchKVCacheManager(config, 64, max_num_reqs=8, tuning=self.tuning)
        self.requests: dict[str, tuple[Request, Request]] = {}

    def add(self, request_id: str, prompt: list[int], memo: bool = False) -> None:
        size = self.ref.hash_block_size
        opt_request = (
            Request(
                request_id, list(prompt), hash_block_size=size, block_hasher=self.opt.block_hasher
            )
            if memo
            else Request(request_id, list(prompt), hash_block_size=size)
        )
        self.requests[request_id] = (Request(request_id, prompt, hash_block_size=size), opt_request)

    def admit(self, request_id: str) -> KVCacheBlocks | None:
        """Look the request up and allocate the rest of its prompt, as a scheduler does."""
        ref_req, opt_req = self.requests[request_id]
        found = self.opt.get_computed_blocks(opt_req)
        assert found == self.ref.get_computed_blocks(ref_req)
        blocks, hit, _ = found
        n = ref_req.num_tokens - hit
        new = self.opt.allocate_slots(opt_req, n, hit, blocks)
        assert new == self.ref.allocate_slots(ref_req, n, hit, blocks)
        if new is not None:
            for r in (ref_req, opt_req):
                r.num_computed_tokens = r.num_tokens
        return new

    def decode(self, request_id: str, token: int) -> KVCacheBlocks | None:
        """One decode step of a running request, without ``new_step_starts``."""
        ref_req, opt_req = self.requests[request_id]
        for r in (ref_req, opt_req):
            r.append_output_token_ids(token)
        new = self.opt.allocate_slots(opt_req, 1)
        assert new == self.ref.allocate_slots(ref_req, 1)
        if new is not None:
            for r in (ref_req, opt_req):
                r.num_computed_tokens += 1
        return new

    def same_state(self) -> None:
        assert self.opt.snapshot() == self.ref.snapshot()
        assert self.opt.num_free_blocks == self.ref.num_free_blocks
        for request_id in self.requests:
            assert self.opt.get_block_ids(request_id) == self.ref.get_block_ids(request_id)
            assert self.opt.estimate_cached_tokens(request_id) == self.ref.estimate_cached_tokens(
                request_id
            )
        self.opt.check_invariants()


def test_a_lookup_sees_the_block_a_running_step_left_to_cache() -> None:
    pair = Pair(40)
    pair.add("a", [1, 2, 3, 4, 5])
    pair.admit("a")
    pair.decode("a", 6)  # fills block 2 (tokens 5, 6): its insert waits
    assert pair.opt.pool.pending.inserts
    pair.add("b", [1, 2, 3, 4, 5, 6, 9, 9])
    ref_req, opt_req = pair.requests["b"]
    found = pair.opt.get_computed_blocks(opt_req)
    assert found == pair.ref.get_computed_blocks(ref_req)
    assert found[1] == 6  # the three full blocks a holds, the pending one included
    pair.same_state()


def test_the_counters_count_the_blocks_a_running_step_released() -> None:
    pair = Pair(40)
    pair.add("a", list(range(1, 9)))  # 8 tokens: 4 blocks per group, window 4
    pair.admit("a")
    pair.decode("a", 9)  # the window moves past blocks 0 and 1: their releases wait
    assert pair.opt.pool.pending.released
    assert pair.opt.usage == pair.ref.usage
    assert pair.opt.num_free_blocks == pair.ref.num_free_blocks
    pair.same_state()


def test_an_admission_takes_the_blocks_a_pending_release_frees() -> None:
    # 13 blocks (12 usable): a holds 5 + 5 after its prompt and takes the last 2 in its first
    # step, which releases 3 window blocks (pending); b needs 2 of them.
    pair = Pair(13)
    pair.add("a", list(range(1, 11)))
    pair.admit("a")
    pair.decode("a", 11)
    assert pair.opt.pool.pending.released
    assert pair.ref.num_free_blocks == 3
    pair.add("b", [7, 7])
    assert pair.admit("b") is not None
    pair.same_state()


def test_a_running_step_takes_the_blocks_its_own_pending_release_frees() -> None:
    # 13 blocks (12 usable), all held by a and b: a's step releases 3 window blocks (pending)
    # and needs 2 new ones, which only those give.
    pair = Pair(13)
    pair.add("a", list(range(1, 11)))
    pair.add("b", [5, 5])
    pair.admit("a")
    pair.admit("b")
    assert pair.ref.num_free_blocks == 0
    assert pair.decode("a", 11) is not None
    pair.same_state()


def test_a_block_never_cached_is_released_to_the_head_at_once() -> None:
    # Steps that delay caching leave a's blocks uncached; the next step's window release puts
    # them at the head of the queue, which a deferred release would not do.
    pair = Pair(40)
    pair.add("a", list(range(1, 9)))
    ref_req, opt_req = pair.requests["a"]
    new = pair.opt.allocate_slots(opt_req, 8, delay_cache_blocks=True)
    assert new == pair.ref.allocate_slots(ref_req, 8, delay_cache_blocks=True)
    for r in (ref_req, opt_req):
        r.num_computed_tokens = 8
    pair.decode("a", 9)
    pair.same_state()


def test_freeing_a_request_makes_its_pending_inserts_first() -> None:
    pair = Pair(40)
    pair.add("a", [1, 2, 3])
    pair.admit("a")
    pair.decode("a", 4)  # block 1 full: pending
    assert pair.opt.pool.pending.inserts
    ref_req, opt_req = pair.requests["a"]
    pair.opt.free(opt_req)
    pair.ref.free(ref_req)
    del pair.requests["a"]
    pair.same_state()  # the freed cached blocks went to the tail, as in the reference


def test_a_window_releases_a_block_whose_insert_is_pending() -> None:
    # Block size 1, window 2: every step caches a block and releases the one cached a step
    # earlier, whose insert still waits.
    pair = Pair(40, block_size=1, window=2)
    pair.add("a", [1, 2, 3])
    pair.admit("a")
    for token in range(4, 12):
        pair.decode("a", token)
    pair.same_state()


def test_a_shared_window_block_goes_to_the_tail_at_its_last_release() -> None:
    # b adopts a's prompt as a hit; both windows later release the shared blocks, pending: each
    # becomes free at its second release.
    pair = Pair(60)
    prompt = list(range(1, 9))
    pair.add("a", prompt)
    pair.admit("a")
    pair.opt.new_step_starts()
    pair.ref.new_step_starts()
    pair.add("b", [*prompt, 50, 51])
    pair.admit("b")
    for token in range(20, 28):
        pair.decode("a", token)
        pair.decode("b", token + 100)
    assert pair.opt.pool.pending.released
    pair.same_state()


def test_cache_blocks_and_estimates_see_the_pending_inserts() -> None:
    pair = Pair(40)
    pair.add("a", [1, 2, 3, 4, 5])
    pair.admit("a")
    pair.decode("a", 6)
    assert pair.opt.pool.pending.inserts
    assert pair.opt.estimate_cached_tokens("a") == pair.ref.estimate_cached_tokens("a") == 6
    ref_req, opt_req = pair.requests["a"]
    pair.opt.cache_blocks(opt_req, 6)
    pair.ref.cache_blocks(ref_req, 6)
    pair.same_state()


def test_the_memo_adopts_a_pending_block_s_hash_at_once() -> None:
    # a's step fills block 2 (its insert waits); a follow-up built with the manager's hasher
    # right away adopts the hashes of blocks 0 to 2 and hashes only its own block 3.
    pair = Pair(40)
    pair.add("a", [1, 2, 3, 4, 5], memo=True)
    pair.admit("a")
    pair.decode("a", 6)
    assert pair.opt.pool.pending.inserts
    memo = pair.opt.block_hasher
    starts: list[int] = []

    def counting(
        token_ids: Sequence[int],
        block_size: int,
        *,
        start_block: int,
        parent_hash: BlockHash | None,
        cache_salt: str | None,
    ) -> list[BlockHash]:
        starts.append(start_block)
        return hash_full_blocks_torch(
            token_ids,
            block_size,
            start_block=start_block,
            parent_hash=parent_hash,
            cache_salt=cache_salt,
        )

    memo.hasher = counting
    prompt = [1, 2, 3, 4, 5, 6, 9, 9]
    follow_up = Request("b", prompt, hash_block_size=2, block_hasher=memo)
    assert starts == [3]
    assert list(follow_up.block_hashes) == list(
        Request("b", prompt, hash_block_size=2).block_hashes
    )
    pair.same_state()


def test_pending_work_waits_for_at_most_pending_max(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(optimized_step, "PENDING_MAX", 4)
    pair = Pair(80, block_size=1, window=2)
    pair.add("a", [1, 2, 3])
    pair.admit("a")
    for token in range(4, 30):
        pair.decode("a", token)
        assert len(pair.opt.pool.pending) < 4
    pair.same_state()


def test_new_step_starts_makes_the_previous_step_s_work() -> None:
    pair = Pair(40)
    pair.add("a", list(range(1, 9)))
    pair.admit("a")
    pair.decode("a", 9)
    assert pair.opt.pool.pending
    pair.opt.new_step_starts()
    assert not pair.opt.pool.pending
    pair.same_state()


def test_add_rows_appends_what_add_appends_row_by_row() -> None:
    """A whole step's decode rows appended at once (``PendingInserts.add_rows``) leave the
    columns exactly as one ``add`` per row, in row order."""
    group_ids = array("q", [0, 1, 2])
    rows = [[11, 12, 13], [21, 22, 23]]
    hashes = [BlockHash(b"\x01" * 32), BlockHash(b"\x02" * 32)]
    one_by_one, at_once = PendingInserts(), PendingInserts()
    for blocks, pos, block_hash, src in zip(rows, [4, 9], hashes, [3, 5], strict=True):
        one_by_one.add(blocks, group_ids, pos, block_hash, src)
    at_once.add_rows(np.array(rows, dtype=np.int32), group_ids, [4, 9], hashes, [3, 5])
    for column in ("blocks", "groups", "positions", "sources", "counts", "hashes"):
        assert getattr(at_once, column) == getattr(one_by_one, column), column
    assert list(at_once.blocks) == [11, 12, 13, 21, 22, 23]
    assert list(at_once.counts) == [3, 3]
