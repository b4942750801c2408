"""The benchmark's report: ratios against vLLM (``ratio``, above 1: faster or smaller), how
numbers are printed, the tables (plain or Markdown), the issue's targets (``Target``, ``met``)
and the scenarios' table as it fills (``BenchTable``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

FLOOR_SLACK = 1.2
"""A missed target may stay missed where the path is within 20 % of its floor."""


def ratio(baseline: float, value: float) -> float | None:
    """``baseline ÷ value`` (above 1: ``value`` is faster or smaller), ``None`` without both."""
    return baseline / value if baseline > 0 and value > 0 else None


def fmt_ratio(value: float | None) -> str:
    if value is None:
        return ""
    return f"{value:.1f}×" if value >= 10 else f"{value:.2f}×"


def fmt_us(us: float, per: int = 0) -> str:
    return f"{us:,.0f} ({us / per:.2f})" if per else f"{us:,.0f}"


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> None:
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
        for row in rows:
            print("| " + " | ".join(cell.strip() or " " for cell in row) + " |")
        return
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]
    for row in (header, tuple("-" * w for w in widths), *rows):
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w)
                for i, (cell, w) in enumerate(zip(row, widths, strict=True))
            ).rstrip()
        )


@dataclass(frozen=True)
class Target:
    minimum: float
    unit: str = "×"  # "×": a ratio against vLLM; "B": at most this many bytes

    def __str__(self) -> str:
        return f"≥ {self.minimum:g}×" if self.unit == "×" else f"≤ {self.minimum:g} {self.unit}"


def met(target: Target | None, value: float | None, judged: bool) -> str:
    if target is None or value is None:
        return ""
    if target.unit == "×" and not judged:
        return "n/a (no vLLM)"
    ok = value >= target.minimum if target.unit == "×" else value <= target.minimum
    return "yes" if ok else "no"


Values = tuple[float | None, float | None, float | None]
"""A row's figures for the baseline (vLLM, or the stand-in), the reference and the optimized
backend; ``None`` where a backend has no such way."""


@dataclass
class BenchTable:
    """The scenarios' table as it is measured: a row per scenario with the three backends'
    cells, the baseline's ratio to each, a target and whether the optimized backend meets it
    (``judged``: against vLLM, else the stand-in and no verdict)."""

    baseline: str
    judged: bool
    rows: list[tuple[str, ...]] = field(default_factory=list)

    @property
    def header(self) -> tuple[str, ...]:
        return (
            "scenario", self.baseline, "reference", "optimized",
            f"{self.baseline}÷ref", f"{self.baseline}÷opt", "target", "met?",
        )  # fmt: skip

    def row(
        self,
        scenario: str,
        values: Values,
        cells: tuple[str, str, str],
        target: Target | None = None,
    ) -> None:
        """A row of ``values`` printed as ``cells``; a target in bytes is judged on the
        optimized backend's value, one in × on the baseline's ratio to it."""
        b, r, o = values
        vs_ref = ratio(b, r) if b is not None and r is not None else None
        vs_opt = ratio(b, o) if b is not None and o is not None else None
        target_value = o if target is not None and target.unit != "×" else vs_opt
        self.rows.append(
            (
                scenario, *cells, fmt_ratio(vs_ref), fmt_ratio(vs_opt),
                str(target or ""), met(target, target_value, self.judged),
            )
        )  # fmt: skip
        sys.stdout.flush()

    def timed(
        self, scenario: str, values: Values, per: int = 0, target: Target | None = None
    ) -> None:
        """A row of times in µs (and per request, over ``per`` requests), blank where none."""
        cells = tuple("" if v is None else fmt_us(v, per) for v in values)
        self.row(scenario, values, (cells[0], cells[1], cells[2]), target)

    def floor(self, scenario: str, baseline: float, floor: float, path: float) -> None:
        """A row of a path's floor, timed beside it: the baseline ÷ the floor (the most the
        path could gain), and whether the optimized backend's ``path`` lies within
        ``FLOOR_SLACK`` of it (where a missed target may stay missed)."""
        share = path / floor
        verdict = "yes" if share <= FLOOR_SLACK else "no"
        self.rows.append(
            (
                scenario, fmt_us(baseline), "", fmt_us(floor),
                "", fmt_ratio(ratio(baseline, floor)),
                f"opt ≤ {FLOOR_SLACK:g}× it", f"{verdict} ({share:.2f}×)",
            )
        )  # fmt: skip

    def note(self, scenario: str, optimized: str) -> None:
        """A row of the optimized backend's alone, with no ratio and no target."""
        self.rows.append((scenario, "", "", optimized, "", "", "", ""))

    def print(self, markdown: bool) -> None:
        print_table(self.header, self.rows, markdown)
