"""Bad input, refused before anything changes: the checks every manager makes, one wording.

A scheduler calls the manager with counts it computed and block ids it was handed back; a
mistake there must raise a ``ValueError`` that names the field and the value, and leave the pool
as it was (a failed call changes nothing). Both backends run these same functions, so that they
refuse the same calls with the same words; each is called before the first state change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from hybridkv.reference.engine_settings import EngineSettings
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike
from hybridkv.spec import KVCacheConfig, rules
from hybridkv.spec.errors import check_non_negative, check_positive


def validate_manager_config(
    config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    *,
    hash_block_size: int | None = None,
    max_in_flight_tokens: int | None = None,
    use_eagle: bool = False,
    num_hash_lookahead_tokens: int = 0,
    log_stats: bool = True,
    num_prefill_lookahead: int = 0,
) -> EngineSettings:
    """Reject configurations the manager does not support, naming the field and the value;
    return the resolved engine settings."""
    if not isinstance(config, KVCacheConfig):
        raise ValueError(f"config must be a KVCacheConfig, got {config!r}")
    check_positive("max_model_len", max_model_len)
    if max_in_flight_tokens is not None:
        check_positive("max_in_flight_tokens", max_in_flight_tokens)
    if not isinstance(use_eagle, bool):
        raise ValueError(f"use_eagle must be a bool, got {use_eagle!r}")
    if not isinstance(log_stats, bool):
        raise ValueError(f"log_stats must be a bool, got {log_stats!r}")
    check_non_negative("num_hash_lookahead_tokens", num_hash_lookahead_tokens)
    check_non_negative("num_prefill_lookahead", num_prefill_lookahead)
    if enable_caching:
        for group in config.groups:
            group.spec.check_prefix_caching()
    block_sizes = [group.spec.block_size for group in config.groups]
    scheduler_block_size = rules.scheduler_block_size(block_sizes)
    resolved = _resolve_hash_block_size(
        config, block_sizes, enable_caching, hash_block_size, scheduler_block_size
    )
    settings = EngineSettings(
        max_model_len=max_model_len,
        max_in_flight_tokens=max_model_len
        if max_in_flight_tokens is None
        else max_in_flight_tokens,
        scheduler_block_size=scheduler_block_size,
        hash_block_size=resolved,
        use_eagle=use_eagle,
        num_hash_lookahead_tokens=num_hash_lookahead_tokens,
        num_prefill_lookahead=num_prefill_lookahead,
    )
    if enable_caching:
        _check_caching_layout(config, settings)
        _check_prefill_lookahead(config, settings)
    return settings


def _check_prefill_lookahead(config: KVCacheConfig, settings: EngineSettings) -> None:
    """Multi-module MTP with EAGLE groups: a hit drops its last scheduler block, which must
    hold every token the draft modules prefill again (vLLM's check)."""
    eagle = settings.use_eagle or any(group.is_eagle_group for group in config.groups)
    if eagle and settings.scheduler_block_size < settings.num_prefill_lookahead:
        raise ValueError(
            "Multi-module MTP with prefix caching requires scheduler_block_size"
            f" (={settings.scheduler_block_size}) >= num_speculative_tokens"
            f" (={settings.num_prefill_lookahead})."
        )


def _resolve_hash_block_size(
    config: KVCacheConfig,
    block_sizes: list[int],
    enable_caching: bool,
    hash_block_size: int | None,
    scheduler_block_size: int,
) -> int:
    """The given hash block size, checked; else one group's block size, else the gcd (the lcm
    with caching off or a Mamba group in ``"none"`` mode, where nothing is looked up finer)."""
    if hash_block_size is None:
        lcm_hashing = not enable_caching or any(g.spec.lcm_hashing for g in config.groups)
        if len(block_sizes) == 1:
            return block_sizes[0]
        return rules.hash_block_size(block_sizes, lcm_hashing=lcm_hashing)
    check_positive("hash_block_size", hash_block_size)
    if scheduler_block_size % hash_block_size or (
        enable_caching and any(size % hash_block_size for size in block_sizes)
    ):
        raise ValueError(
            "hash_block_size must divide every group's block size "
            f"{sorted(set(block_sizes))} (and their lcm {scheduler_block_size}), "
            f"got {hash_block_size!r}"
        )
    return hash_block_size


def _check_caching_layout(config: KVCacheConfig, settings: EngineSettings) -> None:
    """Caching layouts this manager implements exactly as vLLM 0.33 does."""
    sizes = sorted({group.spec.block_size for group in config.groups})
    for group in config.groups:
        group.spec.check_hash_block_size(settings.hash_block_size)
    shared = [g.spec for g in config.groups if g.spec.needs_shared_block_size]
    if len(sizes) > 1 and shared:
        raise ValueError(
            f"a {shared[0].title} group needs every group to share its block size when "
            f"prefix caching is on, got block sizes {sizes}"
        )
    dropped = [
        g.spec
        for g in config.groups
        if not g.spec.supports_eagle_drop
        and (g.is_eagle_group or not any(h.is_eagle_group for h in config.groups))
    ]
    if settings.use_eagle and dropped:
        raise ValueError(
            f"use_eagle=True cannot drop a block from a {dropped[0].title} group; flag the "
            "drafter's groups with is_eagle_group"
        )
    interval = config.prefix_cache_retention_interval
    if interval is None:
        return
    sparse = any(g.spec.sparse_retention for g in config.groups)
    if not sparse and interval != 0:
        raise ValueError(
            "prefix_cache_retention_interval applies to sliding-window and Mamba groups only and "
            f"this layout has none; set it to 0 or None, got {interval!r}"
        )
    if sparse and interval % settings.scheduler_block_size:
        raise ValueError(
            "prefix_cache_retention_interval must be a multiple of the scheduler block size "
            f"({settings.scheduler_block_size}), got {interval!r}"
        )


def check_block_hashes(
    request: RequestLike,
    hash_block_size: int,
    num_hash_lookahead_tokens: int = 0,
    *,
    allow_fewer: bool = False,
) -> None:
    """The request must be hashed at the manager's hash block size, one hash per full block
    (per full block followed by its lookahead tokens, with lookahead hashing).

    With ``allow_fewer`` a request may lag behind (an engine's request whose hashes wait for
    lookahead tokens still in flight, as vLLM allows): only its hashed blocks are looked up and
    cached. More hashes than full blocks always mean another hash block size."""
    expected = max(request.num_tokens - num_hash_lookahead_tokens, 0) // hash_block_size
    count = len(request.block_hashes)
    if count > expected or (count < expected and not allow_fewer):
        raise ValueError(
            f"request {request.request_id!r} has {len(request.block_hashes)} block_hashes, "
            f"expected {expected} (hash_block_size must be {hash_block_size}"
            + (
                f" and num_hash_lookahead_tokens {num_hash_lookahead_tokens})"
                if num_hash_lookahead_tokens
                else ")"
            )
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
    settings: EngineSettings,
    allow_fewer_hashes: bool = False,
    issued: bool = False,
    num_external_computed_tokens: int = 0,
) -> tuple[tuple[int, ...], ...]:
    """Check every argument of ``allocate_slots``; return the adopted hit's block ids per group.

    ``holds_blocks(request_id)`` says whether the request already holds blocks: only a request
    being admitted adopts a cache hit (a running one would hold two tables). ``issued``: the
    manager returned ``new_computed_blocks`` itself (a lookup result, whose ids are pool blocks
    by construction), so only their counts are checked, not each id. Tokens a KV connector
    supplies (``num_external_computed_tokens``) follow the hit of a request being admitted.
    """
    _check_counts(
        request,
        num_new_tokens,
        num_new_computed_tokens,
        num_lookahead_tokens,
        enable_caching,
        settings,
        allow_fewer_hashes,
        num_external_computed_tokens,
    )
    _check_admitted(request, False, holds_blocks, num_external_computed_tokens)
    if new_computed_blocks is None:
        if num_new_computed_tokens:
            raise ValueError(
                "new_computed_blocks must be given with num_new_computed_tokens="
                f"{num_new_computed_tokens}, got None"
            )
        return tuple(() for _ in config.groups)
    hits = new_computed_blocks
    _check_hit_group_count(hits.num_groups, config)
    for group_id, ids in enumerate(hits.block_ids):
        block_size = config.groups[group_id].spec.block_size
        # A connector's per-group lookup may hand a lagging state group a shorter hit: its
        # external tokens supply the state, and the group adopts none of the hit.
        shorter = num_external_computed_tokens > 0 and config.groups[group_id].spec.holds_state
        _check_hit_ids(
            group_id,
            ids,
            num_new_computed_tokens,
            block_size,
            config.num_blocks,
            issued,
            shorter,
        )
    _check_admitted(request, any(hits.block_ids), holds_blocks)
    return hits.block_ids


def check_issued_allocation(
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    hit_sizes: Sequence[int],
    num_lookahead_tokens: int,
    *,
    config: KVCacheConfig,
    enable_caching: bool,
    holds_blocks: Callable[[str], bool],
    settings: EngineSettings,
    allow_fewer_hashes: bool = False,
    num_external_computed_tokens: int = 0,
) -> None:
    """``check_allocation`` of a hit the manager issued itself, given by the number of blocks
    in each group (``hit_sizes``): its ids are pool blocks by construction, so the hit need not
    be read as ids at all."""
    _check_counts(
        request,
        num_new_tokens,
        num_new_computed_tokens,
        num_lookahead_tokens,
        enable_caching,
        settings,
        allow_fewer_hashes,
        num_external_computed_tokens,
    )
    _check_admitted(request, False, holds_blocks, num_external_computed_tokens)
    _check_hit_group_count(len(hit_sizes), config)
    for group_id, size in enumerate(hit_sizes):
        block_size = config.groups[group_id].spec.block_size
        _check_hit_count(group_id, size, num_new_computed_tokens, block_size)
    _check_admitted(request, any(hit_sizes), holds_blocks)


def _check_hit_group_count(num_groups: int, config: KVCacheConfig) -> None:
    """A hit has one list per KV cache group."""
    if num_groups != len(config.groups):
        raise ValueError(
            f"new_computed_blocks must have one list per KV cache group ({len(config.groups)}), "
            f"got {num_groups}"
        )


def _check_admitted(
    request: RequestLike, adopts: bool, holds_blocks: Callable[[str], bool], external: int = 0
) -> None:
    """Only a request being admitted adopts a cache hit or tokens a KV connector supplies (a
    running one would hold two tables)."""
    if not (adopts or external) or not holds_blocks(request.request_id):
        return
    if adopts:
        raise ValueError(
            f"request {request.request_id!r} already holds blocks; only a request being "
            "admitted adopts a cache hit (new_computed_blocks must be empty)"
        )
    raise ValueError(
        f"request {request.request_id!r} already holds blocks; only a request being "
        f"admitted adopts external tokens (num_external_computed_tokens={external} must be 0)"
    )


def _check_counts(
    request: RequestLike,
    num_new_tokens: int,
    num_new_computed_tokens: int,
    num_lookahead_tokens: int,
    enable_caching: bool,
    settings: EngineSettings,
    allow_fewer_hashes: bool,
    num_external_computed_tokens: int = 0,
) -> None:
    """The token counts of ``allocate_slots``, and the request's hashes."""
    check_non_negative("num_new_tokens", num_new_tokens)
    check_non_negative("num_new_computed_tokens", num_new_computed_tokens)
    check_non_negative("num_lookahead_tokens", num_lookahead_tokens)
    check_non_negative("num_external_computed_tokens", num_external_computed_tokens)
    if num_new_tokens == 0 and num_new_computed_tokens == 0 and not num_external_computed_tokens:
        raise ValueError("num_new_tokens must be positive with nothing computed to adopt, got 0")
    if enable_caching:
        check_block_hashes(
            request,
            settings.hash_block_size,
            settings.num_hash_lookahead_tokens,
            allow_fewer=allow_fewer_hashes,
        )


def _check_hit_count(
    group_id: int,
    size: int,
    num_new_computed_tokens: int,
    block_size: int,
    shorter: bool = False,
) -> None:
    """One group's hit holds exactly the blocks of ``num_new_computed_tokens`` (at most, with
    ``shorter``)."""
    expected = num_new_computed_tokens // block_size
    wrong = size > expected if shorter else size != expected
    if num_new_computed_tokens % block_size or wrong:
        raise ValueError(
            f"num_new_computed_tokens={num_new_computed_tokens} must be the "
            f"{size} blocks of new_computed_blocks group {group_id} "
            f"× block_size {block_size}"
        )


def _check_hit_ids(
    group_id: int,
    ids: Sequence[int],
    num_new_computed_tokens: int,
    block_size: int,
    num_blocks: int,
    issued: bool = False,
    shorter: bool = False,
) -> None:
    """One group's hit: exactly the blocks of ``num_new_computed_tokens``, each a pool block
    (known to be, when the manager ``issued`` them)."""
    _check_hit_count(group_id, len(ids), num_new_computed_tokens, block_size, shorter)
    if issued:
        return
    if ids and set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < num_blocks:
        return  # plain ints in range, checked at C speed
    bad = [i for i in ids if not isinstance(i, int) or not 0 <= i < num_blocks]
    if bad:
        raise ValueError(f"new_computed_blocks group {group_id} has invalid ids {bad!r}")


def check_block_ids(block_ids: Iterable[object], num_blocks: int) -> list[int]:
    """``block_ids`` as a list, each a plain int in ``0 … num_blocks − 1`` (``ValueError``
    naming the first that is not, before anything changes)."""
    return _check_ids("block_ids", "block", block_ids, num_blocks)


def hit_length_limit(request: RequestLike, max_cache_hit_length: int | None) -> int:
    """The longest hit a lookup of ``request`` may return: ``num_tokens − 1`` (the last token
    is always recomputed), lowered to ``max_cache_hit_length`` when given (checked)."""
    if max_cache_hit_length is None:
        return request.num_tokens - 1
    check_non_negative("max_cache_hit_length", max_cache_hit_length)
    return min(max_cache_hit_length, request.num_tokens - 1)


def check_group_ids(group_ids: Iterable[object], num_groups: int) -> list[int]:
    """``group_ids`` as a list, each a plain int in ``0 … num_groups − 1``."""
    return _check_ids("kv_cache_group_ids", "group", group_ids, num_groups)


def _check_ids(field: str, what: str, ids: Iterable[object], count: int) -> list[int]:
    checked: list[int] = []
    for value in ids:
        if type(value) is not int or not 0 <= value < count:
            raise ValueError(f"{field}: {value!r} is not a {what} id (0 … {count - 1})")
        checked.append(value)
    return checked
