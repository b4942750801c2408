"""``--scaling``: the decode step (per request and batched) for B = 64 … 4,096 running
requests on pools of 10⁴, 10⁵ and 10⁶ blocks, with ~100-token prompts (a batch whose requests
do not fit its pool is skipped and listed), each row the fastest of three sweeps over all of
them (a slow phase of a shared machine, seconds to minutes long, slows some sweeps of a row,
not all) and, where the baseline shows that every sweep of a row caught one, of up to three
more passes of that row; then each way's highest cost per request over the rows ÷ its lowest
(the flatness the optimized backend's target bounds); and ``--plot``: µs per step against B,
log–log.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from hybridkv.bench_backends import SCALING_PROMPT, Backend, Way
from hybridkv.bench_report import fmt_ratio, print_table, ratio
from hybridkv.bench_scenarios import Sizes, decode, decode_blocks

Curves = dict[int, dict[str, list[tuple[int, float]]]]
"""Per pool, each way's ``(B, µs per step)``."""


def run_scaling(bases: Sequence[Backend], sizes: Sizes, markdown: bool) -> Curves:
    """µs per request of the decode step for each pool and batch that fits, each the fastest of
    ``sizes.scaling_passes`` sweeps over all of them; returns the curves."""
    base, ref, opt = bases
    ways = [Way(base), Way(ref), Way(opt), Way(opt, batched=True)]
    labels = [w.label for w in ways]
    fastest, again = sweeps(ways, sizes)
    curves: Curves = {pool: {label: [] for label in labels} for pool in sizes.scaling_pools}
    rows: list[tuple[str, ...]] = []
    for (pool, b), steps in fastest.items():
        for label, us in zip(labels, steps, strict=True):
            curves[pool][label].append((b, us))
        rows.append(
            (
                f"{pool:,}", f"{b:,}", *(f"{us / b:.2f}" for us in steps),
                fmt_ratio(ratio(steps[0], steps[2])), fmt_ratio(ratio(steps[0], steps[3])),
            )
        )  # fmt: skip
    header = (
        "pool (blocks)", "B", *(f"{label}: µs/request" for label in labels),
        f"{base.name}÷opt", f"{base.name}÷opt, batched",
    )  # fmt: skip
    print_table(header, rows, markdown)
    spreads = [
        f"{label} {max(costs) / min(costs):.2f}×"
        for label in labels
        if (costs := [us / b for pool in curves for b, us in curves[pool][label]])
    ]
    print(
        f"\neach figure: the fastest of {sizes.scaling_passes} pass(es) over every row"
        + rerun_note(again)
        + (
            f"; per request, the highest row ÷ the lowest: {', '.join(spreads)} (target for "
            "the optimized backend: ≤ 1.5×)"
            if spreads
            else ""
        )
    )
    skipped = [
        f"pool {pool:,}: B = {', '.join(f'{b:,}' for b in too_big)}"
        for pool in sizes.scaling_pools
        if (too_big := [b for b in sizes.scaling_batches if (pool, b) not in fastest])
    ]
    if skipped:
        blocks = decode_blocks(1, sizes.scaling_steps, SCALING_PROMPT) - 64
        print(
            f"\nnot run, {blocks} blocks per request (plus 64) exceeding the pool: "
            + "; ".join(skipped)
        )
    return curves


SLOW_ROW = 1.25
"""A row whose baseline took more than this times the baseline's median µs per request (over
every row) caught a slow phase of the machine in each of its passes: it is run again."""
EXTRA_PASSES = 3
"""At most this many more passes of such rows (each pass reruns the rows still slow)."""

Row = tuple[int, int]
"""A (pool, B) of the sweep."""


def sweeps(ways: Sequence[Way], sizes: Sizes) -> tuple[dict[Row, list[float]], dict[Row, int]]:
    """Per (pool, B) that fits, each way's µs per decode step: the fastest of
    ``sizes.scaling_passes`` sweeps over every (pool, B), in pool-then-B order, then of the
    extra passes of the rows the baseline (the first way) finds slow (``slow_rows``); and how
    many extra passes each such row took.

    The baseline's cost per request does not depend on B or the pool (vLLM's manager, or the
    reference standing in): where it runs far above its median, the machine was slow while
    that row ran, for every way, since each step times every way in turn."""
    fits = [
        (pool, b)
        for pool in sizes.scaling_pools
        for b in sizes.scaling_batches
        if decode_blocks(b, sizes.scaling_steps, SCALING_PROMPT) <= pool
    ]
    passes: dict[Row, list[list[float]]] = {row: [] for row in fits}

    def run(pool: int, b: int) -> None:
        t = decode(ways, b, sizes.scaling_steps, SCALING_PROMPT, num_blocks=pool)
        passes[pool, b].append([t[way.label][0] for way in ways])

    for _ in range(sizes.scaling_passes):
        for pool, b in fits:
            run(pool, b)
    again: dict[Row, int] = {}
    for _ in range(EXTRA_PASSES if sizes.scaling_passes > 1 else 0):
        slow = slow_rows(fastest_of(passes))
        if not slow:
            break
        for pool, b in slow:
            run(pool, b)
            again[pool, b] = again.get((pool, b), 0) + 1
    return fastest_of(passes), again


def fastest_of(passes: dict[Row, list[list[float]]]) -> dict[Row, list[float]]:
    """Each row's fastest figure per way over its passes."""
    return {row: [min(way) for way in zip(*runs, strict=True)] for row, runs in passes.items()}


def slow_rows(fastest: dict[Row, list[float]]) -> list[Row]:
    """The rows whose baseline (each row's first figure) per request exceeds ``SLOW_ROW`` times
    its median over the rows."""
    per_request = {(pool, b): steps[0] / b for (pool, b), steps in fastest.items()}
    if not per_request:
        return []
    bound = SLOW_ROW * statistics.median(per_request.values())
    return [row for row, us in per_request.items() if us > bound]


def rerun_note(again: dict[Row, int]) -> str:
    """The rows run again, for the footnote."""
    if not again:
        return ""
    rows = ", ".join(f"pool {pool:,} B = {b:,} (+{n})" for (pool, b), n in again.items())
    return (
        f"; rows where the baseline ran over {SLOW_ROW:g}× its median µs per request (a slow "
        f"phase of the machine in every pass) run again, each the fastest of all its passes: "
        f"{rows}"
    )


def plot(curves: dict[str, list[tuple[int, float]]], pool: int, path: str) -> None:
    """µs per decode step against B, log–log, one line per way."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        if points:
            axes.plot([b for b, _ in points], [us for _, us in points], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    axes.set_xlabel("B (running requests)")
    axes.set_ylabel("µs per decode step (append + allocate)")
    axes.set_title(f"Decode step, Gemma-3-like layout, {pool:,}-block pool")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
