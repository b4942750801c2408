"""KV cache events and prefix-cache statistics: what the manager reports to the outside.

Events let an external index (a KV-aware router, a CPU offload tier) mirror the prefix cache:
a block stored, a block removed, everything cleared. They have vLLM 0.33's schema
(``vllm.distributed.kv_events``): the same classes, fields, order and defaults, tuples in place
of lists, and hashes as the core's 32-byte ``BlockHash`` (an engine converts them, as vLLM does
under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). The core fills every field with the value
vLLM 0.33's own manager gives it in the same situation; ``EventBuilder`` says why each has it.
Statistics count lookups and their hits.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hybridkv.reference.block_hash import BlockHash
from hybridkv.reference.request import Request, RequestLike
from hybridkv.spec import KVCacheConfig, event_metadata

MEDIUM_GPU = "GPU"
"""vLLM's ``MEDIUM_GPU``: the medium of blocks of the device pool."""


@dataclass(frozen=True)
class BlockStored:
    """Full blocks of one group entered the prefix cache, in chain order (vLLM's fields).

    ``block_hashes`` the blocks stored; ``parent_block_hash`` the hash before the first position
    of the run (``None`` at the start of the chain); ``token_ids`` the tokens of every position of
    the run, null and skipped positions included; ``extra_keys`` and ``lookahead_token_ids`` one
    entry per stored block.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """A cached key of one group was dropped (its block's memory is about to be reused, or the
    block now answers for a longer prefix): one event per key, as vLLM's."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """``reset_prefix_cache`` dropped every cached hash."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBuilder:
    """Builds a manager's events with every field vLLM 0.33's manager gives them.

    Precomputed once per manager: each group's ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` (``hybridkv.spec.event_metadata``, equal to vLLM's
    ``get_kv_cache_spec_kind`` / ``get_kv_cache_spec_sliding_window`` of the group's spec) and
    the lookahead hashing setting. Why each field has its value:

    - ``lora_id``, ``lora_name``: the id and name of the request's ``lora`` adapter, else
      ``None`` (vLLM's ``adapter_id`` and ``name`` of its ``lora_request``; ``lora``, which an
      engine's builder overrides for its own requests).
    - ``medium``: ``MEDIUM_GPU``: the pool is the device tier (vLLM's block pool default).
    - ``extra_keys``: one entry per stored block, as vLLM's ``to_event_extra_keys`` publishes the
      keys of each block's hash, untagged: the LoRA name, ``(identifier, offset)`` of each
      multimodal item, the salt on the block starting at token 0, the prompt-embedding digest
      (``RequestKeys.event_keys``); ``None`` for a block without keys; ``None`` when no block
      was stored (``extra_keys``, which an engine's builder overrides for its own requests).
    - ``group_idx``: the KV cache group of the blocks.
    - ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``: the group's (see above; vLLM's
      manager annotates them in ``take_events``).
    - ``locality``, ``ownership``: ``None``: vLLM's block pool leaves them unspecified (they
      describe offloading tiers).
    - ``session_id``: the request's ``session_id`` when it has one, else ``None``.
    - ``lookahead_token_ids``: with ``num_hash_lookahead_tokens > 0``, for each stored block the
      tokens after it that its hash covers (vLLM's ``_lookahead_token_ids``); else ``None``.

    ``BlockRemoved`` carries ``medium`` and ``group_idx``; its ``locality`` and ``ownership``
    are ``None``, as vLLM's.

    An engine's integration may subclass it to build the engine's own event classes directly
    (one construction per event instead of two): ``stored_type``, ``removed_type`` and
    ``cleared_type`` are called with the fields in this order, ``sequence`` makes every list
    field (``tuple`` here), and ``convert_hash``, when set, maps every hash (vLLM's
    ``maybe_convert_block_hash``).
    """

    stored_type: Callable[..., Any] = BlockStored
    removed_type: Callable[..., Any] = BlockRemoved
    cleared_type: Callable[[], Any] = AllBlocksCleared
    sequence: Callable[[Iterable[Any]], Sequence[Any]] = tuple
    convert_hash: Callable[[BlockHash], Any] | None = None

    def __init__(
        self, groups: Sequence[tuple[str, int | None]], num_hash_lookahead_tokens: int = 0
    ) -> None:
        self.groups = tuple(groups)
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens

    @classmethod
    def of(cls, config: KVCacheConfig, num_hash_lookahead_tokens: int = 0) -> EventBuilder:
        """The builder of a manager of ``config``."""
        return cls(
            [event_metadata(group.spec) for group in config.groups], num_hash_lookahead_tokens
        )

    def extra_keys(
        self, request: Any, positions: Sequence[int], block_size: int
    ) -> Sequence[tuple[Any, ...] | None] | None:
        """One entry per stored block (at ``positions``), ``None`` when none was stored: a
        ``Request``'s keys as it hashes them (``request_keys``), else the salt on the block
        starting at token 0. An engine whose requests carry their keys in other fields
        overrides this."""
        if not positions:
            return None
        keys = request.request_keys if isinstance(request, Request) else None
        if keys is not None:
            return self.sequence(
                keys.event_keys(positions, block_size, self.num_hash_lookahead_tokens)
            )
        salt = request.cache_salt
        first = (salt,) if salt and positions[0] == 0 else None
        return self.sequence((first,) + (None,) * (len(positions) - 1))

    def lora(self, request: Any) -> tuple[int | None, str | None]:
        """``lora_id`` and ``lora_name`` of ``request``'s events: its ``lora`` adapter's id and
        name (a ``Request``'s), else ``None``."""
        lora = request.lora if isinstance(request, Request) else None
        return (None, None) if lora is None else (lora.id, lora.name)

    def stored(
        self,
        request: Any,
        block_hashes: Sequence[BlockHash],
        positions: Sequence[int],
        parent_block_hash: BlockHash | None,
        start: int,
        end: int,
        block_size: int,
        group_idx: int,
    ) -> KVCacheEvent:
        """``BlockStored`` of ``block_hashes``, the blocks at ``positions`` (block indices at
        ``block_size``, one per hash, ascending) of the run of tokens ``start … end − 1``."""
        seq, convert = self.sequence, self.convert_hash
        tokens = request.all_token_ids
        extra_keys = self.extra_keys(request, positions, block_size)
        lora_id, lora_name = self.lora(request)
        lookahead: Sequence[Sequence[int]] | None = None
        if self.num_hash_lookahead_tokens:
            n = self.num_hash_lookahead_tokens
            lookahead = seq(
                seq(tokens[(p + 1) * block_size : (p + 1) * block_size + n]) for p in positions
            )
        kind, window = self.groups[group_idx]
        parent: Any = parent_block_hash
        if convert is not None:
            hashes = seq(map(convert, block_hashes))
            parent = None if parent is None else convert(parent)
        else:
            hashes = seq(block_hashes)
        event: KVCacheEvent = self.stored_type(
            hashes,
            parent,
            seq(tokens[start:end]),
            block_size,
            lora_id,
            MEDIUM_GPU,
            lora_name,
            extra_keys,
            group_idx,
            kind,
            window,
            None,  # locality
            None,  # ownership
            request.session_id,
            lookahead,
        )
        return event

    def removed(self, block_hash: BlockHash, group_idx: int) -> KVCacheEvent:
        """``BlockRemoved`` of one key."""
        convert = self.convert_hash
        hashes = self.sequence((block_hash if convert is None else convert(block_hash),))
        event: KVCacheEvent = self.removed_type(hashes, MEDIUM_GPU, group_idx)
        return event

    def cleared(self) -> KVCacheEvent:
        """``AllBlocksCleared``."""
        event: KVCacheEvent = self.cleared_type()
        return event


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache lookups counted since the last report, in vLLM's shape.

    A lookup is counted when its request is admitted (``record``), not when it is made: a
    scheduler looks a waiting request up at every step until it fits, and only the lookup that
    admits it says what the cache saved. Requests admitted again after a preemption are counted
    apart (``preempted_*``): their hits are mostly their own blocks, kept since the preemption,
    and would inflate the hit rate of new traffic. ``queries`` and ``hits`` are tokens;
    ``reset`` says the prefix cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool = False) -> PrefixCacheStats:
        """These statistics plus one admitted lookup of ``num_tokens`` tokens that hit
        ``num_hits`` (counted apart when the request was ``preempted`` before)."""
        if preempted:
            return replace(
                self,
                preempted_requests=self.preempted_requests + 1,
                preempted_queries=self.preempted_queries + num_tokens,
                preempted_hits=self.preempted_hits + num_hits,
            )
        return replace(
            self,
            requests=self.requests + 1,
            queries=self.queries + num_tokens,
            hits=self.hits + num_hits,
        )

    def after_reset(self) -> PrefixCacheStats:
        """These statistics, marked as spanning a prefix-cache reset."""
        return replace(self, reset=True)


def count_admission(
    stats: PrefixCacheStats, request: RequestLike, num_hits: int
) -> PrefixCacheStats:
    """``stats`` plus the lookup that admitted ``request`` with ``num_hits`` cached tokens.

    A request counts as preempted when it has ``num_preemptions > 0`` (the scheduler's
    counter; a request without the attribute was never preempted). ``num_hits`` must lie in
    ``[0, num_tokens)``: the last token is always recomputed.
    """
    if (
        not isinstance(num_hits, int)
        or isinstance(num_hits, bool)
        or not 0 <= num_hits < max(request.num_tokens, 1)
    ):
        raise ValueError(
            f"num_hits must be an int in [0, {request.num_tokens}) for request "
            f"{request.request_id!r}, got {num_hits!r}"
        )
    preempted = request.num_preemptions > 0
    return stats.record(request.num_tokens, num_hits, preempted)
