"""``KVCacheManager``: the scheduler's interface to the KV cache (Implementation, first layer).

The scheduler asks two questions per request and step: how much of this prompt is cached
(``get_computed_blocks``), and can the next tokens get slots (``allocate_slots``, ``None`` when
the pool is short). Everything else (groups, attention types, the block pool) stays behind the
coordinator.

Every call validates its input before it changes anything: a rejected call, like a failed
allocation, leaves the state as it was (a failed allocation still releases the blocks that left
a sliding window or chunk, exactly as a successful one would have).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from hybridkv.policies import EvictionPolicy, resolve_policy
from hybridkv.reference.connector_calls import ConnectorCalls
from hybridkv.reference.coordinator import make_coordinator
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.prefix_stats import PrefixCacheCounter, PrefixCacheStatsCalls
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.reused_events import reused_block_events
from hybridkv.reference.single_type_managers import BlocksPerGroup, prompt_tokens
from hybridkv.reference.snapshot import PoolSnapshot, pool_snapshot
from hybridkv.reference.table_invariants import (
    cached_tokens_by_scan,
    check_ref_counts,
    check_tables,
)
from hybridkv.reference.validation import (
    check_allocation,
    check_block_hashes,
    check_cache_blocks,
    hit_length_limit,
    validate_manager_config,
)
from hybridkv.spec import KVCacheConfig
from hybridkv.spec.errors import InvariantError, check_non_negative


class KVCacheManager(ConnectorCalls, PrefixCacheStatsCalls):
    """Allocation and prefix caching for every KV cache group of one model.

    The keyword-only settings are an engine's (vLLM's names):

    - ``hash_block_size``: tokens per block hash; by default the block size of a single group,
      else the gcd of the groups' block sizes (their lcm with caching off or a Mamba group in
      ``"none"`` mode). The scheduler block size, a multiple of every group's block size, is
      their lcm: hits land on it.
    - ``max_in_flight_tokens``: tokens scheduled but not yet settled (an engine's
      ``max_num_batched_tokens``); it sizes a window's reservation in a full-prompt admission.
    - ``use_eagle``: EAGLE drafting; cache hits drop their last block so the drafter recomputes
      it (only the groups flagged ``is_eagle_group``, or all when none is).
    - ``num_hash_lookahead_tokens``: EAGLE/MTP with lookahead block hashes instead; requests
      must be built with the same value.
    - ``num_prefill_lookahead``: multi-module MTP's draft modules, which prefill the last
      ``num_prefill_lookahead − 1`` computed tokens again: those are cached a step later.
    - ``log_stats``: count admitted lookups for ``make_prefix_cache_stats`` (on by default, as
      an engine logs them unless told not to).
    - ``event_builder_class``: builds the KV events (``EventBuilder``: the core's dataclasses);
      an engine's integration passes a subclass that builds the engine's own event classes.
    - ``eviction_policy``: which free blocks new tokens reuse: ``"lru"`` (vLLM's order, the
      default), a shipped policy's name, ``"module:Class"`` or an ``EvictionPolicy`` instance
      (``hybridkv.policies``).
    """

    def __init__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        log_stats: bool = True,
        event_builder_class: type[EventBuilder] = EventBuilder,
        num_prefill_lookahead: int = 0,
        eviction_policy: str | EvictionPolicy = "lru",
    ) -> None:
        policy = resolve_policy(eviction_policy)
        settings = validate_manager_config(
            config,
            max_model_len,
            enable_caching,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            log_stats=log_stats,
            num_prefill_lookahead=num_prefill_lookahead,
        )
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.settings = settings
        self.hash_block_size = settings.hash_block_size
        self.scheduler_block_size = settings.scheduler_block_size
        self.block_size = settings.scheduler_block_size
        self.coordinator = make_coordinator(
            config,
            settings,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            event_builder_class=event_builder_class,
            eviction_policy=policy,
        )
        self.eviction_policy = "lru" if policy is None else policy.name
        self.block_pool = self.coordinator.block_pool
        self.num_groups = len(config.groups)
        self.log_stats = log_stats
        self._stats = PrefixCacheCounter(log_stats)
        # Tokens in flight at each request's last allocation: that step still reads the Mamba
        # states before them, so an "align" table may hold their blocks too (the invariant).
        self.in_flight_tokens: dict[str, int] = {}
        # Blocks ``pop_blocks_for_free`` handed out, not yet freed (``connector_calls``).
        self.deferred_holders: Counter[int] = Counter()

    def make_request(
        self, request_id: str, prompt_token_ids: Sequence[int], **options: Any
    ) -> Request:
        """A ``Request`` hashed as this manager reads it (its hash block size and lookahead);
        ``options`` are ``Request``'s other keywords. The optimized backend's ``make_request``
        also gives it that backend's hashing memo, so the same line is the fast path there."""
        return Request(
            request_id,
            prompt_token_ids,
            hash_block_size=self.hash_block_size,
            num_hash_lookahead_tokens=self.settings.num_hash_lookahead_tokens,
            **options,
        )

    # --- The scheduler's calls --------------------------------------------------------------

    def get_computed_blocks(
        self,
        request: RequestLike,
        max_cache_hit_length: int | None = None,
        *,
        report_reused_blocks: bool = False,
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's longest cache hit: its blocks per group, its length in tokens, and the
        shared-prefix boundary.

        The last token is always recomputed (its logits are needed), so a hit is at most
        ``num_tokens − 1`` tokens long. The boundary is where some type alone found the prefix
        cached beyond the hit (the first type looked up, full attention if any): a prefix other
        requests share but a sparse group has not cached yet. A scheduler stores it on the
        request (``request.shared_prefix_boundary``) so that the sparse groups cache there too.
        It is 0 when there is no such prefix, and always with one group.

        ``max_cache_hit_length`` caps the hit below ``num_tokens − 1`` (vLLM's argument: an
        external connector that knows a shorter valid prefix). ``report_reused_blocks`` (vLLM's
        ``kv_cache_report_mode="full"``): with events on, a ``BlockStored`` event per group for
        the blocks of a non-empty hit (``reused_events``).
        """
        if not self.prefix_cache_lookup_enabled(request):
            return KVCacheBlocks.empty(self.num_groups), 0, 0
        lookahead = self.settings.num_hash_lookahead_tokens
        check_block_hashes(request, self.hash_block_size, lookahead, allow_fewer=True)
        hits, num_hit_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
            request.block_hashes, hit_length_limit(request, max_cache_hit_length)
        )
        if report_reused_blocks and num_hit_tokens:
            pool, sizes = self.block_pool, [len(blocks) for blocks in hits]
            pool.events += reused_block_events(
                pool.event_builder, request, sizes, self.config, self.hash_block_size
            )
        block_ids = tuple(tuple(block.block_id for block in blocks) for blocks in hits)
        boundary = num_hit_tokens + num_uncached if num_uncached else 0
        return KVCacheBlocks(block_ids), num_hit_tokens, boundary

    def new_step_starts(self) -> None:
        """The scheduler begins a step: a Mamba state cached in the previous step may now be
        adopted (until then its block is still being written; the same-step rule)."""
        self.coordinator.new_step_starts()

    def allocate_slots(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        *,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        watermark_blocks: int = 0,
        num_external_computed_tokens: int = 0,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (and lookahead), or ``None`` if they do not fit.

        ``num_new_computed_tokens`` and ``new_computed_blocks`` are a cache hit from
        ``get_computed_blocks`` that a request being admitted adopts. With
        ``full_sequence_must_fit`` (an engine's admission of a waiting request) the whole
        sequence must fit first, a window counting only what it ever holds at once; if it does
        not, nothing is released. Returns the new blocks per group.

        ``reserved_blocks`` free blocks stay untouched for other sequences (an engine's async
        loads in flight); ``watermark_blocks`` more must stay free as headroom (vLLM applies its
        watermark to waiting and preempted requests when others are scheduled). The
        full-sequence check keeps the watermark only, as vLLM's does.

        ``num_external_computed_tokens`` follow the hit at admission: tokens a KV connector
        supplies (loaded from another tier or engine). They count as computed and get blocks,
        only where their type still reads them; with ``delay_cache_blocks`` nothing is cached
        until the load is done (``cache_blocks``).

        ``num_encoder_tokens`` size a cross-attention group's table (an encoder-decoder
        model's encoder input, scheduled in this step; 0 otherwise, as vLLM's scheduler passes
        it): that group ignores the decoder tokens, and the other groups ignore these.

        Token regions, as the scheduler sees them::

            | computed | new computed (hit) | external | new | lookahead |
                       |<----------- to be allocated ------------------->|
                       |<------ to be cached ------------>|
        """
        hits = self._validate_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
        )
        check_non_negative("reserved_blocks", reserved_blocks)
        check_non_negative("watermark_blocks", watermark_blocks)
        check_non_negative("num_encoder_tokens", num_encoder_tokens)
        request_id = request.request_id
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local_computed + num_external_computed_tokens
        total_computed = min(num_computed, self.max_model_len)
        prefill_end = max(prompt_tokens(request), request.num_tokens - 1)
        if full_sequence_must_fit:
            full_length = min(request.num_tokens, self.max_model_len)
            needed = self.coordinator.get_num_blocks_to_allocate(
                request_id,
                full_length,
                hits,
                total_computed,
                full_length,
                apply_admission_cap=True,
                prefill_end=prefill_end,
                num_external_computed_tokens=num_external_computed_tokens,
                num_encoder_tokens=num_encoder_tokens,
            )
            if needed + watermark_blocks > self.block_pool.num_free_blocks:
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, self.max_model_len)
        # Release out-of-window blocks first: they may be exactly what this step needs. A step
        # still in flight reads them, so only processed tokens count.
        in_flight = request.num_in_flight_tokens
        self.coordinator.remove_skipped_blocks(request_id, max(0, total_computed - in_flight))
        if in_flight:
            self.in_flight_tokens[request_id] = in_flight
        else:
            self.in_flight_tokens.pop(request_id, None)
        needed = self.coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hits,
            num_computed,
            num_tokens_main_model,
            prefill_end=prefill_end,
            num_external_computed_tokens=num_external_computed_tokens,
            num_encoder_tokens=num_encoder_tokens,
        )
        if needed + watermark_blocks > self.block_pool.num_free_blocks - reserved_blocks:
            return None
        if any(hits) or num_external_computed_tokens:
            self.coordinator.allocate_new_computed_blocks(
                request_id, hits, num_local_computed, num_external_computed_tokens
            )
        new_blocks = self.coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_tokens_main_model, num_encoder_tokens
        )
        if not delay_cache_blocks:
            # Lookahead slots hold tokens that may be rejected: cache only real tokens.
            num_tokens_to_cache = min(total_computed + num_new_tokens, request.num_tokens)
            self.coordinator.cache_blocks(request, num_tokens_to_cache)
        return KVCacheBlocks(tuple(tuple(b.block_id for b in blocks) for blocks in new_blocks))

    def free(self, request: RequestLike) -> None:
        """Release every block of a finished, aborted or preempted request (a no-op if none)."""
        self.coordinator.free(request.request_id)
        self.in_flight_tokens.pop(request.request_id, None)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_computed_tokens`` into the prefix cache
        (for callers that delayed caching, e.g. while KV arrives from another engine)."""
        check_cache_blocks(request, num_computed_tokens)
        if self.enable_caching:
            lookahead = self.settings.num_hash_lookahead_tokens
            check_block_hashes(request, self.hash_block_size, lookahead, allow_fewer=True)
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table per group (empty lists for an unknown request)."""
        tables = self.coordinator.get_blocks(request_id)
        return tuple([block.block_id for block in table] for table in tables)

    def cached_block_counts(self) -> dict[str, tuple[int, ...]]:
        """Per request holding blocks, per group its blocks in the cache (``num_cached_block``)."""
        managers = self.coordinator.managers
        ids = dict.fromkeys(rid for m in managers for rid, held in m.req_to_blocks.items() if held)
        return {rid: tuple(m.num_cached_block.get(rid, 0) for m in managers) for rid in ids}

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Tokens of the request that are in the prefix cache: per group the longest prefix one
        of its blocks is cached under, the minimum over the groups (vLLM's estimate, read from
        the request's own tables, not the pool). Each group reads a few positions of its table
        (``SingleTypeKVCacheManager.prefix_positions``): O(groups), whatever the length."""
        cached: int | None = None
        for manager in self.coordinator.managers:
            longest = manager.cached_prefix_tokens(request_id)
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (``False``) while any request holds a block."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats.after_reset()
        return True

    # --- Observation ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call, in vLLM 0.33's schema (``reference.events``;
        empty unless events are enabled)."""
        return self.block_pool.take_events()

    def snapshot(self) -> PoolSnapshot:
        """The pool's observable state as one comparable value."""
        return pool_snapshot(self.block_pool, self.num_groups)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool and the managers disagree (tests call it after
        every step): reference counts equal holders, no block in two groups, nulls only where
        the group's type puts them (``hybridkv.reference.table_invariants``), and each
        request's estimate of its cached tokens equal to the scan of its tables."""
        self.block_pool.check_invariants()
        holders = check_tables(self.coordinator.managers, self.in_flight_tokens)
        check_ref_counts(self.block_pool.blocks, holders + self.deferred_holders)
        # Last: the estimate reads the tables the checks above vouch for.
        for request_id in self.cached_block_counts():
            estimate = self.estimate_cached_tokens(request_id)
            scan = cached_tokens_by_scan(self.coordinator.get_blocks(request_id))
            if estimate != scan:
                raise InvariantError(
                    f"request {request_id!r}: estimate_cached_tokens {estimate} but its tables "
                    f"hold a prefix of {scan} cached tokens"
                )

    # --- Validation (hybridkv.reference.validation) ------------------------------------------

    def _validate_allocation(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
    ) -> BlocksPerGroup:
        """Check every argument; return the adopted hits as blocks per group."""
        hit_ids = check_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            config=self.config,
            enable_caching=self.enable_caching,
            holds_blocks=lambda request_id: any(self.get_block_ids(request_id)),
            settings=self.settings,
            allow_fewer_hashes=True,
        )
        blocks = self.block_pool.blocks
        return tuple([blocks[i] for i in ids] for ids in hit_ids)
