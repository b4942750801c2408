"""How ``hybridkv replay`` shows a grid: one table, JSON, and a miss-ratio-curve plot."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from hybridkv.cli.options import UserError

if TYPE_CHECKING:
    from hybridkv.cli.replay_setup import CellResult

PLOT_EXTRA = "--plot needs matplotlib: pip install '.[plot]' from a checkout (or hybridkv[plot])"


def check_plot() -> None:
    """``UserError`` (one line naming the extra) when matplotlib is absent."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError(PLOT_EXTRA)


def _gib(size: int) -> str:
    return f"{size / (1 << 30):g} GiB"


def print_table(cells: Sequence[CellResult]) -> None:
    """One row per cell: memory, policy, first-admission hits against the bound, TTFT."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console = Console(highlight=False, width=max(console.width, 110))  # never truncate a figure
    first = cells[0].summary
    console.print(
        f"[bold]{first['model']}[/bold] · {first['requests']:,} requests · "
        f"{first['prompt_tokens']:,} prompt tokens · {first['backend']} backend · "
        f"{first['defaults']} defaults · {first['scheduler']} scheduler · bound "
        f"{first['bound_hit_rate']:.2%}"
    )
    table = Table(box=box.SIMPLE, pad_edge=False)
    host = any(cell.summary["host_hit_rate"] is not None for cell in cells)
    columns = ("memory", "policy", "hit", "/bound", "re-adm", "preempt", "evicted", "host")
    for column in columns[: len(columns) - (not host)]:
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("TTFT p50/p99 s", justify="right", no_wrap=True)
    table.add_column("wall s", justify="right", no_wrap=True)
    for cell in cells:
        row = _row(cell.summary)
        table.add_row(*(row if host else row[:7] + row[8:]))
    console.print(table)
    console.print("per-group hits, end-to-end and queueing times: --format json")
    skipped = sum(cell.summary["skipped"] for cell in cells)
    if skipped:
        console.print(f"skipped (longer than --max-model-len): {skipped:,} requests over the grid")
    in_flight = max(cell.summary["in_flight_bound_tokens"] for cell in cells)
    if in_flight:
        console.print(
            f"bound tokens in flight at admission (no cache could hit them): up to {in_flight:,}"
            " per cell (in_flight_bound_tokens)"
        )


def _count(value: int) -> str:
    """A count in at most five characters: 987, 12.3k, 4.5M."""
    if value < 1000:
        return str(value)
    if value < 1_000_000:
        return f"{value / 1e3:.1f}k"
    return f"{value / 1e6:.1f}M"


def _row(s: dict[str, Any]) -> list[str]:
    bound = s["bound_hit_rate"]
    ttft = s["ttft_ms"]
    host = "-" if s["host_hit_rate"] is None else f"{s['host_accounting']} {s['host_hit_rate']:.2%}"
    return [
        _gib(s["memory_bytes"]),
        s["eviction"],
        f"{s['hit_rate']:.2%}",
        f"{s['hit_rate'] / bound:.0%}" if bound else "-",
        _count(s["readmission_hit_tokens"]),
        f"{s['preemptions']:,}",
        _count(s["evictions"]),
        host,
        f"{ttft['p50'] / 1e3:.1f}/{ttft['p99'] / 1e3:.1f}",
        f"{s['wall_seconds']:.0f}",
    ]


def write_plot(cells: Sequence[CellResult], path: str) -> None:
    """Hit rate against memory per policy with the bound (a miss-ratio curve), and each
    cell's TTFT distribution (a CDF), side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in dict.fromkeys(cell.summary["eviction"] for cell in cells):
        mine = sorted(
            (c.summary["memory_bytes"], c.summary["hit_rate"])
            for c in cells
            if c.summary["eviction"] == policy
        )
        curve.plot([m / (1 << 30) for m, _ in mine], [100 * h for _, h in mine], "o-", label=policy)
    bound = 100 * cells[0].summary["bound_hit_rate"]
    curve.axhline(bound, color="grey", linestyle="--", label=f"infinite cache {bound:.1f} %")
    curve.set_xscale("log", base=2)
    curve.set_xlabel("KV cache memory (GiB)")
    curve.set_ylabel("prompt tokens hit at first admission (%)")
    curve.set_ylim(0, 100)
    curve.set_title(cells[0].summary["model"])
    curve.legend()
    for cell in cells:
        values = sorted(cell.ttft_ms)
        if values:
            share = [100 * (i + 1) / len(values) for i in range(len(values))]
            label = f"{_gib(cell.summary['memory_bytes'])} {cell.summary['eviction']}"
            if cell.summary["host_accounting"]:
                label += f" + host ({cell.summary['host_accounting']})"
            ttft.plot([v / 1e3 for v in values], share, label=label)
    ttft.set_xscale("log")
    ttft.set_xlabel("TTFT (s, simulated)")
    ttft.set_ylabel("requests (%)")
    ttft.legend(fontsize="small")
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    finally:
        plt.close(figure)
