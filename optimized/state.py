"""``ManagerState``: everything a ``TorchKVCacheManager`` holds, in one slotted object.

The manager (``hybridkv.optimized.manager``) is the public API over this state; the phase
modules (``hits``, ``admission``, ``step``, ``caching``, ``general_caching``, ``mamba``,
``batch``, ``invariants``) are functions of it. One object owns each piece of state, and this
one owns them all, so no phase reaches into another's private names.

Data layout (G groups, R = ``max_num_reqs`` rows, W = ``max_blocks_per_req`` positions)
--------------------------------------------------------------------------------------------
::

    layout       GroupLayout: the per-group constants (``hybridkv.optimized.layout``)
    pool         TorchBlockPool: per-block state, the free queue, the prefix cache and its
                 pending work (``hybridkv.optimized.block_pool``)
    tables       BlockTables: ``tables[G, R, W]`` int32 block ids, one flat host buffer
                 (``tab``: its views) mirrored on the device (``hybridkv.optimized.block_tables``)
    rows         RowTables: which request holds which row, per (row, group) the table's length,
                 leading nulls, cached and kept positions, per row its thresholds
    thresholds   RowThresholds: recomputes a row's thresholds after a step
    row_src[R]   the pool source (token and hash lists) each row caches under, -1 for none
    mamba        MambaState: a Mamba ``"align"`` group's bookkeeping beside its tables
    deferred     Counter: blocks ``pop_blocks_for_free`` handed out and not yet freed (holders
                 outside the tables; ``hybridkv.optimized.connector_calls``)
    tuning       Tuning: the sizes at which paths switch to vectorised calls

The shared steps are methods: ``settle`` (make the running steps' pending pool work before
anything reads the pool), ``release_row`` (give a row back with its source and Mamba
bookkeeping) and ``table`` (a group's block table of a row as a list).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from hybridkv.optimized._buffers import IntBuffer
from hybridkv.optimized.block_pool import TorchBlockPool
from hybridkv.optimized.block_tables import BlockTables
from hybridkv.optimized.hash_memo import HashMemo
from hybridkv.optimized.layout import GroupLayout
from hybridkv.optimized.row_thresholds import RowThresholds
from hybridkv.optimized.rows import RowTables
from hybridkv.optimized.thresholds import (
    BATCH_MIN,
    BUSY_BATCH_MIN,
    FREE_BATCH_MIN,
    INSERT_MIN,
    MEMCMP_MIN,
    PENDING_MIN,
    VECTOR_MIN,
)
from hybridkv.policies.protocol import EvictionPolicy
from hybridkv.reference.events import EventBuilder

Key = tuple[bytes, int]
"""A cache key: (block hash, group id), ``BlockHashWithGroupId``."""


@dataclass(frozen=True)
class Tuning:
    """The size thresholds a test may lower (``hybridkv.optimized.thresholds``) and the
    switches of the fused step and the memo's hits: none changes a result, only which path
    computes it."""

    vector_min: int = VECTOR_MIN
    batch_min: int = BATCH_MIN
    free_batch_min: int = FREE_BATCH_MIN
    busy_batch_min: int = BUSY_BATCH_MIN
    insert_min: int = INSERT_MIN
    pending_min: int = PENDING_MIN
    memcmp_min: int = MEMCMP_MIN
    fused_step: bool = True
    """Whether a running request's common crossing call takes ``FusedStep``
    (``hybridkv.optimized.fused_step``); off, ``step`` makes every call."""
    memo_hits: bool = True
    """Whether a lookup may read its hit from the memo's run (``hybridkv.optimized.memo_hit``);
    off, the general lookup answers every one."""
    one_pass_admission: bool = True
    """Whether a plain admission writes every group's table as one matrix
    (``hybridkv.optimized.one_pass_admission``); off, ``admission.allocate`` adopts, takes and
    caches group by group."""


class _HasTuning(Protocol):
    tuning: Tuning


def tuning_knob(name: str) -> Any:
    """A property that reads one field of its owner's ``tuning`` and, set, replaces it."""

    def get(owner: _HasTuning) -> int:
        value: int = getattr(owner.tuning, name)
        return value

    def set_(owner: _HasTuning, value: int) -> None:
        changes: dict[str, Any] = {name: value}
        owner.tuning = replace(owner.tuning, **changes)

    return property(get, set_)


class TuningKnobs:
    """A manager's size thresholds: whole (``tuning``, the state's) or one at a time (the
    knobs, as the conformance adapter and tests set them); no result changes with them."""

    @property
    def state(self) -> ManagerState:
        raise NotImplementedError

    @property
    def tuning(self) -> Tuning:
        """The size thresholds at which paths switch to vectorised calls."""
        return self.state.tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        self.state.tuning = tuning

    vector_min, batch_min, free_batch_min, busy_batch_min, insert_min, pending_min, memcmp_min = (
        map(
            tuning_knob,
            (
                "vector_min",
                "batch_min",
                "free_batch_min",
                "busy_batch_min",
                "insert_min",
                "pending_min",
                "memcmp_min",
            ),
        )
    )


@dataclass
class MambaState:
    """``MambaManager``'s bookkeeping beside the tables, for every Mamba ``"align"`` group."""

    allocated: set[tuple[str, int]] = field(default_factory=set)
    last_state: dict[tuple[str, int], int] = field(default_factory=dict)
    checkpoints: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    cached_this_step: dict[int, set[Key]] = field(default_factory=dict)
    # (row, group) pairs tracked as running (``num_cached_block`` of the reference).
    running: set[tuple[int, int]] = field(default_factory=set)
    # The positions of the real blocks of each Mamba table as of its last allocation
    # (``state_positions`` of the reference): where its longest cached prefix can sit.
    positions: dict[tuple[str, int], list[int]] = field(default_factory=dict)
    # Tokens in flight at each request's last allocation (the reference's ``in_flight_tokens``):
    # a table may hold their states' blocks too until that step is processed.
    in_flight: dict[str, int] = field(default_factory=dict)
    # Per group, the states cached since the last ``take_boundary_state_offloads``: (request
    # id, block id, tokens), for a KV connector.
    offloads: dict[int, list[tuple[str, int, int]]] = field(default_factory=dict)

    def forget(self, request_id: str, groups: Sequence[int]) -> None:
        self.in_flight.pop(request_id, None)
        for g, entries in self.offloads.items():
            self.offloads[g] = [entry for entry in entries if entry[0] != request_id]
        for g in groups:
            self.allocated.discard((request_id, g))
            self.last_state.pop((request_id, g), None)
            self.checkpoints.pop((request_id, g), None)
            self.positions.pop((request_id, g), None)


class ManagerState:
    """The state of one ``TorchKVCacheManager`` (see the module docstring)."""

    __slots__ = (
        "_tuning",
        "block_hasher",
        "deferred",
        "layout",
        "mamba",
        "pool",
        "row_src",
        "rows",
        "tab",
        "tables",
        "thresholds",
    )

    def __init__(
        self,
        layout: GroupLayout,
        pool: TorchBlockPool,
        tables: BlockTables,
        block_hasher: HashMemo,
        tuning: Tuning,
    ) -> None:
        self.layout = layout
        self.pool = pool
        self.tables = tables
        self.tab: IntBuffer = tables.host  # the flat host tables, read on every path
        self.rows = RowTables(layout.max_num_reqs, layout.num_groups)
        self.thresholds = RowThresholds(
            self.rows,
            layout.rules,
            layout.columns,
            block_size=layout.block_size,
            caching=layout.caching,
            uniform=layout.uniform_columns,
            general=layout.general,
        )
        self.row_src = [-1] * layout.max_num_reqs
        self.mamba = MambaState()
        # Blocks ``pop_blocks_for_free`` handed out, not yet freed: holders outside the tables.
        self.deferred: Counter[int] = Counter()
        self.block_hasher = block_hasher
        self._tuning = tuning
        self.tuning = tuning

    @property
    def tuning(self) -> Tuning:
        """The size thresholds; ``insert_min`` and ``pending_min`` are the pool's own (its free
        queue and pending work read them), ``memcmp_min`` the hash memo's."""
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        self._tuning = tuning
        self.pool.insert_min = tuning.insert_min
        self.pool.pending_min = tuning.pending_min
        self.block_hasher.memcmp_min = tuning.memcmp_min

    @classmethod
    def build(
        cls,
        layout: GroupLayout,
        device: torch.device,
        event_builder: EventBuilder | None,
        tuning: Tuning,
        policy: EvictionPolicy | None = None,
    ) -> ManagerState:
        """The empty state of a manager of ``layout``: a pool with every block free (and the
        hasher's memo when caching; ``policy`` choosing its victims), empty tables on
        ``device``, no rows taken."""
        pool = TorchBlockPool(
            layout.config.num_blocks,
            layout.num_groups,
            enable_caching=layout.caching,
            enable_kv_cache_events=event_builder is not None,
            event_builder=event_builder,
        )
        tables = BlockTables(
            layout.num_groups, layout.max_num_reqs, layout.max_blocks_per_req, device
        )
        if policy is not None:
            specs = [group.spec for group in layout.config.groups]
            pool.attach_policy(policy, specs, layout.hash_block_size)
        block_hasher = HashMemo(layout.hash_block_size, paths=pool.paths)
        if layout.caching:
            pool.memo = block_hasher
        return cls(layout, pool, tables, block_hasher, tuning)

    def settle(self) -> None:
        """Make the running steps' pending releases and inserts (``PendingWork``): every call
        that reads the pool, but a running request's step, calls this first."""
        if self.pool.pending:
            self.pool.apply_pending()

    def raise_policy_error(self) -> None:
        """Raise the eviction policy's first notification error of the manager call just
        made (``hybridkv.optimized.policy_seam``), if any."""
        if self.pool.policy is not None:
            self.pool.policy.raise_failed()

    def table(self, group_id: int, row: int) -> list[int]:
        """Group ``group_id``'s block table of the request in row ``row``."""
        return self.tables.table(group_id, row, self.rows.length[self.rows.index(row, group_id)])

    def free(self, request_id: str) -> None:
        """Release every block of the request, each group's as one batch, last block first,
        then its row (``KVCacheManager.free``; a no-op for a request holding none)."""
        if self.layout.has_align:
            self.mamba.forget(request_id, range(self.layout.num_groups))
        row = self.rows.row_of(request_id)
        if row is None:
            return
        for g in range(self.layout.num_groups):
            walk = self.table(g, row)
            walk.reverse()
            self.pool.free_blocks(walk)
        self.release_row(request_id, row)
        self.raise_policy_error()

    def release_row(self, request_id: str, row: int) -> None:
        """Give the request's row back, with its Mamba bookkeeping and its source."""
        self.rows.release(request_id, row)
        if self.layout.has_align:
            for g in range(self.layout.num_groups):
                self.mamba.running.discard((row, g))
        src = self.row_src[row]
        if src >= 0:
            self.row_src[row] = -1
            self.pool.source(src).row_refs -= 1
            self.pool.maybe_drop_source(src)
