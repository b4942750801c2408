"""hybridkv: the hybrid KV cache manager, as a checked specification, a readable reference and a
fast torch backend.

The subpackages: ``hybridkv.spec`` (vocabulary and rules), ``hybridkv.reference`` (the planner
and the manager), ``hybridkv.optimized`` (the torch backend) and ``hybridkv.conformance``.
"""

__version__ = "0.1.0"
