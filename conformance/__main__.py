"""``python -m hybridkv.conformance``: run the conformance suite and print a report.

Sections, in order (each prints as it finishes; the exit status is 1 if any failed):

1. golden traces: the 189 traces recorded from vLLM 0.33, replayed on every backend;
2. stateful differential machine: scheduler traffic on every backend in lockstep, every
   observable compared and every invariant checked after every step;
3. oracles: the longest hit against brute force on built cache states, and the planner against
   the grouping, memory-layout and padding rules;
4. ``--crosshair``: the CrossHair manifest (contracts, harnesses, planted bugs);
5. ``--mutants``: every planted bug in the reference must be caught.

Profiles: ``fast`` (CI-sized) and ``long`` (nightly: many more examples and steps, 30× the
CrossHair budget). ``--examples`` and ``--steps`` override the profile.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.conformance.adapters import (
    AdapterFactory,
    Backend,
    EngineOptions,
    ProtocolAdapter,
    backends_named,
    optimized_backend,
)
from hybridkv.conformance.protocol import KVCacheManagerLike, ManagerFactory
from hybridkv.spec import KVCacheConfig


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
    parser.add_argument("--examples", type=int, default=None, help="state-machine examples")
    parser.add_argument("--steps", type=int, default=None, help="most steps per example")
    parser.add_argument(
        "--seed", type=int, default=None, help="random seed (default: derandomized)"
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="fast")
    parser.add_argument("--device", default="cpu", help="device of the optimized backend")
    parser.add_argument("--crosshair", action="store_true", help="run the CrossHair manifest")
    parser.add_argument("--mutants", action="store_true", help="hunt the planted bugs")
    parser.add_argument("--no-golden", action="store_true", help="skip the golden traces")
    return parser


def _section(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _golden_factory(factory: AdapterFactory) -> ManagerFactory:
    """The golden replay drives a manager's scheduler API: unwrap a ``ProtocolAdapter``.

    An engine trace also sets the manager's engine keywords: the adapter factory gets them as
    its ``EngineOptions``.
    """

    def build(
        config: KVCacheConfig, max_model_len: int, caching: bool, /, **engine: Any
    ) -> KVCacheManagerLike:
        adapter = factory(config, max_model_len, caching, False, EngineOptions(**engine))
        if not isinstance(adapter, ProtocolAdapter):
            raise TypeError(f"{adapter.name}: the golden replay needs a ProtocolAdapter")
        return adapter.manager

    return build


def run_golden(backends: Sequence[Backend]) -> bool:
    from hybridkv.conformance.golden import replay_trace, trace_names

    ok = True
    names = trace_names()
    for name, factory in backends:
        start = time.monotonic()
        manager = _golden_factory(factory)
        ops = 0
        failed = []
        refused = 0
        for trace in names:
            try:
                matched, divergence = replay_trace(trace, manager)
            except ValueError as error:
                if not str(error).startswith("the optimized backend does not implement "):
                    raise
                refused += 1  # an engine feature this backend refuses by name
                continue
            ops += matched
            if divergence is not None:
                failed.append(str(divergence))
        seconds = time.monotonic() - start
        passed = len(names) - len(failed) - refused
        print(
            f"  {name}: {passed}/{len(names)} traces identical, {ops} operations"
            + (f", {refused} refused (engine features not implemented)" if refused else "")
            + f" ({seconds:.1f}s)"
        )
        for text in failed[:3]:
            print("    " + text.replace("\n", "\n    "))
        ok = ok and not failed
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    profile = PROFILES[args.profile]
    choice = args.backend or ("both" if optimized_backend(args.device) is not None else "reference")
    try:
        backends = backends_named(choice, args.device)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    examples = args.examples if args.examples is not None else profile.examples
    steps = args.steps if args.steps is not None else profile.steps
    results: dict[str, bool] = {}
    start = time.monotonic()
    print(
        f"hybridkv conformance: backends {', '.join(n for n, _ in backends)}; profile "
        f"{args.profile}; seed {'derandomized' if args.seed is None else args.seed}"
    )

    if not args.no_golden:
        _section("golden traces (vLLM 0.33)")
        results["golden traces"] = run_golden(backends)

    _section("stateful differential machine")
    from hybridkv.conformance.machine import RunStats, run_differential

    stats = RunStats()
    try:
        run_differential(backends, max_examples=examples, steps=steps, seed=args.seed, stats=stats)
        results["differential machine"] = True
    except Exception as error:
        print(f"  FAILED: {type(error).__name__}: {error}")
        # The traceback and Hypothesis's notes (the shortest failing sequence of calls).
        print("    " + "".join(traceback.format_exception(error)).replace("\n", "\n    "))
        results["differential machine"] = False
    print("\n".join(stats.lines()))

    _section("oracles (brute force)")
    from hybridkv.conformance.oracles import (
        run_engine_hit_oracle,
        run_hit_oracle,
        run_planner_oracle,
    )

    oracle = run_hit_oracle(profile.hit_states, seed=args.seed or 0)
    run_planner_oracle(profile.planner_models, seed=7 + (args.seed or 0), stats=oracle)
    engine_oracle = run_engine_hit_oracle(profile.hit_states, seed=args.seed or 0)
    oracle.failures = [*(oracle.failures or []), *engine_oracle.failures]
    print("\n".join([*oracle.lines(), *engine_oracle.lines()]))
    for failure in (oracle.failures or [])[:5]:
        print(f"  FAILED: {failure}")
    results["oracles"] = not oracle.failures

    if args.crosshair:
        _section("CrossHair (a bounded symbolic search, not a proof)")
        from hybridkv.conformance.crosshair_runner import run_manifest

        report = run_manifest(args.profile)
        print("\n".join(report.lines()))
        results["crosshair"] = report.ok

    if args.mutants:
        _section("planted bugs in the reference")
        from hybridkv.conformance.mutants import MUTANTS, hunt_all

        def show(hunt: object) -> None:
            from hybridkv.conformance.mutants import Hunt

            assert isinstance(hunt, Hunt)
            verdict = f"caught by {hunt.caught_by}" if hunt.caught_by else "SURVIVED"
            print(f"  {hunt.mutant.name:30} {verdict}: {hunt.detail[:100]}", flush=True)

        hunts = hunt_all(MUTANTS, profile.mutant_examples, progress=show)
        caught = sum(h.caught_by is not None for h in hunts)
        print(f"  mutants caught: {caught}/{len(hunts)}")
        results["mutants"] = caught == len(hunts)

    _section("summary")
    for name, ok in results.items():
        print(f"  {'PASS' if ok else 'FAIL'}  {name}")
    print(f"  {time.monotonic() - start:.1f}s")
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
