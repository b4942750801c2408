"""``GroupColumns``: the per-group constants the vectorised paths compute with.

A whole step (``hybridkv.optimized.batch``) and the row refresh of many rows work on ``[n, G]``
numpy arrays of counters (``hybridkv.optimized.rows``); what they need to know about the groups
themselves is fixed when the manager is built and lives here, named, instead of in the
manager's private attributes.

Data layout (G groups, R = ``max_num_reqs`` rows)
----------------------------------------------
::

    table_rows[G]        int64, g × R: row 0 of group g's table in the flat host tables
                         (``tables[G, R, W]`` viewed as rows of W positions)
    window_less_one[G]   int64, a sliding window's length less one (a huge number for other
                         groups: a window never releases there)
    chunk[G]             int64, a chunked-local group's chunk size, 0 for other groups;
                         ``None`` when no group is chunked
    chunk_or_one[G]      int64, ``chunk`` with 0 as 1 (a divisor that is never 0)

    group_ids[G]         ``array("q")``, 0 … G − 1 (the groups a decode step's new blocks are
                         cached under, ``PendingWork``)

and five facts: whether any group releases blocks (a window or a chunk), the sliding-window
groups that cache only reachable blocks (``sparse_groups``, which a batch leaves to the single
calls), whether the vectorised step applies at all (``vectorisable``: one block size, no
Mamba ``"align"`` group, no speculative blocks), whether a running step's releases and inserts
wait in the pool's pending work (``defers``, ``hybridkv.optimized.pending``), and whether a
Mamba ``"align"`` group serves every call one request at a time (``mamba_align``,
``hybridkv.optimized.mamba``).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class GroupColumns:
    """The per-group constants of the vectorised paths (see the module docstring)."""

    table_rows: npt.NDArray[np.int64]
    window_less_one: npt.NDArray[np.int64]
    chunk: npt.NDArray[np.int64] | None
    chunk_or_one: npt.NDArray[np.int64]
    releases: bool
    sparse_groups: list[int]
    vectorisable: bool
    defers: bool
    mamba_align: bool
    group_ids: array[int]

    @classmethod
    def build(
        cls,
        num_rows: int,
        windows: Sequence[int],
        chunks: Sequence[int],
        *,
        releases: bool,
        sparse_groups: Sequence[int],
        vectorisable: bool,
        defers: bool = False,
        mamba_align: bool = False,
    ) -> GroupColumns:
        """From each group's window (a huge number where none) and chunk (0 where none)."""
        if len(windows) != len(chunks):
            raise ValueError(f"windows and chunks differ in length: {len(windows)}, {len(chunks)}")
        return cls(
            table_rows=np.arange(len(windows), dtype=np.int64) * num_rows,
            window_less_one=np.array(windows, dtype=np.int64) - 1,
            chunk=np.array(chunks, dtype=np.int64) if any(chunks) else None,
            chunk_or_one=np.maximum(np.array(chunks, dtype=np.int64), 1),
            releases=releases,
            sparse_groups=list(sparse_groups),
            vectorisable=vectorisable,
            defers=defers,
            mamba_align=mamba_align,
            group_ids=array("q", range(len(windows))),
        )
