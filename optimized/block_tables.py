"""``BlockTables``: every KV cache group's block tables, on the host and on the device.

The tables are what a GPU kernel reads: row r of group g lists, position by position, the blocks
of the request in row r (``RowTables`` says which request holds which row and how long each table
is). The manager writes them on the host; with a CUDA device the device keeps its own copy, and
every call ends by writing the entries it changed to it in one indexed copy (the issue's "one
host→device copy of the changed entries per step").

Data layout (G groups, R = ``max_num_reqs`` rows, W = ``max_blocks_per_req`` positions)
--------------------------------------------------------------------------------------------
::

    host[G × R × W]    int32 block ids, one flat ``IntBuffer``; position p of row r of group g
                       is at ``(g × R + r) × W + p`` (``base(g, r) + p``); positions past a
                       table's length are stale
    on_host[G, R, W]   the same memory as a tensor (``host.t`` viewed in three dimensions)
    on_device[G, R, W] ``on_host`` itself on a CPU device; otherwise a tensor of its own there,
                       equal to ``on_host`` after every ``flush``

The entries changed since the last flush are kept as ranges of flat indices (the single-request
paths: a few positions of one row) and as index arrays (the batched paths: a step's scattered
positions); ``flush`` sends indices and values together, in one copy.
"""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from hybridkv.optimized._buffers import IntBuffer


class BlockTables:
    """The ``[G, R, W]`` block tables of a manager's groups (see the module docstring)."""

    __slots__ = (
        "_indices",
        "_nulls",
        "_ranges",
        "copies",
        "group_stride",
        "held",
        "host",
        "on_device",
        "on_host",
        "rows",
        "width",
    )

    def __init__(self, groups: int, rows: int, width: int, device: torch.device) -> None:
        self.rows, self.width = rows, width
        self.group_stride = rows * width
        """How far group g + 1's table of a row starts after group g's (``base``)."""
        self._nulls = memoryview(array("i", [0] * groups))
        self.host = IntBuffer(groups * rows * width)
        self.on_host = self.host.t.view(groups, rows, width)
        self.on_device = (
            self.on_host
            if device.type == "cpu"
            else torch.zeros((groups, rows, width), dtype=torch.int32, device=device)
        )
        self._ranges: list[tuple[int, int]] = []
        self._indices: list[torch.Tensor] = []
        self.held = False
        """Inside ``one_copy``: flushes wait for its end."""
        self.copies = 0
        """The host→device copies made so far (a mirrored table's flushes that had changes)."""

    @property
    def mirrored(self) -> bool:
        """Whether the device keeps a copy of its own (changed entries must be recorded)."""
        return self.on_device is not self.on_host

    @property
    def unflushed(self) -> bool:
        """Whether entries changed since the last flush wait to be copied."""
        return bool(self._ranges or self._indices)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the tables take."""
        return self.host.nbytes

    def base(self, group_id: int, row: int) -> int:
        """The flat index of position 0 of group ``group_id``'s table in row ``row``."""
        return (group_id * self.rows + row) * self.width

    def table(self, group_id: int, row: int, length: int) -> list[int]:
        """The first ``length`` positions of group ``group_id``'s table in row ``row``."""
        base = self.base(group_id, row)
        return self.host.a[base : base + length].tolist()

    def across(self, first: int, end: int, row: int, pos: int) -> list[int]:
        """The blocks at position ``pos`` of row ``row`` in groups ``first`` … ``end − 1``, in
        group order: one strided read (the groups' tables lie ``group_stride`` apart)."""
        start = self.base(first, row) + pos
        stride = self.group_stride
        blocks: list[int] = self.host.a[start : start + (end - first) * stride : stride].tolist()
        return blocks

    def clear_across(self, first: int, end: int, row: int, pos: int) -> list[int]:
        """``across``, then nulls in those positions (one strided write, recorded when
        mirrored)."""
        blocks = self.across(first, end, row, pos)
        start = self.base(first, row) + pos
        stride = self.group_stride
        self.host.a[start : start + (end - first) * stride : stride] = self._nulls[: end - first]
        if self.on_device is not self.on_host:
            for group_id in range(first, end):
                self.touched(group_id, row, pos, pos + 1)
        return blocks

    def touched(self, group_id: int, row: int, lo: int, hi: int) -> None:
        """Positions ``lo`` … ``hi − 1`` of that table changed (recorded when mirrored)."""
        if hi > lo and self.on_device is not self.on_host:
            base = (group_id * self.rows + row) * self.width
            self._ranges.append((base + lo, base + hi))

    def touched_at(self, flat: npt.NDArray[Any]) -> None:
        """The entries at these flat indices changed (recorded when mirrored)."""
        if self.on_device is not self.on_host:
            self._indices.append(torch.from_numpy(np.ascontiguousarray(flat, dtype=np.int64)))

    def flush(self) -> None:
        """Write the entries changed since the last flush to the device tables (unless held)."""
        if self.held or not (self._ranges or self._indices):
            return
        parts = [torch.arange(lo, hi, dtype=torch.int64) for lo, hi in self._ranges]
        index = torch.cat(parts + self._indices)
        self._ranges.clear()
        self._indices.clear()
        # Indices and values travel together: one host→device copy, split on the device.
        n = index.shape[0]
        packed = torch.cat((index, self.host.t[index].to(torch.int64)))
        on_device = packed.to(self.on_device.device, non_blocking=True)
        self.on_device.view(-1).index_copy_(0, on_device[:n], on_device[n:].to(torch.int32))
        self.copies += 1

    def one_copy(self) -> OneCopy:
        """Hold every flush until the end of the ``with`` block, then flush once (a whole
        step's changes in one copy); nested blocks leave the flush to the outermost."""
        return OneCopy(self)


class OneCopy:
    """``BlockTables.one_copy``'s context: a class, not a ``contextlib`` generator, as every
    batched call enters one, and a generator's machinery is a fixed cost a small batch feels."""

    __slots__ = ("outer", "tables")

    def __init__(self, tables: BlockTables) -> None:
        self.tables = tables
        self.outer = False

    def __enter__(self) -> None:
        tables = self.tables
        self.outer, tables.held = tables.held, True

    def __exit__(self, *exc: object) -> None:
        self.tables.held = self.outer
        self.tables.flush()
