"""A plan from ``plan_kv_cache`` runs in ``KVCacheManager`` under the same caching setting.

The engine-features example (Mamba prefix caching) as a user writes it: plan a Mamba hybrid,
hand the plan to the manager with its default prefix caching, step and hit.
"""

from __future__ import annotations

import pytest
from markdown_pages import fenced_block

from hybridkv.reference import KVCacheManager, Request, plan_kv_cache
from hybridkv.spec import FullAttentionSpec, KVCacheSpec, MambaSpec

LAYERS: dict[str, KVCacheSpec] = {
    "layers.0": MambaSpec(block_size=16, state_bytes=4096),
    "layers.1": FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype_bytes=2),
}
PROMPT = list(range(100, 155))


def test_the_documented_mamba_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/reference.md, "Mamba prefix caching, planned": the block a reader copies."""
    code = fenced_block("docs/reference.md", "Mamba prefix caching, planned", "python")
    exec(compile(code, "docs/reference.md", "exec"), {})
    assert capsys.readouterr().out == "128 48\n"


def test_planned_mamba_hybrid_runs_with_prefix_caching_on_as_written() -> None:
    config = plan_kv_cache(LAYERS, available_memory_bytes=64 * 2 * 4096)
    manager = KVCacheManager(config, max_model_len=4096)
    first = Request("first", PROMPT, hash_block_size=manager.hash_block_size)
    manager.new_step_starts()
    blocks, hit, _ = manager.get_computed_blocks(first)
    assert manager.allocate_slots(first, 48, hit, blocks) is not None
    first.num_computed_tokens = 48
    manager.new_step_starts()
    assert manager.allocate_slots(first, 7) is not None
    first.num_computed_tokens = 55
    manager.new_step_starts()
    again = Request("again", PROMPT, hash_block_size=manager.hash_block_size)
    _, hit, _ = manager.get_computed_blocks(again)
    assert (config.num_blocks, hit) == (128, 48)


def test_planned_mamba_groups_are_align_with_caching_and_none_without() -> None:
    on = plan_kv_cache(LAYERS, 64 * 2 * 4096)
    off = plan_kv_cache(LAYERS, 64 * 2 * 4096, enable_caching=False)
    assert [g.spec.mamba_cache_mode for g in on.groups if isinstance(g.spec, MambaSpec)] == [
        "align"
    ]
    assert [g.spec.mamba_cache_mode for g in off.groups if isinstance(g.spec, MambaSpec)] == [
        "none"
    ]
    manager = KVCacheManager(off, max_model_len=4096, enable_caching=False)
    request = Request("r", PROMPT, hash_block_size=manager.hash_block_size)
    assert manager.allocate_slots(request, len(PROMPT)) is not None
