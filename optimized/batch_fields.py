"""Which rows a whole-step call works on, and the requests' computed tokens.

``allocate_slots_batch`` (``hybridkv.optimized.batch``) first reads, for every request, the
row it holds and its computed tokens, and checks that each is running, listed once and hashed
soundly. A scheduler's decode steps pass the same running requests step after step, so the
rows of the last batch are remembered (``RowTables.remember``) and taken back for the same
request objects in the same order; for column requests of one ``StepColumns``
(``hybridkv.optimized.step_columns``) their slots are remembered too, and their counts are one
gather. Otherwise every request object is read (comprehensions: the interpreter's cached
attribute reads).

Data layout
-----------
Rows and computed tokens come back as int64 numpy arrays, one entry per request in call
order; the remembered rows are the array ``RowTables`` holds (read-only to the caller).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from operator import countOf
from typing import cast

import numpy as np
import numpy.typing as npt

from hybridkv.optimized import path_counts as paths
from hybridkv.optimized.state import ManagerState
from hybridkv.optimized.step_columns import ColumnRequest, StepColumns
from hybridkv.reference.request import Request, RequestLike

Ints = npt.NDArray[np.int64]


def step_fields(s: ManagerState, requests: Sequence[RequestLike]) -> tuple[Ints, Ints] | None:
    """Rows and computed tokens per request, each an int64 array; ``None`` unless every
    request is running, listed once and hashed soundly (with caching). The rows of the last
    step's requests are remembered (``RowTables.remember``), with their slots where they are
    column requests of one ``StepColumns`` (then their counts are one gather)."""
    found = s.rows.remembered(requests)
    if found is not None:
        rows, slots = found
        s.pool.paths.ran(paths.BATCH_REMEMBERED)
        if slots is not None:
            columns, at = cast("tuple[StepColumns, Ints]", slots)
            s.pool.paths.ran(paths.BATCH_COLUMNS)
            return rows, columns.computed[at]
    else:
        read = _rows_of(s, requests)
        if read is None:
            return None
        rows = read
    computed = array("q", [r.num_computed_tokens for r in requests])
    return rows, np.frombuffer(computed, dtype=np.int64)


def _rows_of(s: ManagerState, requests: Sequence[RequestLike]) -> Ints | None:
    """The requests' rows read afresh, and remembered where what was checked cannot change
    while the same request objects come back: ``Request``s and ``ColumnRequest``s (their ids
    fixed) hashed soundly by construction, or with caching off."""
    # Comprehensions, not ``map(attrgetter(…))``: their attribute reads are the
    # interpreter's cached ones, about twice as fast per request.
    found = s.rows.rows_of([r.request_id for r in requests])
    if None in found:
        return None
    rows = np.array(found, dtype=np.int64)
    if np.bincount(rows, minlength=1).max() > 1:
        return None  # a request listed twice
    n = len(requests)
    plain = countOf(map(type, requests), Request)
    in_columns = countOf(map(type, requests), ColumnRequest) if plain < n else 0
    own = plain + in_columns == n
    sound = own and _sound_by_construction(s, cast("Sequence[Request]", requests))
    if s.layout.caching and not sound and not _hashes_within_tokens(s, requests):
        return None  # a request hashed at another block size: the single calls raise
    if own and (sound or not s.layout.caching):
        s.rows.remember(requests, rows, _slots(requests) if in_columns == n else None)
    return rows


def _slots(requests: Sequence[RequestLike]) -> tuple[StepColumns, Ints] | None:
    """The column and slots of column requests all of one ``StepColumns``, else ``None``."""
    columns = cast("ColumnRequest", requests[0]).columns
    slots = columns.slots(requests)
    return None if slots is None else (columns, slots)


def _sound_by_construction(s: ManagerState, requests: Sequence[Request]) -> bool:
    """Whether no request can have more block hashes than full blocks
    (``check_block_hashes``): a ``Request`` hashed at the manager's block size, with at least
    its lookahead, has none by construction (both are fixed when it is built)."""
    n = len(requests)
    return [r.hash_block_size for r in requests].count(s.layout.hash_block_size) == n and min(
        [r.num_hash_lookahead_tokens for r in requests]
    ) >= s.layout.lookahead


def _hashes_within_tokens(s: ManagerState, requests: Sequence[RequestLike]) -> bool:
    """Whether no request has more block hashes than full blocks, counted."""
    num_tokens = np.array([r.num_tokens for r in requests], dtype=np.int64)
    num_hashes = np.array([len(r.block_hashes) for r in requests], dtype=np.int64)
    limit = np.maximum(num_tokens - s.layout.lookahead, 0) // s.layout.hash_block_size
    return not bool((num_hashes > limit).any())
