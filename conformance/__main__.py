"""``python -m hybridkv.conformance``: run the conformance suite and print a report.

Sections, in order (each prints as it finishes, ends with a PASS or FAIL line with its counts;
the exit status is 1 if any failed, 2 if the command line names nothing usable):

1. golden traces: the 339 traces recorded from vLLM 0.33 (189 unit-test, 150 engine), replayed
   through every implementation's adapter with its invariant checker after every operation;
2. stateful differential machine: scheduler traffic on every backend in lockstep with the
   reference, every observable compared and every invariant checked after every step (the
   examples on small pools, as many on roomy ones that feed prefills and decodes, and a
   fourteenth at serving sizes: ``machine.run_command_machine``);
3. oracles: the longest hit of every implementation under test against brute force on states
   built through its adapter; for the project's own run also the reference's hit oracles on
   states built inside its pool, and the planner against the grouping, memory-layout and
   padding rules;
4. ``--crosshair``: the CrossHair manifest (contracts, harnesses, planted bugs);
5. ``--mutants``: every planted bug in the reference must be caught.

``--adapter MODULE:FACTORY`` puts an outside implementation under test instead of the
project's backends (an ``AdapterFactory``, see ``hybridkv.conformance.adapters`` and the
README's "Check your own implementation"); a failure its module names as a known bug of that
implementation (``known_bug(error) -> str | None``, as ``adapters.vllm`` offers) is reported as
such. Profiles: ``fast`` (CI-sized) and ``long`` (nightly: many more examples and steps, 30×
the CrossHair budget). ``--examples``, ``--steps``, ``--traces`` and ``--hit-states`` override
the profile.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.conformance.adapters import (
    AdapterLoadError,
    Backend,
    backends_named,
    load_backend,
    optimized_backend,
    reference_backend,
)
from hybridkv.conformance.extras import missing_extra
from hybridkv.extras import first_missing, needs_line
from hybridkv.policies import resolve_policy


@dataclass(frozen=True)
class Profile:
    examples: int
    steps: int
    hit_states: int
    planner_models: int
    mutant_examples: int


PROFILES = {
    "fast": Profile(
        examples=200, steps=40, hit_states=2_000, planner_models=300, mutant_examples=40
    ),
    "long": Profile(
        examples=30_000, steps=100, hit_states=200_000, planner_models=20_000, mutant_examples=400
    ),
}


def _at_least_one(text: str) -> int:
    """A count of examples, steps or states: a whole number of at least 1 (0 would run the
    profile's default in Hypothesis, or nothing, and still say PASS)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.conformance",
        description="Check KV cache manager backends against the reference and the document.",
    )
    parser.add_argument(
        "--backend",
        choices=["reference", "optimized", "both"],
        default=None,
        help="what to check (default: both when the optimized backend imports, else reference)",
    )
    parser.add_argument(
        "--examples", type=_at_least_one, default=None, help="state-machine examples"
    )
    parser.add_argument("--steps", type=_at_least_one, default=None, help="most steps per example")
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: derandomized)"
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="fast")
    parser.add_argument("--device", default="cpu", help="device of the optimized backend")
    parser.add_argument("--crosshair", action="store_true", help="run the CrossHair manifest")
    parser.add_argument("--mutants", action="store_true", help="hunt the planted bugs")
    parser.add_argument("--no-golden", action="store_true", help="skip the golden traces")
    parser.add_argument(
        "--eviction",
        metavar="POLICY",
        default="lru",
        help="eviction policy of both backends: lru, hybrid, cost, arc or module:Class "
        "(golden traces, vLLM's LRU order, only with lru)",
    )
    parser.add_argument(
        "--adapter",
        metavar="MODULE:FACTORY",
        default=None,
        help="check an outside implementation: an AdapterFactory to import, e.g. "
        "my_module:make_adapter (compared with the reference; excludes --backend)",
    )
    parser.add_argument(
        "--traces",
        type=int,
        default=None,
        metavar="N",
        help="replay N golden traces spread over both sets (default: all 339)",
    )
    parser.add_argument(
        "--hit-states",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="cache states of the longest-hit oracles (the adapter's gets N/4, each probed 3×)",
    )
    return parser


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _verdict(ok: bool, what: str) -> None:
    print(f"  {'PASS' if ok else 'FAIL'}  {what}", flush=True)


def _raised(section: str, error: BaseException) -> None:
    print(f"  FAIL  {section}: raised {type(error).__name__}: {error}")
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


def _machine_failure(
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
    print(_rerun_hint(argv, seed))


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
        _verdict(
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


def _rerun_hint(argv: Sequence[str], seed: int | None) -> str:
    command = " ".join(["python -m hybridkv.conformance", *argv])
    if seed is None:
        return f"  rerun: {command}  (derandomized: the same command replays the same examples)"
    return f"  rerun: {command}  (seed {seed})"


def _missing_extra(args: argparse.Namespace) -> str | None:
    """Before any work, the one line naming a missing extra: the differential machine needs
    hypothesis, an asked-for optimized backend torch and numpy."""
    needed = ["hypothesis"]
    if args.backend in ("optimized", "both"):
        needed += ["torch", "numpy"]
    missing = first_missing(needed)
    return None if missing is None else needs_line("python -m hybridkv.conformance", missing)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    profile = PROFILES[args.profile]
    missing = _missing_extra(args)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        if args.adapter is not None:
            if args.backend is not None:
                raise ValueError(
                    "--adapter and --backend are exclusive (--adapter is compared "
                    "with the reference)"
                )
            if args.eviction != "lru":
                raise ValueError("--adapter and --eviction are exclusive (the adapter builds it)")
            under_test = [load_backend(args.adapter)]
            adapter_specs = {under_test[0][0]: args.adapter}
            backends = [reference_backend(), *under_test]
        else:
            choice = args.backend or (
                "both" if optimized_backend(args.device) is not None else "reference"
            )
            resolve_policy(args.eviction)  # a bad name: refused here, by name
            backends = backends_named(choice, args.device, args.eviction)
            under_test = backends
            adapter_specs = {}
        if args.traces is not None:
            sample_traces([], args.traces)
        if args.crosshair:
            missing = missing_extra("crosshair", "crosshair", "--crosshair")
            if missing is not None:
                raise ValueError(missing)
    except (AdapterLoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    examples = args.examples if args.examples is not None else profile.examples
    steps = args.steps if args.steps is not None else profile.steps
    hit_states = args.hit_states if args.hit_states is not None else profile.hit_states
    results: dict[str, bool] = {}
    start = time.monotonic()
    print(
        f"hybridkv conformance: under test {', '.join(n for n, _ in under_test)}; compared "
        f"with {backends[0][0]}; profile {args.profile}; "
        f"seed {'derandomized' if args.seed is None else args.seed}"
    )

    if args.eviction != "lru":
        print(f"golden traces skipped: they record vLLM's LRU order, not {args.eviction}")
    elif not args.no_golden:
        _section("golden traces (vLLM 0.33)")
        try:
            results["golden traces"] = run_golden(under_test, args.traces)
        except Exception as error:
            _raised("golden traces", error)
            results["golden traces"] = False

    _section("stateful differential machine")
    from hybridkv.conformance.machine import RunStats, run_command_machine

    stats = RunStats()
    known: list[str] = []
    try:
        run_command_machine(
            backends,
            examples=examples,
            steps=steps,
            seed=args.seed,
            stats=stats,
            adapter_specs=adapter_specs,
        )
        results["differential machine"] = True
    except Exception as error:
        _machine_failure(error, argv, args.seed, under_test)
        known = known_bugs(error, under_test)
        results["differential machine"] = False
    print("\n".join(stats.lines()))
    _verdict(
        results["differential machine"],
        f"differential machine: {stats.examples} examples, {stats.steps} steps, "
        f"{stats.comparisons} comparisons, {stats.invariant_checks} invariant checks"
        + (
            "; the failure is a known bug of the implementation under test (above)" if known else ""
        ),
    )

    _section("oracles (brute force)")
    results["oracles"] = run_oracles(under_test, args, profile, hit_states)

    if args.crosshair:
        _section("CrossHair (a bounded symbolic search, not a proof)")
        from hybridkv.conformance.crosshair_batches import run_manifest

        try:
            report = run_manifest(args.profile)
            print("\n".join(report.lines()))
            results["crosshair"] = report.ok
            _verdict(report.ok, "CrossHair manifest")
        except Exception as error:
            _raised("CrossHair manifest", error)
            results["crosshair"] = False

    if args.mutants:
        _section("planted bugs in the reference")
        from hybridkv.conformance.mutants import MUTANTS, hunt_all

        def show(hunt: object) -> None:
            from hybridkv.conformance.mutants import Hunt

            assert isinstance(hunt, Hunt)
            verdict = f"caught by {hunt.caught_by}" if hunt.caught_by else "SURVIVED"
            print(f"  {hunt.mutant.name:30} {verdict}: {hunt.detail[:100]}", flush=True)

        try:
            hunts = hunt_all(MUTANTS, profile.mutant_examples, progress=show)
            caught = sum(h.caught_by is not None for h in hunts)
            results["mutants"] = caught == len(hunts)
            _verdict(results["mutants"], f"mutants caught: {caught}/{len(hunts)}")
        except Exception as error:
            _raised("planted bugs", error)
            results["mutants"] = False

    _section("summary")
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"  {time.monotonic() - start:.1f}s")
    return 0 if all(results.values()) else 1


def run_oracles(
    under_test: Sequence[Backend], args: argparse.Namespace, profile: Profile, hit_states: int
) -> bool:
    """The longest hit of every implementation under test against brute force, on states
    built through its adapter; without ``--adapter`` also the reference's own oracles (the
    longest hit on states built inside its pool, engine layouts, the planner)."""
    from hybridkv.conformance.oracles import (
        run_adapter_hit_oracle,
        run_engine_hit_oracle,
        run_hit_oracle,
        run_planner_oracle,
    )

    seed = args.seed or 0
    ok = True
    for name, factory in under_test:
        adapter_oracle = run_adapter_hit_oracle(name, factory, max(1, hit_states // 4), seed)
        print("\n".join(adapter_oracle.lines()))
        for failure in adapter_oracle.failures[:5]:
            print(f"    FAIL {failure}")
        _verdict(
            not adapter_oracle.failures,
            f"longest hit of {name}: {len(adapter_oracle.failures)} of "
            f"{adapter_oracle.probes} lookups differ from brute force (seed {seed})",
        )
        ok = ok and not adapter_oracle.failures
    if args.adapter is not None:
        return ok
    try:
        oracle = run_hit_oracle(hit_states, seed=seed)
        run_planner_oracle(profile.planner_models, seed=7 + seed, stats=oracle)
        engine_oracle = run_engine_hit_oracle(hit_states, seed=seed)
    except Exception as error:
        _raised("reference oracles", error)
        return False
    failures = [*(oracle.failures or []), *engine_oracle.failures]
    print("\n".join([*oracle.lines(), *engine_oracle.lines()]))
    for failure in failures[:5]:
        print(f"    FAIL {failure}")
    _verdict(
        not failures,
        f"reference oracles: {len(failures)} failures over {oracle.hit_states} + "
        f"{engine_oracle.states} cache states and {oracle.planner_models} planner models",
    )
    return ok and not failures


if __name__ == "__main__":
    sys.exit(main())
