"""The differential machine counts the optimized backend's fast paths, and its fast profile
reaches each of them: a vectorised path the machine seldom runs is one only unit tests check."""

from __future__ import annotations

import pytest

from hybridkv.conformance.__main__ import PROFILES
from hybridkv.conformance.adapters import backends_named
from hybridkv.conformance.machine import RunStats, run_command_machine
from hybridkv.conformance.path_tally import QUIET_EXIT
from hybridkv.reference import Request
from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, SlidingWindowSpec

pytest.importorskip("torch")
from hybridkv.optimized import TorchKVCacheManager, path_counts
from hybridkv.optimized.state import Tuning

B = 4


def _manager(tuning: Tuning | None = None) -> TorchKVCacheManager:
    sizes = {"block_size": B, "num_kv_heads": 1, "head_size": 8, "dtype_bytes": 2}
    config = KVCacheConfig(
        32,
        (
            KVCacheGroup(("full",), FullAttentionSpec(**sizes)),
            KVCacheGroup(("sw",), SlidingWindowSpec(sliding_window=4, **sizes)),
        ),
    )
    return TorchKVCacheManager(config, 64, tuning=tuning)


def test_a_new_manager_lists_every_path_at_zero() -> None:
    paths = _manager().fast_paths
    assert list(paths) == list(path_counts.PATHS)
    assert set(paths.values()) == {0}


@pytest.mark.parametrize("fused", [True, False])
def test_the_quiet_exit_changes_no_count_and_a_block_boundary_runs_the_step(fused: bool) -> None:
    manager = _manager(Tuning(fused_step=fused))
    request = Request("r", list(range(6)), hash_block_size=B)
    manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, 6) is not None
    admitted = manager.fast_paths
    assert admitted[path_counts.ALLOCATE] == 1
    request.num_computed_tokens = 6
    request.append_output_token_ids(6)
    manager.allocate_slots(request, 1)  # token 7 of 8: the second block has room
    assert manager.fast_paths == admitted
    request.num_computed_tokens = 7
    request.append_output_token_ids(7)
    manager.allocate_slots(request, 1)  # token 8 fills the block: caching
    request.num_computed_tokens = 8
    request.append_output_token_ids(8)
    manager.allocate_slots(request, 1)  # token 9 needs a third block, the window releases
    after = manager.fast_paths
    if fused:  # each crossing is one block per group: the fused step makes both
        assert after[path_counts.FUSED_STEP] == 2
        assert after[path_counts.RUNNING_STEP] == 0
        return
    assert after[path_counts.FUSED_STEP] == 0
    assert after[path_counts.RUNNING_STEP] == 2
    assert after[path_counts.CACHE_UNIFORM] == 1
    assert after[path_counts.STEP_UNIFORM_TAKE] == 1
    assert after[path_counts.STEP_RELEASE] >= 1


@pytest.mark.slow(seconds=40)
def test_the_fast_profile_reaches_every_fast_path() -> None:
    """The command's fast profile (its machine: small pools, roomy ones and serving sizes),
    counted per path: the quiet exit, the running step, the small batch's loop, the batched
    step with and without window releases, with the last batch's rows remembered and with
    their counts read from step columns, the vectorised touch and caching, the vectorised
    links (each entry in a bucket of its own, or sharing one), the vectorised lookups, the
    memo's run, hybrids of 3–4 types with full attention, the one-pass admission, the take of
    a run of consecutive ids, the memo's comparison by ``memcmp``: each at least 30 times
    (dozens). Only the policy's group-by-group touch needs ``--eviction``."""
    profile = PROFILES["fast"]
    stats = RunStats()
    run_command_machine(
        backends_named("both"), examples=profile.examples, steps=profile.steps, stats=stats
    )
    print("\n".join(stats.path_lines()))
    (name,) = stats.fast_paths
    counts = stats.fast_paths[name]
    assert name.startswith("optimized")
    reached = {path: n for path, n in counts.items() if "policy hears" not in path}
    assert len(reached) == 27
    assert min(reached.values()) >= 30, reached
    assert counts[QUIET_EXIT] >= 100
