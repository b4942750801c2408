"""Conformance: golden vLLM traces, stateful differential models and symbolic checks.

* ``golden``: replay the traces recorded from vLLM 0.33 against any backend;
* ``adapters``: the adapter protocol an implementation joins through, and the backends;
  ``adapters.vllm``: vLLM 0.33's own manager behind it;
* ``stateful``: the Hypothesis state machine that drives implementations in lockstep (split
  into ``strategies``, ``invariants`` and ``machine``; ``stateful`` re-exports them);
* ``oracles``: brute-force checks of the longest hit and of the planner;
* ``harnesses``, ``planted_bugs``, ``crosshair_manifest``, ``crosshair_runner``,
  ``crosshair_batches``: CrossHair;
* ``mutants``: planted bugs in the reference that the suite must catch;
* ``mutation_score``: mutmut over ``reference/`` (a separate command);
* ``python -m hybridkv.conformance``: all of it, with a report.
"""
