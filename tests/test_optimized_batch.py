"""The optimized backend's own API: whole-step batches, block-table tensors, capacity limits.

``allocate_slots_batch`` and ``free_batch`` must equal the single-request calls in order (same
results, ``None``s and state), at scheduler sizes where the vectorised paths run: many running
requests of staggered lengths on a hybrid layout, a pool that runs short, shared prefixes.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from batch_layouts import SPECS, layout
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager, path_counts
from hybridkv.optimized.batch import expand
from hybridkv.optimized.rows import RowTables
from hybridkv.reference import KVCacheManager, Request


def make_requests(count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(16)]
    return [
        Request(
            f"r{i}",
            (shared if i % 3 == 0 else []) + [rng.randrange(50) for _ in range(5 + i % 9)],
            hash_block_size=4,
        )
        for i in range(count)
    ]


@pytest.mark.parametrize(
    ("num_blocks", "caching", "busy_batch_min", "batch_min", "fused"),
    [
        (2000, True, 64, 16, True),
        (2000, True, 1, 16, True),
        (700, True, 1, 16, True),
        (2000, False, 1, 16, True),
        (400, False, 1, 16, True),
        (2000, True, 64, 640, True),
        (700, True, 64, 640, True),
        (400, False, 64, 640, True),
        (2000, True, 64, 16, False),
        (700, True, 64, 640, False),
    ],
)
def test_decode_steps_equal_single_calls(
    num_blocks: int, caching: bool, busy_batch_min: int, batch_min: int, fused: bool
) -> None:
    """40 requests, 30 decode steps; a short pool makes some requests get ``None``. With
    ``batch_min`` 16 the vectorised step serves the batches (its busy requests one by one
    below ``busy_batch_min``), with 640 (the default) the small batch's loop
    (``batch_small``); the busy requests' steps past the call's checks go through the fused
    step, or without it (``fused`` off) through ``step.run``."""
    batched = TorchKVCacheManager(layout(num_blocks), 200, caching, max_num_reqs=48)
    batched.batch_min, batched.busy_batch_min = batch_min, busy_batch_min
    batched.tuning = replace(batched.tuning, fused_step=fused)
    single = TorchKVCacheManager(layout(num_blocks), 200, caching, max_num_reqs=48)
    reference = KVCacheManager(layout(num_blocks), 200, caching)
    twins = [make_requests(40, seed) for seed in (1, 1, 1)]
    running: list[list[Request]] = [[], [], []]
    managers: tuple[TorchKVCacheManager | KVCacheManager, ...] = (batched, single, reference)
    for i in range(40):
        for m, reqs, run in zip(managers, twins, running, strict=True):
            r = reqs[i]
            if m.allocate_slots(r, r.num_tokens) is not None:
                r.num_computed_tokens = r.num_tokens
                run.append(r)
    rng = random.Random(7)
    for step in range(30):
        tokens = [rng.randrange(50) for _ in running[0]]
        for run in running:
            for r, t in zip(run, tokens, strict=True):
                r.append_output_token_ids(t)
        counts = [1 + (step % 3 == 0 and i % 5 == 0) for i in range(len(running[0]))]
        got = batched.allocate_slots_batch(running[0], counts, num_lookahead_tokens=step % 2)
        for m, run in zip(managers[1:], running[1:], strict=True):
            expected = [
                m.allocate_slots(r, c, num_lookahead_tokens=step % 2)
                for r, c in zip(run, counts, strict=True)
            ]
            assert got == expected
        for run in running:
            for r, c, new in zip(run, counts, got, strict=True):
                if new is not None:
                    r.num_computed_tokens = min(r.num_computed_tokens + c, r.num_tokens)
        assert batched.snapshot() == single.snapshot() == reference.snapshot()
        batched.check_invariants()
        if step % 10 == 9:  # finish a third of the requests
            done = [run[::3] for run in running]
            batched.free_batch(done[0])
            for m, d in zip(managers[1:], done[1:], strict=True):
                for r in d:
                    m.free(r)
            for run in running:
                del run[::3]
            assert batched.snapshot() == single.snapshot() == reference.snapshot()
            batched.check_invariants()
    for r in running[0]:
        assert batched.get_block_ids(r.request_id) == reference.get_block_ids(r.request_id)
    if batch_min > 40:
        assert batched.fast_paths[path_counts.BATCH_SMALL] > 0
    elif busy_batch_min > 40:
        assert batched.fast_paths[path_counts.BATCH_ONE_BY_ONE] > 0
    one_by_one = batch_min > 40 or busy_batch_min > 40  # some busy request served alone
    crossed = batched.fast_paths[path_counts.FUSED_STEP]
    if not fused:
        assert crossed == 0
    elif caching and one_by_one:
        assert crossed > 0


@pytest.mark.parametrize(("num_blocks", "busy_batch_min"), [(2000, 64), (2000, 1), (560, 1)])
def test_steps_with_kept_free_blocks_and_tokens_in_flight_equal_single_calls(
    num_blocks: int, busy_batch_min: int
) -> None:
    """Async decode steps (each request's last 0–3 computed tokens in flight) that keep all but
    0–23 of the free blocks free (reserved and watermark): the step's own need decides, and a
    request needing no block fails too when they are short."""
    batched = TorchKVCacheManager(layout(num_blocks), 200, max_num_reqs=48)
    batched.batch_min, batched.busy_batch_min = 1, busy_batch_min
    reference = KVCacheManager(layout(num_blocks), 200)
    managers: tuple[TorchKVCacheManager | KVCacheManager, ...] = (batched, reference)
    twins = [make_requests(40, seed) for seed in (3, 3)]
    running: list[list[Request]] = [[], []]
    for i in range(40):
        for m, reqs, run in zip(managers, twins, running, strict=True):
            r = reqs[i]
            if m.allocate_slots(r, r.num_tokens) is not None:
                r.num_computed_tokens = r.num_tokens
                run.append(r)
    rng = random.Random(11)
    failed = 0
    for step in range(40):
        tokens = [rng.randrange(50) for _ in running[0]]
        in_flight = [rng.randrange(4) for _ in running[0]]
        # Near the free count: the step's own need decides.
        reserved = rng.randrange(3)
        watermark = max(0, reference.num_free_blocks - reserved - rng.randrange(24))
        for run in running:
            for r, t, f in zip(run, tokens, in_flight, strict=True):
                r.append_output_token_ids(t)
                vars(r)["num_in_flight_tokens"] = f
        counts = [1 + (step % 3 == 0 and i % 5 == 0) for i in range(len(running[0]))]
        got = batched.allocate_slots_batch(
            running[0], counts, reserved_blocks=reserved, watermark_blocks=watermark
        )
        expected = [
            reference.allocate_slots(r, c, reserved_blocks=reserved, watermark_blocks=watermark)
            for r, c in zip(running[1], counts, strict=True)
        ]
        assert got == expected, step
        failed += got.count(None)
        for run in running:
            for r, c, new in zip(run, counts, got, strict=True):
                if new is not None:
                    r.num_computed_tokens = min(r.num_computed_tokens + c, r.num_tokens)
        assert batched.snapshot() == reference.snapshot()
        batched.check_invariants()
        if step % 10 == 9:  # finish a third of the requests
            for m, run in zip(managers, running, strict=True):
                for r in run[::3]:
                    m.free(r)
                del run[::3]
    assert failed > 0
    message = "reserved_blocks must be a non-negative int, got -1"
    with pytest.raises(ValueError, match=message):
        batched.allocate_slots_batch(running[0], 1, reserved_blocks=-1)
    assert batched.snapshot() == reference.snapshot()


def test_block_tables_hold_every_request_table_in_its_row() -> None:
    m = TorchKVCacheManager(layout(200), 64, max_num_reqs=4)
    requests = make_requests(3, seed=3)
    for r in requests:
        assert m.allocate_slots(r, r.num_tokens) is not None
    for g in range(len(SPECS)):
        table = m.block_table(g)
        assert table.dtype == torch.int32
        assert tuple(table.shape) == (4, 16)
        for r in requests:
            row = m.row_of(r.request_id)
            assert row is not None
            ids = m.get_block_ids(r.request_id)[g]
            assert table[row, : len(ids)].tolist() == ids
    m.free(requests[0])
    assert m.row_of(requests[0].request_id) is None
    assert m.row_of("never seen") is None


def test_more_live_requests_than_rows_is_an_error_that_changes_nothing() -> None:
    m = TorchKVCacheManager(layout(200), 64, max_num_reqs=2)
    requests = make_requests(3, seed=4)
    for r in requests[:2]:
        assert m.allocate_slots(r, r.num_tokens) is not None
    before = m.snapshot()
    with pytest.raises(ValueError, match="max_num_reqs must cover every request holding blocks"):
        m.allocate_slots(requests[2], requests[2].num_tokens)
    assert m.snapshot() == before
    m.free(requests[0])
    assert m.allocate_slots(requests[2], requests[2].num_tokens) is not None


def test_bad_capacity_limits_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_num_reqs must be a positive int, got 0"):
        TorchKVCacheManager(layout(200), 64, max_num_reqs=0)
    with pytest.raises(ValueError, match="max_blocks_per_req must be at least the 16 blocks"):
        TorchKVCacheManager(layout(200), 64, max_blocks_per_req=3)


def test_batches_of_bad_or_unusual_calls_behave_as_single_calls() -> None:
    """Unknown requests, a repeated request and a bad count go through the single calls."""
    m = TorchKVCacheManager(layout(200), 64)
    m.batch_min = 1
    requests = make_requests(4, seed=5)
    for r in requests[:3]:
        assert m.allocate_slots(r, r.num_tokens) is not None
        r.num_computed_tokens = r.num_tokens
    with pytest.raises(ValueError, match="num_new_tokens must give one count per request"):
        m.allocate_slots_batch(requests[:3], [1, 1])
    with pytest.raises(ValueError, match="num_new_tokens must be positive with nothing computed"):
        m.allocate_slots_batch(requests[:3], [1, 0, 1])
    # The first request was served before the second one failed, as in single calls.
    assert m.get_block_ids(requests[0].request_id)[0][-1] != 0
    new = m.allocate_slots_batch([requests[3], requests[3]], 2)
    assert None not in new
    m.free_batch([requests[1], requests[1], requests[3]])
    assert m.row_of(requests[1].request_id) is None
    m.check_invariants()


def test_a_small_batch_answers_its_quiet_requests_in_its_loop_and_calls_the_others_in_order() -> (
    None
):
    """Below ``batch_min``: the quiet requests are answered by the batch's loop (counted), the
    others by the single calls at their turn — a crossing one, an unknown one (admitted), a
    repeated one, one with kept-free blocks, and a bad count raising after the calls before."""
    m = TorchKVCacheManager(layout(200), 64)
    twin = TorchKVCacheManager(layout(200), 64)
    requests, twins = make_requests(5, seed=5), make_requests(5, seed=5)
    for manager, reqs in ((m, requests), (twin, twins)):
        for r in reqs[:4]:
            assert manager.allocate_slots(r, r.num_tokens) is not None
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(7)
    batch = [*requests[:4], requests[4], requests[0]]
    got = m.allocate_slots_batch(batch, [1, 1, 1, 1, requests[4].num_tokens, 1])
    expected, quiet = [], 0
    for r, c in zip(
        [*twins[:4], twins[4], twins[0]], [1, 1, 1, 1, twins[4].num_tokens, 1], strict=True
    ):
        before = twin.fast_paths
        expected.append(twin.allocate_slots(r, c))
        quiet += twin.fast_paths == before  # no path counted: the quiet exit answered
    assert 0 < quiet < 6
    assert got == expected
    assert m.snapshot() == twin.snapshot()
    assert m.fast_paths[path_counts.BATCH_SMALL] == quiet
    kept = m.allocate_slots_batch(requests[:2], 1, reserved_blocks=1)
    assert kept == [twin.allocate_slots(r, 1, reserved_blocks=1) for r in twins[:2]]
    with pytest.raises(ValueError, match="num_new_tokens must be positive with nothing computed"):
        m.allocate_slots_batch([requests[1], requests[2]], [1, 0])
    twin.allocate_slots(twins[1], 1)
    with pytest.raises(ValueError, match="num_new_tokens must be positive with nothing computed"):
        twin.allocate_slots(twins[2], 0)
    assert m.snapshot() == twin.snapshot()
    m.check_invariants()


def test_remembered_rows_need_the_same_request_objects_in_order_and_no_row_changing_hands() -> None:
    """``RowTables.remember``: the next batch of exactly these objects gets the rows back;
    another order, another object or any ``take``/``release`` since reads them afresh."""
    rows = RowTables(max_num_reqs=4, num_groups=2)
    a, b, c = (Request(rid, [1, 2, 3], hash_block_size=4) for rid in ("a", "b", "c"))
    held = np.array([rows.take("a"), rows.take("b")], dtype=np.int64)
    rows.remember([a, b], held, "extra")
    found = rows.remembered([a, b])
    assert found is not None
    assert found[0] is held
    assert found[1] == "extra"
    assert rows.remembered((a, b)) == found
    assert rows.remembered([b, a]) is None
    assert rows.remembered([a, b, c]) is None
    assert rows.remembered([a, Request("b", [1, 2, 3], hash_block_size=4)]) is None
    rows.take("c")
    assert rows.remembered([a, b]) is None
    rows.remember([a, b], held)
    rows.release("c", 2)
    assert rows.remembered([a, b]) is None
    assert rows.remembered([]) is None


def test_a_batch_of_readmitted_requests_reads_their_new_rows() -> None:
    """The same request objects batched again after both were freed and readmitted in the
    other order (so that each now holds the other's row) must not reuse the rows remembered
    before: results and state equal the reference's."""
    batched = TorchKVCacheManager(layout(2000), 200, max_num_reqs=8)
    batched.batch_min = batched.busy_batch_min = 1
    reference = KVCacheManager(layout(2000), 200)
    managers: tuple[TorchKVCacheManager | KVCacheManager, ...] = (batched, reference)
    twins = [make_requests(2, seed) for seed in (5, 5)]
    for m, reqs in zip(managers, twins, strict=True):
        for r in reqs:
            assert m.allocate_slots(r, r.num_tokens) is not None
            r.num_computed_tokens = r.num_tokens

    def step(remembered: int) -> None:
        for reqs in twins:
            for r in reqs:
                r.append_output_token_ids([7, 8, 9, 10])
        before = batched.fast_paths[path_counts.BATCH_REMEMBERED]
        got = batched.allocate_slots_batch(twins[0], 4)
        assert got == [reference.allocate_slots(r, 4) for r in twins[1]]
        assert batched.fast_paths[path_counts.BATCH_REMEMBERED] - before == remembered
        for reqs in twins:
            for r in reqs:
                r.num_computed_tokens += 4
        assert batched.snapshot() == reference.snapshot()
        batched.check_invariants()

    step(remembered=0)  # read afresh, remembered
    step(remembered=1)
    rows_before = [batched.row_of(r.request_id) for r in twins[0]]
    for m, reqs in zip(managers, twins, strict=True):
        m.free(reqs[0])
        m.free(reqs[1])
        for r in reqs:  # readmitted first-freed first: each takes the other's row
            r.num_computed_tokens = 0
            assert m.allocate_slots(r, r.num_tokens) is not None
            r.num_computed_tokens = r.num_tokens
    assert [batched.row_of(r.request_id) for r in twins[0]] == rows_before[::-1]
    step(remembered=0)
    step(remembered=1)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 4), max_size=40), st.booleans())
def test_expanding_per_pair_counts_lists_each_element_by_pair_and_rank(
    counts: list[int], ones_only: bool
) -> None:
    """``expand``, told the total or not (its 0-or-1 shortcut), equals the definition: pair
    ``p`` repeated ``counts[p]`` times, ranked 0, 1, … within it."""
    if ones_only:
        counts = [min(c, 1) for c in counts]
    array_counts = np.array(counts, dtype=np.int64)
    expected_pairs = [p for p, c in enumerate(counts) for _ in range(c)]
    expected_ranks = [r for c in counts for r in range(c)]
    for total in (None, sum(counts)):
        pair, rank = expand(array_counts, total)
        assert pair.tolist() == expected_pairs
        assert rank.tolist() == expected_ranks
