"""How an implementation joins the conformance suite: a small adapter protocol, and backends.

The golden replay (``golden``), the stateful differential machine
(``hybridkv.conformance.stateful``) and the adapter hit oracle never call a manager directly;
they call a ``ManagerAdapter``, which speaks plain values (block ids as tuples of ints,
hit lengths, snapshots as tuples), so managers of other engines, or mutated copies of the
reference, compare equal whenever they behave the same. ``hybridkv.reference.KVCacheManager``
and ``hybridkv.optimized.TorchKVCacheManager`` already have the scheduler API of
``KVCacheManagerLike``; ``ProtocolAdapter`` wraps either.

Plugging in another implementation
----------------------------------
``python -m hybridkv.conformance --adapter my_module:make_adapter`` runs the whole suite (golden
traces, differential machine, longest-hit oracle) on an ``AdapterFactory`` (``load_backend``);
the README's "Check your own implementation" documents every value's format.

Write a class with the methods of ``ManagerAdapter`` (most are one line), and a factory
``(config, max_model_len, enable_caching, enable_kv_cache_events, engine) -> adapter``, where
``engine`` is an ``EngineOptions`` (the engine's keywords: ``max_in_flight_tokens``,
``use_eagle``, ``num_hash_lookahead_tokens``) that the implementation must honour; requests are
hashed at ``hash_block_size_of(config, enable_caching)`` with ``engine``'s lookahead. From
Python, each part alone::

    from hybridkv.conformance.adapters import reference_backend
    from hybridkv.conformance.golden import check_trace
    from hybridkv.conformance.machine import run_differential

    result = check_trace("gen_s101_0000", my_factory)  # TraceResult: pass, fail or skipped
    stats = run_differential([reference_backend(), ("mine", my_factory)], max_examples=200)

``run_differential`` raises on the first difference and prints the shortest sequence of
scheduler calls that shows it. ``ProtocolAdapter`` is the example adapter, used on the reference
itself. An adapter may return ``None`` from ``snapshot``, ``take_events`` or ``take_stats`` when
its implementation cannot show them: those observables are then not compared for it.

Batched calls (optional)
------------------------
An adapter whose implementation serves a whole scheduler step at once may also have
``allocate_batch(requests, num_new_tokens, num_lookahead_tokens, delay_cache_blocks)`` (running
requests, no new hits; one count per request; the new blocks or ``None`` per request, in order)
and ``free_batch(requests)`` (``BatchAllocating``, ``BatchFreeing``). The machine then drives
them as a scheduler does; their results must equal the single calls made one by one in order
(the model's adapter, ``ProtocolAdapter``, makes them by looping where its manager has no batched
calls). An adapter without them is driven through ``allocate`` and ``free`` one by one.

An implementation that does not implement a drawn layout or engine setting yet raises, from its
factory, a ``ValueError`` whose message contains ``NOT_IMPLEMENTED`` ("does not implement"): the
machine then skips that example for that backend only (the run summary counts the skips), and
the golden replay counts the trace as skipped, by name (also when an operation raises it).

The package: ``adapter_protocol`` (the protocol and its values), ``protocol_adapter`` (the
example adapter) and ``backends`` (the backends the suite runs); their public names are
re-exported here.
"""

from __future__ import annotations

from hybridkv.conformance.adapters.adapter_protocol import (
    MODEL_REFUSED,
    NOT_IMPLEMENTED,
    AdapterFactory,
    Backend,
    BatchAllocating,
    BatchFreeing,
    BlockIds,
    EngineOptions,
    Lookup,
    ManagerAdapter,
    PathCounting,
    PlanFacts,
    Planning,
    Snapshot,
    batch_allocator,
    batch_freer,
    path_counter,
    planner,
)
from hybridkv.conformance.adapters.backends import (
    SMALL_THRESHOLDS,
    AdapterLoadError,
    backends_named,
    load_backend,
    manager_backend,
    optimized_backend,
    reference_backend,
    reference_stand_in,
    thresholds_of_pool,
)
from hybridkv.conformance.adapters.protocol_adapter import (
    PlanningAdapter,
    ProtocolAdapter,
    block_size_of,
    hash_block_size_of,
)

__all__ = [
    "MODEL_REFUSED",
    "NOT_IMPLEMENTED",
    "SMALL_THRESHOLDS",
    "AdapterFactory",
    "AdapterLoadError",
    "Backend",
    "BatchAllocating",
    "BatchFreeing",
    "BlockIds",
    "EngineOptions",
    "Lookup",
    "ManagerAdapter",
    "PathCounting",
    "PlanFacts",
    "Planning",
    "PlanningAdapter",
    "ProtocolAdapter",
    "Snapshot",
    "backends_named",
    "batch_allocator",
    "batch_freer",
    "block_size_of",
    "hash_block_size_of",
    "load_backend",
    "manager_backend",
    "optimized_backend",
    "path_counter",
    "planner",
    "reference_backend",
    "reference_stand_in",
    "thresholds_of_pool",
]
