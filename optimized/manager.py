"""``TorchKVCacheManager``: the reference's scheduler API on flat buffers, plus whole-step batches.

Same public API and observable behaviour as ``hybridkv.reference.KVCacheManager`` (same
results, free-queue order, reference counts, cached blocks, events and statistics), plus:
``device``, the capacity limits ``max_num_reqs`` and ``max_blocks_per_req``, the block-table
tensors (``block_table``, ``row_of``) and the batched calls ``allocate_slots_batch`` and
``free_batch`` (in ``hybridkv.optimized.batch``).

Data layout (G groups, R = ``max_num_reqs`` rows, W = ``max_blocks_per_req`` positions)
--------------------------------------------------------------------------------------------
The block tables, ``tables[G, R, W]`` int32 block ids (row r of group g is the block table of the
request in row r), live in ``BlockTables`` (``hybridkv.optimized.block_tables``), ``self.tables``:
one flat host buffer, mirrored on a CUDA ``device`` by one indexed copy of the changed entries at
the end of every call. Which request holds which row, and per row and group the table's length,
leading nulls and cached positions, with the row's thresholds (when it next needs work;
``quiet_below`` says in one comparison that a step needs none, which decides most decode calls at
once), live in ``RowTables`` (``hybridkv.optimized.rows``), ``self.rows``, and ``RowThresholds``
(``hybridkv.optimized.row_thresholds``), ``self.thresholds``, recomputes the thresholds after a
step. A request gets a row on its first successful allocation and gives it back when freed;
``row_of`` says which. Per-block state lives in ``TorchBlockPool``; lookups in
``hybridkv.optimized.lookup``.

A running request's step changes its own row and tables at once; what it changes in the pool
(releasing the blocks that left its windows, caching its newly full blocks) waits in the
pool's ``PendingWork`` (``hybridkv.optimized.pending``, which says why that is exact) where the
layout allows (``columns.defers``), and every other call makes it first (``_settle``).

Groups of one block size take the paths above. With different block sizes every group keeps its
own positions (``block_table(g)`` is as wide as the largest group's need), sees the hashes at its
block size, and caches one call at a time (``_cache_general``: scheduler-block rounding, the
prompt-tail partial entries); a Mamba ``"align"`` group sends every allocation through
``hybridkv.optimized.mamba``. Such layouts are served request by request (the batched calls
give the same results as the single ones).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized import batch, mamba
from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.block_tables import BlockTables
from hybridkv.optimized.group_columns import GroupColumns
from hybridkv.optimized.group_rules import (
    CHUNKED,
    FULL,
    MAMBA,
    NEVER,
    SLIDING,
    GroupRule,
    one_window,
)
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.lookup import (
    NO_HIT,
    GroupHit,
    HitBlocks,
    Lookup,
    TypeProbe,
    lead_run,
)
from hybridkv.optimized.row_thresholds import RowThresholds
from hybridkv.optimized.rows import RowTables
from hybridkv.optimized.thresholds import (
    BATCH_MIN,
    BUSY_BATCH_MIN,
    INSERT_MIN,
    PENDING_MAX,
    VECTOR_MIN,
)
from hybridkv.optimized.type_hits import TYPE_HITS, HitProbe, TypeHit
from hybridkv.reference.events import (
    EventBuilder,
    KVCacheEvent,
    PrefixCacheStats,
    count_admission,
)
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.reference.single_type_managers import prompt_tokens
from hybridkv.reference.snapshot import PoolSnapshot
from hybridkv.reference.validation import (
    check_allocation,
    check_block_hashes,
    check_cache_blocks,
    check_issued_allocation,
    validate_manager_config,
)
from hybridkv.spec import (
    KVCacheConfig,
    KVCacheSpec,
    SlidingWindowSpec,
    rules,
)
from hybridkv.spec.errors import check_non_negative, check_positive, require

BlockIds = tuple[tuple[int, ...], ...]


class TorchKVCacheManager:
    """Allocation and prefix caching for every KV cache group, on flat buffers (see the module
    doc)."""

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
    ) -> None:
        self.settings = validate_manager_config(
            config,
            max_model_len,
            enable_caching,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            log_stats=log_stats,
        )
        check_positive("max_num_reqs", max_num_reqs)
        self.config = config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.hash_block_size = self.settings.hash_block_size
        self.block_size = self.settings.scheduler_block_size
        self.num_groups = len(config.groups)
        self.rules = [GroupRule.of(group.spec) for group in config.groups]
        # The groups whose windows or chunks release blocks, in group order.
        self._releasing = [(g, rule) for g, rule in enumerate(self.rules) if rule.releases]
        # One block size (the hash block size too): the vectorised paths and the one-key-per-
        # block caching apply. Otherwise (groups with different block sizes) tables differ in
        # width, each group sees the hashes at its block size, and requests go one by one.
        self._uniform = all(
            rule.block_size == self.block_size == self.hash_block_size for rule in self.rules
        )
        # A Mamba "align" group: every allocation goes through ``hybridkv.optimized.mamba``.
        self._has_align = any(rule.kind == MAMBA for rule in self.rules)
        self._mamba = mamba.MambaState()
        self._general = not self._uniform or self._has_align
        needed = max(rule.blocks_for_tokens(max_model_len) for rule in self.rules)
        if max_blocks_per_req is None:
            max_blocks_per_req = needed
        check_positive("max_blocks_per_req", max_blocks_per_req)
        if max_blocks_per_req < needed:
            raise ValueError(
                f"max_blocks_per_req must be at least the {needed} blocks of max_model_len "
                f"{max_model_len}, got {max_blocks_per_req!r}"
            )
        self.device = torch.device(device)
        self.pool = TorchBlockPool(
            config.num_blocks,
            self.num_groups,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            event_builder=(
                event_builder_class.of(config, self.settings.num_hash_lookahead_tokens)
                if enable_kv_cache_events
                else None
            ),
        )
        g, r, w = self.num_groups, max_num_reqs, max_blocks_per_req
        self.max_num_reqs, self.max_blocks_per_req = r, w
        self.tables = BlockTables(g, r, w, self.device)
        self._tab = self.tables.host  # the flat host tables, read on every path
        self.rows = RowTables(r, g)
        self._row_of = self.rows.row_of
        self.retention_interval = config.prefix_cache_retention_interval
        self._admission_caps = [
            group.spec.admission_cap(
                self.settings.max_model_len, self.settings.max_in_flight_tokens
            )
            for group in config.groups
        ]
        self._row_src = [-1] * r
        # Groups whose hits take the EAGLE last-block drop: the flagged drafter groups, or
        # every group when none is flagged (``KVCacheCoordinator``).
        eagle = {g for g, group in enumerate(config.groups) if group.is_eagle_group}
        if self.settings.use_eagle and not eagle:
            eagle = set(range(self.num_groups))
        self._eagle_groups = eagle if self.settings.use_eagle else set()
        self.lookahead = self.settings.num_hash_lookahead_tokens
        self._types = self._attention_types(config)
        self._type_eagle = [
            any(g in self._eagle_groups for g in group_ids) for _, group_ids in self._types
        ]
        # Per group: does its type take the EAGLE drop (``SingleTypeKVCacheManager.use_eagle``)?
        self._group_eagle = [False] * self.num_groups
        for (_, group_ids), eagle_type in zip(self._types, self._type_eagle, strict=True):
            for group_id in group_ids:
                self._group_eagle[group_id] = eagle_type
        # Sliding-window groups that cache only the blocks a later hit can reach
        # (``reachable_block_mask``): under sparse retention, or when a hit needs fewer of
        # their blocks than a scheduler block holds.
        sparse_groups = [
            g
            for g, group in enumerate(config.groups)
            if isinstance(group.spec, SlidingWindowSpec)
            and enable_caching
            and (
                self.retention_interval is not None
                or self.block_size // group.spec.block_size
                > rules.sliding_window_contiguous_blocks(
                    group.spec.sliding_window, group.spec.block_size, self._group_eagle[g]
                )
            )
        ]
        # Per-group constants of the single-request paths: where each group's table starts in
        # the flat tables, and the distinct rules of the groups that release blocks (and which
        # one each such group follows).
        self._group_bases = [self.tables.base(group, 0) for group in range(g)]
        self._group_base_column = np.array(self._group_bases, dtype=np.int64)[:, None]
        self._release_rules = list(dict.fromkeys(rule for _, rule in self._releasing))
        self._release_plan = [
            (group, self._release_rules.index(rule)) for group, rule in self._releasing
        ]
        # The releasing groups as one slice of a row's counters, when they are neighbours of
        # one sliding-window rule (``group_rules.one_window``).
        self._one_window = one_window(self.rules)
        # One block size, no Mamba ``"align"`` group, no speculative blocks: every allocation
        # extends all of a row's tables to one length.
        self._uniform_columns = (
            self._uniform
            and not self._has_align
            and not any(rule.spec_blocks for rule in self.rules)
        )
        # Per-group constants of the vectorised paths. A running request's step leaves its
        # releases and inserts to the pool's pending work (``hybridkv.optimized.pending``,
        # ``defers``) where they are plain: one block size, no Mamba ``"align"`` group, no
        # speculative blocks, caching on without events or sparse retention (each of these
        # needs the pool current at the step itself).
        self.columns = GroupColumns.build(
            r,
            [rule.span if rule.kind == SLIDING else NEVER for rule in self.rules],
            [rule.span if rule.kind == CHUNKED else 0 for rule in self.rules],
            releases=any(rule.releases for rule in self.rules),
            sparse_groups=sparse_groups,
            vectorisable=not self._general and not any(rule.spec_blocks for rule in self.rules),
            defers=self._uniform_columns
            and not self._general
            and enable_caching
            and not enable_kv_cache_events
            and not sparse_groups,
            mamba_align=self._has_align,
        )
        # When each row next needs work (``hybridkv.optimized.row_thresholds``).
        self.thresholds = RowThresholds(
            self.rows,
            self.rules,
            self.columns,
            block_size=self.block_size,
            caching=enable_caching,
            uniform=self._uniform_columns,
            general=self._general,
        )
        self._stats = PrefixCacheStats()
        self.block_hasher = HashMemo(self.hash_block_size)
        """The block hasher for this manager's requests: ``Request(..., hash_block_size=
        manager.hash_block_size, block_hasher=manager.block_hasher)``. It returns the hashes of
        ``hash_full_blocks_torch``, adopting those of a prefix this manager has cached
        (``hybridkv.optimized.hash_memo``) and hashing only the rest."""
        if enable_caching:
            self.pool.memo = self.block_hasher
        # The size thresholds a test may lower (``hybridkv.optimized.thresholds``).
        self.vector_min = VECTOR_MIN
        self.batch_min = BATCH_MIN
        self.busy_batch_min = BUSY_BATCH_MIN
        empty: BlockIds = tuple(() for _ in range(self.num_groups))
        self._no_blocks = KVCacheBlocks(empty)
        self._no_hits = empty
        self._no_group_hits = tuple(GroupHit.of(()) for _ in range(self.num_groups))
        # The last lookup's result: handed back to ``allocate_slots`` as it is, its ids need
        # no checking (they are pool blocks by construction).
        self._issued: KVCacheBlocks | None = None

    @staticmethod
    def _attention_types(config: KVCacheConfig) -> list[tuple[KVCacheSpec, list[int]]]:
        """(spec, group ids) per distinct spec, full attention first (``HybridCoordinator``)."""
        types: dict[KVCacheSpec, list[int]] = {}
        for group_id, group in enumerate(config.groups):
            types.setdefault(group.spec, []).append(group_id)
        ordered = list(types.items())
        ordered.sort(key=lambda item: not item[0].hit_is_prefix)
        return ordered

    # --- Block tables -----------------------------------------------------------------------

    def block_table(self, group_id: int) -> torch.Tensor:
        """Group ``group_id``'s int32 ``[max_num_reqs, max_blocks_per_req]`` table on ``device``,
        updated in place by every call (row ``row_of(request_id)``, positions below the table
        length are valid)."""
        return self.tables.on_device[group_id]

    def row_of(self, request_id: str) -> int | None:
        """The table row the request occupies, or ``None`` if it holds no blocks."""
        return self.rows.row_of(request_id)

    def _table(self, group_id: int, row: int) -> list[int]:
        """Group ``group_id``'s block table of the request in row ``row``."""
        return self.tables.table(group_id, row, self.rows.length[self.rows.index(row, group_id)])

    def _release_row(self, request_id: str, row: int) -> None:
        """Give the request's row back, with its Mamba bookkeeping and its source."""
        self.rows.release(request_id, row)
        if self._has_align:
            mamba.release_row(self, row)
        src = self._row_src[row]
        if src >= 0:
            self._row_src[row] = -1
            self.pool.source(src).row_refs -= 1
            self.pool.maybe_drop_source(src)

    def _settle(self) -> None:
        """Make the running steps' pending releases and inserts (``PendingWork``): every call
        that reads the pool, but a running request's step, calls this first."""
        if self.pool.pending:
            self.pool.apply_pending()

    # --- Lookup -----------------------------------------------------------------------------

    def get_computed_blocks(
        self, request: RequestLike, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The request's longest cache hit: its blocks per group, its length in tokens, and the
        shared-prefix boundary (``KVCacheManager.get_computed_blocks``); at most
        ``max_cache_hit_length`` tokens when given. A request with fewer block hashes than full
        blocks is looked up over its hashed blocks only."""
        if not self.prefix_cache_lookup_enabled(request):
            return self._no_blocks, 0, 0
        self._settle()
        hbs = self.hash_block_size
        check_block_hashes(request, hbs, self.lookahead, allow_fewer=True)
        max_length = request.num_tokens - 1
        if max_cache_hit_length is not None:
            check_non_negative("max_cache_hit_length", max_cache_hit_length)
            max_length = min(max_cache_hit_length, max_length)
        lookups: dict[int, Lookup] = {}
        memos: list[TypeProbe] = []
        for (spec, group_ids), eagle in zip(self._types, self._type_eagle, strict=True):
            b = spec.block_size
            lookup = lookups.get(b)
            if lookup is None:
                lookup = lookups[b] = Lookup(
                    self.pool, request, b, self.vector_min, self.lookahead, b // hbs
                )
            # An EAGLE type of a hybrid matches one block beyond the candidate, then drops it.
            extra = b if eagle and self.num_groups > 1 and not spec.holds_state else 0
            limit = min((max_length + extra) // b, len(lookup.hashes))
            memos.append(TypeProbe(lookup, group_ids, limit))
        if len(memos) > 1 and len(lookups) == 1:
            lead_run(memos)
        hits: Sequence[GroupHit]
        boundary = 0
        if self.num_groups == 1:
            spec = self._types[0][0]
            hits = self._type_hit(spec, memos[0], max_length, self._type_eagle[0], spec.block_size)
            hit_length = len(hits[0]) * spec.block_size
        else:
            hits, hit_length, longest = self._hybrid_hit(memos, max_length)
            boundary = longest if longest > hit_length else 0
        self._issued = HitBlocks(hits)
        return self._issued, hit_length, boundary

    def new_step_starts(self) -> None:
        """The scheduler begins a step: a Mamba state cached in the previous step may now be
        adopted (no per-step state without a Mamba ``"align"`` group). The previous step's
        pending releases and inserts are made now."""
        self._settle()
        if self._has_align:
            mamba.new_step_starts(self)

    def _type_hit(
        self,
        spec: KVCacheSpec,
        memo: TypeProbe,
        max_length: int,
        drop: bool = False,
        alignment: int = 0,
    ) -> TypeHit:
        """One type's longest hit of at most ``max_length`` tokens (the ``longest_hit`` hook,
        from ``TYPE_HITS``); with ``drop`` (EAGLE) one block shorter; its length a multiple of
        ``alignment`` (the scheduler block)."""
        probe = HitProbe(
            memo,
            max_length,
            min(max_length // spec.block_size, memo.length),
            alignment or self.block_size,
            drop,
            self.vector_min,
        )
        return TYPE_HITS[spec.kind](spec, probe)

    def _hybrid_hit(
        self, memos: list[TypeProbe], max_length: int
    ) -> tuple[list[GroupHit], int, int]:
        """``rules.hybrid_hit_length`` over the attention types (as the reference coordinator
        calls it), each type probed through its memo; also the longest length one type found
        on its own."""
        hits = [NO_HIT] * self.num_groups
        num_hashed = len(memos[0].lookup.request_hashes) * self.hash_block_size

        def lookup(index: int, length: int, drop: bool) -> int:
            spec, group_ids = self._types[index]
            extend = drop and not spec.holds_state
            max_len = min(length + spec.block_size, num_hashed) if extend else length
            found = self._type_hit(spec, memos[index], max_len, drop, self.block_size)
            for group_id, blocks in zip(group_ids, found, strict=True):
                hits[group_id] = blocks
            return len(found[0]) * spec.block_size

        hit_length, longest = rules.hybrid_hit_length(
            lookup,
            [spec.hit_is_prefix for spec, _ in self._types],
            self._type_eagle,
            max_length,
        )
        for spec, group_ids in self._types:
            if spec.hit_is_prefix:
                for group_id in group_ids:
                    hits[group_id] = hits[group_id].cut(hit_length // spec.block_size)
        return hits, hit_length, longest

    # --- Allocation -------------------------------------------------------------------------

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
    ) -> KVCacheBlocks | None:
        """Slots for ``num_new_tokens`` more tokens (and lookahead), or ``None`` if they do not fit
        (``KVCacheManager.allocate_slots``): ``reserved_blocks`` free blocks stay untouched and
        ``watermark_blocks`` more stay free (the full-sequence check keeps the watermark only).
        Window and chunk blocks are released on the processed count, ``num_computed_tokens``
        less the request's ``num_in_flight_tokens`` (async scheduling)."""
        if (
            new_computed_blocks is None
            and type(num_new_computed_tokens) is int
            and num_new_computed_tokens == 0
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            and type(num_lookahead_tokens) is int
            and num_lookahead_tokens >= 0
            and type(reserved_blocks) is int
            and reserved_blocks >= 0
            and type(watermark_blocks) is int
            and watermark_blocks >= 0
        ):
            # A step of a running request (no hit to adopt, plain counts): what
            # ``check_allocation`` checks reduces to the request's hash count (more hashes
            # than full blocks: another hash block size; the checker says so). A ``Request``
            # hashed at this block size, with at least this lookahead, has no more by
            # construction.
            row = self._row_of(request.request_id)
            sound = not self.enable_caching or (
                type(request) is Request
                and request.hash_block_size == self.hash_block_size
                and request.num_hash_lookahead_tokens >= self.lookahead
            )
            if (
                row is not None
                and sound
                and request.num_computed_tokens + num_new_tokens + num_lookahead_tokens
                < self.rows.quiet_below[row]
                and not reserved_blocks
                and not watermark_blocks
                and not full_sequence_must_fit
                and not self._has_align
            ):
                return self._no_blocks  # a decode step that crosses no threshold
            num_tokens = request.num_tokens
            if (
                not sound
                and len(request.block_hashes)
                > max(num_tokens - self.lookahead, 0) // self.hash_block_size
            ):
                check_block_hashes(request, self.hash_block_size, self.lookahead, allow_fewer=True)
            if row is not None and not full_sequence_must_fit and not self._has_align:
                # A running request: its row's thresholds (read by ``_step``) say whether this
                # step takes, releases or caches a block.
                computed = request.num_computed_tokens
                if (
                    computed + num_new_tokens + num_lookahead_tokens < self.rows.quiet_below[row]
                    and not reserved_blocks
                    and not watermark_blocks
                ):
                    return self._no_blocks  # another request type's quiet step, its hashes checked
                if computed > self.max_model_len:
                    computed = self.max_model_len
                need = computed + num_new_tokens + num_lookahead_tokens
                if need > self.max_model_len:
                    need = self.max_model_len
                cache_up_to = -1
                if self.enable_caching and not delay_cache_blocks:
                    cache_up_to = computed + num_new_tokens
                    if cache_up_to > num_tokens:
                        cache_up_to = num_tokens
                kept_free = reserved_blocks + watermark_blocks
                try:
                    return self._step(request, row, computed, need, cache_up_to, kept_free)
                finally:
                    self.tables.flush()
            hits = self._no_hits
            group_hits = self._no_group_hits
        elif (
            new_computed_blocks is not None
            and new_computed_blocks is self._issued
            and isinstance(new_computed_blocks, HitBlocks)
            and not self._has_align
        ):
            # This manager's own lookup result: its counts are all there is to check, and its
            # arrays are adopted as they are (no Python ints built).
            group_hits = new_computed_blocks.group_hits
            check_issued_allocation(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                [len(hit) for hit in group_hits],
                num_lookahead_tokens,
                config=self.config,
                enable_caching=self.enable_caching,
                holds_blocks=self.rows.__contains__,
                settings=self.settings,
                allow_fewer_hashes=True,
            )
            check_non_negative("reserved_blocks", reserved_blocks)
            check_non_negative("watermark_blocks", watermark_blocks)
            hits = self._no_hits  # not read on this path
        else:
            hits = check_allocation(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                config=self.config,
                enable_caching=self.enable_caching,
                holds_blocks=self.rows.__contains__,
                settings=self.settings,
                allow_fewer_hashes=True,
                issued=new_computed_blocks is not None and new_computed_blocks is self._issued,
            )
            check_non_negative("reserved_blocks", reserved_blocks)
            check_non_negative("watermark_blocks", watermark_blocks)
            group_hits = tuple(map(GroupHit.of, hits)) if not self._has_align else ()
        self._settle()
        if self._has_align:
            try:
                return mamba.allocate(
                    self,
                    request,
                    num_new_tokens,
                    num_new_computed_tokens,
                    hits,
                    num_lookahead_tokens,
                    delay_cache_blocks,
                    full_sequence_must_fit,
                    reserved_blocks,
                    watermark_blocks,
                )
            finally:
                self.tables.flush()
        if full_sequence_must_fit and not self._whole_sequence_fits(
            request, num_new_computed_tokens, group_hits, watermark_blocks
        ):
            return None
        try:
            return self._allocate(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                group_hits,
                num_lookahead_tokens,
                delay_cache_blocks,
                reserved_blocks + watermark_blocks,
            )
        finally:
            self.tables.flush()

    def _allocate(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hits: Sequence[GroupHit],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        kept_free: int = 0,
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` after validation, ``hits`` each group's adopted hit; ``kept_free``
        blocks (reserved and watermark) must stay free."""
        pool = self.pool
        request_id = request.request_id
        row = self.rows.row_of(request_id)
        computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        need = min(computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        cache_up_to = -1
        if self.enable_caching and not delay_cache_blocks:
            cache_up_to = min(computed + num_new_tokens, request.num_tokens)
        if row is not None:
            return self._step(request, row, computed, need, cache_up_to, kept_free)
        # Admission: skipped positions, then the adopted hits, then new blocks.
        required = [rule.blocks_for_tokens(need) for rule in self.rules]
        skipped = [rule.skipped_positions(computed) for rule in self.rules]
        adopted = self._adopted_blocks(hits, skipped)
        total = int(np.count_nonzero(pool.ref.n[adopted] == 0))  # hits in the free queue
        for g, count in enumerate(required):
            total += max(count - max(skipped[g], len(hits[g])), 0)
        if total + kept_free > pool.num_free_blocks:
            return None
        row = self.rows.take(request_id)
        self._adopt(row, hits, skipped, adopted)
        admitted = self._extend(row, required)
        if cache_up_to >= 0:
            self._cache(request, row, cache_up_to)
        self.thresholds.refresh(row)
        return KVCacheBlocks(admitted)

    def _step(
        self,
        request: RequestLike,
        row: int,
        computed: int,
        need: int,
        cache_up_to: int,
        kept_free: int,
    ) -> KVCacheBlocks | None:
        """A running request's step (``allocate_slots`` of a request holding ``row``): release
        what left each window or chunk, take the blocks ``need`` tokens lack, cache the blocks
        full up to ``cache_up_to`` tokens (-1: none); the row's thresholds say which of these
        can do anything."""
        pool = self.pool
        rows = self.rows
        # A step still in flight reads the window's blocks: only processed tokens count.
        processed = max(0, computed - int(getattr(request, "num_in_flight_tokens", 0)))
        released = cached = False
        if processed >= rows.release_at[row]:
            self._release_skipped(row, processed)
            released = True
        new_blocks: tuple[tuple[int, ...], ...] | None = None
        took = need > rows.capacity[row]
        g_count = self.num_groups
        total = have = count = 0
        required: list[int] = []
        if took:
            if self._uniform_columns:
                # Every group of the row is as long (each allocation extends all of them to
                # the same length): the same count of new blocks for each.
                have = rows.length[row * g_count]
                count = -(-need // self.block_size) - have
                total = count * g_count
            else:
                required = [rule.blocks_for_tokens(need) for rule in self.rules]
                at, length = row * g_count, rows.length
                total = sum(max(c - length[at + g], 0) for g, c in enumerate(required))
        if (took or kept_free) and not self._fits(total + kept_free):
            if released:
                self.thresholds.after_step(row, True, False, False)
            return None
        if took:
            new_blocks = (
                self._extend_uniform(row, have, count)
                if self._uniform_columns
                else self._extend(row, required)
            )
        if cache_up_to >= rows.cache_at[row]:
            self._cache(request, row, cache_up_to, defer=self.columns.defers)
            cached = True
        if released or took or cached:
            self.thresholds.after_step(row, released, took, cached)
        if len(pool.pending) >= PENDING_MAX:
            self._settle()  # long without another call: bounded memory
        return self._no_blocks if new_blocks is None else KVCacheBlocks(new_blocks)

    def _fits(self, blocks: int) -> bool:
        """Whether ``blocks`` blocks are free, counting those the pending releases free."""
        if blocks <= self.pool.num_free_blocks:
            return True
        if self.pool.pending:
            self._settle()
            return blocks <= self.pool.num_free_blocks
        return False

    def _whole_sequence_fits(
        self,
        request: RequestLike,
        num_new_computed_tokens: int,
        hits: Sequence[GroupHit],
        watermark_blocks: int = 0,
    ) -> bool:
        """A full-prompt admission's first check: the whole sequence, a window counting only
        what it ever holds at once, fits in the free blocks less the watermark (before anything
        is released)."""
        computed = min(request.num_computed_tokens + num_new_computed_tokens, self.max_model_len)
        full_length = min(request.num_tokens, self.max_model_len)
        row = self.rows.row_of(request.request_id)
        length = self.rows.length
        total = 0
        skipped = [rule.skipped_positions(computed) for rule in self.rules]
        for g, rule in enumerate(self.rules):
            required = rule.blocks_for_tokens(full_length)
            cap = self._admission_caps[g]
            if cap is not None:
                required = min(required, cap)
            if row is not None:
                total += max(required - length[row * self.num_groups + g], 0)
            else:
                total += max(required - max(skipped[g], len(hits[g])), 0)
        if row is None:
            adopted = self._adopted_blocks(hits, skipped)
            total += int(np.count_nonzero(self.pool.ref.n[adopted] == 0))
        return total + watermark_blocks <= self.pool.num_free_blocks

    def _extend(self, row: int, required: list[int]) -> BlockIds:
        """Take new blocks, group 0 first, until each group holds ``required`` positions: one
        take from the free queue for all groups, split in group order (the blocks, evictions
        and events of one take per group)."""
        length, at = self.rows.length, row * self.num_groups
        counts = [c - length[at + g] for g, c in enumerate(required)]
        total = sum(c for c in counts if c > 0)
        if not total:
            return self._no_hits
        popped = self.pool.pop_n(total)
        tab, row_base, bases = self._tab.a, row * self.max_blocks_per_req, self._group_bases
        tracking = self.tables.mirrored
        new_blocks: list[tuple[int, ...]] = []
        taken = 0
        for g, count in enumerate(counts):
            if count <= 0:
                new_blocks.append(())
                continue
            have = length[at + g]
            base = bases[g] + row_base + have
            if count == 1:  # a decode step's new block
                block = popped[taken]
                tab[base] = block
                new_blocks.append((block,))
            else:
                part = popped[taken : taken + count]
                tab[base : base + count] = _int_array(part)
                new_blocks.append(tuple(part))
            taken += count
            length[at + g] = have + count
            if tracking:
                self.tables.touched(g, row, have, have + count)
        return tuple(new_blocks)

    def _extend_uniform(self, row: int, have: int, count: int) -> BlockIds:
        """``_extend`` of a uniform layout's row, whose groups all hold ``have`` positions, by
        ``count`` positions each."""
        if count <= 0:
            return self._no_hits
        g_count = self.num_groups
        popped = self.pool.pop_n(count * g_count)
        tab, length, at = self._tab.a, self.rows.length, row * g_count
        offset = row * self.max_blocks_per_req + have
        tracking = self.tables.mirrored
        length[at : at + g_count] = array("q", (have + count,)) * g_count
        if count == 1:  # a decode step's new block in every group
            for base, block in zip(self._group_bases, popped, strict=True):
                tab[base + offset] = block
            if tracking:
                for g in range(g_count):
                    self.tables.touched(g, row, have, have + 1)
            return tuple(zip(popped))
        new_blocks: list[tuple[int, ...]] = []
        for g, base in enumerate(self._group_bases):
            part = popped[g * count : (g + 1) * count]
            tab[base + offset : base + offset + count] = _int_array(part)
            new_blocks.append(tuple(part))
            if tracking:
                self.tables.touched(g, row, have, have + count)
        return tuple(new_blocks)

    @staticmethod
    def _adopted_blocks(hits: Sequence[GroupHit], skipped: Sequence[int]) -> npt.NDArray[Any]:
        """The real blocks an admission adopts: each group's hit past its skipped positions
        (every group's blocks differ from the others', and a group's from each other)."""
        parts = [
            hit.ids[max(skip - hit.nulls, 0) :] for hit, skip in zip(hits, skipped, strict=True)
        ]
        adopted = np.concatenate(parts) if parts else np.empty(0, dtype=np.int32)
        real: npt.NDArray[Any] = adopted[adopted != 0]
        return real

    def _adopt(
        self,
        row: int,
        hits: Sequence[GroupHit],
        skipped: Sequence[int],
        adopted: npt.NDArray[Any],
    ) -> None:
        """Admit a request: null positions for its skipped tokens, then its adopted hits (whose
        real blocks are ``adopted``)."""
        self.pool.touch_array(adopted)
        rows, tab = self.rows, self._tab.n
        row_base = row * self.max_blocks_per_req
        for g, (hit, skip) in enumerate(zip(hits, skipped, strict=True)):
            base = self._group_bases[g] + row_base
            size = max(skip, len(hit))
            zeros = max(skip, hit.nulls)  # positions before the hit's first adopted block
            ids = hit.ids[zeros - hit.nulls :] if zeros < size else hit.ids[:0]
            tab[base : base + zeros] = 0
            tab[base + zeros : base + size] = ids
            nulls = zeros
            if not hit.dense and ids.shape[0]:
                real = np.flatnonzero(ids)
                nulls += int(real[0]) if real.shape[0] else int(ids.shape[0])
            i = rows.index(row, g)
            rows.length[i] = rows.cached[i] = rows.kept[i] = size
            rows.nulls[i] = nulls
            self.tables.touched(g, row, 0, size)

    def _release_skipped(self, row: int, computed: int) -> None:
        """Release the blocks that left each window or chunk (``remove_skipped_blocks``), every
        group's in one pass of the pool (as ``free_blocks`` group by group)."""
        released: list[int] = []  # every group's blocks in walk order, group after group
        sizes: list[int] | None = None  # each group's count, once one releases several
        # Equal rules skip as many positions: one target per distinct rule.
        window = self._one_window
        if window is not None:
            # ``sliding_window_skipped_tokens``, then ``skipped_block_positions``, inline.
            skipped = computed - window[3] + 1
            target = skipped // window[2] if skipped > 0 else 0
            one = self._release_one_each(row, target, window[0], window[1])
            if one is not None:
                self._free_released(one, None)
                return
            targets = [target]
        else:
            targets = [rule.skipped_positions(computed) for rule in self._release_rules]
        rows, tab = self.rows, self._tab.a
        length, nulls = rows.length, rows.nulls
        at, row_base = row * self.num_groups, row * self.max_blocks_per_req
        bases = self._group_bases
        tracking = self.tables.mirrored
        for g, which in self._release_plan:
            i = at + g
            target, held = targets[which], nulls[i]
            if target == held + 1 and target <= length[i]:
                # A decode step's one block leaving the window.
                pos = bases[g] + row_base + held
                released.append(tab[pos])
                tab[pos] = 0
                nulls[i] = target
                if sizes is not None:
                    sizes.append(1)
                if tracking:
                    self.tables.touched(g, row, held, target)
            elif target > held:
                walk = self._skip_positions(row, g, target)
                if walk:
                    if sizes is None:
                        sizes = [1] * len(released)
                    sizes.append(len(walk))
                    released.extend(walk)
        if released:
            self._free_released(released, sizes)

    def _release_one_each(self, row: int, target: int, first: int, end: int) -> list[int] | None:
        """A decode step's release under one sliding window (``_one_window``, groups ``first``
        … ``end − 1``): when every window group's leading nulls end at ``target − 1`` and its
        table reaches ``target``, each lets its block at ``target − 1`` go. Those blocks sit
        one group's table apart in the flat tables, so one strided read and one strided write
        release them all, in group order (``BlockTables.clear_across``). ``None`` (nothing
        changed) when that is not the case."""
        rows = self.rows
        at = row * self.num_groups
        held = target - 1
        nulls = rows.nulls[at + first : at + end]
        if min(nulls) != held or max(nulls) != held:
            return None
        if min(rows.length[at + first : at + end]) < target:
            return None
        released = self.tables.clear_across(first, end, row, held)
        rows.nulls[at + first : at + end] = array("q", (target,)) * (end - first)
        return released

    def _free_released(self, released: list[int], sizes: list[int] | None) -> None:
        """Hand a step's released blocks (walk order; ``sizes``: each group's count where one
        released several) to the pool: deferred where they are cached, else freed at once."""
        pool = self.pool
        if self.columns.defers:
            if min(map(pool.src.a.__getitem__, released)) >= 0:
                pool.pending.release(released)  # cached blocks: to the tail, made later
                return
            self._settle()  # an uncached block goes to the head: the pool must be current
        if sizes is None:
            pool.free_walks([[block] for block in released])
            return
        walks, start = [], 0
        for size in sizes:
            walks.append(released[start : start + size])
            start += size
        pool.free_walks(walks)

    def _release_skipped_group(self, row: int, g: int, computed: int) -> None:
        """``_release_skipped`` of one group (nothing unless a window or chunk)."""
        rule = self.rules[g]
        if rule.releases:
            released = self._skip_positions(row, g, rule.skipped_positions(computed))
            if released:
                self.pool.free_blocks(released)

    def _skip_positions(self, row: int, g: int, target: int) -> list[int]:
        """Null the row's positions of group ``g`` before ``target``; the blocks they held, in
        the order they are freed (last first)."""
        rows, tab = self.rows, self._tab.a
        i = rows.index(row, g)
        skipped = min(target, rows.length[i])
        nulls = rows.nulls[i]
        if skipped <= nulls:
            return []
        at = self.tables.base(g, row) + nulls
        if skipped - nulls == 1:  # a decode step's one block leaving the window
            released = [tab[at]]
            tab[at] = 0
        else:
            released = tab[at : at + skipped - nulls].tolist()
            released.reverse()
            tab[at : at + skipped - nulls] = _int_array([0] * (skipped - nulls))
        rows.nulls[i] = skipped
        self.tables.touched(g, row, nulls, skipped)
        return released

    def _source_of(self, request: RequestLike, row: int, num_hashes: int, num_tokens: int) -> int:
        """The row's source, created on its first cached block and kept current (it must have
        ``num_hashes`` hashes and ``num_tokens`` tokens, lookahead tokens besides)."""
        pool = self.pool
        src = self._row_src[row]
        if src >= 0:
            source = pool.sources[src]
            if (
                source is not None
                and len(source.tokens) >= num_tokens + self.lookahead
                and len(source.hashes) >= num_hashes
            ):
                return src  # current already (a request's own lists grow with it)
        tokens, hashes = request.all_token_ids, request.block_hashes
        if src < 0:
            src = pool.new_source(
                tokens,
                hashes,
                getattr(request, "cache_salt", None),
                getattr(request, "packed_token_ids", None),
            )
            pool.source(src).row_refs += 1
            self._row_src[row] = src
            if self._hashed_by_memo(request):
                pool.memo_srcs.add(src)
            return src
        source = pool.source(src)
        if len(source.tokens) < num_tokens + self.lookahead:
            source.tokens = tokens
            source.packed = getattr(request, "packed_token_ids", None)
        if len(source.hashes) < num_hashes:
            source.hashes = hashes
        return src

    def _hashed_by_memo(self, request: RequestLike) -> bool:
        """Whether the request's hashes are ``block_hasher``'s (so the memo may keep them)."""
        return (
            getattr(request, "block_hasher", None) is self.block_hasher
            and not self.lookahead
            and not getattr(request, "num_hash_lookahead_tokens", 0)
            and getattr(request, "hash_block_size", None) == self.hash_block_size
        )

    def _cache(self, request: RequestLike, row: int, num_tokens: int, defer: bool = False) -> None:
        """Enter the row's full blocks covered by ``num_tokens`` into the prefix cache (with
        ``defer``, a running step's: into the pool's pending work)."""
        if self._general:
            self._cache_general(request, row, num_tokens)
            return
        pool = self.pool
        b, g_count = self.block_size, self.num_groups
        hashes = request.block_hashes
        num_full = min(num_tokens // b, len(hashes))
        tab, cached, at = self._tab.a, self.rows.cached, row * g_count
        row_base, bases = row * self.max_blocks_per_req, self._group_bases
        entries: list[tuple[int, int, int]] = []  # (block, group, position)
        src = -1
        # Sparse retention and events need each group's stored positions; otherwise a group's
        # new full blocks are its table's slice.
        plain = not self.columns.sparse_groups and pool.event_builder is None
        if defer and plain and num_full > 0:
            last = num_full - 1
            row_blocks = self.tables.across(0, g_count, row, last)
            if min(cached[at : at + g_count]) == last == max(cached[at : at + g_count]) and min(
                row_blocks
            ):
                # A decode step: one newly full block in every group.
                src = self._source_of(request, row, num_full, num_full * b)
                pool.defer_row(row_blocks, self.columns.group_ids, last, hashes[last], src)
                cached[at : at + g_count] = array("q", (num_full,)) * g_count
                return
        start = cached[at]
        if (
            plain
            and not defer
            and num_full - start >= INSERT_MIN // g_count
            and min(cached[at : at + g_count]) == start == max(cached[at : at + g_count])
        ):
            self._cache_columns(request, row, start, num_full)
            return
        boundaries: list[int] | None = None
        for g in range(g_count):
            start = cached[at + g]
            if start >= num_full:
                continue
            if src < 0:
                src = self._source_of(request, row, num_full, num_full * b)
            base = bases[g] + row_base
            cached[at + g] = num_full
            if plain:
                if num_full - start == 1:  # a decode step's newly full block
                    block = tab[base + start]
                    if block:
                        entries.append((block, g, start))
                else:
                    for pos, block in enumerate(tab[base + start : base + num_full], start):
                        if block:
                            entries.append((block, g, pos))
                continue
            stored = []
            mask: Sequence[bool] | None = None
            if g in self.columns.sparse_groups:
                if boundaries is None:
                    boundaries = self._reachable_boundaries(request)
                mask = self._retention_mask(request, g, start, num_full, boundaries)
            for pos, block in enumerate(tab[base + start : base + num_full], start):
                if block and (mask is None or mask[pos - start]):
                    entries.append((block, g, pos))
                    stored.append(pos)
            if mask is not None and stored:
                self.rows.kept[at + g] = stored[-1] + 1
            if pool.event_builder is not None:
                parent = hashes[start - 1] if start else None
                pool.events.append(
                    pool.event_builder.stored(
                        request,
                        [hashes[p] for p in stored],
                        stored,
                        parent,
                        start * b,
                        num_full * b,
                        b,
                        g,
                    )
                )
        if not entries:
            return
        if defer:
            pool.defer_entries(entries, hashes, src)
            return
        if len(entries) < INSERT_MIN:
            pool.insert_entries(entries, hashes, src)
            return
        blocks, groups, positions = (
            np.array(column, dtype=np.int64) for column in zip(*entries, strict=True)
        )
        keys = pool.keys_of([hashes[p] for _, _, p in entries])
        pool.insert_array(blocks, groups, positions, keys, src)

    def _cache_columns(self, request: RequestLike, row: int, start: int, num_full: int) -> None:
        """``_cache`` of positions ``start … num_full − 1`` in every group of a row that has
        cached as far in each (a prompt's blocks), in numpy calls: the same entries in the same
        order (group by group, position by position, the null ones left out)."""
        g_count, b = self.num_groups, self.block_size
        src = self._source_of(request, row, num_full, num_full * b)
        positions = np.arange(start, num_full, dtype=np.int64)
        flat = self._group_base_column + row * self.max_blocks_per_req + positions
        blocks = self._tab.n[flat].astype(np.int64).ravel()
        shape = (g_count, positions.shape[0])
        groups = np.broadcast_to(np.arange(g_count, dtype=np.int64)[:, None], shape).ravel()
        every = np.broadcast_to(positions, shape).ravel()
        keys = np.broadcast_to(self.pool.keys_of(request.block_hashes[start:num_full]), shape)
        keys = keys.ravel()
        real = blocks != 0
        if not real.all():
            blocks, groups, every, keys = blocks[real], groups[real], every[real], keys[real]
        self.pool.insert_array(blocks, groups, every, keys, src)
        cached, at = self.rows.cached, row * g_count
        for i in range(at, at + g_count):
            cached[i] = num_full

    def _cacheable(self, num_tokens: int, g: int) -> int:
        """``HybridCoordinator.num_cacheable_tokens``: hits land on scheduler blocks, so a
        hybrid caches up to the last one (an EAGLE group one block past it)."""
        if self.num_groups == 1:
            return num_tokens
        sb = self.block_size
        aligned = num_tokens // sb * sb
        if self._group_eagle[g] and aligned > 0:
            return min(num_tokens, aligned + self.rules[g].block_size)
        return aligned

    def _cache_general(self, request: RequestLike, row: int, num_tokens: int) -> None:
        """``_cache`` for groups with different block sizes: each group caches its full blocks
        at its block size (keyed by the hash at the block's last hash boundary), one by one; a
        full-attention block larger than the hash block also keeps the prompt's tail entry."""
        hbs = self.hash_block_size
        num_hashed = len(request.block_hashes) * hbs
        boundaries: list[int] | None = None
        for g, rule in enumerate(self.rules):
            b = rule.block_size
            scale = b // hbs
            tokens = self._cacheable(num_tokens, g)
            if rule.kind == MAMBA:
                if boundaries is None:
                    boundaries = self._reachable_boundaries(request)
                mamba.cache_mamba_group(self, request, row, g, tokens, boundaries)
                continue
            start = self.rows.cached[self.rows.index(row, g)]
            num_full = min(tokens, num_hashed) // b
            if start < num_full:
                src = self._source_of(request, row, num_full * scale, num_full * b)
                mask: Sequence[bool] | None = None
                if g in self.columns.sparse_groups:
                    if boundaries is None:
                        boundaries = self._reachable_boundaries(request)
                    mask = self._retention_mask(request, g, start, num_full, boundaries)
                self._store_full_blocks(request, row, g, start, num_full, mask, src)
            if rule.kind == FULL and b != hbs:
                self._cache_prompt_tail(request, row, g, tokens)

    def _store_full_blocks(
        self,
        request: RequestLike,
        row: int,
        g: int,
        start: int,
        num_full: int,
        mask: Sequence[bool] | None,
        src: int,
    ) -> None:
        """Key positions ``start … num_full − 1`` of group ``g``'s row (those ``mask`` keeps) by
        the hash at each block's last hash boundary, as ``BlockPool.cache_full_blocks`` does;
        record ``num_full`` as cached and emit one ``BlockStored`` for the blocks stored."""
        pool = self.pool
        b = self.rules[g].block_size
        scale = b // self.hash_block_size
        hashes = request.block_hashes
        view = hashes[scale - 1 :: scale] if scale > 1 else hashes
        tab, base = self._tab.a, self.tables.base(g, row)
        positions = []
        kept = 0
        for pos in range(start, num_full):
            block = tab[base + pos]
            if not block or (mask is not None and not mask[pos - start]):
                continue
            pool.remove_keys(block)
            hidx = (pos + 1) * scale - 1
            pool.insert(block, hashes[hidx], g, hidx, src)
            positions.append(pos)
            kept = pos + 1
        i = self.rows.index(row, g)
        self.rows.cached[i] = num_full
        if mask is not None and kept:
            self.rows.kept[i] = kept
        self._mamba.running.add((row, g))
        if pool.event_builder is not None:
            parent = view[start - 1] if start else None
            pool.events.append(
                pool.event_builder.stored(
                    request,
                    [view[p] for p in positions],
                    positions,
                    parent,
                    start * b,
                    num_full * b,
                    b,
                    g,
                )
            )

    def _cache_prompt_tail(self, request: RequestLike, row: int, g: int, num_tokens: int) -> None:
        """``FullAttentionManager._cache_prompt_tail``: the block holding the prompt's last hash
        boundary also answers for it (an extra key beside a full-block key)."""
        pool, hbs = self.pool, self.hash_block_size
        b = self.rules[g].block_size
        hashes = request.block_hashes
        limit = prompt_tokens(request) - (0 if self._group_eagle[g] else 1)
        boundary = min(limit // hbs, len(hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % b == 0:
            return
        index = boundary // b
        if index >= self.rows.length[self.rows.index(row, g)]:
            return
        block = self._tab.a[self.tables.base(g, row) + index]
        if block == 0:
            return
        hidx = boundary // hbs - 1
        src = self._source_of(request, row, hidx + 1, boundary)
        already = pool.holds_key(block, src, hidx, g)
        if not already and pool.src.a[block] >= 0 and (pool.hash_index(block) + 1) < hidx + 1:
            pool.remove_keys(block)  # a shorter entry gives way
        pool.insert_key(block, src, hidx, g)
        if pool.event_builder is not None and not already:
            start = boundary - hbs
            parent = hashes[hidx - 1] if start else None
            pool.events.append(
                pool.event_builder.stored(
                    request, (hashes[hidx],), (hidx,), parent, start, boundary, hbs, g
                )
            )

    def _reachable_boundaries(self, request: RequestLike) -> list[int]:
        """Where a later request can resume (``KVCacheCoordinator.cache_blocks``): a resend of
        the prompt, and the shared-prefix boundary the scheduler stored on the request."""
        eagle = bool(self._eagle_groups)
        boundaries = list(rules.replay_boundaries(prompt_tokens(request), self.block_size, eagle))
        shared = int(getattr(request, "shared_prefix_boundary", 0))
        if shared:
            boundaries.append(shared)
        return boundaries

    def _retention_mask(
        self, request: RequestLike, g: int, start: int, end: int, boundaries: Sequence[int]
    ) -> Sequence[bool] | None:
        """Which of positions ``start … end − 1`` a sliding-window group caches."""
        spec = self.config.groups[g].spec
        assert isinstance(spec, SlidingWindowSpec)
        b = spec.block_size
        eagle = self._group_eagle[g]
        shared = int(getattr(request, "shared_prefix_boundary", 0))
        if eagle and shared:
            # A sibling diverging right after the junction cannot peek past it.
            boundaries = [*boundaries, shared - b]
        return rules.sliding_window_retention_mask(
            start,
            end,
            alignment_tokens=self.block_size,
            block_size=b,
            contiguous_blocks=rules.sliding_window_contiguous_blocks(spec.sliding_window, b, eagle),
            use_eagle=eagle,
            retention_interval=self.retention_interval,
            reachable_boundaries=boundaries,
        )

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
        """One scheduler step for running requests: exactly ``[allocate_slots(r, n,
        num_lookahead_tokens=…, delay_cache_blocks=…, reserved_blocks=…, watermark_blocks=…)
        for r, n in zip(requests, num_new_tokens)]`` (``num_new_tokens`` may be one int for
        all), vectorised across the requests."""
        return batch.allocate_slots_batch(
            self,
            requests,
            num_new_tokens,
            num_lookahead_tokens,
            delay_cache_blocks,
            reserved_blocks,
            watermark_blocks,
        )

    def free_batch(self, requests: Sequence[RequestLike]) -> None:
        """Exactly ``for r in requests: free(r)``, vectorised across the requests."""
        self._settle()
        batch.free_batch(self, requests)

    def free(self, request: RequestLike) -> None:
        """Release every block of the request, each group as one batch (a no-op if none)."""
        self._settle()
        if self._has_align:
            mamba.free(self, request.request_id)
        row = self.rows.row_of(request.request_id)
        if row is None:
            return
        for g in range(self.num_groups):
            walk = self._table(g, row)
            walk.reverse()
            self.pool.free_blocks(walk)
        self._release_row(request.request_id, row)

    def cache_blocks(self, request: RequestLike, num_computed_tokens: int) -> None:
        """Enter the request's full blocks up to ``num_computed_tokens`` into the prefix cache."""
        check_cache_blocks(request, num_computed_tokens)
        if not self.enable_caching:
            return
        self._settle()
        hbs = self.hash_block_size
        check_block_hashes(request, hbs, self.lookahead, allow_fewer=True)
        row = self.rows.row_of(request.request_id)
        if row is None:
            num_hashed = len(request.block_hashes) * hbs
            if any(
                min(self._cacheable(num_computed_tokens, g), num_hashed) // rule.block_size > 0
                for g, rule in enumerate(self.rules)
            ):
                raise KeyError(request.request_id)
            return
        self._cache(request, row, num_computed_tokens)
        self.thresholds.refresh(row)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's whole block table per group (empty lists for an unknown request)."""
        row = self.rows.row_of(request_id)
        if row is None:
            return tuple([] for _ in range(self.num_groups))
        return tuple(self._table(g, row) for g in range(self.num_groups))

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Tokens of the request that are in the prefix cache: per group the longest prefix one
        of its blocks is cached under (``block_hash_num_tokens``: the primary key's hash index
        plus one, in hash blocks), the minimum over the groups; 0 for an unknown request
        (``KVCacheManager.estimate_cached_tokens``). Each group reads the blocks at a few
        positions (``_prefix_positions``): O(groups), whatever the request's length."""
        row = self.rows.row_of(request_id)
        if row is None:
            return 0
        self._settle()
        cached: int | None = None
        for g in range(self.num_groups):
            longest = self._cached_prefix_tokens(request_id, row, g)
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def _prefix_positions(self, request_id: str, row: int, g: int) -> Sequence[int]:
        """Table positions among which the longest cached prefix of group ``g``'s table sits
        (``SingleTypeKVCacheManager.prefix_positions`` says why): for an attention group the
        last position adopted or kept under a retention mask, the last cached one and the
        first not cached (a prompt-tail entry); for a Mamba ``"align"`` group its real
        blocks."""
        if self.rules[g].kind == MAMBA:
            return self._mamba.positions.get((request_id, g), ())
        i = self.rows.index(row, g)
        cached = self.rows.cached[i]
        return self.rows.kept[i] - 1, cached - 1, cached

    def _cached_prefix_tokens(self, request_id: str, row: int, g: int) -> int:
        """The largest ``block_hash_num_tokens`` of group ``g``'s table (0 when no block is
        cached), read at ``_prefix_positions``."""
        pool, tab, base = self.pool, self._tab.a, self.tables.base(g, row)
        length = self.rows.length[self.rows.index(row, g)]
        longest = -1
        for pos in self._prefix_positions(request_id, row, g):
            if 0 <= pos < length:
                block = tab[base + pos]
                if block and pool.src.a[block] >= 0:
                    longest = max(longest, pool.hash_index(block))
        return (longest + 1) * self.hash_block_size

    def _estimate_cached_tokens_by_scan(self, request_id: str) -> int:
        """``estimate_cached_tokens`` as vLLM 0.33 computes it, over every block of every table
        (``check_invariants`` compares the two)."""
        row = self.rows.row_of(request_id)
        if row is None:
            return 0
        pool, g_count = self.pool, self.num_groups
        cached: int | None = None
        for g in range(g_count):
            base = self.tables.base(g, row)
            length = self.rows.length[self.rows.index(row, g)]
            table = self._tab.t[base : base + length].to(torch.int64)
            held = table[pool.src.t[table] >= 0]
            longest = 0
            if held.numel():
                index = int(((pool.hk.t[held] & 0xFFFFFFFF) // g_count).max())
                longest = (index + 1) * self.hash_block_size
            cached = longest if cached is None else min(cached, longest)
        return cached or 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (``False``) while any request holds a block."""
        self._settle()
        if not self.pool.reset_prefix_cache():
            return False
        self._row_src = [-1] * self.max_num_reqs
        if self.log_stats:
            self._stats = self._stats.after_reset()
        return True

    # --- Observation ------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        self._settle()
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        self._settle()
        return self.pool.num_free_blocks

    def take_events(self) -> list[KVCacheEvent]:
        self._settle()
        return self.pool.take_events()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics counted since the last ``make_prefix_cache_stats`` (``None`` with
        ``log_stats`` off)."""
        return self._stats if self.log_stats else None

    def prefix_cache_lookup_enabled(self, request: RequestLike) -> bool:
        return self.enable_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def record_prefix_cache_stats(self, request: RequestLike, num_hits: int) -> None:
        if self.log_stats and self.prefix_cache_lookup_enabled(request):
            self._stats = count_admission(self._stats, request, num_hits)

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats

    def snapshot(self) -> PoolSnapshot:
        self._settle()
        pool = self.pool
        ref = pool.ref.t
        held = torch.nonzero(ref[1:] > 0).flatten() + 1
        return PoolSnapshot(
            free_block_ids=tuple(pool.free_queue()),
            ref_counts=dict(zip(held.tolist(), ref[held].tolist(), strict=True)),
            cached_block_ids=tuple(tuple(ids) for ids in pool.cached_blocks()),
            num_cached_keys=pool.num_cached_keys(),
        )

    @property
    def host_nbytes(self) -> int:
        """Bytes of host memory in the manager's buffers (pool, tables and row counters)."""
        return self.pool.nbytes + self.tables.nbytes + self.rows.nbytes

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` if the pool, the rows and the tables disagree, or a request's
        estimate of its cached tokens differs from the scan of its tables."""
        self._settle()
        pool = self.pool
        pool.check_invariants()
        rows = self.rows
        rows.check_invariants()
        holders = [0] * self.config.num_blocks
        owner: dict[int, int] = {}
        row_sources: dict[int, int] = {}
        for request_id, row in rows.items():
            for g in range(self.num_groups):
                table = self._table(g, row)
                nulls = rows.nulls[rows.index(row, g)]
                if self.rules[g].kind == MAMBA:
                    # Nulls anywhere, but few real blocks (``_check_null_positions``).
                    real = sum(1 for b in table if b)
                    in_flight = self._mamba.in_flight.get(request_id, 0)
                    limit = 3 + self.rules[g].spec_blocks
                    limit += rules.cdiv(in_flight, self.rules[g].block_size)
                    require(real <= limit, f"request {request_id!r} holds {real} Mamba blocks")
                else:
                    require(
                        all(b == 0 for b in table[:nulls]) and all(b != 0 for b in table[nulls:]),
                        f"request {request_id!r} group {g} has nulls outside positions 0 … "
                        f"{nulls - 1}",
                    )
                    require(
                        nulls == 0 or self.rules[g].releases,
                        f"request {request_id!r} of a full-attention group holds null blocks",
                    )
                for block in table:
                    if block == 0:
                        continue
                    holders[block] += 1
                    group = owner.setdefault(block, g)
                    require(group == g, f"block {block} is in groups {group} and {g}")
                if self.tables.mirrored:
                    on_device = self.tables.on_device[g, row, : len(table)].cpu().tolist()
                    require(on_device == table, f"device table of {request_id!r} is stale")
            if self._uniform_columns:
                at = row * self.num_groups
                lengths = set(rows.length[at : at + self.num_groups])
                require(len(lengths) == 1, f"request {request_id!r}'s tables differ in length")
            src = self._row_src[row]
            if src >= 0:
                row_sources[src] = row_sources.get(src, 0) + 1
            stored = rows.thresholds[:, row].tolist()
            self.thresholds.refresh(row)
            require(
                stored == rows.thresholds[:, row].tolist(),
                f"thresholds of {request_id!r} are stale",
            )
        for block in range(1, self.config.num_blocks):
            require(
                pool.ref.a[block] == holders[block],
                f"block {block} has ref_cnt {pool.ref.a[block]} but {holders[block]} holders",
            )
        for index, source in enumerate(pool.sources):
            if source is not None:
                require(
                    source.row_refs == row_sources.get(index, 0),
                    f"source {index} has a wrong row count",
                )
        self._check_estimates()

    def _check_estimates(self) -> None:
        """Each request's ``estimate_cached_tokens`` equals vLLM's scan of its tables (checked
        last: it reads the tables the other checks vouch for)."""
        for request_id, _ in self.rows.items():
            estimate = self.estimate_cached_tokens(request_id)
            scan = self._estimate_cached_tokens_by_scan(request_id)
            require(
                estimate == scan,
                f"request {request_id!r}: estimate_cached_tokens {estimate} but its tables hold "
                f"a prefix of {scan} cached tokens",
            )


def _int_array(values: Sequence[int]) -> array[int]:
    return array("i", values)
