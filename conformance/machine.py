"""The differential machine, run: ``machine_for`` (a ``DifferentialMachine`` over chosen
backends), ``run_differential`` (Hypothesis runs it; a failure carries the shortest failing
example as scheduler calls) and ``run_command_machine`` (the runs ``python -m
hybridkv.conformance`` makes). The machine itself is split by concept: ``machine_state`` (the
scheduler's bookkeeping), ``machine_steps`` (its actions on every implementation),
``machine_rules`` (the rules) and ``run_stats`` (what a run covered); their public names are
re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.stateful import get_state_machine_test

from hybridkv.conformance.adapters import Backend, reference_stand_in
from hybridkv.conformance.draws import seed_only_draws
from hybridkv.conformance.lockstep import repro
from hybridkv.conformance.machine_rules import DifferentialMachine
from hybridkv.conformance.machine_state import MAX_LIVE_REQUESTS, LiveRequest
from hybridkv.conformance.run_stats import RunStats
from hybridkv.conformance.strategies import FAMILIES, Layout

__all__ = [
    "MAX_LIVE_REQUESTS",
    "DifferentialMachine",
    "LiveRequest",
    "RunStats",
    "machine_for",
    "run_command_machine",
    "run_differential",
]


def machine_for(
    backends: Sequence[Backend],
    stats: RunStats,
    family: str = "hybrid",
    stand_in: Backend | None = None,
    roomy: bool = False,
    big: bool = False,
) -> type[DifferentialMachine]:
    """A ``DifferentialMachine`` over these backends and one layout family, counting into
    ``stats``; ``stand_in`` joins an example in which a backend refuses the layout by name;
    ``roomy`` draws pools of two to twelve longest requests (prefills and decodes succeed);
    ``big`` serving sizes (``layouts``: prompts of thousands of tokens, pools of hundreds of
    blocks)."""
    stats.backends = tuple(name for name, _ in backends)
    attrs = {
        "backends": tuple(backends),
        "stats": stats,
        "family": family,
        "stand_in": stand_in,
        "roomy": roomy,
        "big": big,
    }
    return type(f"DifferentialMachine_{family}", (DifferentialMachine,), attrs)


def run_differential(
    backends: Sequence[Backend],
    *,
    max_examples: int = 100,
    steps: int = 50,
    seed: int | None = None,
    stats: RunStats | None = None,
    shrink: bool = True,
    families: Sequence[str] = FAMILIES,
    hypothesis_backend: str = "hypothesis",
    stand_in: Backend | None = None,
    roomy: bool = False,
    big: bool = False,
    adapter_specs: Mapping[str, str] | None = None,
) -> RunStats:
    """Run the machine over ``backends``; raise on the first difference or broken invariant.

    ``max_examples`` is split evenly between the layout ``families``. With ``seed=None`` the run
    is derandomized (the same examples every time, as CI needs); with a seed, that seed picks
    the examples. Hypothesis shrinks a failure; the error then carries (``repro`` attribute,
    and a note) the shortest failing example as a program of scheduler calls
    (``lockstep.repro``), naming each backend as ``adapter_specs`` maps its name (an outside
    adapter's ``MODULE:FACTORY``). ``shrink=False``: raise at once, quietly, as the mutant
    hunt wants.
    ``hypothesis_backend="crosshair"`` (with the ``hypothesis-crosshair`` package) draws the
    choices symbolically: about 18× slower, an advisory extra lane, not the main one.

    A backend whose factory refuses a drawn layout by name (``adapters.NOT_IMPLEMENTED``) skips
    that example (``RunStats.skipped``); ``stand_in`` (default: an independent reference,
    ``reference-again``) then joins so that the example still compares two implementations.
    ``roomy`` draws pools large enough that most allocations succeed; ``big`` draws serving
    sizes (model lengths of 512–4,096 tokens, pools of hundreds of blocks).
    """
    stats = RunStats() if stats is None else stats
    run_settings = machine_settings(
        max(1, max_examples // len(families)), steps, seed, shrink, hypothesis_backend
    )
    for family in families:
        machine = machine_for(
            backends,
            stats,
            family,
            reference_stand_in() if stand_in is None else stand_in,
            roomy,
            big,
        )
        # Hypothesis types this helper only in recent releases: call it through Any.
        make_test: Any = get_state_machine_test
        test: Any = make_test(machine, settings=run_settings)
        if seed is not None:
            test._hypothesis_internal_use_seed = seed
        try:
            with seed_only_draws():
                test()
        except Exception as error:
            if stats.last_run is not None:
                attach_repro(error, stats.last_run, adapter_specs or {})
            raise
    return stats


def machine_settings(
    examples: int, steps: int, seed: int | None, shrink: bool, hypothesis_backend: str
) -> settings:
    """Hypothesis's settings for one family's run: ``examples`` examples of up to ``steps``
    steps, derandomized without a seed, no database, shrinking (and reporting) only with
    ``shrink``."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=seed is None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])],
        report_multiple_bugs=False,
        verbosity=Verbosity.normal if shrink else Verbosity.quiet,
        backend=hypothesis_backend,
    )


def attach_repro(
    error: Exception,
    last_run: tuple[Layout, list[str], list[str]],
    adapter_specs: Mapping[str, str],
) -> None:
    """The failing example (``RunStats.last_run``: its layout, its script and the backends'
    names) as scheduler calls to paste: a note on ``error`` and its ``repro`` attribute, each
    backend named as ``adapter_specs`` maps it (an outside adapter's ``MODULE:FACTORY``)."""
    layout, script, names = last_run
    loadable = [adapter_specs.get(name, name) for name in names]
    text = repro(layout, loadable, script)
    error.add_note("The failing example as scheduler calls (paste into Python):")
    error.add_note(text)
    error.repro = text  # type: ignore[attr-defined]


def run_command_machine(
    backends: Sequence[Backend],
    *,
    examples: int,
    steps: int,
    seed: int | None = None,
    stats: RunStats | None = None,
    shrink: bool = True,
    adapter_specs: Mapping[str, str] | None = None,
) -> RunStats:
    """The machine as ``python -m hybridkv.conformance`` runs it (and the kill table measures
    it): ``examples`` on small pools (allocations fail, caches evict), as many on roomy pools
    (prefills, decodes and batched steps succeed; hits stay cached), then a fourteenth of them,
    at least one per family, at serving sizes (prompts of thousands of tokens, pools of
    hundreds of blocks, the vectorised paths' sizes)."""
    stats = RunStats() if stats is None else stats
    for roomy, big in ((False, False), (True, False), (False, True)):
        run_differential(
            backends,
            max_examples=max(len(FAMILIES), examples // 14) if big else examples,
            steps=steps,
            seed=seed,
            stats=stats,
            shrink=shrink,
            roomy=roomy,
            big=big,
            adapter_specs=adapter_specs,
        )
    return stats
