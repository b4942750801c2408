"""``RowTables``: which block-table row each request holds, and the counters of every row's tables.

The block tables themselves (``tables[G, R, W]`` in ``hybridkv.optimized.manager``) say which
block sits at each position; this class keeps what the manager needs to know about a row without
reading them: how long each group's table is, where its leading nulls end, how far it is cached
(and where its longest cached prefix can sit), and when the row next needs work. The manager,
``hybridkv.optimized.batch`` and ``hybridkv.optimized.mamba`` read and write these through the
named columns below, never through offsets into the buffers.

Data layout (G groups, R = ``max_num_reqs`` rows)
----------------------------------------------
::

    state[3, R, G]   int64, one flat ``IntBuffer``; row r, group g is at index ``r × G + g``
                     (``index(row, g)``) of each column (request-major, so that a batch gathers
                     the ``[n, G]`` counters of n rows with one ``index_select``):
        length       the table length (positions past it are stale)
        nulls        the leading null positions (a window or chunk releases from the front only,
                     so the nulls of a row are exactly positions 0 … nulls − 1; for a Mamba
                     ``"align"`` group, whose nulls sit between states, the positions retired)
        cached       the positions already entered into the prefix cache
    kept[R, G]       int64, same indexing, a buffer of its own (no batch reads it): one past the
                     last position adopted as a hit or entered into the cache under a retention
                     mask (which may leave the positions after it, up to ``cached``, uncached);
                     ``estimate_cached_tokens`` reads the block before it
    next[4, R]       int64, per row, when it next needs work (derived from ``state`` by
                     ``RowThresholds``, ``hybridkv.optimized.row_thresholds``):
        capacity     the tokens its tables hold (a step needing more takes blocks)
        release_at   the processed tokens (computed less ``num_in_flight_tokens``, async
                     scheduling) at which a window or chunk next releases a block
        cache_at     the tokens at which its next block is full (and is cached)
        quiet_below  the three in one: a step whose computed, new and lookahead tokens add up
                     to less than this does none of those (``min(capacity + 1, release_at + 1,
                     cache_at)``, the last only with caching on), one comparison for the
                     common decode step

Each column is a ``memoryview`` of its buffer (``rows.length[i]``: one indexing operation, for
the single-request paths) and, but ``kept``, a row of a numpy array (``columns`` ``[3, R·G]``,
``thresholds`` ``[4, R]``: the batched paths). A request takes a row on its first successful
allocation (``take``) and gives it back when freed (``release``), its counters zeroed.

A batch (``hybridkv.optimized.batch``) may ``remember`` the rows of the requests it served
(with a value of its own: the requests' slots of a ``StepColumns``): the next batch of the same
request objects, in the same order, gets them back from ``remembered`` (one identity
comparison per request) instead of reading every request's id and looking it up, as long as
no row was taken or given back since (``take`` and ``release`` forget them). A
scheduler's decode steps pass the same running requests step after step, and reading 1,024
requests' ids (each a string object of its own, then a dict entry) costs more than the step's
arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, ItemsView, Iterable, Sequence
from operator import is_

import numpy as np
import numpy.typing as npt

from hybridkv.optimized._buffers import IntBuffer
from hybridkv.spec.errors import require


class RowTables:
    """The rows of the block tables and their per-group counters (see the module docstring)."""

    __slots__ = (
        "_batch",
        "_batch_extra",
        "_batch_rows",
        "_free",
        "_garange",
        "_kept",
        "_next",
        "_rows",
        "_state",
        "cache_at",
        "cached",
        "capacity",
        "columns",
        "kept",
        "length",
        "max_num_reqs",
        "nulls",
        "num_groups",
        "quiet_below",
        "release_at",
        "row_of",
        "thresholds",
    )

    def __init__(self, max_num_reqs: int, num_groups: int) -> None:
        r, g = max_num_reqs, num_groups
        self.max_num_reqs, self.num_groups = r, g
        rg = r * g
        self._state = IntBuffer(3 * rg, typecode="q")
        state = memoryview(self._state.a)
        self.length = state[:rg]
        self.nulls = state[rg : 2 * rg]
        self.cached = state[2 * rg : 3 * rg]
        self.columns: npt.NDArray[np.int64] = self._state.n.reshape(3, rg)
        self._kept = IntBuffer(rg, typecode="q")
        self.kept = memoryview(self._kept.a)[:rg]
        self._next = IntBuffer(4 * r, typecode="q")
        thresholds = memoryview(self._next.a)
        self.capacity = thresholds[:r]
        self.release_at = thresholds[r : 2 * r]
        self.cache_at = thresholds[2 * r : 3 * r]
        self.quiet_below = thresholds[3 * r : 4 * r]
        self.thresholds: npt.NDArray[np.int64] = self._next.n.reshape(4, r)
        self._garange = np.arange(g, dtype=np.int64)
        self._rows: dict[str, int] = {}
        # The row a request holds, or ``None``: the dict's own ``get`` (no Python frame; every
        # decode call reads it).
        self.row_of: Callable[[str], int | None] = self._rows.get
        self._free = list(range(r - 1, -1, -1))
        # The last remembered batch (its request objects, in order) and their rows.
        self._batch: list[object] = []
        self._batch_rows: npt.NDArray[np.int64] = np.zeros(0, dtype=np.int64)
        self._batch_extra: object = None

    # --- Indexing ---------------------------------------------------------------------------

    def index(self, row: int, group_id: int) -> int:
        """Where row ``row``, group ``group_id`` sits in every column."""
        return row * self.num_groups + group_id

    def pair_index(self, rows: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``index`` of every (row, group) of ``rows`` (int64), as ``[n, G]``."""
        pairs: npt.NDArray[np.int64] = rows[:, None] * self.num_groups + self._garange
        return pairs

    def gather(self, pair_index: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``[3, n, G]``: length, nulls and cached of the pairs ``pair_index`` (``[n, G]``)."""
        picked: npt.NDArray[np.int64] = self.columns[:, pair_index]
        return picked

    @property
    def nbytes(self) -> int:
        """Bytes of host memory in the counters."""
        return self._state.nbytes + self._kept.nbytes + self._next.nbytes

    # --- Rows -------------------------------------------------------------------------------

    def rows_of(self, request_ids: Iterable[str]) -> list[int | None]:
        """``row_of`` of each request (one C-level ``map``: a batch reads every request)."""
        return list(map(self._rows.get, request_ids))

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._rows

    def items(self) -> ItemsView[str, int]:
        """(request id, row) of every row in use."""
        return self._rows.items()

    def remember(
        self, requests: Sequence[object], rows: npt.NDArray[np.int64], extra: object = None
    ) -> None:
        """Remember that ``requests`` (each holding one row, listed once) hold ``rows``, with
        the caller's ``extra``."""
        self._batch = list(requests)
        self._batch_rows = rows
        self._batch_extra = extra

    def remembered(self, requests: Sequence[object]) -> tuple[npt.NDArray[np.int64], object] | None:
        """The rows (and the caller's extra) remembered for exactly these request objects in
        this order, no row taken or given back since, else ``None``. The caller must not
        change the array."""
        batch = self._batch
        if batch and len(requests) == len(batch) and all(map(is_, requests, batch)):
            return self._batch_rows, self._batch_extra
        return None

    def forget(self) -> None:
        """Drop the remembered batch (a row changed hands; its requests may be gone)."""
        if self._batch:
            self._batch = []
            self._batch_rows = np.zeros(0, dtype=np.int64)
            self._batch_extra = None

    def take(self, request_id: str) -> int:
        """A free row for the request (its counters are zero)."""
        if not self._free:
            raise ValueError(
                f"max_num_reqs must cover every request holding blocks: {self.max_num_reqs} rows "
                f"are in use, so request {request_id!r} cannot be admitted"
            )
        row = self._free.pop()
        self._rows[request_id] = row
        self.forget()
        return row

    def release(self, request_id: str, row: int) -> None:
        """Give the request's row back, its counters zeroed (its thresholds are rewritten when
        the row is next taken)."""
        del self._rows[request_id]
        self.forget()
        at = row * self.num_groups
        length, nulls, cached, kept = self.length, self.nulls, self.cached, self.kept
        for i in range(at, at + self.num_groups):
            length[i] = nulls[i] = cached[i] = kept[i] = 0
        self._free.append(row)

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless every row is either free or held by one request."""
        held = list(self._rows.values())
        require(
            sorted(held + self._free) == list(range(self.max_num_reqs)),
            "table rows are lost or shared",
        )
