"""The stateful differential model: a scheduler driving implementations in lockstep.

``DifferentialMachine`` is a Hypothesis ``RuleBasedStateMachine`` that lives in the library (like
``zarr.testing.stateful``), so anyone can point it at their own KV cache manager through an
adapter (``hybridkv.conformance.adapters``). It draws a layout (1–4 KV cache groups mixing full
attention, sliding window, chunked local attention and Mamba; one block size; windows and chunks
that are and are not multiples of it; pools small enough that eviction and failed allocations
happen; caching on or off; events on or off; the engine's settings), plans one drawn model
with every implementation that plans (``plan_model``), warms the cache up with one finished
request, then acts like a scheduler:

* ``add_request``, ``add_follow_up``: a new prompt: fresh (mostly the deployment's usual system
  prompt plus a question), the next turn of an earlier conversation (its salt kept), or an
  exact resend, with or without a cache salt;
* ``lookup``: ``get_computed_blocks`` of a waiting request;
* ``admit``, ``admit_whole_prompt``: look up, then ``allocate_slots`` with or without the hit,
  a token budget (chunked prefill, never more than the engine's in-flight budget), lookahead
  slots, full-prompt admission, sometimes delayed caching; after a failed admission no more
  admissions until blocks are released;
* ``prefill``, ``decode``, ``speculative_decode``: a running request's next prefill chunk, a
  decode step, or a decode step with drafts (accepted ones settled first);
* ``step_batch``, ``step_all``: one scheduler step of several (or every) running requests,
  through the implementation's ``allocate_batch`` where it has one;
* ``cache_delayed``: ``cache_blocks`` for a request whose caching was delayed;
* ``new_step``: ``new_step_starts()`` (a Mamba state cached before may now be adopted);
* ``finish``, ``finish_batch`` (``free``, ``free_batch``), ``abort`` (free a waiting request: a
  no-op), ``preempt`` (free, back to waiting with no computed tokens), ``reset_prefix_cache``,
  and ``drain`` (free everything, then nothing may be in use and a reset must succeed).

After every rule, every implementation must agree with the first (the model) on every
observable: the call's result (hit length and blocks, new blocks or ``None``), every live
request's whole block table, free count, usage, free-queue order, reference counts, cached
blocks per group, number of cache keys, events and statistics. And every implementation must
pass the invariants (its own ``check_invariants()`` and the external ones in
``check_observable_invariants``, computed from what it shows).

Every call goes through a ``lockstep.Lockstep``, which compares the results and writes the call
as a line of Python: a failure carries the shortest failing example as a program to paste.

The machine is split by concern: ``strategies`` (layouts, models and traffic), ``invariants``
(what any implementation must satisfy, from what it shows), ``lockstep`` (the implementations
driven and compared call by call), ``machine_state``, ``machine_steps`` and ``machine_rules``
(the scheduler's bookkeeping, its actions and the rules), ``run_stats`` (what a run covered)
and ``machine`` (the run); this module re-exports their public names.
"""

from __future__ import annotations

from hybridkv.conformance.invariants import (
    ConformanceError,
    check_failed_allocation,
    check_observable_invariants,
    skipped_block_count,
)
from hybridkv.conformance.lockstep import Lockstep, repro
from hybridkv.conformance.machine import (
    MAX_LIVE_REQUESTS,
    DifferentialMachine,
    LiveRequest,
    RunStats,
    machine_for,
    run_command_machine,
    run_differential,
)
from hybridkv.conformance.strategies import FAMILIES, SIZES, SYSTEM_PROMPTS, Layout, layouts

__all__ = [
    "FAMILIES",
    "MAX_LIVE_REQUESTS",
    "SIZES",
    "SYSTEM_PROMPTS",
    "ConformanceError",
    "DifferentialMachine",
    "Layout",
    "LiveRequest",
    "Lockstep",
    "RunStats",
    "check_failed_allocation",
    "check_observable_invariants",
    "layouts",
    "machine_for",
    "repro",
    "run_command_machine",
    "run_differential",
    "skipped_block_count",
]
