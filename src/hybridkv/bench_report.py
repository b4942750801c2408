"""The benchmark's report: ratios against vLLM (``ratio``, above 1: faster or smaller), how
numbers are printed, the tables (plain or Markdown), and the issue's targets (``Target``,
``met``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


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
