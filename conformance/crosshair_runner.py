"""Check CrossHair manifest targets: ``crosshair check`` by name, with hard budgets.

A target runs as ``crosshair check --analysis_kind PEP316 --report_all --per_condition_timeout
T --max_uninteresting_iterations N module.function`` under a wall-clock timeout (``run_target``:
one target, one process; ``crosshair_batches`` names a few targets of one budget in one
process and runs the manifest a few processes at a time). ``--report_all`` makes CrossHair
print one line per condition, so the runner can tell a real result from a vacuous one:

* ``Confirmed over all paths.``: every path within the bounds of the preconditions was explored;
* ``Not confirmed.``: the budget ran out before every path was explored, with no counterexample
  (a bounded search, the usual result for loops over lists);
* ``Unable to meet precondition.``: CrossHair found no input satisfying the preconditions. It
  exits 0, but nothing was checked: the runner counts it as a failure.
* ``error: ...``: a counterexample, or an exception, or a precondition of a callee violated.

A target whose run prints no condition at all (a typo, a function without a contract) fails too.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from hybridkv.conformance.crosshair_manifest import Target


@dataclass(frozen=True)
class Budget:
    """How hard CrossHair searches (per condition) and how long anything may take (wall clock).

    The search is bounded by work, never by the wall clock: ``per_condition_timeout`` is CPU
    seconds of the CrossHair process (``--per_condition_timeout`` counts process CPU time) and
    ``max_uninteresting_iterations`` counts iterations, so a machine whose cores are shared
    with other jobs explores the same paths, only later. The two wall clocks only stop a hung
    process: they are sized for a machine running several times as many jobs as it has cores,
    and cost nothing on an idle one, where every target finishes long before them.
    """

    per_condition_timeout: float
    max_uninteresting_iterations: int
    target_wall_clock: float
    total_wall_clock: float


PROFILES: dict[str, Budget] = {
    # CI: small budgets; the whole manifest in well under two minutes on 2 idle cores, and
    # wall clocks (15 min a target, 1 h in all) that a loaded CI machine does not run out of.
    "fast": Budget(2.0, 50, 900.0, 3_600.0),
    # Nightly: 30× the search per condition.
    "long": Budget(60.0, 1_000, 1_800.0, 14_400.0),
}

Verdict = Literal["pass", "fail", "known"]

_LINE = re.compile(r"^(?P<path>.*?):(?P<line>\d+): (?P<level>info|error|warning): (?P<msg>.*)$")


@dataclass(frozen=True)
class ConditionResult:
    """One line of CrossHair's report: a condition (by source line) and what happened to it."""

    line: int
    level: str
    message: str

    @property
    def confirmed(self) -> bool:
        return self.level == "info" and self.message.startswith("Confirmed over all paths")

    @property
    def searched(self) -> bool:
        """Bounded search, no counterexample (the budget ran out first)."""
        return self.level == "info" and self.message.startswith("Not confirmed")

    @property
    def vacuous(self) -> bool:
        return "Unable to meet precondition" in self.message

    @property
    def counterexample(self) -> bool:
        return self.level == "error"


@dataclass(frozen=True)
class TargetResult:
    """What CrossHair reported for one manifest target, and the runner's verdict on it."""

    target: Target
    returncode: int | None
    seconds: float
    conditions: tuple[ConditionResult, ...]
    other_output: tuple[str, ...]
    verdict: Verdict
    reason: str
    batch_size: int = 1
    """How many targets shared the CrossHair process (and ``seconds``)."""

    @property
    def num_confirmed(self) -> int:
        return sum(c.confirmed for c in self.conditions)

    @property
    def num_searched(self) -> int:
        return sum(c.searched for c in self.conditions)

    @property
    def num_counterexamples(self) -> int:
        return sum(c.counterexample for c in self.conditions)


@dataclass
class CrosshairReport:
    """Every target's result; ``ok`` when nothing failed."""

    profile: str
    results: list[TargetResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.verdict != "fail" for r in self.results)

    def lines(self) -> list[str]:
        """A human-readable summary, one line per target, then totals."""
        out = []
        for r in self.results:
            counts = (
                f"{r.num_confirmed} confirmed, {r.num_searched} searched, "
                f"{r.num_counterexamples} counterexample(s)"
            )
            reason = f": {r.reason}" if r.reason else ""
            shared = f" with {r.batch_size - 1} other(s)" if r.batch_size > 1 else ""
            out.append(
                f"  {r.verdict.upper():5} {r.target.name.removeprefix('hybridkv.')} "
                f"[{r.target.expect}] {counts} ({r.seconds:.1f}s{shared}){reason}"
            )
        holds = [r for r in self.results if r.target.expect == "hold"]
        bugs = [r for r in self.results if r.target.expect == "counterexample"]
        out.append(
            f"  contracts: {len(holds)} targets, "
            f"{sum(r.num_confirmed for r in holds)} conditions confirmed over all paths, "
            f"{sum(r.num_searched for r in holds)} searched to the budget without a "
            f"counterexample, {sum(r.verdict == 'known' for r in holds)} known problem(s)"
        )
        out.append(
            f"  planted bugs: {sum(r.verdict == 'pass' for r in bugs)}/{len(bugs)} caught; "
            f"profile {self.profile}, {self.seconds:.1f}s wall clock"
        )
        return out


def crosshair_command(target: Target, budget: Budget) -> list[str]:
    """The exact command line for one target."""
    return [*crosshair_arguments(target, budget), target.name]


def crosshair_arguments(target: Target, budget: Budget) -> list[str]:
    """The command line for ``target``'s budget, before the names of the targets it checks."""
    return [
        sys.executable,
        "-m",
        "crosshair",
        "check",
        "--analysis_kind",
        "PEP316",
        "--report_all",
        "--per_condition_timeout",
        f"{budget.per_condition_timeout * target.scale:g}",
        "--max_uninteresting_iterations",
        str(int(budget.max_uninteresting_iterations * target.scale)),
    ]


def parse_output(stdout: str) -> tuple[tuple[ConditionResult, ...], tuple[str, ...]]:
    """Condition lines, and every other non-empty line."""
    located, other = parse_located_output(stdout)
    return tuple(condition for _, condition in located), other


def parse_located_output(
    stdout: str,
) -> tuple[tuple[tuple[str, ConditionResult], ...], tuple[str, ...]]:
    """Condition lines with the file each names, and every other non-empty line."""
    located: list[tuple[str, ConditionResult]] = []
    other: list[str] = []
    for raw in stdout.splitlines():
        line = raw.strip()
        if not line:
            continue
        match = _LINE.match(line)
        if match and match["level"] in ("info", "error"):
            condition = ConditionResult(int(match["line"]), match["level"], match["msg"])
            located.append((match["path"], condition))
        else:
            other.append(line)
    return tuple(located), tuple(other)


def judge(
    target: Target,
    returncode: int | None,
    conditions: Sequence[ConditionResult],
    other: Sequence[str],
) -> tuple[Verdict, str]:
    """The runner's verdict on one target's report."""
    if returncode is None:
        return "fail", "wall-clock timeout"
    if any(c.vacuous for c in conditions):
        return "fail", "Unable to meet precondition (vacuous)"
    if not conditions:
        detail = "; ".join(other)[:300]
        return "fail", f"CrossHair reported no condition (exit {returncode}) {detail}".rstrip()
    errors = [c for c in conditions if c.counterexample]
    if target.expect == "counterexample":
        if errors:
            return "pass", ""
        return "fail", "planted bug NOT caught at this budget"
    if errors:
        first = errors[0].message[:300]
        if target.known_problem:
            return "known", f"{target.known_problem} ({first})"
        return "fail", first
    if returncode != 0:
        return "fail", f"exit {returncode}: {'; '.join(other)[:300]}"
    if target.known_problem:
        return "fail", "known_problem no longer reproduces: remove the marker from the manifest"
    return "pass", ""


def run_target(target: Target, budget: Budget) -> TargetResult:
    """Check one target in its own CrossHair process."""
    start = time.monotonic()
    try:
        done = subprocess.run(
            crosshair_command(target, budget),
            capture_output=True,
            text=True,
            timeout=budget.target_wall_clock * max(target.scale, 1.0),
            check=False,
        )
        returncode: int | None = done.returncode
        stdout = done.stdout + "\n" + done.stderr
    except subprocess.TimeoutExpired as timeout:
        returncode = None
        stdout = str(timeout.stdout or "")
    conditions, other = parse_output(stdout)
    verdict, reason = judge(target, returncode, conditions, other)
    seconds = time.monotonic() - start
    return TargetResult(target, returncode, seconds, conditions, other, verdict, reason)
