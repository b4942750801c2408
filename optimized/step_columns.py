"""``StepColumns``: requests whose computed-token counts live in one numpy column.

A whole-step call (``allocate_slots_batch``) reads every request's ``num_computed_tokens``: at
B = 1,024 that is 1,024 request objects and the 1,024 int objects they hold, cold after the
scheduler's own work between steps (about a sixth of the benchmark's batched step). A
``ColumnRequest`` (made by ``StepColumns.request``) is a ``Request`` whose count is its slot of
``StepColumns.computed``: reading or writing the attribute reads or writes the column, so a
scheduler may keep updating ``request.num_computed_tokens`` one request at a time, or update a
whole step's counts in one numpy operation (``columns.computed[slots] += scheduled``). A batch
of column requests of one ``StepColumns`` reads their counts with one gather: their slots are
remembered with their rows (``RowTables.remember``), so a step of the same requests as the last
reads no request object at all.

The column holds exactly what the attribute would: every manager call reads the same count
either way (results identical to plain ``Request``s; ``tests/test_optimized_step_columns.py``).

Data layout
-----------
::

    computed[S]   int64 numpy array, one slot per live column request; S doubles when full
                  (the array is replaced: read ``columns.computed`` afresh after making
                  requests, never keep it across them)
    view          the same memory as a ``memoryview`` of int64 (one indexing operation per
                  attribute read or write)
    free          the slots of collected requests (each zeroed), reused first
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from hybridkv.reference.request import Request

Ints = npt.NDArray[np.int64]


class StepColumns:
    """The computed-token counts of the requests it makes, one slot each (see the module
    docstring)."""

    __slots__ = ("computed", "free", "used", "view")

    def __init__(self, capacity: int = 64) -> None:
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.computed: Ints = np.zeros(capacity, dtype=np.int64)
        self.view = self.computed.data.cast("B").cast("q")
        self.free: list[int] = []
        self.used = 0

    def request(
        self, request_id: str, prompt_token_ids: Sequence[int], **kwargs: Any
    ) -> ColumnRequest:
        """A ``ColumnRequest``: ``Request(request_id, prompt_token_ids, **kwargs)`` whose
        ``num_computed_tokens`` is a slot of this column (0 at first)."""
        slot = self.free.pop() if self.free else self._next_slot()
        try:
            return ColumnRequest(self, slot, request_id, prompt_token_ids, **kwargs)
        except BaseException:
            self.release(slot)  # a bad argument leaves the column as it was
            raise

    def release(self, slot: int) -> None:
        """Give a collected request's slot back, zeroed."""
        self.view[slot] = 0
        self.free.append(slot)

    def slots(self, requests: Sequence[object]) -> Ints | None:
        """The slots of ``requests`` if every one is a ``ColumnRequest`` of this column, else
        ``None``."""
        found = [r.slot if type(r) is ColumnRequest and r.columns is self else -1 for r in requests]
        if -1 in found:
            return None
        return np.array(found, dtype=np.int64)

    def _next_slot(self) -> int:
        if self.used == self.computed.shape[0]:
            grown = np.zeros(2 * self.used, dtype=np.int64)
            grown[: self.used] = self.computed
            self.computed = grown
            self.view = grown.data.cast("B").cast("q")
        self.used += 1
        return self.used - 1


class ColumnRequest(Request):
    """A ``Request`` whose ``num_computed_tokens`` is its ``slot`` of ``columns``."""

    def __init__(
        self,
        columns: StepColumns,
        slot: int,
        request_id: str,
        prompt_token_ids: Sequence[int],
        **kwargs: Any,
    ) -> None:
        self.columns = columns
        self.slot = slot
        self._holds_slot = False  # until built: a failed build's slot is its maker's to give back
        super().__init__(request_id, prompt_token_ids, **kwargs)
        self._holds_slot = True

    @property
    def num_computed_tokens(self) -> int:
        value: int = self.columns.view[self.slot]
        return value

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        try:
            self.columns.view[self.slot] = value
        except (TypeError, ValueError, OverflowError):
            raise ValueError(
                f"num_computed_tokens must be an int that fits in 64 bits, got {value!r}"
            ) from None

    def __reduce__(self) -> Any:
        """Refused: a copy would share the slot (and give it back twice)."""
        raise TypeError(
            f"request {self.request_id!r} is a ColumnRequest: its num_computed_tokens is a slot "
            "of its StepColumns, so it cannot be copied or pickled"
        )

    def __del__(self) -> None:
        if getattr(self, "_holds_slot", False):
            self.columns.release(self.slot)
