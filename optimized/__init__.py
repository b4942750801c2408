"""The optimized backend: ``TorchKVCacheManager``, equal to the reference, on flat buffers.

Modules: ``manager`` (the public API: validation and dispatch), ``state`` (everything a manager
holds, in one object, with its shared steps), ``layout`` (the per-group constants, computed once),
and the phases of a request's life as functions of the state: ``hits`` (lookup), ``allocation`` and
``admission`` (a first allocation; ``one_pass_admission``: a plain one, every group's table as one
matrix), ``step`` (a running request's step), ``caching`` and ``general_caching`` (entering full
blocks into the prefix cache), ``mamba`` (the per-request path of a Mamba ``"align"`` group),
``batch``, ``batch_small`` and ``batch_free`` (whole-step calls) and ``invariants`` (observation and
self-checks). Beneath them: ``block_pool`` (per-block state: reference counts, free queue, prefix
cache), ``pending`` (the pool's share of running requests' steps, made in one pass before anything
reads it), ``lookup`` (cache hits with verification), ``type_hits`` (each attention type's longest
hit), ``block_tables`` (the block-table tensors), ``rows`` and ``row_thresholds`` (which request
holds which table row, each row's per-group counters and thresholds), ``group_rules`` and
``group_columns`` (the per-group rules and the constants of the vectorised paths), ``hash_memo``
(the block hasher that adopts cached prefixes' hashes), ``hashing`` (block hashes with the CBOR of
all blocks encoded by tensor operations, for ``Request(..., block_hasher=hash_full_blocks_torch)``),
``step_columns`` (requests whose computed-token counts live in one numpy column, which a whole-step
call reads with one gather), ``_buffers`` (the numpy buffers every state lives in, with their
memoryview and tensor views; the pool's per-block int32 fields interleaved, one record per block)
and ``thresholds`` (the sizes at which each path switches between one element at a time and
vectorised calls). Each explains its data layout at the top.
"""

from hybridkv.optimized.manager import TorchKVCacheManager
from hybridkv.optimized.step_columns import ColumnRequest, StepColumns

__all__ = ["ColumnRequest", "StepColumns", "TorchKVCacheManager"]
