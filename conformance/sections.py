"""The conformance report's sections, each printing as it runs and ending with a PASS or FAIL
line with its counts: the golden traces, the stateful differential machine, the brute-force
oracles, the CrossHair manifest and the planted bugs. ``python -m hybridkv.conformance``
(``hybridkv.conformance.__main__``) chooses the backends and the sizes and runs them in order.
"""

from __future__ import annotations

import sys
import time
import traceback
from collections.abc import Mapping, Sequence

from hybridkv.conformance.adapters import Backend


def section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def verdict(ok: bool, what: str) -> None:
    print(f"  {'PASS' if ok else 'FAIL'}  {what}", flush=True)


def raised(what: str, error: BaseException) -> None:
    print(f"  FAIL  {what}: raised {type(error).__name__}: {error}")
    print("    " + "".join(traceback.format_exception(error)).replace("\n", "\n    "))


def known_bugs(error: BaseException, under_test: Sequence[Backend]) -> list[str]:
    """The known bugs of the implementations under test that ``error`` is: an adapter's module
    may name them with ``known_bug(error) -> str | None`` (``adapters.vllm`` does)."""
    found = []
    for name, factory in under_test:
        module = sys.modules.get(getattr(factory, "__module__", ""))
        explain = getattr(module, "known_bug", None)
        note = explain(error) if callable(explain) else None
        if isinstance(note, str):
            found.append(f"known bug of {name}: {note}")
    return found


def machine_failure(
    error: Exception, argv: Sequence[str], seed: int | None, under_test: Sequence[Backend] = ()
) -> None:
    """What differed (the values side by side), the shortest failing example as scheduler
    calls to paste, and the command that reruns it; a crash (not a difference) with its
    traceback; and whether it is a known bug of an implementation under test."""
    from hybridkv.conformance.invariants import ConformanceError

    print(f"  FAILED: {type(error).__name__}: {error}".replace("\n", "\n    "))
    for note in known_bugs(error, under_test):
        print(f"  {note}")
    script = getattr(error, "repro", None)
    if not isinstance(error, ConformanceError):
        print("    " + "".join(traceback.format_exception(error)).replace("\n", "\n    "))
    if script is not None:
        print("  the shortest failing example as scheduler calls (paste into Python; it raises")
        print("  at the call that differs):")
        print("    " + script.replace("\n", "\n    "))
    print(rerun_hint(argv, seed))


def sample_traces(names: Sequence[str], count: int | None) -> list[str]:
    """``count`` of ``names`` spread evenly over the sorted list (both sets), or all of them."""
    if count is not None and count < 1:
        raise ValueError(f"--traces must be at least 1, got {count}")
    if count is None or count >= len(names):
        return list(names)
    return [names[i * len(names) // count] for i in range(count)]


def run_golden(backends: Sequence[Backend], count: int | None = None) -> bool:
    """Every (or a sample of ``count``) golden trace through each backend's adapter, with its
    invariant checker after every operation; prints a PASS/FAIL line with counts per backend,
    the failing traces (name, operation index, what differed or what was raised) and the
    skipped ones (a feature refused by name)."""
    from hybridkv.conformance.golden import check_trace, trace_names

    ok = True
    names = sample_traces(trace_names(), count)
    for name, factory in backends:
        start = time.monotonic()
        results = [check_trace(trace, factory) for trace in names]
        failed = [r for r in results if r.status == "fail"]
        skipped = [r for r in results if r.status == "skipped"]
        passed = len(results) - len(failed) - len(skipped)
        ops = sum(r.matched for r in results)
        not_shown = sum(r.states_not_shown for r in results)
        seconds = time.monotonic() - start
        verdict(
            not failed,
            f"{name}: {passed}/{len(names)} traces identical, {len(failed)} failed, "
            f"{len(skipped)} skipped (feature not implemented), {ops} operations matched"
            + (f", {not_shown} pool states not shown (snapshot None)" if not_shown else "")
            + f" ({seconds:.1f}s)",
        )
        for result in failed[:5]:
            print("    FAIL " + result.detail.replace("\n", "\n    "))
        if len(failed) > 5:
            print(f"    … and {len(failed) - 5} more: {', '.join(r.trace for r in failed[5:])}")
        if skipped:
            print(f"    skipped: {', '.join(r.trace for r in skipped)}")
            print(f"      first refusal: {skipped[0].detail}")
        ok = ok and not failed
    return ok


def rerun_hint(argv: Sequence[str], seed: int | None) -> str:
    command = " ".join(["python -m hybridkv.conformance", *argv])
    if seed is None:
        return f"  rerun: {command}  (derandomized: the same command replays the same examples)"
    return f"  rerun: {command}  (seed {seed})"


def run_oracles(
    under_test: Sequence[Backend],
    *,
    hit_states: int,
    planner_models: int,
    seed: int,
    with_reference: bool,
) -> bool:
    """The longest hit of every implementation under test against brute force, on states
    built through its adapter; ``with_reference`` (no outside adapter under test) also the
    reference's own oracles (the longest hit on states built inside its pool, engine layouts,
    the planner)."""
    from hybridkv.conformance.oracles import (
        run_adapter_hit_oracle,
        run_engine_hit_oracle,
        run_hit_oracle,
        run_planner_oracle,
    )

    ok = True
    for name, factory in under_test:
        adapter_oracle = run_adapter_hit_oracle(name, factory, max(1, hit_states // 4), seed)
        print("\n".join(adapter_oracle.lines()))
        for failure in adapter_oracle.failures[:5]:
            print(f"    FAIL {failure}")
        verdict(
            not adapter_oracle.failures,
            f"longest hit of {name}: {len(adapter_oracle.failures)} of "
            f"{adapter_oracle.probes} lookups differ from brute force (seed {seed})",
        )
        ok = ok and not adapter_oracle.failures
    if not with_reference:
        return ok
    try:
        oracle = run_hit_oracle(hit_states, seed=seed)
        run_planner_oracle(planner_models, seed=7 + seed, stats=oracle)
        engine_oracle = run_engine_hit_oracle(hit_states, seed=seed)
    except Exception as error:
        raised("reference oracles", error)
        return False
    failures = [*(oracle.failures or []), *engine_oracle.failures]
    print("\n".join([*oracle.lines(), *engine_oracle.lines()]))
    for failure in failures[:5]:
        print(f"    FAIL {failure}")
    verdict(
        not failures,
        f"reference oracles: {len(failures)} failures over {oracle.hit_states} + "
        f"{engine_oracle.states} cache states and {oracle.planner_models} planner models",
    )
    return ok and not failures


def run_machine(
    backends: Sequence[Backend],
    under_test: Sequence[Backend],
    *,
    examples: int,
    steps: int,
    seed: int | None,
    adapter_specs: Mapping[str, str],
    argv: Sequence[str],
) -> bool:
    """The stateful differential machine over ``backends`` (the first the one compared with):
    on a failure what differed, the shortest failing example and the command rerunning it
    (``machine_failure``); then the run's counts and its verdict."""
    from hybridkv.conformance.machine import RunStats, run_command_machine

    stats = RunStats()
    known: list[str] = []
    try:
        run_command_machine(
            backends,
            examples=examples,
            steps=steps,
            seed=seed,
            stats=stats,
            adapter_specs=dict(adapter_specs),
        )
        ok = True
    except Exception as error:
        machine_failure(error, argv, seed, under_test)
        known = known_bugs(error, under_test)
        ok = False
    print("\n".join(stats.lines()))
    verdict(
        ok,
        f"differential machine: {stats.examples} examples, {stats.steps} steps, "
        f"{stats.comparisons} comparisons, {stats.invariant_checks} invariant checks"
        + (
            "; the failure is a known bug of the implementation under test (above)" if known else ""
        ),
    )
    return ok


def run_crosshair(profile: str) -> bool:
    """The CrossHair manifest at the profile's budget: its report and its verdict."""
    from hybridkv.conformance.crosshair_batches import run_manifest

    try:
        report = run_manifest(profile)
        print("\n".join(report.lines()))
    except Exception as error:
        raised("CrossHair manifest", error)
        return False
    verdict(report.ok, "CrossHair manifest")
    return report.ok


def run_mutants(examples: int) -> bool:
    """Every planted bug in the reference hunted (``examples`` machine examples each), one line
    per bug as it is caught or survives, then the verdict: all caught."""
    from hybridkv.conformance.mutants import MUTANTS, Hunt, hunt_all

    def show(hunt: object) -> None:
        assert isinstance(hunt, Hunt)
        caught = f"caught by {hunt.caught_by}" if hunt.caught_by else "SURVIVED"
        print(f"  {hunt.mutant.name:30} {caught}: {hunt.detail[:100]}", flush=True)

    try:
        hunts = hunt_all(MUTANTS, examples, progress=show)
    except Exception as error:
        raised("planted bugs", error)
        return False
    caught = sum(h.caught_by is not None for h in hunts)
    ok = caught == len(hunts)
    verdict(ok, f"mutants caught: {caught}/{len(hunts)}")
    return ok
