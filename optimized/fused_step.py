"""``FusedStep``: a decode step's crossing call, checked and then made in one function.

A decode step crosses a threshold in one of three ways (``RowThresholds``): its tokens enter a
new block (one block taken in every group), a window lets a block go (one position nulled in
every window group), or a block becomes full (that position cached in every group). ``step``
makes each part through the general functions (``release_skipped``, ``extend_uniform``,
``cache_uniform``, ``RowThresholds.after_step``), each reading the state's buffers again and
choosing among its own cases. For a layout where those three parts are each one block per
group, this class does the same work with the buffers bound once: it first checks that the
call is the common case in every part it makes (else it changes nothing and returns ``None``,
and ``step`` makes the call), then writes it. The result is ``step``'s, block for block: the
same blocks taken from the pool in the same order, the same pending releases and inserts, the
same row counters and thresholds.

Where it applies (``FusedStep.build``): a layout whose running steps defer their pool work
(``GroupColumns.defers``: one block size, caching, no Mamba ``"align"`` group, no sparse
retention, no events, every table of a row as long) and no eviction policy (a policy hears
each take and release as ``step`` makes them).

Data layout
-----------
It reads and writes the state's own buffers (``hybridkv.optimized.step``): the host tables
``tab[(g × R + row) × W + pos]`` (group ``g``'s table of a row at ``group_bases[g] + row ×
W``; neighbouring groups' tables ``R × W`` apart, so one window's groups are one strided
slice), the row counters at ``row × G + g`` and the row thresholds at ``row``
(``hybridkv.optimized.rows``).
"""

from __future__ import annotations

from array import array

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.caching import source_of
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.thresholds import PENDING_MAX
from hybridkv.reference.kv_cache_blocks import KVCacheBlocks
from hybridkv.reference.request import RequestLike


class FusedStep:
    """A running request's crossing call in one function (see the module docstring)."""

    __slots__ = (
        "_bases",
        "_block_size",
        "_counts",
        "_g",
        "_group_ids",
        "_max_len",
        "_s",
        "_stride",
        "_width",
        "_window",
        "_zeros",
    )

    def __init__(self, s: ManagerState) -> None:
        layout = s.layout
        self._s = s
        self._g = layout.num_groups
        self._block_size = layout.block_size
        self._width = layout.max_blocks_per_req
        self._bases = layout.group_bases
        self._window = layout.one_window
        self._max_len = layout.max_model_len
        self._group_ids = layout.columns.group_ids
        self._stride = s.tables.group_stride
        self._counts = s.pool.paths.counts  # the pool's path counts (``PathCounts.ran``)
        window = layout.one_window
        # Nulls for one position of every window group (one strided write releases them).
        self._zeros = array("i", (0,)) * (0 if window is None else window[1] - window[0])

    @classmethod
    def build(cls, s: ManagerState) -> FusedStep | None:
        """The fused step of ``s``'s layout, or ``None`` where it does not apply."""
        if not s.layout.columns.defers or s.pool.policy is not None:
            return None
        return cls(s)

    def cross(
        self,
        request: RequestLike,
        row: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
    ) -> KVCacheBlocks | None:
        """``step.run`` of a crossing call that keeps no blocks free (``kept_free`` 0) when
        each part it makes is one block per group; ``None``, with nothing changed, otherwise."""
        s = self._s
        computed = request.num_computed_tokens
        max_len = self._max_len
        if computed > max_len or not s.tuning.fused_step:
            return None
        need = computed + num_new_tokens + num_lookahead_tokens
        if need > max_len:
            need = max_len
        rows, b, g_count = s.rows, self._block_size, self._g
        at = row * g_count
        tab, bases = s.tab.a, self._bases
        row_base = row * self._width
        pool = s.pool
        # --- Check: each part that happens is the one-block case (nothing written yet).
        processed = computed - request.num_in_flight_tokens
        released: list[int] | None = None
        target = 0
        if processed >= rows.release_at[row]:
            window = self._window
            if window is None:
                return None
            first, end, _, span = window
            skipped = processed - span + 1
            target = skipped // b if skipped > 0 else 0
            held = target - 1
            if (
                rows.nulls[at + first : at + end].tolist().count(held) != end - first
                or rows.length[at] < target
            ):
                return None
            start = bases[first] + row_base + held
            released = tab[start : start + (end - first) * self._stride : self._stride].tolist()
            if min(map(pool.src.a.__getitem__, released)) < 0:
                return None  # an uncached block goes to the free queue's head: ``step``
        have = rows.length[at]
        take = need > rows.capacity[row]
        if take and (-(-need // b) - have != 1 or g_count > pool.num_free_blocks):
            return None
        num_full = 0
        # Caching: read only once the tokens reach the row's next full block (the request's
        # token count caps them, which a step below that threshold need not read).
        if not delay_cache_blocks and computed + num_new_tokens >= rows.cache_at[row]:
            cache_up_to = computed + num_new_tokens
            if cache_up_to > request.num_tokens:
                cache_up_to = request.num_tokens
            if cache_up_to >= rows.cache_at[row]:
                hashes = request.block_hashes
                num_full = min(cache_up_to // b, len(hashes))
                last = num_full - 1
                if (
                    last < 0
                    or rows.cached[at : at + g_count].tolist().count(last) != g_count
                    or (take and last >= have)
                    or (released is not None and target > last)
                ):
                    return None
                start = row_base + last
                full = tab[start : start + g_count * self._stride : self._stride].tolist()
                if not min(full):
                    return None
        # --- Make it: release, take, cache, as ``step`` does.
        self._counts[paths.FUSED_STEP] += 1
        tables = s.tables
        mirrored = tables.on_device is not tables.on_host
        if released is not None:
            window = self._window
            assert window is not None
            first, end, _, span = window
            start = bases[first] + row_base + target - 1
            stride = self._stride
            tab[start : start + (end - first) * stride : stride] = self._zeros
            if mirrored:
                for g in range(first, end):
                    tables.touched(g, row, target - 1, target)
            rows.nulls[at + first : at + end] = array("q", (target,)) * (end - first)
            pool.pending.release(released)
            rows.release_at[row] = (target + 1) * b + span - 1
        new_blocks = s.layout.no_blocks
        if take:
            popped = pool.pop_n(g_count)
            start = row_base + have  # group 0's position; group g's is ``stride`` × g on
            tab[start : start + g_count * self._stride : self._stride] = array("i", popped)
            rows.length[at : at + g_count] = array("q", (have + 1,)) * g_count
            if mirrored:
                for g in range(g_count):
                    tables.touched(g, row, have, have + 1)
            rows.capacity[row] = (have + 1) * b
            new_blocks = KVCacheBlocks(tuple(zip(popped)))
        if num_full:
            last = num_full - 1
            src = source_of(s, request, row, num_full, num_full * b)
            pool.defer_row(full, last, hashes[last], src, self._group_ids)
            rows.cached[at : at + g_count] = array("q", (num_full,)) * g_count
            rows.cache_at[row] = (num_full + 1) * b
        quiet = min(rows.capacity[row], rows.release_at[row]) + 1
        rows.quiet_below[row] = min(quiet, rows.cache_at[row])
        if (released is not None or num_full) and len(pool.pending) >= PENDING_MAX:
            s.settle()  # long without another call: bounded memory
        if mirrored:
            tables.flush()
        return new_blocks
