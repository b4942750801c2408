"""Several manifest targets in one ``crosshair check``, each condition traced back to its target.

One CrossHair process per target spends a third of a second starting (the interpreter, z3, the
checked modules) before it searches; the fast profile's search of most targets is not much
longer. So the runner checks targets in batches: one process per batch, with the same
per-condition budget for each of its targets (a batch holds targets of one ``expect`` and one
``scale``, so one command line carries their budget), and each reported condition is given to
the target whose source lines hold it.

A batch whose report cannot be split that way (a line outside every target, a crash, a
timeout, an exit code CrossHair gives for nothing but a counterexample) is checked again one
target at a time: a batch never decides a verdict it cannot attribute.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import groupby

from hybridkv.conformance.crosshair_manifest import MANIFEST, Target
from hybridkv.conformance.crosshair_runner import (
    PROFILES,
    Budget,
    ConditionResult,
    CrosshairReport,
    TargetResult,
    crosshair_arguments,
    judge,
    parse_located_output,
    run_target,
)

BATCH_SCALE = 6.0
"""The most ``scale`` one batch adds up: about six targets of the base budget, fewer wide ones."""


@dataclass(frozen=True)
class Batch:
    """Targets checked by one CrossHair process: one ``expect``, one ``scale``."""

    targets: tuple[Target, ...]

    @property
    def name(self) -> str:
        """The first target's short name and how many follow it (a test id)."""
        first = self.targets[0].name.rsplit(".", 1)[-1]
        return first if len(self.targets) == 1 else f"{first}+{len(self.targets) - 1}"

    @property
    def scale(self) -> float:
        return self.targets[0].scale

    @property
    def weight(self) -> float:
        """The batch's share of the profile's search: its targets' scales, added."""
        return sum(t.scale for t in self.targets)


def batches(targets: Sequence[Target]) -> tuple[Batch, ...]:
    """``targets`` in batches of one ``expect`` and one ``scale``, each adding up to at most
    ``BATCH_SCALE`` (a target wider than that alone), in manifest order within a batch; the
    widest batches first, so that workers taking them in order finish together."""
    out: list[Batch] = []
    key = lambda t: (t.expect, t.scale)  # noqa: E731
    for (_, scale), group in groupby(sorted(targets, key=key), key=key):
        members = list(group)
        size = max(1, int(BATCH_SCALE // scale))
        out.extend(Batch(tuple(members[i : i + size])) for i in range(0, len(members), size))
    return tuple(sorted(out, key=lambda b: -b.weight))


def source_span(target: Target) -> tuple[str, range]:
    """The file and the lines of the target's function (where CrossHair reports its
    conditions: the ``pre:``/``post:`` lines of its docstring, or a line of its body)."""
    module_name, function_name = target.name.rsplit(".", 1)
    function = getattr(importlib.import_module(module_name), function_name)
    lines, first = inspect.getsourcelines(function)
    return os.path.realpath(inspect.getsourcefile(function) or ""), range(first, first + len(lines))


def attribute(
    batch: Batch, located: Sequence[tuple[str, ConditionResult]]
) -> dict[str, list[ConditionResult]] | None:
    """Each target's conditions, by the source span holding each reported line; ``None`` when
    a line belongs to no target of the batch."""
    spans = {t.name: source_span(t) for t in batch.targets}
    found: dict[str, list[ConditionResult]] = {t.name: [] for t in batch.targets}
    for path, condition in located:
        owners = [
            name
            for name, (file, lines) in spans.items()
            if condition.line in lines and os.path.realpath(path) == file
        ]
        if len(owners) != 1:
            return None
        found[owners[0]].append(condition)
    return found


def run_batch(batch: Batch, budget: Budget) -> list[TargetResult]:
    """Check the batch in one CrossHair process, or its targets one by one where its report
    cannot be split between them."""
    if len(batch.targets) == 1:
        return [run_target(batch.targets[0], budget)]
    start = time.monotonic()
    command = [*crosshair_arguments(batch.targets[0], budget), *(t.name for t in batch.targets)]
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=budget.target_wall_clock * max(batch.scale, 1.0) * len(batch.targets),
            check=False,
        )
    except subprocess.TimeoutExpired:
        return [run_target(t, budget) for t in batch.targets]
    located, other = parse_located_output(done.stdout + "\n" + done.stderr)
    found = attribute(batch, located)
    errors = any(c.counterexample for _, c in located)
    if found is None or done.returncode not in (0, 1) or (done.returncode == 1) != errors:
        return [run_target(t, budget) for t in batch.targets]
    seconds = time.monotonic() - start
    results = []
    for target in batch.targets:
        conditions = tuple(found[target.name])
        code = int(any(c.counterexample for c in conditions))
        verdict, reason = judge(target, code, conditions, other)
        results.append(
            TargetResult(
                target, code, seconds, conditions, other, verdict, reason, len(batch.targets)
            )
        )
    return results


def run_manifest(
    profile: str = "fast",
    *,
    targets: Sequence[Target] = MANIFEST,
    workers: int = 2,
    progress: Callable[[TargetResult], None] | None = None,
) -> CrosshairReport:
    """Check every target, in batches, ``workers`` processes at a time; the report in
    manifest order."""
    budget = PROFILES[profile]
    report = CrosshairReport(profile)
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(run_batch, batch, budget) for batch in batches(targets)]
        for future in futures:
            remaining = budget.total_wall_clock - (time.monotonic() - start)
            for result in future.result(timeout=max(remaining, 1.0)):
                report.results.append(result)
                if progress is not None:
                    progress(result)
    order = {t.name: i for i, t in enumerate(targets)}
    report.results.sort(key=lambda r: order[r.target.name])
    report.seconds = time.monotonic() - start
    return report
