"""``KVCacheManager``: hybridkv's reference or optimized manager behind vLLM 0.33's manager API.

vLLM's ``Scheduler`` builds its manager with ``KVCacheManager(kv_cache_config=…, …)`` and then
calls the methods and reads the attributes below; this class accepts exactly those keyword
arguments, plus ``backend=``, ``device=`` and ``eviction_policy=`` (an eviction policy for
either backend, ``hybridkv.policies``; when not given, ``HYBRIDKV_EVICTION`` names it). A
setting hybridkv cannot honour raises ``UnsupportedSetting`` naming it, at construction or at
the call that uses it.

What the scheduler reads and where it comes from:

- ``get_computed_blocks``, ``allocate_slots``, ``free``, ``cache_blocks``, ``get_blocks``,
  ``get_block_ids``, ``reset_prefix_cache``, ``usage``, ``new_step_starts``: the core manager
  (a running request's ``allocate_slots`` that crosses no threshold of its row is answered
  here, where the core hands out its quiet exit: ``quiet_thresholds``).
- ``take_events``: the core's events, built by the core as vLLM's own structs
  (``BlockStored`` with every field, ``BlockRemoved``, ``AllBlocksCleared``;
  ``vllm_event_builder_class``).
- ``record_prefix_cache_stats`` / ``make_prefix_cache_stats``: the core's counts (at admission,
  preempted requests apart, ``None`` with ``log_stats`` off) in vLLM's ``PrefixCacheStats``.
- ``take_new_block_ids``: new attention blocks of each step (zeroing, Mamba hybrids), group
  by group as vLLM's managers hand them over; ``record_blocks_for_zeroing`` adds a table's
  tail again (a failed load left it unwritten).
- ``metrics_collector`` (``--kv-cache-metrics``): vLLM's collector, told of each block taken,
  touched and evicted and of each reset as vLLM's block pool tells it, through an observing
  eviction policy around the configured one (``hybridkv.integrations.vllm.metrics``).
- ``coordinator`` and ``block_pool``: read-only views (``hybridkv.integrations.vllm.views``)
  of what the scheduler, vLLM's aux-output connector and its tests read.
- A KV connector's calls: ``allocate_slots(num_external_computed_tokens=…,
  delay_cache_blocks=…, skip_zeroing_group_ids=…)`` (the core's admission of external
  tokens), ``get_computed_blocks_for_connector``, ``truncate_computed_blocks``,
  ``get_block_ids_for_computed_tokens``, ``remove_skipped_blocks``, ``pop_blocks_for_free``
  and ``block_pool.free_blocks`` (deferred frees), ``coordinator.get_num_blocks_to_allocate``
  (a waiting load's reservation), ``evict_blocks`` (failed loads).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

from hybridkv.integrations.vllm.connector import ConnectorCalls
from hybridkv.integrations.vllm.convert import from_vllm_config
from hybridkv.integrations.vllm.cores import Backend, make_core
from hybridkv.integrations.vllm.errors import refuse, refuse_unsupported
from hybridkv.integrations.vllm.metrics import observed_policy
from hybridkv.integrations.vllm.stats_calls import StatsCalls
from hybridkv.integrations.vllm.views import (
    BlockPoolView,
    BlockViews,
    CoordinatorView,
    group_view,
)
from hybridkv.policies import EvictionPolicy
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.spec.errors import ZERO


class KVCacheManager(ConnectorCalls, StatsCalls):
    """vLLM 0.33's ``KVCacheManager`` API over a hybridkv backend."""

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: Any = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        *,
        backend: Backend = "reference",
        device: str | None = None,
        max_num_reqs: int | None = None,
        eviction_policy: str | EvictionPolicy | None = None,
    ) -> None:
        refuse_unsupported(
            kv_cache_config,
            hash_block_size,
            enable_caching,
            (dcp_world_size, pcp_world_size),
            watermark,
        )
        from vllm.v1.kv_cache_interface import (
            get_kv_cache_spec_kind,
            get_kv_cache_spec_sliding_window,
        )

        self.config = from_vllm_config(kv_cache_config)
        policy = eviction_policy
        if metrics_collector is not None:  # vLLM's --kv-cache-metrics
            policy = observed_policy(policy, metrics_collector, self.config, enable_caching)
        self.kv_cache_config = kv_cache_config
        self.backend = backend
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.kv_cache_event_metadata = tuple(
            (
                get_kv_cache_spec_kind(group.kv_cache_spec).value,
                get_kv_cache_spec_sliding_window(group.kv_cache_spec),
            )
            for group in kv_cache_config.kv_cache_groups
        )
        self.core = make_core(
            backend,
            self.config,
            max_model_len,
            enable_caching=enable_caching,
            enable_kv_cache_events=enable_kv_cache_events,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=(
                max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
            ),
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            log_stats=log_stats,
            device=device,
            max_num_reqs=max_num_reqs,
            eviction_policy=policy,
            num_prefill_lookahead=num_prefill_lookahead,
            event_metadata=self.kv_cache_event_metadata,
        )
        core_block_size = int(getattr(self.core, "scheduler_block_size", scheduler_block_size))
        refuse(
            core_block_size != scheduler_block_size,
            f"scheduler_block_size={scheduler_block_size}",
            f"the groups' block sizes give {core_block_size} (their lcm)",
        )
        from vllm.v1.metrics.stats import PrefixCacheStats

        self._stats_class = PrefixCacheStats
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(self.config.groups)
        self._bind_views(kv_cache_config, metrics_collector)
        self.mamba_shared_prefix_checkpoint = False
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.scheduler_block_size = scheduler_block_size
        self.empty_kv_cache_blocks = BlockViews(tuple(() for _ in range(self.num_kv_cache_groups)))
        self.init_connector_calls(
            self.config, bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
        )
        from vllm.v1.request import Request as VllmRequest
        from vllm.v1.request import RequestStatus

        self._waiting_statuses = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        self._running_status = RequestStatus.RUNNING
        # A running request's decode call, the one vLLM's scheduler makes most: the core's
        # method bound once, and the shared result of a call that needs no block, where the
        # core has one (the optimized backend's ``no_blocks``).
        self._core_allocate = self.core.allocate_slots
        self._core_no_blocks: object = getattr(self.core, "no_blocks", None)
        self._bind_quiet_exit(VllmRequest)

    # --- The scheduler's calls -----------------------------------------------------------

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        """The longest cache hit: blocks, tokens and the shared-prefix boundary (with events on,
        a ``kv_cache_report_mode="full"`` request's reused blocks reported, as vLLM's)."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if self.enable_kv_cache_events and request.kv_cache_report_mode == "full":
            blocks, hit, boundary = self.core.get_computed_blocks(
                request, max_cache_hit_length, report_reused_blocks=True
            )
        elif max_cache_hit_length is None:
            blocks, hit, boundary = self.core.get_computed_blocks(request)
        else:
            blocks, hit, boundary = self.core.get_computed_blocks(request, max_cache_hit_length)
        return self._blocks(blocks), hit, boundary

    def _bind_views(self, kv_cache_config: Any, metrics_collector: Any) -> None:
        """The read-only ``block_pool`` and ``coordinator`` over the core, as vLLM's."""
        self.block_pool = BlockPoolView(self.core, self.config.num_blocks, metrics_collector)
        self.coordinator = CoordinatorView(
            self.core,
            [
                group_view(i, group.kv_cache_spec, self.block_pool)
                for i, group in enumerate(kv_cache_config.kv_cache_groups)
            ],
        )

    def _bind_quiet_exit(self, vllm_request: type) -> None:
        """Where the core hands them out (``TorchKVCacheManager.quiet_thresholds``), the quiet
        exit's row lookup and thresholds: a quiet call of vLLM's request is answered here."""
        self._vllm_request: Any = vllm_request
        thresholds = getattr(self.core, "quiet_thresholds", None)
        quiet = thresholds(vllm_request) if thresholds is not None else None
        self._quiet_row_of = cast("Callable[[str], int | None]", {}.get)  # (never read then)
        self._quiet_below: memoryview | None = None
        if quiet is not None:
            self._quiet_row_of, self._quiet_below = quiet

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        """Slots for new tokens (vLLM's full keyword set; see the README's picture)."""
        if (
            new_computed_blocks is None
            and num_external_computed_tokens is ZERO
            and num_encoder_tokens is ZERO
            and full_sequence_must_fit is False
            and reserved_blocks is ZERO
            and request.status is self._running_status  # no watermark
            and num_new_tokens  # 0: the general path refuses it
        ):
            # A running request's call: the core's quiet exit made here (``quiet_thresholds``).
            below = self._quiet_below
            if (
                below is not None
                and num_new_computed_tokens is ZERO
                and num_lookahead_tokens is ZERO
                and type(request) is self._vllm_request
                and type(num_new_tokens) is int
                and num_new_tokens > 0
            ):
                row = self._quiet_row_of(request.request_id)
                if row is not None and request.num_computed_tokens + num_new_tokens < below[row]:
                    return self.empty_kv_cache_blocks
            return self._running_call(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                delay_cache_blocks,
                skip_zeroing_group_ids,
            )
        return self._general_call(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )

    def _running_call(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> KVCacheBlocks | None:
        """A running request's call that is not the quiet exit: the core's call with vLLM's
        default keywords left out, its result as vLLM reads it."""
        new_blocks = self._core_allocate(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            None,
            num_lookahead_tokens,
            delay_cache_blocks,
        )
        if new_blocks is None:
            return None
        if new_blocks is self._core_no_blocks:
            return self.empty_kv_cache_blocks
        return self._new_blocks(request, new_blocks, None, 0, skip_zeroing_group_ids)

    def _general_call(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        delay_cache_blocks: bool,
        num_encoder_tokens: int,
        full_sequence_must_fit: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
        skip_zeroing_group_ids: tuple[int, ...],
    ) -> KVCacheBlocks | None:
        """``allocate_slots`` with every keyword passed on: a waiting request's (the watermark
        kept free), an admission's, a connector's or an encoder's call (``num_encoder_tokens``
        size a cross-attention group's table: encoder-decoder models)."""
        if (
            num_new_tokens == 0
            and num_new_computed_tokens == 0
            and not num_external_computed_tokens
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        watermark_blocks = 0
        if has_scheduled_reqs and request.status in self._waiting_statuses:
            watermark_blocks = self.watermark_blocks
        # Both backends release window and chunk blocks on the processed count (the request's
        # ``num_in_flight_tokens``, async scheduling) and keep the reserved and watermark blocks.
        new_blocks = self.core.allocate_slots(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            delay_cache_blocks,
            full_sequence_must_fit=full_sequence_must_fit,
            reserved_blocks=reserved_blocks,
            watermark_blocks=watermark_blocks,
            num_external_computed_tokens=num_external_computed_tokens,
            num_encoder_tokens=num_encoder_tokens,
        )
        if new_blocks is None:
            return None
        return self._new_blocks(
            request,
            new_blocks,
            new_computed_blocks,
            num_external_computed_tokens,
            skip_zeroing_group_ids,
        )

    def free(self, request: Any) -> None:
        self.core.free(request)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.core.cache_blocks(request, num_computed_tokens)

    def get_blocks(self, request_id: str) -> BlockViews:
        ids = self.core.get_block_ids(request_id)
        if not any(ids):
            return self.empty_kv_cache_blocks
        return BlockViews(tuple(tuple(group) for group in ids), self.vllm_block_hashes)

    def reset_prefix_cache(self) -> bool:
        if not self.core.reset_prefix_cache():
            return False
        self._publish_stats()
        return True

    def new_step_starts(self) -> None:
        step = getattr(self.core, "new_step_starts", None)
        if step is not None:
            step()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM (cascade attention was removed): zeros."""
        return [0] * self.num_kv_cache_groups

    def estimate_cached_tokens(self, request: Any) -> int:
        """Tokens of the request's blocks that are in the prefix cache (the minimum over the
        groups of the longest cached prefix a block of the group names; the core's)."""
        return int(self.core.estimate_cached_tokens(request.request_id))

    # --- Events --------------------------------------------------------------------------

    def take_events(self) -> list[Any]:
        """The core's events, built as vLLM's msgspec structs as they happen
        (``vllm_event_builder_class``): nothing to convert per step."""
        events: list[Any] = self.core.take_events()
        return events
