"""The optimized (torch) backend: ``TorchKVCacheManager``, equal to the reference, in tensors.

Modules: ``block_pool`` (per-block state: reference counts, free queue, prefix cache),
``lookup`` (cache hits with verification), ``manager`` (the scheduler API and the block-table
tensors), ``rows`` (which request holds which table row, and each row's per-group counters),
``batch`` (whole-step calls), ``mamba`` (the per-request path of a Mamba ``"align"`` group) and
``hashing`` (block hashes with the CBOR of all blocks encoded by tensor operations, for
``Request(..., block_hasher=hash_full_blocks_torch)``), and ``thresholds`` (the sizes at which
each path switches between one element at a time and tensor calls). Each explains its data
layout at the top.
"""

from hybridkv.optimized.manager import TorchKVCacheManager

__all__ = ["TorchKVCacheManager"]
