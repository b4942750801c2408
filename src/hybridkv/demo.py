"""The design document's worked example, end to end: ``python -m hybridkv.demo``.

A model of 10 full-attention and 20 sliding-window layers (block size 16, window 32) is
planned into KV cache groups and tensors, a 112-token request is served, and the prefix-cache
examples (Cases 0–2) are looked up.
"""

from __future__ import annotations

from hybridkv.reference import KVCacheManager, Request, plan_kv_cache
from hybridkv.spec import FullAttentionSpec, SlidingWindowSpec, spec_kind

HEADS = {"num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}


def document_model() -> dict[str, FullAttentionSpec | SlidingWindowSpec]:
    """10 full + 20 sliding layers, interleaved sw, sw, full as in many hybrid models."""
    layers: dict[str, FullAttentionSpec | SlidingWindowSpec] = {}
    for i in range(10):
        layers[f"sw.{2 * i}"] = SlidingWindowSpec(block_size=16, sliding_window=32, **HEADS)
        layers[f"sw.{2 * i + 1}"] = SlidingWindowSpec(block_size=16, sliding_window=32, **HEADS)
        layers[f"full.{i}"] = FullAttentionSpec(block_size=16, **HEADS)
    return layers


def main() -> None:
    """Print the groups, tensors, blocks of a 112-token request and a few cache hits."""
    layer_page = 16 * 2 * 8 * 128 * 2
    config = plan_kv_cache(document_model(), available_memory_bytes=100 * 10 * layer_page)
    print("KV cache groups (Allocation, Case 2):")
    for group_id, group in enumerate(config.groups):
        names = group.layer_names
        print(f"  group {group_id}: {spec_kind(group.spec):<14} {names[0]} … {names[-1]}")
    print(
        f"KV cache tensors (Memory Layout): {len(config.tensors)}, e.g. tensor 0 shared by "
        f"{', '.join(config.tensors[0].shared_by)}; num_blocks = {config.num_blocks}"
    )

    manager = KVCacheManager(config, max_model_len=1024)
    prompt = list(range(1000, 1113))
    first = Request("first", prompt, hash_block_size=16)
    manager.allocate_slots(first, len(prompt))
    manager.free(first)
    second = Request("second", prompt, hash_block_size=16)
    hit, num_hit_tokens, _ = manager.get_computed_blocks(second)
    manager.allocate_slots(second, 0, num_hit_tokens, hit)
    tables = manager.get_block_ids("second")
    held = [sum(1 for block_id in table if block_id) for table in tables]
    print(
        f"A request of length 112 holds {sum(held)} blocks: {held} per group "
        "(0 = null block: outside the sliding window)"
    )
    for group_id, table in enumerate(tables):
        print(f"  group {group_id}: {table}")
    print(
        f"Cache hit of a resent 113-token prompt: {num_hit_tokens} tokens "
        "(the last token is always recomputed)"
    )


if __name__ == "__main__":
    main()
