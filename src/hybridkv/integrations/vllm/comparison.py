"""Two ``vllm-check`` runs compared step by step (``compare``: the first step whose records
differ, or a refusal by name), what a run exercised (``summarize``), and every run on vLLM's
manager and on each backend, one line each (``run_all``: the token and multimodal runs, and the
offloading runs with their own driver and summary, ``connector_check``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from hybridkv.integrations.vllm import mm_workload
from hybridkv.integrations.vllm.run_config import RunResult

Summary = Callable[[Sequence[dict[str, Any]]], str]
"""What a run's records say it exercised, for its line."""


class NamedRun(Protocol):
    @property
    def name(self) -> str: ...


Run = TypeVar("Run", bound=NamedRun)


@dataclass
class Comparison:
    run: str
    manager: str
    steps: int
    equal_steps: int
    divergence: str | None

    summary: str = ""
    refused: bool = False

    @property
    def ok(self) -> bool:
        return self.divergence is None

    @property
    def status(self) -> str:
        return "equal" if self.ok else "REFUSED" if self.refused else "DIFFERENT"


def summarize(records: Sequence[dict[str, Any]]) -> str:
    """What a run exercised: preemptions, cache hits, events, resets."""
    preemptions = sum(len(r["preempted"]) for r in records)
    hits = sum(s[2] + s[5] for r in records for s in r["stats"] if s is not None)
    events = sum(len(r["events"]) for r in records)
    resets = sum(1 for r in records if r["reset"])
    drafts = sum(len(tokens) for r in records for _, tokens in r["spec"])
    blocks = sum(len(g) for r in records for _, _, groups in r["new"] for g in groups)
    text = (
        f"{preemptions} preemptions, {hits} hit tokens, {events} events, "
        f"{resets} resets, {drafts} draft tokens, {blocks} new-request block ids"
    )
    if any(r["encoder"] for r in records):
        text += "; " + mm_workload.summarize(records)
    return text


def _is_refusal(error: str) -> bool:
    """A setting the backend refuses by name (not a wrong answer)."""
    return error.startswith("UnsupportedSetting") or "does not implement" in error


def compare(
    run: str, expected: RunResult, actual: RunResult, summary: Summary = summarize
) -> Comparison:
    """Step by step, the first field that differs (or the error either run raised); equal runs
    carry ``summary`` of vLLM's records."""
    equal = 0
    for i, (want, got) in enumerate(zip(expected.records, actual.records, strict=False)):
        if want != got:
            keys = [k for k in want if want.get(k) != got.get(k)]
            detail = "; ".join(
                f"{k}: vllm={want.get(k)!r} {actual.manager}={got.get(k)!r}" for k in keys
            )
            return Comparison(
                run, actual.manager, len(expected.records), i, f"step {i}: {detail}"[:2000]
            )
        equal += 1
    for result in (expected, actual):
        if result.error is not None:
            return Comparison(
                run,
                actual.manager,
                len(expected.records),
                equal,
                f"{result.manager}: {result.error}",
                refused=result is actual and _is_refusal(result.error),
            )
    if len(expected.records) != len(actual.records):
        return Comparison(
            run,
            actual.manager,
            len(expected.records),
            equal,
            f"vllm ran {len(expected.records)} steps, {actual.manager} {len(actual.records)}",
        )
    return Comparison(
        run, actual.manager, len(expected.records), equal, None, summary(expected.records)
    )


def run_all(
    runs: Sequence[Run],
    backends: Sequence[str],
    drive: Callable[[Run, str], RunResult],
    summary: Summary = summarize,
    echo: Callable[[str], None] = print,
) -> list[Comparison]:
    """Every run driven on vLLM's manager and on each backend; one comparison (and one line)
    per backend."""
    comparisons: list[Comparison] = []
    width = max([22] + [len(run.name) + 1 for run in runs])  # the longest name fits
    for run in runs:
        expected = drive(run, "vllm")
        for backend in backends:
            result = compare(run.name, expected, drive(run, backend), summary)
            comparisons.append(result)
            echo(
                f"{run.name:<{width}} {backend:<10} "
                f"{result.equal_steps}/{result.steps} steps {result.status}"
                + (f" ({result.summary})" if result.ok else f"\n    {result.divergence}")
            )
    return comparisons
