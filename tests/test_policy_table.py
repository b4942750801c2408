"""The policy table: its cells (engine defaults, first admissions), its bound, its output."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.lab import policy_table
from hybridkv.lab.policy_table import GIB, MIB, Cell, CellResult, bound_cell, run_cell
from hybridkv.reference import KVCacheManager
from hybridkv.reference.planner import plan_kv_cache
from hybridkv.simulate import RequestSpec, Scheduler, SchedulerConfig
from hybridkv.spec import FullAttentionSpec

pytest.importorskip("torch")

TINY = {"layers.0": FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=1)}


class Spy(KVCacheManager):
    """The reference manager, writing down each admission's ``full_sequence_must_fit``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.must_fit: list[bool] = []

    def allocate_slots(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 2:  # an admission passes its computed tokens and blocks
            self.must_fit.append(kwargs.get("full_sequence_must_fit", False))
        return super().allocate_slots(*args, **kwargs)


@pytest.mark.parametrize("full", [False, True])
def test_the_scheduler_asks_for_the_whole_sequence_only_under_full_prompt_admission(
    full: bool,
) -> None:
    manager = Spy(plan_kv_cache(TINY, 12 * 8), max_model_len=64)
    requests = [RequestSpec("A", tuple(range(1, 9)), (90, 91))]
    limits = SchedulerConfig(16, 4, 64, full_prompt_admission=full)
    Scheduler(manager, requests, block_size=4, config=limits).run()
    assert manager.must_fit == [full]


def test_a_readmission_after_preemption_is_left_out_of_the_first_admission_rate() -> None:
    """Two 8-token prompts with 6 outputs each in a pool of 4 usable blocks: B is preempted
    and admitted again; the first-admission counts hold each prompt once."""
    requests = [
        RequestSpec("A", tuple(range(1, 9)), tuple(range(100, 106))),
        RequestSpec("B", tuple(range(11, 19)), tuple(range(200, 206))),
    ]
    manager = KVCacheManager(plan_kv_cache(TINY, 5 * 8), max_model_len=64)
    limits = SchedulerConfig(16, 4, 64)
    result = Scheduler(manager, requests, block_size=4, config=limits).run()
    assert result.preemptions >= 1
    assert result.first_prompt_tokens == 16
    assert result.prompt_tokens > result.first_prompt_tokens


def test_a_cell_is_a_function_of_its_settings_and_under_its_bound() -> None:
    cell = Cell("gpt-oss-120b", "agent", 512 * MIB, "lru", seed=1, requests=24)
    first, again = run_cell(cell), run_cell(cell)
    assert first == again
    assert (first.num_blocks, first.rejected) == (910, 0)
    bound = run_cell(bound_cell("gpt-oss-120b", "agent", 1, 24))
    assert bound.preemptions == 0
    for policy in policy_table.POLICIES:
        result = run_cell(Cell("gpt-oss-120b", "agent", 512 * MIB, policy, 1, 24))
        assert 0 < result.hit_rate <= bound.hit_rate


def test_the_table_shows_each_policys_mean_and_spread_beside_the_bound() -> None:
    def result(policy: str, seed: int, rate: float, engine: bool = True) -> CellResult:
        memory = GIB if engine else policy_table.BOUND_MEMORY
        return CellResult(Cell("m", "agent", memory, policy, seed, engine=engine), 10, rate, 0, 0)

    results = [
        result("lru", 0, 0.9, engine=False),
        result("lru", 1, 0.9, engine=False),
        result("lru", 0, 0.5),
        result("lru", 1, 0.6),
        result("hybrid", 0, 0.6),
        result("hybrid", 1, 0.6),
    ]
    table = policy_table.markdown(policy_table.summarise(results), ["lru", "hybrid"])
    assert table.splitlines() == [
        "| model | workload | memory | bound | lru | hybrid | best − lru |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        "| m | agent | 1 GiB | 90.0 | 55.0 ± 7.1 | 60.0 ± 0.0 | +5.0 |",
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "gpt-oss-20b"], "--models: gpt-oss-20b not in the table"),
        (["--policies", "hybrid,arc"], "--policies must include lru"),
        (["--policies", "lru,nosuch"], "--policies: eviction_policy 'nosuch' is not a policy"),
        (["--memories", "5"], "--memories: 5 not among the byte counts of"),
        (["--seeds", "0"], "argument --seeds: must be an int of at least 1, got '0'"),
    ],
)
def test_the_command_names_a_bad_option(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        policy_table.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_profile_counts_each_groups_first_admission_hits_and_evictions() -> None:
    """A and B share 8 prompt tokens (two blocks); B's first admission finds them. C, with
    nothing shared, needs the pool's cached blocks: its allocation evicts keys of the group."""
    from hybridkv.lab.hit_profile import ProfiledManager

    config = plan_kv_cache(TINY, 7 * 8)
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    profiled = ProfiledManager(manager, [TINY["layers.0"]], 4)
    shared = tuple(range(1, 9))
    requests = [
        RequestSpec("A", (*shared, 50, 51), (90,)),
        RequestSpec("B", (*shared, 60, 61), (91,), arrival_step=3),
        RequestSpec("C", tuple(range(200, 220)), (92,), arrival_step=6),
    ]
    limits = SchedulerConfig(32, 4, 64)
    result = Scheduler(profiled, requests, block_size=4, config=limits).run()
    assert result.first_hit_tokens == 8
    assert profiled.profile.hit_tokens == [8]
    assert profiled.profile.evicted_keys[0] > 0


def test_the_profile_counts_evicted_keys_a_later_prompt_reached_again() -> None:
    """A caches three blocks (two of them a shared prefix); C, with nothing shared, needs the
    whole pool and evicts all three; D asks for A's prefix again and evicts three of C's
    keys: six keys evicted, two of them (the shared prefix) reached again. A's third key and
    C's are not (D's prompt stops before them)."""
    from hybridkv.lab.hit_profile import ProfiledManager

    config = plan_kv_cache(TINY, 7 * 8)
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    profiled = ProfiledManager(manager, [TINY["layers.0"]], 4)
    shared = tuple(range(1, 9))
    requests = [
        RequestSpec("A", (*shared, 50, 51, 52, 53), (90,)),
        RequestSpec("C", tuple(range(200, 224)), (92,), arrival_step=4),
        RequestSpec("D", (*shared, 70, 71, 72, 73), (93,), arrival_step=10),
    ]
    limits = SchedulerConfig(32, 4, 64)
    result = Scheduler(profiled, requests, block_size=4, config=limits).run()
    assert result.first_hit_tokens == 0
    assert profiled.profile.evicted_keys == [6]
    assert profiled.profile.reached_again == [2]


def test_the_eviction_ledger_walks_cached_and_evicted_keys_up_to_a_key_never_cached() -> None:
    """Keys a, b, c cached; b evicted: a prompt a, b, c, d reaches b (a and c still cached, d
    never cached). Counting it takes b off the evicted keys: a second prompt reaches nothing."""
    from hybridkv.lab.hit_profile import EvictionLedger
    from hybridkv.reference.block_hash import BlockHash
    from hybridkv.reference.events import BlockRemoved, BlockStored

    a, b, c, d = (BlockHash(bytes([n]) * 32) for n in range(4))
    ledger = EvictionLedger([True, False])
    stored = BlockStored((a, b, c), None, (), 4, None, None, None, group_idx=0)
    ledger.observe([stored, BlockRemoved((b,), None, group_idx=0)])
    reached = ledger.reached([a, b, c, d], 4)
    assert reached == [[b], []]
    assert ledger.reached([b, a], 1) == [[b], []]
    assert ledger.reached([d, b], 2) == [[], []]
    ledger.count(reached)
    assert ledger.reached_again == [1, 0]
    assert ledger.reached([a, b, c], 3) == [[], []]


def test_the_profile_table_gives_each_groups_means_over_the_seeds() -> None:
    """Two seeds of one cell: group 0's hit %, keys evicted and keys reached again (with
    their tokens in percent of prompt tokens) are the seeds' means."""
    cells = [Cell("m", "agent", GIB, "lru", seed) for seed in (0, 1)]
    results = [
        CellResult(cells[0], 100, 0.5, 0, 0, (0.5,), (10,), (4,), (0.02,)),
        CellResult(cells[1], 100, 0.3, 0, 0, (0.3,), (20,), (6,), (0.04,)),
    ]
    lines = policy_table.profile_markdown(results, ["lru"]).splitlines()
    assert lines[2] == "| m | agent | 1 GiB | lru | 40.0 | g0 40.0 / 15 (5, 3.0 %) |"


def test_the_ledger_walks_full_attention_at_the_hash_block_size_only() -> None:
    """A window reads only the blocks before a hit's end and a Mamba group one state: a walk
    from the prompt's start measures neither, nor a group of another block size."""
    from hybridkv.lab.hit_profile import walked_groups
    from hybridkv.spec import MambaSpec, SlidingWindowSpec

    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype_bytes=2)
    window = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=8, dtype_bytes=2, sliding_window=64
    )
    wide = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8, dtype_bytes=2)
    state = MambaSpec(block_size=16, state_bytes=64)
    assert walked_groups([full, window, wide, state], 16) == [True, False, False, False]
