"""Planted bugs in the reference, and the suite that must catch every one.

Each ``Mutant`` is a source patch of one module of ``spec/`` or ``reference/`` (exact text,
found exactly once, so a patch that no longer applies fails loudly instead of testing nothing).
``load_mutant`` imports a private copy of the reference with the patch applied, leaving the
real modules untouched, and ``hunt`` runs the conformance checks against it, cheapest first,
until one fails:

* manager mutants: the stateful differential machine (mutant vs the pristine reference, every
  observable and invariant after every step), then the longest-hit oracles on built cache
  states (the first set's layouts, then Mamba "align" and mixed block sizes), then the golden
  vLLM traces: the engine set (Mamba, mixed block sizes, retention, full-prompt admission,
  speculative decoding), then the unit set;
* planner mutants: the grouping, memory-layout and padding oracles over the document's models
  and random ones.

A mutant that survives every check means the suite has a blind spot: ``tests/test_mutants.py``
fails for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import random
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from hybridkv.conformance import oracles
from hybridkv.conformance.adapters import (
    Backend,
    manager_backend,
    optimized_backend,
    reference_backend,
)
from hybridkv.conformance.golden import replay_trace, trace_names
from hybridkv.conformance.mutant import Mutant, Suite
from hybridkv.conformance.mutants_optimized import OPTIMIZED_MUTANTS
from hybridkv.conformance.mutants_planner import PLANNER_MUTANTS
from hybridkv.conformance.mutants_reference import REFERENCE_MUTANTS
from hybridkv.conformance.strategies import document_models, random_models

__all__ = ["MUTANTS", "Mutant", "Suite", "hunt", "hunt_all", "load_mutant"]

MUTANTS: tuple[Mutant, ...] = REFERENCE_MUTANTS + OPTIMIZED_MUTANTS + PLANNER_MUTANTS


# --- Loading a private, patched copy of the reference ---------------------------------------


class _PatchedLoader(importlib.abc.Loader):
    def __init__(self, source: str, path: str) -> None:
        self.source = source
        self.path = path

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        module.__file__ = self.path
        exec(compile(self.source, self.path, "exec"), module.__dict__)


class _PatchedFinder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, source: str, path: str) -> None:
        self.name = name
        self.loader = _PatchedLoader(source, path)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self.loader, origin=self.loader.path)


def patched_source(mutant: Mutant) -> tuple[str, str]:
    """The module's patched source and its file path; ``ValueError`` if a patch does not apply."""
    spec = importlib.util.find_spec(mutant.module)
    if spec is None or spec.origin is None:
        raise ValueError(f"mutant {mutant.name}: module {mutant.module} not found")
    with open(spec.origin, encoding="utf-8") as handle:
        source = handle.read()
    for old, new in mutant.patches:
        count = source.count(old)
        if count != 1:
            raise ValueError(
                f"mutant {mutant.name}: patch text found {count} times in {mutant.module} "
                f"(expected once; update the mutant to the current source):\n{old}"
            )
        source = source.replace(old, new)
    return source, spec.origin


def fresh_packages(mutant: Mutant) -> tuple[str, ...]:
    """The packages imported afresh for a mutant: the optimized backend's for its mutants (it
    keeps the real reference, whose requests the adapters build), the reference's otherwise
    (``spec`` modules are patched in place and the reference re-imports them)."""
    if mutant.module.startswith("hybridkv.optimized"):
        return ("hybridkv.optimized",)
    return ("hybridkv.reference",)


@contextmanager
def _private_modules(mutant: Mutant) -> Iterator[None]:
    """Import inside this block gets fresh reference modules and the patched target module;
    afterwards ``sys.modules`` and the package attributes are exactly as before."""
    source, path = patched_source(mutant)
    fresh = (*fresh_packages(mutant), mutant.module)
    saved = {
        name: module
        for name, module in sys.modules.items()
        if any(name == f or name.startswith(f + ".") for f in fresh)
    }
    parents = {}
    for name in {*saved, mutant.module}:
        parent, _, child = name.rpartition(".")
        if parent in sys.modules and hasattr(sys.modules[parent], child):
            parents[(parent, child)] = getattr(sys.modules[parent], child)
    finder = _PatchedFinder(mutant.module, source, path)
    for name in saved:
        del sys.modules[name]
    sys.meta_path.insert(0, finder)
    try:
        importlib.import_module(mutant.module)
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in list(sys.modules):
            if any(name == f or name.startswith(f + ".") for f in fresh):
                del sys.modules[name]
        sys.modules.update(saved)
        for (parent, child), value in parents.items():
            setattr(sys.modules[parent], child, value)


@dataclass(frozen=True)
class MutantBundle:
    """The public objects of a mutated copy of the reference (for a mutant of the optimized
    backend, ``KVCacheManager`` is its patched ``TorchKVCacheManager``)."""

    mutant: Mutant
    KVCacheManager: Any
    plan_groups: Callable[..., Any]
    plan_kv_cache: Callable[..., Any]
    plan_report: Callable[..., Any]


def load_mutant(mutant: Mutant) -> MutantBundle:
    """A private copy of ``hybridkv.reference`` (or ``hybridkv.optimized``) with ``mutant``
    applied."""
    with _private_modules(mutant):
        reference = importlib.import_module("hybridkv.reference")
        manager = reference.KVCacheManager
        if is_optimized(mutant):
            manager = importlib.import_module("hybridkv.optimized").TorchKVCacheManager
        return MutantBundle(
            mutant,
            manager,
            reference.plan_groups,
            reference.plan_kv_cache,
            reference.plan_report,
        )


def is_optimized(mutant: Mutant) -> bool:
    return mutant.module.startswith("hybridkv.optimized")


# --- The suites ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hunt:
    """Which check caught a mutant (``None``: it survived every one), and how."""

    mutant: Mutant
    caught_by: str | None
    detail: str


def _first_line(error: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(error), error)).strip()
    return text.splitlines()[0][:300] if text else type(error).__name__


def mutant_backend(bundle: MutantBundle) -> Backend:
    """The mutated manager behind the adapter protocol (a mutant of the reference plans with
    its own, possibly mutated, planner); a mutant of the optimized backend with
    its size thresholds (``optimized_backend``: small on half the layouts, so that its
    vectorised and batched paths run)."""
    if is_optimized(bundle.mutant):
        backend = optimized_backend(manager_class=bundle.KVCacheManager)
        assert backend is not None
        return backend
    return manager_backend("mutant", bundle.KVCacheManager, plan_report=bundle.plan_report)


def manager_checks(
    bundle: MutantBundle, examples: int = 40, steps: int = 30
) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, check) pairs; a check raises when it sees the bug."""
    backend: Backend = mutant_backend(bundle)

    def differential() -> None:
        from hybridkv.conformance.machine import run_differential

        run_differential(
            [reference_backend(), backend], max_examples=examples, steps=steps, shrink=False
        )

    def replay(trace_set: str) -> None:
        for name in trace_names(trace_set):
            _, divergence = replay_trace(name, backend[1])
            if divergence is not None:
                raise AssertionError(str(divergence).splitlines()[0])

    def golden() -> None:
        replay("unit")

    def engine_golden() -> None:
        """The engine traces (Mamba, mixed block sizes, retention, full-prompt admission,
        speculative decoding): the only recorded vLLM behaviour for the engine rules."""
        replay("engine")

    def differential_roomy() -> None:
        """Pools that feed prefills and decodes: a batched step with work to do in every
        request (new blocks, releases, newly full blocks to cache) is common only here."""
        from hybridkv.conformance.machine import run_differential

        run_differential(
            [reference_backend(), backend],
            max_examples=examples,
            steps=steps,
            shrink=False,
            roomy=True,
        )

    yield "differential machine", differential
    yield "differential machine, roomy pools", differential_roomy
    yield "longest-hit oracle", lambda: longest_hit_check(bundle, backend)
    # The engine set first: it replays faster than the unit set (13 s vs 20 s for the
    # reference) and exercises the same code plus the engine rules, so most mutants that get
    # this far fail within its first traces.
    yield "engine golden traces", engine_golden
    yield "golden traces", golden


def longest_hit_check(bundle: MutantBundle, backend: Backend) -> None:
    """The longest-hit oracles on the mutant: through its adapter for an optimized mutant, else
    on cache states built inside its pool (random ones, then the engine layouts')."""
    if is_optimized(bundle.mutant):
        found = oracles.run_adapter_hit_oracle(backend[0], backend[1], 150, seed=4)
        if found.failures:
            raise AssertionError(found.failures[0])
        return
    rng = random.Random(4)
    for _ in range(300):
        groups, prompt, block_size = oracles.random_cache_state(rng)
        hit = oracles.reference_hit(groups, prompt, block_size, bundle.KVCacheManager)
        if (hit.hit_tokens, hit.block_ids) != (hit.brute_force_tokens, hit.expected_block_ids):
            raise AssertionError(f"longest hit {hit} for {groups}")
    engine = oracles.run_engine_hit_oracle(200, seed=4, manager_class=bundle.KVCacheManager)
    if engine.failures:
        raise AssertionError(engine.failures[0])


def planner_checks(bundle: MutantBundle) -> Iterator[tuple[str, Callable[[], None]]]:
    def grouping() -> None:
        from hybridkv.reference import plan_report

        models = document_models() + random_models(random.Random(7), 300)
        for layers, sharing in models:
            args = (layers, 10**9)
            kw: dict[str, Any] = {
                "max_model_len": 4096,
                "max_num_batched_tokens": 512,
                "kv_sharing": sharing,
            }
            try:
                plan_report(*args, **kw)
            except ValueError:
                continue  # a model the document does not cover: the error is the spec
            report = bundle.plan_report(*args, **kw)
            problems = oracles.check_plan_report(layers, report, 10**9, sharing)
            if problems:
                raise AssertionError(f"{problems[0]} (model of {len(layers)} layers)")

    yield "planner oracles", grouping


FIRST_CHECK: dict[str, str] = {
    "opt_pending_release_order": "golden traces",
    "opt_pending_release_of_uncached": "differential machine, roomy pools",
    "opt_lookup_before_pending": "differential machine, roomy pools",
    "capacity_ignores_queued_hits": "engine golden traces",
    "full_prompt_without_window_cap": "engine golden traces",
    "opt_touch_many_keeps_queued": "differential machine, roomy pools",
    "opt_window_vector_off_by_one": "differential machine, roomy pools",
    "opt_hybrid_one_pass": "golden traces",
    "opt_memo_run_skips_next_probe": "golden traces",
    "opt_one_pass_counts_queued_hits_free": "golden traces",
    "full_hit_no_stop": "longest-hit oracle",
}
"""Mutants caught late or slowly in the cheapest-first order, and the check that catches them
(``python -m hybridkv.conformance.kill_table``): their hunt tries it first, then the others in
order, so the verdict is the same and the hunt short."""


def _first_check_first(
    mutant: Mutant, checks: Iterator[tuple[str, Callable[[], None]]]
) -> list[tuple[str, Callable[[], None]]]:
    first = FIRST_CHECK.get(mutant.name)
    return sorted(checks, key=lambda check: check[0] != first)


def hunt(mutant: Mutant, examples: int = 40) -> Hunt:
    """Run the checks of the mutant's suite until one fails (``FIRST_CHECK`` first)."""
    bundle = load_mutant(mutant)
    if is_optimized(mutant):
        # The vectorised paths run in steps of several busy requests: the fast profile's
        # differential budget (a caught mutant stops at its first difference).
        checks = manager_checks(bundle, max(examples, 200), 40)
    elif mutant.suite == "planner":
        checks = planner_checks(bundle)
    else:
        checks = manager_checks(bundle, examples)
    for name, check in _first_check_first(mutant, checks):
        try:
            check()
        except Exception as error:
            return Hunt(mutant, name, _first_line(error))
    return Hunt(mutant, None, "survived every check")


def hunt_all(
    mutants: Sequence[Mutant] = MUTANTS,
    examples: int = 40,
    progress: Callable[[Hunt], None] | None = None,
) -> list[Hunt]:
    results = []
    for mutant in mutants:
        result = hunt(mutant, examples)
        results.append(result)
        if progress is not None:
            progress(result)
    return results


# --- Which check kills which mutant, each check alone ---------------------------------------
