"""The optimized backend: ``TorchKVCacheManager``, equal to the reference, on flat buffers.

Modules: ``block_pool`` (per-block state: reference counts, free queue, prefix cache),
``pending`` (the pool's share of running requests' steps, made in one pass before anything
reads it), ``lookup`` (cache hits with verification), ``manager`` (the scheduler API and the
block-table tensors), ``rows`` (which request holds which table row, each row's per-group
counters and thresholds), ``group_columns`` (the per-group constants of the vectorised paths),
``batch`` (whole-step calls), ``mamba`` (the per-request path of a Mamba ``"align"`` group),
``hash_memo`` (the block hasher that adopts cached prefixes' hashes), ``hashing`` (block hashes
with the CBOR of all blocks encoded by tensor operations, for ``Request(...,
block_hasher=hash_full_blocks_torch)``), ``_buffers`` (the numpy buffers every state lives in,
with their memoryview and tensor views) and ``thresholds`` (the sizes at which each path
switches between one element at a time and vectorised calls). Each explains its data layout at
the top.
"""

from hybridkv.optimized.manager import TorchKVCacheManager

__all__ = ["TorchKVCacheManager"]
