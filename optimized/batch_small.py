"""The single calls of ``allocate_slots_batch``: a small batch's loop, and a batch's busy requests.

A batch too small for the vectorised step (``hybridkv.optimized.batch``: its fixed cost in
numpy calls exceeds the single calls') is exactly the single-request calls in order. Most of a
decode step's calls take ``allocate_slots``' quiet exit (no block taken, released or cached):
``allocate_each`` makes that exit's check for each request in its own loop — the counts and
keywords the exit checks per call checked once for the batch, the manager's row index and
thresholds bound once — and answers those requests with ``no_blocks``. A request that passes
the checks before that exit (its row, its sound hashes) but crosses a threshold gets what
``allocate_slots`` makes of it past them (``running_step``: the fused step, else
``step.run``) without the call's checks made again; every other request, a bad one included,
gets the single call itself, with its result or its error, at its turn. A request answered
so is one the single call would answer so (the same check on the same state: an earlier
request's call changes only its own row's thresholds, or this request's if it comes twice,
and the check reads them after that call). The vectorised step leaves its few busy requests
(fewer than ``busy_batch_min``), whose rows and counts it has checked, to ``running_step``
too.

Data layout: none of its own. It reads what the quiet exit reads (``RequestCalls``): the row of
a request id, each row's ``quiet_below`` and the manager's ``no_blocks``, and counts the requests
it answers (the pool's ``path_counts.BATCH_SMALL``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized import step
from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.fused_step import FusedStep
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.step_columns import ColumnRequest
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import Request, RequestLike
from hybridkv.spec.errors import ZERO


class SingleCall(Protocol):
    """``allocate_slots`` with the positional arguments a running request's call passes."""

    def __call__(
        self,
        request: RequestLike,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        *,
        reserved_blocks: int = 0,
        watermark_blocks: int = 0,
    ) -> KVCacheBlocks | None: ...


class SmallBatches:
    """The small batch's loop (mixed into ``TorchKVCacheManager``; see the module docstring)."""

    # The manager's own, which this reads.
    hash_block_size: int
    lookahead: int
    enable_caching: bool
    no_blocks: KVCacheBlocks
    trusted: frozenset[type]
    _row_of: Callable[[str], int | None]
    _quiet_below: memoryview
    _has_align: bool
    _fused: FusedStep | None
    _s: ManagerState
    pool: TorchBlockPool

    def allocate_each(
        self,
        one: SingleCall,
        requests: Sequence[RequestLike],
        counts: Sequence[int],
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        kept_free: tuple[int, int],
    ) -> list[KVCacheBlocks | None]:
        """``[one(r, c, 0, None, num_lookahead_tokens, delay_cache_blocks, reserved_blocks=…,
        watermark_blocks=…) for r, c in zip(requests, counts)]`` (``kept_free``: the reserved
        and watermark blocks), each quiet exit made here where none are kept free (with some,
        the quiet exit does not apply)."""
        lookahead, delay = num_lookahead_tokens, delay_cache_blocks
        reserved, watermark = kept_free
        if (
            reserved is not ZERO
            or watermark is not ZERO
            or self._has_align
            or not (lookahead is ZERO or (type(lookahead) is int and lookahead > 0))
        ):
            return [
                one(
                    r, c, ZERO, None, lookahead, delay_cache_blocks,
                    reserved_blocks=reserved, watermark_blocks=watermark,
                )
                for r, c in zip(requests, counts, strict=True)
            ]  # fmt: skip
        row_of, quiet_below, no_blocks = self._row_of, self._quiet_below, self.no_blocks
        any_type = not self.enable_caching
        size, own_lookahead, trusted = self.hash_block_size, self.lookahead, self.trusted
        out: list[KVCacheBlocks | None] = []
        answered = 0
        for request, count in zip(requests, counts, strict=True):
            if type(count) is int and count > 0:
                row = row_of(request.request_id)
                if row is not None and (
                    any_type
                    or (
                        (type(request) is Request or type(request) is ColumnRequest)
                        and request.hash_block_size == size
                        and request.num_hash_lookahead_tokens >= own_lookahead
                    )
                    or type(request) in trusted
                ):
                    if request.num_computed_tokens + count + lookahead < quiet_below[row]:
                        out.append(no_blocks)
                        answered += 1
                        continue
                    out.append(self.running_step(request, row, count, lookahead, delay))
                    continue
            out.append(one(request, count, ZERO, None, lookahead, delay_cache_blocks))
        self.pool.paths.ran(paths.BATCH_SMALL, answered)
        return out

    def running_step(
        self,
        request: RequestLike,
        row: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> KVCacheBlocks | None:
        """What ``allocate_slots`` makes of a batch's call past the checks the batch made
        already (a running request in ``row``, plain counts, no blocks kept free, sound hashes,
        no Mamba ``"align"`` group) and its quiet exit: the fused step, else ``step.run``.
        ``allocate_slots`` makes the same inline for its own crossing calls (one Python call
        fewer on the path a scheduler takes per request)."""
        fused = self._fused
        if fused is not None:
            made = fused.cross(
                request, row, num_new_tokens, num_lookahead_tokens, delay_cache_blocks
            )
            if made is not None:
                return made
        kept_free = 0
        return step.run(
            self._s,
            request,
            row,
            num_new_tokens,
            num_lookahead_tokens,
            delay_cache_blocks,
            kept_free,
        )
