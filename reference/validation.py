"""Bad input, refused before anything changes: the checks every manager makes, one wording.

A scheduler calls the manager with counts it computed and block ids it was handed back; a
mistake there must raise a ``ValueError`` that names the field and the value, and leave the pool
as it was (a failed call changes nothing). Both backends run these same functions, so that they
refuse the same calls with the same words; each is called before the first state change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.spec import KVCacheConfig, MambaSpec
from hybridkv.spec.errors import check_non_negative, check_positive


def validate_manager_config(
    config: KVCacheConfig, max_model_len: int, enable_caching: bool
) -> None:
    """Reject configurations the manager does not support, naming the field and the value."""
    if not isinstance(config, KVCacheConfig):
        raise ValueError(f"config must be a KVCacheConfig, got {config!r}")
    check_positive("max_model_len", max_model_len)
    block_sizes = sorted({group.spec.block_size for group in config.groups})
    if len(block_sizes) > 1:
        raise ValueError(
            f"every KV cache group must share one block size (one page size), got {block_sizes}"
        )
    if enable_caching and any(isinstance(g.spec, MambaSpec) for g in config.groups):
        raise ValueError(
            "enable_caching=True is not supported with a Mamba group yet (prefix caching for "
            "Mamba is a later issue); pass enable_caching=False"
        )


def check_block_hashes(request: RequestLike, block_size: int) -> None:
    """The request must be hashed at the pool's block size, one hash per full block."""
    expected = request.num_tokens // block_size
    if len(request.block_hashes) != expected:
        raise ValueError(
            f"request {request.request_id!r} has {len(request.block_hashes)} block_hashes, "
            f"expected {expected} (hash_block_size must be the block size {block_size})"
        )


def check_cache_blocks(request: RequestLike, num_computed_tokens: int) -> None:
    """``cache_blocks`` may cache up to the request's last token, not past it."""
    check_non_negative("num_computed_tokens", num_computed_tokens)
    if num_computed_tokens > request.num_tokens:
        raise ValueError(
            f"num_computed_tokens must be at most the request's {request.num_tokens} tokens, "
            f"got {num_computed_tokens!r}"
        )


def check_allocation(
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    new_computed_blocks: KVCacheBlocks | None,
    num_lookahead_tokens: int,
    *,
    config: KVCacheConfig,
    enable_caching: bool,
    holds_blocks: Callable[[str], bool],
) -> tuple[tuple[int, ...], ...]:
    """Check every argument of ``allocate_slots``; return the adopted hit's block ids per group.

    ``holds_blocks(request_id)`` says whether the request already holds blocks: only a request
    being admitted adopts a cache hit (a running one would hold two tables).
    """
    check_non_negative("num_new_tokens", num_new_tokens)
    check_non_negative("num_new_computed_tokens", num_new_computed_tokens)
    check_non_negative("num_lookahead_tokens", num_lookahead_tokens)
    if num_new_tokens == 0 and num_new_computed_tokens == 0:
        raise ValueError("num_new_tokens must be positive when no cache hit is adopted, got 0")
    block_size = config.groups[0].spec.block_size
    if enable_caching:
        check_block_hashes(request, block_size)
    if new_computed_blocks is None:
        if num_new_computed_tokens:
            raise ValueError(
                "new_computed_blocks must be given with num_new_computed_tokens="
                f"{num_new_computed_tokens}, got None"
            )
        return tuple(() for _ in config.groups)
    hits = new_computed_blocks
    if hits.num_groups != len(config.groups):
        raise ValueError(
            f"new_computed_blocks must have one list per KV cache group ({len(config.groups)}), "
            f"got {hits.num_groups}"
        )
    for group_id, ids in enumerate(hits.block_ids):
        _check_hit_ids(group_id, ids, num_new_computed_tokens, block_size, config.num_blocks)
    if any(hits.block_ids) and holds_blocks(request.request_id):
        raise ValueError(
            f"request {request.request_id!r} already holds blocks; only a request being "
            "admitted adopts a cache hit (new_computed_blocks must be empty)"
        )
    return hits.block_ids


def _check_hit_ids(
    group_id: int,
    ids: Sequence[int],
    num_new_computed_tokens: int,
    block_size: int,
    num_blocks: int,
) -> None:
    """One group's hit: exactly the blocks of ``num_new_computed_tokens``, each a pool block."""
    expected = num_new_computed_tokens // block_size
    if num_new_computed_tokens % block_size or len(ids) != expected:
        raise ValueError(
            f"num_new_computed_tokens={num_new_computed_tokens} must be the "
            f"{len(ids)} blocks of new_computed_blocks group {group_id} "
            f"× block_size {block_size}"
        )
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"new_computed_blocks group {group_id} has invalid ids {bad!r}")
