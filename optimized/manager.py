"""``TorchKVCacheManager``: the reference's scheduler API on flat buffers, plus whole-step batches.

Same public API and observable behaviour as ``hybridkv.reference.KVCacheManager`` (same
results, free-queue order, reference counts, cached blocks, events and statistics), plus:
``device``, the limits ``max_num_reqs`` and ``max_blocks_per_req``, the block-table tensors
(``block_table``, ``row_of``), the batched ``allocate_slots_batch`` and ``free_batch``,
``host_nbytes``, ``block_hasher``, ``make_request``, ``tuning`` and the whole ``state``.

This module is the facade: it validates each call and dispatches it to the phase that serves
it, each a module of functions over one ``ManagerState`` (``hybridkv.optimized.state``, which
says what it holds): ``hits`` (lookup), ``allocation`` and ``admission`` (a first
allocation), ``step`` and ``fused_step`` (a running request's step), ``caching`` and
``general_caching`` (entering full blocks into the prefix cache), ``mamba`` (a Mamba
``"align"`` layout, request by request), ``batch`` (whole steps; a small one's loop in
``batch_small``) and ``invariants``.

Data layout: the manager holds the state, the statistics and the last lookup's result, and what
the quiet exit of ``allocate_slots`` reads: the row counters (one comparison with
``RowTables.quiet_below[row]`` decides most decode calls) and a few ``GroupLayout`` flags.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridkv.optimized import (
    allocation,
    batch,
    batch_free,
    general_caching,
    hits,
    invariants,
    step,
)
from hybridkv.optimized.batch_small import SmallBatches
from hybridkv.optimized.connector_calls import ConnectorCalls
from hybridkv.optimized.fused_step import FusedStep
from hybridkv.optimized.layout import BlockIds, GroupLayout
from hybridkv.optimized.request_calls import RequestCalls
from hybridkv.optimized.state import ManagerState, Tuning, TuningKnobs
from hybridkv.optimized.step_columns import ColumnRequest
from hybridkv.policies import EvictionPolicy, resolve_policy
from hybridkv.reference.events import EventBuilder, KVCacheEvent
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.prefix_stats import PrefixCacheCounter, PrefixCacheStatsCalls
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.snapshot import PoolSnapshot
from hybridkv.reference.validation import (
    check_block_hashes,
    check_cache_blocks,
    hit_length_limit,
    validate_manager_config,
)
from hybridkv.spec import KVCacheConfig
from hybridkv.spec.errors import ZERO

__all__ = ["BlockIds", "TorchKVCacheManager", "Tuning"]


class TorchKVCacheManager(
    ConnectorCalls, RequestCalls, SmallBatches, TuningKnobs, PrefixCacheStatsCalls
):
    """Allocation and prefix caching for every KV cache group, on flat buffers (module doc)."""

    def __init__(
        self,
        config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = False,
        *,
        device: str | torch.device = "cpu",
        max_num_reqs: int = 256,
        max_blocks_per_req: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        log_stats: bool = True,
        event_builder_class: type[EventBuilder] = EventBuilder,
        tuning: Tuning | None = None,
        eviction_policy: str | EvictionPolicy = "lru",
        num_prefill_lookahead: int = 0,
    ) -> None:
        policy = resolve_policy(eviction_policy)
        self.settings = settings = validate_manager_config(
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
        layout = GroupLayout.build(
            config,
            settings,
            max_num_reqs,
            max_blocks_per_req,
            caching=enable_caching,
            events=enable_kv_cache_events,
            immediate=policy is not None,
        )
        self.config, self.max_model_len, self.enable_caching = config, max_model_len, enable_caching
        self.log_stats, self.device = log_stats, torch.device(device)
        self.hash_block_size, self.block_size = layout.hash_block_size, layout.block_size
        self.num_groups, self.lookahead = layout.num_groups, layout.lookahead
        self.max_num_reqs, self.max_blocks_per_req = max_num_reqs, layout.max_blocks_per_req
        self.retention_interval = layout.retention_interval
        builder = event_builder_class.of(config, self.lookahead) if enable_kv_cache_events else None
        self._s = s = ManagerState.build(layout, self.device, builder, tuning or Tuning(), policy)
        self.pool = s.pool
        self.eviction_policy = "lru" if policy is None else policy.name
        self.block_hasher = s.block_hasher
        """``hash_full_blocks_torch``'s hashes, adopting a cached prefix's (``hash_memo``):
        offered to a ``Request`` built without a hasher, named by ``make_request``."""
        # What the quiet exit of ``allocate_slots`` reads, one attribute away.
        self._rows, self._row_of = s.rows, s.rows.row_of
        self._quiet_below = s.rows.quiet_below
        self._has_align, self.no_blocks = layout.has_align, layout.no_blocks
        """``no_blocks``: what a call needing no new block returns, one shared object."""
        self._fused = FusedStep.build(s)  # the common crossing call in one function, or None
        self._stats = PrefixCacheCounter(log_stats)
        # The last lookup's result: handed back to ``allocate_slots``, its ids need no check.
        self._issued: KVCacheBlocks | None = None

    @property
    def fast_paths(self) -> dict[str, int]:
        """How often each fast path ran since the manager was built (``path_counts``)."""
        return self._s.pool.paths.listed()

    @property
    def state(self) -> ManagerState:
        """Everything the manager holds (``hybridkv.optimized.state``), for tests and tools."""
        return self._s

    def block_table(self, group_id: int) -> torch.Tensor:
        """Group ``group_id``'s int32 ``[max_num_reqs, max_blocks_per_req]`` table on ``device``,
        updated in place (row ``row_of(request_id)``; positions below the row's length valid)."""
        return self._s.tables.on_device[group_id]

    def row_of(self, request_id: str) -> int | None:
        """The table row the request occupies, or ``None`` if it holds no blocks."""
        return self._row_of(request_id)

    def get_computed_blocks(
        self,
        request: RequestLike,
        max_cache_hit_length: int | None = None,
        *,
        report_reused_blocks: bool = False,
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's longest cache hit: its blocks per group, its length in tokens, and the
        shared-prefix boundary, at most ``max_cache_hit_length`` tokens; over its hashed blocks
        only if it has fewer hashes (``KVCacheManager.get_computed_blocks``: the same keywords)."""
        if type(request) is Request or type(request) is ColumnRequest:
            request.offer_block_hasher(self.block_hasher)
        if not self.prefix_cache_lookup_enabled(request):
            return self.no_blocks, 0, 0
        self._s.settle()
        check_block_hashes(request, self.hash_block_size, self.lookahead, allow_fewer=True)
        limit = hit_length_limit(request, max_cache_hit_length)
        found, length, boundary = hits.longest_hit(self._s, request, limit, report_reused_blocks)
        self._issued = found
        return found, length, boundary

    def new_step_starts(self) -> None:
        """The scheduler begins a step: a Mamba state cached in the previous step may now be
        adopted; the previous step's pending releases and inserts are made now."""
        self._s.settle()
        self._s.mamba.cached_this_step.clear()

    # The measured hot path (``python -m hybridkv.bench``), over 60 lines on purpose: both quiet
    # exits stay inline (no further Python call); validation and admission in ``allocation``.
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
        """Slots for ``num_new_tokens`` more tokens (and lookahead), or ``None`` if they do not fit
        (``KVCacheManager.allocate_slots``, also for ``num_external_computed_tokens`` a KV
        connector supplies and the ``num_encoder_tokens`` that size a cross-attention group's
        table): ``reserved_blocks`` free blocks stay untouched and
        ``watermark_blocks`` more stay free (the full-sequence check keeps the watermark only).
        Window and chunk blocks are released on the processed count, ``num_computed_tokens``
        less the request's ``num_in_flight_tokens`` (async scheduling)."""
        if (
            new_computed_blocks is None
            and num_new_computed_tokens is ZERO
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            and (
                num_lookahead_tokens is ZERO
                or (type(num_lookahead_tokens) is int and num_lookahead_tokens > 0)
            )
            and (reserved_blocks is ZERO or (type(reserved_blocks) is int and reserved_blocks > 0))
            and (
                watermark_blocks is ZERO or (type(watermark_blocks) is int and watermark_blocks > 0)
            )
            and num_external_computed_tokens == 0
            and num_encoder_tokens is ZERO
        ):
            # A step of a running request (no hit to adopt, plain counts): what ``check_allocation``
            # checks reduces to the request's hash count (more hashes than full blocks: another
            # hash block size; the checker says so). A ``Request`` hashed at this block size,
            # with at least this lookahead, has no more by construction.
            row = self._row_of(request.request_id)
            sound = (
                not self.enable_caching
                or (
                    (type(request) is Request or type(request) is ColumnRequest)
                    and request.hash_block_size == self.hash_block_size
                    and request.num_hash_lookahead_tokens >= self.lookahead
                )
                or type(request) in self.trusted
            )
            if (
                row is not None
                and sound
                and request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
                < self._quiet_below[row]
                and not reserved_blocks
                and not watermark_blocks
                and not full_sequence_must_fit
                and not self._has_align
            ):
                return self.no_blocks  # a decode step that crosses no threshold
            if (
                not sound
                and len(request.block_hashes)
                > max(request.num_tokens - self.lookahead, 0) // self.hash_block_size
            ):
                check_block_hashes(request, self.hash_block_size, self.lookahead, allow_fewer=True)
            if row is not None and not full_sequence_must_fit and not self._has_align:
                # A running request: its row's thresholds (read by ``step``) say whether this
                # step takes, releases or caches a block.
                computed = request.num_computed_tokens
                if (
                    computed + num_new_tokens + num_lookahead_tokens < self._quiet_below[row]
                    and not reserved_blocks
                    and not watermark_blocks
                ):
                    return self.no_blocks  # another request type's quiet step, its hashes checked
                kept_free = reserved_blocks + watermark_blocks
                fused = self._fused
                if fused is not None and not kept_free:
                    # ``running_step``'s work, inline on the per-call path (``None``: declined).
                    made = fused.cross(
                        request, row, num_new_tokens, num_lookahead_tokens, delay_cache_blocks
                    )
                    if made is not None:
                        return made
                args = (num_new_tokens, num_lookahead_tokens, delay_cache_blocks, kept_free)
                return step.run(self._s, request, row, *args)
            checked = True  # no hit, plain counts: nothing more to check
        else:
            checked = False
        allocated = allocation.allocate(
            self._s,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit,
            reserved_blocks,
            watermark_blocks,
            checked=checked,
            issued=new_computed_blocks is not None and new_computed_blocks is self._issued,
            num_external=num_external_computed_tokens,
            num_encoder=num_encoder_tokens,
        )
        self._s.raise_policy_error()
        return allocated

    def allocate_slots_batch(
        self,
        requests: Sequence[RequestLike],
        num_new_tokens: Sequence[int] | int,
        num_lookahead_tokens: int = 0,
        delay_cache_blocks: bool = False,
        *,
        reserved_blocks: int = 0,
        watermark_blocks: int = 0,
    ) -> list[KVCacheBlocks | None]:
        """One scheduler step for running requests: exactly ``[allocate_slots(r, n, …same
        keywords) for r, n in zip(requests, num_new_tokens)]`` (``num_new_tokens`` may be one
        int for all), vectorised across the requests (``hybridkv.optimized.batch``)."""
        counts = batch.counts_of(requests, num_new_tokens)
        one = self.allocate_slots  # called as is: a ``partial`` with keywords doubles a call
        with self._s.tables.one_copy():  # the single calls' table changes: one copy
            served = batch.allocate_slots_batch(
                self._s,
                requests,
                num_new_tokens,
                num_lookahead_tokens,
                delay_cache_blocks,
                reserved_blocks,
                watermark_blocks,
            )
            if served is None:
                kept_free = (reserved_blocks, watermark_blocks)
                return self.allocate_each(
                    one, requests, counts, num_lookahead_tokens, delay_cache_blocks, kept_free
                )
            out, single = served
            for i, count, row in single:  # checked by the batch: past ``allocate_slots``' checks
                out[i] = self.running_step(
                    requests[i], row, count, num_lookahead_tokens, delay_cache_blocks
                )
            return out

    def free_batch(self, requests: Sequence[RequestLike]) -> None:
        """Exactly ``for r in requests: free(r)``, vectorised across the requests."""
        self._s.settle()
        if not batch_free.free_batch(self._s, requests):
            for request in requests:
                self.free(request)

    def free(self, request: RequestLike) -> None:
        """Release every block of the request, each group as one batch (a no-op if none)."""
        self._s.settle()
        self._s.free(request.request_id)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_computed_tokens`` into the prefix cache."""
        check_cache_blocks(request, num_computed_tokens)
        if not self.enable_caching:
            return
        self._s.settle()
        check_block_hashes(request, self.hash_block_size, self.lookahead, allow_fewer=True)
        general_caching.cache_blocks(self._s, request, num_computed_tokens)
        self._s.raise_policy_error()

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table per group (empty lists for an unknown request)."""
        row = self._row_of(request_id)
        if row is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(self._s.table(g, row) for g in range(self.num_groups))

    def cached_block_counts(self) -> dict[str, tuple[int, ...]]:
        """The reference's (vLLM's ``num_cached_block``; ``hybridkv.optimized.invariants``)."""
        return invariants.cached_block_counts(self._s)

    def estimate_cached_tokens(self, request_id: str) -> int:
        """The reference's (the longest cached prefix per group, the minimum over the groups;
        0 for an unknown request; ``hybridkv.optimized.invariants``)."""
        return invariants.estimate_cached_tokens(self._s, request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (``False``) while any request holds a block."""
        self._s.settle()
        if not self.pool.reset_prefix_cache():
            return False
        self._s.row_src[:] = [-1] * self.max_num_reqs
        self._stats.after_reset()
        self._s.raise_policy_error()
        return True

    @property
    def usage(self) -> float:
        self._s.settle()
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        self._s.settle()
        return self.pool.num_free_blocks

    def take_events(self) -> list[KVCacheEvent]:
        self._s.settle()
        return self.pool.take_events()

    def snapshot(self) -> PoolSnapshot:
        return invariants.snapshot(self._s)

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory in the manager's buffers (pool, tables and row counters)."""
        return self.pool.nbytes + self._s.tables.nbytes + self._rows.nbytes

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool, rows, tables or cached-token estimates disagree."""
        invariants.check_invariants(self._s)
