"""``hybridkv.bench_floor``: the admission floor the benchmark times beside the backends does
the work it stands for — the backends' hashes, the hit held, one block per new position and
group taken from the queue's head, the row written and the new blocks keyed — and the table
says how far the optimized backend's admission lies from it."""

from __future__ import annotations

import random

import numpy as np
import pytest

from hybridkv.bench_floor import AdmissionFloor
from hybridkv.bench_report import BenchTable
from hybridkv.reference.block_hash import hash_full_blocks

BLOCK, GROUPS, WINDOW = 4, 3, 2
SHARED, OWN = 16, 8  # 4 shared blocks, 2 own: 6 full blocks


def prompts(count: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(3)
    system = [rng.randrange(1 << 20) for _ in range(SHARED)]
    return system, [system + [rng.randrange(1 << 20) for _ in range(OWN)] for _ in range(count)]


def floor_of(cached: list[int], admissions: int = 3) -> AdmissionFloor:
    return AdmissionFloor(
        cached, SHARED, admissions, groups=GROUPS, block_size=BLOCK, window_blocks=WINDOW
    )


def test_the_floor_hashes_each_prompt_as_the_definition_does() -> None:
    _, (cached, first, second) = prompts(3)
    floor = floor_of(cached)
    for prompt in (first, second):
        floor.admit(prompt)
        assert floor.last_hashes == hash_full_blocks(
            prompt, BLOCK, start_block=0, parent_hash=None, cache_salt=None
        )


def test_each_admission_takes_the_queues_next_blocks_group_by_group() -> None:
    _, (cached, first, second) = prompts(3)
    floor = floor_of(cached)
    # The cached request holds blocks 1-18 (3 groups × 6 positions); the queue starts at 19.
    assert floor.admit(first) == ((19, 20), (21, 22), (23, 24))
    assert floor.admit(second) == ((25, 26), (27, 28), (29, 30))


def test_an_admission_holds_the_hit_writes_the_row_and_keys_the_new_blocks() -> None:
    _, (cached, first) = prompts(2)
    floor = floor_of(cached)
    floor.admit(first)
    # The hit: the full group's 4 shared blocks (1-4), each window's last 2 (9-10, 15-16).
    hit = [1, 2, 3, 4, 9, 10, 15, 16]
    assert floor.ref[hit].tolist() == [2] * 8
    assert floor.ref[[5, 6, 7, 8, 11, 12, 13, 14, 17, 18]].tolist() == [1] * 10
    assert floor.ref[19:25].tolist() == [1] * 6
    assert floor.tab[:, 1, :].tolist() == [
        [1, 2, 3, 4, 19, 20, 0],
        [0, 0, 9, 10, 21, 22, 0],
        [0, 0, 15, 16, 23, 24, 0],
    ]
    keys = np.frombuffer(b"".join(floor.last_hashes[4:]), dtype="<i4")[::8].astype(np.int64)
    assert floor.hk[19:25].tolist() == [
        int(keys[p]) << 32 | g for g in range(GROUPS) for p in range(2)
    ]
    # Every new block heads its bucket's chain.
    buckets = (keys + np.arange(GROUPS)[:, None] * 0x9E3779B1) & floor.mask
    assert floor.heads[buckets].tolist() == [[19, 20], [21, 22], [23, 24]]
    # Taken blocks leave the queue: its sentinel now links to block 25.
    assert floor.nxt[floor.head] == 25
    assert floor.prv_n[25] == floor.head
    assert floor.nxt_n[19:25].tolist() == [-1] * 6


def test_the_floor_refuses_what_it_does_not_stand_for() -> None:
    system, (cached, first) = prompts(2)
    floor = floor_of(cached, admissions=1)
    with pytest.raises(ValueError, match="its shared prefix differs"):
        floor.admit([system[0] + 1, *first[1:]])
    floor = floor_of(cached, admissions=1)
    with pytest.raises(ValueError, match="admits 1 prompts of 24 ids, got one of 23 after 0"):
        floor.admit(first[:-1])
    floor.admit(first)
    with pytest.raises(ValueError, match="got one of 24 after 1"):
        floor.admit(first)
    with pytest.raises(ValueError, match="shared must be a positive multiple of block_size 4"):
        AdmissionFloor(cached, 6, 1, groups=GROUPS, block_size=BLOCK)
    with pytest.raises(ValueError, match="window_blocks must be positive, got 0"):
        AdmissionFloor(cached, SHARED, 1, block_size=BLOCK, window_blocks=0)


def test_the_floor_row_says_whether_the_path_lies_within_20_percent_of_it() -> None:
    table = BenchTable("vLLM", judged=True)
    table.floor("  its floor", 2000.0, 400.0, 470.0)
    table.floor("  its floor", 2000.0, 400.0, 644.0)
    assert table.rows == [
        ("  its floor", "2,000", "", "400", "", "5.00×", "opt ≤ 1.2× it", "yes (1.18×)"),
        ("  its floor", "2,000", "", "400", "", "5.00×", "opt ≤ 1.2× it", "no (1.61×)"),
    ]
