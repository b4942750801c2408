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
from hybridkv.conformance.sections import (
    raised,
    run_crosshair,
    run_golden,
    run_machine,
    run_mutants,
    run_oracles,
    sample_traces,
    section,
)
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


def _missing_extra(args: argparse.Namespace) -> str | None:
    """Before any work, the one line naming a missing extra: the differential machine needs
    hypothesis, an asked-for optimized backend torch and numpy."""
    needed = ["hypothesis"]
    if args.backend in ("optimized", "both"):
        needed += ["torch", "numpy"]
    missing = first_missing(needed)
    return None if missing is None else needs_line("python -m hybridkv.conformance", missing)


@dataclass(frozen=True)
class Selection:
    """What a run checks: ``backends`` in lockstep (the first the one compared with), of them
    ``under_test`` (the ones reported), and the ``--adapter`` spec of an outside one by name."""

    backends: list[Backend]
    under_test: list[Backend]
    adapter_specs: dict[str, str]


def select(args: argparse.Namespace) -> Selection:
    """The backends the command line names; ``ValueError`` or ``AdapterLoadError`` (before any
    work) for options that exclude each other, a bad policy, a bad trace count or a missing
    CrossHair."""
    if args.adapter is not None:
        if args.backend is not None:
            raise ValueError(
                "--adapter and --backend are exclusive (--adapter is compared with the reference)"
            )
        if args.eviction != "lru":
            raise ValueError("--adapter and --eviction are exclusive (the adapter builds it)")
        under_test = [load_backend(args.adapter)]
        selection = Selection(
            [reference_backend(), *under_test], under_test, {under_test[0][0]: args.adapter}
        )
    else:
        choice = args.backend or (
            "both" if optimized_backend(args.device) is not None else "reference"
        )
        resolve_policy(args.eviction)  # a bad name: refused here, by name
        backends = backends_named(choice, args.device, args.eviction)
        selection = Selection(backends, backends, {})
    if args.traces is not None:
        sample_traces([], args.traces)
    if args.crosshair:
        missing = missing_extra("crosshair", "crosshair", "--crosshair")
        if missing is not None:
            raise ValueError(missing)
    return selection


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    profile = PROFILES[args.profile]
    missing = _missing_extra(args)
    if missing is not None:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    try:
        chosen = select(args)
    except (AdapterLoadError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.monotonic()
    print(
        f"hybridkv conformance: under test {', '.join(n for n, _ in chosen.under_test)}; "
        f"compared with {chosen.backends[0][0]}; profile {args.profile}; "
        f"seed {'derandomized' if args.seed is None else args.seed}"
    )
    results = run_sections(args, argv, profile, chosen)
    section("summary")
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"  {time.monotonic() - start:.1f}s")
    return 0 if all(results.values()) else 1


def run_sections(
    args: argparse.Namespace, argv: Sequence[str], profile: Profile, chosen: Selection
) -> dict[str, bool]:
    """Each section the command line asks for, in order: its name and whether it passed."""
    results: dict[str, bool] = {}
    if args.eviction != "lru":
        print(f"golden traces skipped: they record vLLM's LRU order, not {args.eviction}")
    elif not args.no_golden:
        section("golden traces (vLLM 0.33)")
        try:
            results["golden traces"] = run_golden(chosen.under_test, args.traces)
        except Exception as error:
            raised("golden traces", error)
            results["golden traces"] = False
    section("stateful differential machine")
    results["differential machine"] = run_machine(
        chosen.backends,
        chosen.under_test,
        examples=profile.examples if args.examples is None else args.examples,
        steps=profile.steps if args.steps is None else args.steps,
        seed=args.seed,
        adapter_specs=chosen.adapter_specs,
        argv=argv,
    )
    section("oracles (brute force)")
    results["oracles"] = run_oracles(
        chosen.under_test,
        hit_states=profile.hit_states if args.hit_states is None else args.hit_states,
        planner_models=profile.planner_models,
        seed=args.seed or 0,
        with_reference=args.adapter is None,
    )
    if args.crosshair:
        section("CrossHair (a bounded symbolic search, not a proof)")
        results["crosshair"] = run_crosshair(args.profile)
    if args.mutants:
        section("planted bugs in the reference")
        results["mutants"] = run_mutants(profile.mutant_examples)
    return results


if __name__ == "__main__":
    sys.exit(main())
