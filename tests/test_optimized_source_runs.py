"""A long cache hit is read from its sources' runs of blocks, and equals the reference's.

The optimized lookup reads the blocks a source (the request that cached them) recorded per
position (evicting a block clears its entry), drops the unrecorded and duplicate entries in a
few numpy calls, and verifies the source once for the whole run (``Lookup.source_run``, and
``lead_run`` for every attention type at once). It must find exactly the
blocks the reference finds: the first-inserted block of each key, also when a prompt was
computed twice at once (duplicate entries), when a hit spans several sources, and when blocks
in the middle of a run were evicted.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.block_pool import TorchBlockPool, hash_key
from hybridkv.optimized.lookup import Ints, Lookup, TypeProbe, lead_run
from hybridkv.optimized.state import Tuning
from hybridkv.reference import KVCacheManager
from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec


@pytest.fixture(
    autouse=True, params=["vector", "arrays", "vector, types apart", "arrays, types apart"]
)
def run_checks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test four ways: runs checked in numpy calls or on the array views, and a hybrid's
    leading run read for all its types at once (``lead_run``) or by each type's own scan."""
    limit = 0 if request.param.startswith("vector") else 1 << 30
    monkeypatch.setattr("hybridkv.optimized.source_runs.RUN_SCALAR_MAX", limit)
    if request.param.endswith("types apart"):
        monkeypatch.setattr("hybridkv.optimized.type_probe.LEAD_RUN_MAX", 0)


SIZES = {"block_size": 4, "num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
HYBRID = (
    KVCacheGroup(("full",), FullAttentionSpec(**SIZES)),
    KVCacheGroup(("sw.0",), SlidingWindowSpec(sliding_window=8, **SIZES)),
    KVCacheGroup(("sw.1",), SlidingWindowSpec(sliding_window=8, **SIZES)),
)


def managers(
    num_blocks: int, *, memo_hits: bool = True
) -> tuple[TorchKVCacheManager, KVCacheManager]:
    """The optimized manager (``memo_hits=False``: every lookup takes the general path, whose
    runs a test counts) and the reference, on one config."""
    config = KVCacheConfig(num_blocks, HYBRID)
    tuning = Tuning(memo_hits=memo_hits)
    return TorchKVCacheManager(config, 4096, tuning=tuning), KVCacheManager(config, 4096)


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, hash_block_size=4)


@contextmanager
def runs_read(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The widths of the runs read while the block is active: a leading run read for all types
    at once (``lead_run``, its full-attention width), then those ``source_run`` returns."""
    widths: list[int] = []
    original_run = Lookup.source_run

    def spy(
        self: Lookup, lo: int, hi: int, group_ids: list[int], first: int | None = None
    ) -> Ints | None:
        run = original_run(self, lo, hi, group_ids, first)
        if run is not None:
            widths.append(run.shape[1])
        return run

    def lead_spy(memos: list[TypeProbe]) -> list[int]:
        counts = lead_run(memos)
        if counts[0]:
            widths.append(counts[0])
        return counts

    with monkeypatch.context() as patch:
        patch.setattr(Lookup, "source_run", spy)
        patch.setattr("hybridkv.optimized.hits.lead_run", lead_spy)
        yield widths


def same_hit(opt: TorchKVCacheManager, ref: KVCacheManager, tokens: list[int], rid: str) -> int:
    """Look the prompt up on both; assert equal results; return the hit length."""
    got = opt.get_computed_blocks(request(rid, tokens))
    want = ref.get_computed_blocks(request(rid, tokens))
    assert got == want
    opt.check_invariants()
    return got[1]


def cache_and_free(opt: TorchKVCacheManager, ref: KVCacheManager, tokens: list[int]) -> None:
    """Compute the prompt once on both managers and free it: its blocks stay cached."""
    for manager in (opt, ref):
        first = request("a", tokens)
        assert manager.allocate_slots(first, len(tokens)) is not None
        manager.free(first)


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(length)]


def test_a_long_cached_prompt_is_read_as_one_run_with_the_references_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opt, ref = managers(400, memo_hits=False)
    tokens = prompt(1, 401)
    cache_and_free(opt, ref, tokens)
    with runs_read(monkeypatch) as widths:
        assert same_hit(opt, ref, tokens, "b") == 400
    assert widths[0] == 100  # the full-attention group: every block in one run


def test_a_prompt_computed_twice_at_once_hits_the_first_inserted_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests with one prompt computed in the same step cache the same keys twice; the
    later entries are marked, and a run never returns them."""
    opt, ref = managers(600)
    tokens = prompt(2, 201)
    for manager in (opt, ref):
        for rid in ("a", "b"):  # neither looks up: both compute every block
            assert manager.allocate_slots(request(rid, tokens), 201) is not None
    later = set(opt.get_block_ids("b")[0]) | set(opt.get_block_ids("b")[1])
    opt.pool.settle_duplicates()  # what a lookup does first
    assert later & opt.pool.dups  # b's entries repeat a's keys
    with runs_read(monkeypatch):
        assert same_hit(opt, ref, tokens, "c") == 200
    for manager in (opt, ref):
        manager.free(request("a", tokens))  # a's blocks go to the free queue, b's stay held
        manager.free(request("b", tokens))
    assert same_hit(opt, ref, tokens, "d") == 200
    # Evict some of a's blocks (the first-inserted entries): b's may be found from then on.
    for manager in (opt, ref):
        assert manager.allocate_slots(request("e", prompt(3, 420)), 420) is not None
    same_hit(opt, ref, tokens, "f")


def test_a_hit_that_spans_two_sources_is_read_as_two_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b hits a's first 200 tokens and caches its own after them: a lookup of b's prompt reads
    a run from a's source, then one from b's."""
    opt, ref = managers(600)
    head, tail = prompt(4, 200), prompt(5, 201)
    for manager in (opt, ref):
        a = request("a", [*head, 7])
        assert manager.allocate_slots(a, 201) is not None
        manager.free(a)
        b = request("b", head + tail)
        blocks, hit, _ = manager.get_computed_blocks(b)
        assert hit == 200
        assert manager.allocate_slots(b, 201, hit, blocks) is not None
        manager.free(b)
    with runs_read(monkeypatch) as widths:
        assert same_hit(opt, ref, head + tail, "c") == 400
    assert widths[:2] == [50, 50]


def test_blocks_evicted_from_a_run_end_the_hit_where_the_references_does() -> None:
    opt, ref = managers(330)
    tokens = prompt(6, 401)
    cache_and_free(opt, ref, tokens)
    hits = []
    for size in (8, 40, 120):  # each takes blocks from the free queue's head
        for manager in (opt, ref):
            assert manager.allocate_slots(request(f"x{size}", prompt(size, size)), size)
        hits.append(same_hit(opt, ref, tokens, f"p{size}"))
    assert hits == sorted(hits, reverse=True)
    assert hits[-1] < 400


def test_a_repeated_key_in_one_batch_insert_is_marked_duplicate() -> None:
    pool = TorchBlockPool(16, 1, enable_caching=True)
    src = pool.new_source([1, 2, 3, 4], [BlockHash(b"\x01" * 32)], None)
    blocks = np.array([3, 5], dtype=np.int64)
    keys = np.full(2, hash_key(b"\x01" * 32), dtype=np.int64)
    zeros = np.zeros(2, dtype=np.int64)
    pool.insert_array(blocks, zeros, zeros, keys, src)
    pool.settle_duplicates()
    assert pool.dups == {5}
    pool.check_invariants()
    pool.evict(5)
    assert pool.dups == set()
    pool.check_invariants()


def test_packed_token_ids_follow_the_tokens_and_a_huge_id_drops_them() -> None:
    r = Request("r", [1, 2, 3], hash_block_size=2)
    r.append_output_token_ids([4, 5])
    assert r.packed_token_ids is not None
    assert r.packed_token_ids.tolist() == list(r.all_token_ids) == [1, 2, 3, 4, 5]
    r.append_output_token_ids(1 << 64)
    packed: object = r.packed_token_ids
    assert packed is None
    assert list(r.all_token_ids) == [1, 2, 3, 4, 5, 1 << 64]


def test_lookups_of_requests_without_packed_tokens_match_the_reference() -> None:
    """A request holding an id of 2**64 or more keeps no packed tokens: verification compares
    its token lists, with the same result."""
    opt, ref = managers(300)
    tokens = [*prompt(7, 160), 1 << 64, *prompt(8, 40)]
    cache_and_free(opt, ref, tokens)
    assert same_hit(opt, ref, tokens, "b") == 200
    assert same_hit(opt, ref, [*tokens[:-41], 5, *tokens[-40:]], "c") == 160


def test_blocks_cached_without_lookups_are_settled_in_bounded_batches(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long run of steps without a lookup checks its cached blocks for duplicates every
    ``SETTLE_MAX`` of them, so the waiting list stays short and the marks are still made."""
    monkeypatch.setattr("hybridkv.optimized.prefix_cache.SETTLE_MAX", 8)
    monkeypatch.setattr("hybridkv.optimized.bulk_inserts.SETTLE_MAX", 8)
    opt, ref = managers(600)
    tokens = prompt(9, 41)
    for manager in (opt, ref):
        for rid in ("a", "b"):  # the same prompt computed twice: b's entries are duplicates
            r = request(rid, tokens)
            assert manager.allocate_slots(r, 41) is not None
            r.num_computed_tokens = 41
            for step in range(24):  # decode steps cache a block now and then, one by one
                r.append_output_token_ids(step)
                assert manager.allocate_slots(r, 1) is not None
                r.num_computed_tokens += 1
    assert len(opt.pool.unsettled) < 8
    assert set(opt.get_block_ids("b")[0][:10]) <= opt.pool.dups | set(opt.pool.unsettled)
    opt.check_invariants()
    assert same_hit(opt, ref, tokens, "c") == 40
