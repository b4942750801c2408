"""``--scaling``: the decode step (per request and batched) for B = 64 … 4,096 running
requests on pools of 10⁴, 10⁵ and 10⁶ blocks, with ~100-token prompts (a batch whose requests
do not fit its pool is skipped and listed), each row the fastest of three sweeps over all of
them (a slow phase of a shared machine, seconds to minutes long, slows some sweeps of a row,
not all), then each way's highest cost per request over the rows ÷ its lowest (the flatness
the optimized backend's target bounds); and ``--plot``: µs per step against B, log–log.
"""

from __future__ import annotations

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
    fastest = sweeps(ways, sizes)
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


def sweeps(ways: Sequence[Way], sizes: Sizes) -> dict[tuple[int, int], list[float]]:
    """Per (pool, B) that fits, each way's µs per decode step: the fastest of
    ``sizes.scaling_passes`` sweeps over every (pool, B), in pool-then-B order."""
    fits = [
        (pool, b)
        for pool in sizes.scaling_pools
        for b in sizes.scaling_batches
        if decode_blocks(b, sizes.scaling_steps, SCALING_PROMPT) <= pool
    ]
    passes: dict[tuple[int, int], list[list[float]]] = {row: [] for row in fits}
    for _ in range(sizes.scaling_passes):
        for pool, b in fits:
            t = decode(ways, b, sizes.scaling_steps, SCALING_PROMPT, num_blocks=pool)
            passes[pool, b].append([t[way.label][0] for way in ways])
    return {row: [min(way) for way in zip(*runs, strict=True)] for row, runs in passes.items()}


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
