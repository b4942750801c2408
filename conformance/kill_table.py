"""The planted-bug table: every mutant against every check alone.

``python -m hybridkv.conformance.kill_table --table`` prints one row per planted bug (the
catalogues of ``mutants_reference``, ``mutants_optimized`` and ``mutants_planner``, and the
contract bugs of ``planted_bugs``), a mark per check: which checks catch it without the others.
Not run in CI; the table in docs/checks.md is its output.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

try:
    from hybridkv.conformance.adapters import reference_backend
    from hybridkv.conformance.mutant import Mutant
    from hybridkv.conformance.mutants import (
        MUTANTS,
        load_mutant,
        manager_checks,
        mutant_backend,
        planner_checks,
    )
except ModuleNotFoundError as missing:  # run without the dev extra: one line, no traceback
    if __name__ != "__main__":
        raise
    from hybridkv.extras import exit_for_import_error

    exit_for_import_error(missing, "python -m hybridkv.conformance.kill_table")

KILL_COLUMNS = ("golden traces", "differential machine", "oracles", "CrossHair")


@dataclass(frozen=True)
class KillRow:
    """One planted bug and, per check of ``KILL_COLUMNS``, whether that check alone caught it
    (``None``: the check does not apply to it)."""

    name: str
    target: str
    kills: tuple[bool | None, ...]


def _kills(check: Callable[[], None]) -> bool:
    try:
        check()
    except Exception:
        return True
    return False


def kill_row(mutant: Mutant, examples: int, steps: int) -> KillRow:
    """Every check of the mutant's suite run alone on it (golden traces: both sets)."""
    bundle = load_mutant(mutant)
    target = mutant.module.removeprefix("hybridkv.")

    def machine() -> None:
        """The machine exactly as the conformance command runs it (small, roomy and
        serving-size pools; the planners compared on a model per example)."""
        from hybridkv.conformance.machine import run_command_machine

        run_command_machine(
            [reference_backend(), mutant_backend(bundle)],
            examples=examples,
            steps=steps,
            shrink=False,
        )

    if mutant.suite == "planner":
        (_, grouping), *_ = planner_checks(bundle)
        return KillRow(mutant.name, target, (None, _kills(machine), _kills(grouping), None))
    checks = dict(manager_checks(bundle, examples, steps))

    def golden() -> None:
        checks["engine golden traces"]()
        checks["golden traces"]()

    kills = (
        _kills(golden),
        _kills(machine),
        _kills(checks["longest-hit oracle"]),
        None,
    )
    return KillRow(mutant.name, target, kills)


def crosshair_rows(profile: str = "fast") -> list[KillRow]:
    """The planted contract bugs of ``conformance/planted_bugs.py``: CrossHair alone (the other
    checks do not run them: nothing in the manager calls these functions)."""
    from hybridkv.conformance.crosshair_manifest import MANIFEST
    from hybridkv.conformance.crosshair_runner import PROFILES, run_target

    rows = []
    for target in MANIFEST:
        if target.expect != "counterexample":
            continue
        result = run_target(target, PROFILES[profile])
        name = target.name.rpartition(".")[2]
        caught = result.verdict == "pass"
        rows.append(KillRow(name, "conformance.planted_bugs", (None, None, None, caught)))
    return rows


def kill_table(rows: Sequence[KillRow]) -> str:
    """A Markdown table: one row per planted bug, ✓ killed alone, ✗ survived, – not applicable;
    then the per-check counts and the differential machine's share."""

    def mark(value: bool | None) -> str:
        return "–" if value is None else "✓" if value else "✗"

    lines = [
        "| planted bug | in | " + " | ".join(KILL_COLUMNS) + " |",
        "|---|---|" + "---|" * len(KILL_COLUMNS),
    ]
    for row in rows:
        lines.append(
            f"| `{row.name}` | `{row.target}` | " + " | ".join(map(mark, row.kills)) + " |"
        )
    counts = []
    for index, column in enumerate(KILL_COLUMNS):
        applied = [row.kills[index] for row in rows if row.kills[index] is not None]
        counts.append(f"{column} {sum(map(bool, applied))}/{len(applied)}")
    machine = [row for row in rows if row.kills[1] is not None]
    caught = sum(bool(row.kills[1]) for row in machine)
    lines.append("")
    lines.append(f"Killed alone: {', '.join(counts)}.")
    lines.append(
        f"The differential machine alone: {caught} of {len(machine)} planted mutants "
        f"({100 * caught / max(1, len(machine)):.0f}%), {caught} of {len(rows)} planted bugs "
        f"with CrossHair's contract bugs ({100 * caught / max(1, len(rows)):.0f}%)."
    )
    survivors = [row.name for row in machine if not row.kills[1]]
    if survivors:
        lines.append(f"Not caught by the machine alone: {', '.join(survivors)}.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hybridkv.conformance.kill_table --table``: the kill table (not run in CI)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hybridkv.conformance.kill_table")
    parser.add_argument("--table", action="store_true", help="print the per-check kill table")
    parser.add_argument("--examples", type=int, default=None, help="differential examples")
    parser.add_argument("--steps", type=int, default=None, help="differential steps")
    parser.add_argument("--only", default=None, help="comma-separated mutant names")
    parser.add_argument("--no-crosshair", action="store_true", help="skip the planted bugs")
    args = parser.parse_args(argv)
    if not args.table:
        parser.error("nothing to do: pass --table")
    from hybridkv.conformance.__main__ import PROFILES

    fast = PROFILES["fast"]
    examples = args.examples if args.examples is not None else fast.examples
    steps = args.steps if args.steps is not None else fast.steps
    chosen = MUTANTS
    if args.only:
        names = set(args.only.split(","))
        chosen = tuple(m for m in MUTANTS if m.name in names)
    rows = []
    for mutant in chosen:
        row = kill_row(mutant, examples, steps)
        print(f"  {row.name}: {row.kills}", file=sys.stderr, flush=True)
        rows.append(row)
    if not args.no_crosshair:
        rows.extend(crosshair_rows())
    print(kill_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
