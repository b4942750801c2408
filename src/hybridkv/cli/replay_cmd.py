"""``hybridkv replay``: replay a block-hash trace (Mooncake's kind) through the manager, on a
clock, over a grid of memories and eviction policies.

``run_block_trace`` is the command without click: ``hybridkv simulate --trace`` hands a
block-hash trace to it. Each grid cell is a ``ReplaySetup`` run by ``replay_run.run_cell``, in
worker processes up to ``jobs``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import click

from hybridkv.cli.options import MemorySize, UserError
from hybridkv.cli.plan_cmd import model_options
from hybridkv.cli.replay_output import check_plot, print_table, write_plot
from hybridkv.cli.replay_run import is_block_trace
from hybridkv.cli.replay_setup import COST_FIELDS, TRACE_FORMATS, CellResult, ReplaySetup
from hybridkv.cli.replay_vllm import SCHEDULERS, check_scheduler

if TYPE_CHECKING:
    from hybridkv.lab import ReplayResult

_Advance = Callable[[int], None]


def parse_memories(text: str) -> tuple[int, ...]:
    """``2GiB,4GiB,8GiB`` as byte counts; ``UserError`` naming the value that does not parse."""
    size = MemorySize()
    values = []
    for item in text.split(","):
        try:
            values.append(size.convert(item.strip(), None, None))
        except click.BadParameter as error:
            raise UserError(f"--memory: {error.message}") from None
    return tuple(values)


def parse_evictions(text: str) -> tuple[str, ...]:
    """``lru,cost`` as policy names, each checked (built once) before any run starts."""
    from hybridkv.policies import resolve_policy

    names = tuple(item.strip() for item in text.split(","))
    for name in names:
        try:
            resolve_policy(name)
        except (ValueError, ImportError, AttributeError, TypeError) as error:
            raise UserError(f"--eviction {name!r}: {error}") from None
    return names


def parse_accountings(text: str) -> tuple[str, ...]:
    """``vllm,hybrid`` as host accountings; ``UserError`` naming one that is neither."""
    from hybridkv.lab.host_tier import ACCOUNTINGS

    names = tuple(item.strip() for item in text.split(","))
    for name in names:
        if name not in ACCOUNTINGS:
            raise UserError(f"--host-accounting must be among {ACCOUNTINGS}, got {name!r}")
    return names


def run_block_trace(
    setup: ReplaySetup,
    *,
    memories: Sequence[int] | None = None,
    evictions: Sequence[str] | None = None,
    host_accountings: Sequence[str] | None = None,
    trace_format: str | None = None,
    jobs: int = 1,
    output_format: str = "table",
    plot: str | None = None,
) -> int:
    """Run the grid of ``memories`` × ``evictions`` × ``host_accountings`` (``setup``'s own
    when ``None``), print it,
    and return the exit status (0). ``UserError`` for bad input, before anything runs."""
    from hybridkv.cli.replay_run import check_trace

    if plot is not None:
        check_plot()
    check_trace(setup.trace, trace_format)
    cells = [
        dataclasses.replace(
            setup, memory_bytes=memory, eviction=eviction, host_accounting=accounting
        )
        for memory in memories or (setup.memory_bytes,)
        for eviction in evictions or (setup.eviction,)
        for accounting in host_accountings or (setup.host_accounting,)
    ]
    for cell in cells:
        check_scheduler(cell)
    results = _run_grid(cells, jobs, show_progress=output_format == "table")
    if output_format == "json":
        summaries = [result.summary for result in results]
        click.echo(json.dumps(summaries[0] if len(summaries) == 1 else summaries, indent=2))
    else:
        print_table(results)
    if plot is not None:
        write_plot(results, plot)
        if output_format == "table":
            click.echo(f"plot written to {plot}")
    return 0


def _run_grid(cells: list[ReplaySetup], jobs: int, *, show_progress: bool) -> list[CellResult]:
    """Every cell, in order; in a process pool when ``jobs > 1`` and there are several."""
    from rich.console import Console

    from hybridkv.cli.replay_run import run_cell

    console = Console(stderr=True)
    visible = show_progress and console.is_terminal
    if jobs > 1 and len(cells) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=min(jobs, len(cells))) as pool:
            futures = [pool.submit(run_cell, cell) for cell in cells]
            with ReplayProgress(console, visible, len(cells), "cells") as advance:
                results = []
                for future in futures:
                    results.append(future.result())
                    advance(len(results))
            return results
    total = _count_requests(cells[0]) * len(cells)
    results = []
    with ReplayProgress(console, visible, total, "requests") as advance:
        for cell in cells:
            done = sum(result.summary["requests"] for result in results)

            def on_step(result: ReplayResult, done: int = done) -> None:
                if result.steps % 64 == 0:
                    advance(done + result.finished + result.refused)

            results.append(run_cell(cell, on_step if visible else None))
    return results


def _count_requests(setup: ReplaySetup) -> int:
    """The trace's requests (non-blank lines, up to ``max_requests``), for the progress bar."""
    with open(setup.trace, encoding="utf-8") as handle:
        count = sum(1 for line in handle if line.strip())
    return count if setup.max_requests is None else min(count, setup.max_requests)


class ReplayProgress:
    """A rich progress bar with an ETA on a terminal; nothing when piped."""

    def __init__(self, console: object, visible: bool, total: int, unit: str) -> None:
        self.console, self.visible, self.total, self.unit = console, visible, total, unit
        self.bar: object = None

    def __enter__(self) -> _Advance:
        if not self.visible:
            return lambda completed: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        bar = Progress(
            TextColumn(f"replaying ({self.unit})"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=self.console,  # type: ignore[arg-type]
            transient=True,
        )
        bar.start()
        task = bar.add_task(self.unit, total=self.total)
        self.bar = bar
        return lambda completed: bar.update(task, completed=completed)

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()  # type: ignore[attr-defined]


@click.command()
@click.argument("model", required=False, metavar="[MODEL | CONFIG.json]")
@click.option("--trace", type=click.Path(dir_okay=False), required=True, help="Block-hash JSONL.")
@click.option(
    "--trace-format",
    type=click.Choice(TRACE_FORMATS),
    default=None,
    help="The trace's format  [default: recognised by its fields]",
)
@click.option(
    "--trace-block-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Tokens per trace hash block: 512 Mooncake, 16 Bailian, 64 SemiAnalysis.",
)
@click.option("--max-requests", type=click.IntRange(min=1), default=None, help="A prefix.")
@click.option(
    "--memory", default="8GiB", show_default=True, help="KV cache memory; a comma list is a grid."
)
@click.option(
    "--eviction",
    default="lru",
    show_default=True,
    help="Eviction policies (hybridkv policies' names or MODULE:CLASS); a comma list.",
)
@click.option(
    "--backend",
    type=click.Choice(["reference", "optimized", "vllm"]),
    default="optimized",
    show_default=True,
    help="vllm: vLLM's own manager (LRU), with --scheduler vllm only.",
)
@click.option(
    "--scheduler",
    type=click.Choice(SCHEDULERS),
    default="built-in",
    show_default=True,
    help="built-in: hybridkv's FCFS loop; vllm: vLLM 0.33's own Scheduler (its chunked "
    "prefill, admission, preemption and async scheduling) driving the manager.",
)
@click.option("--device", default="cpu", show_default=True, help="Optimized backend's device.")
@click.option("--jobs", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--time-scale", type=click.FloatRange(min=0, min_open=True), default=1.0)
@click.option("--gpu", type=click.Choice(["A100", "H100", "H200"]), default="H100")
@click.option("--fixed-ms", type=click.FloatRange(min=0), default=None)
@click.option("--prefill-token-ms", type=click.FloatRange(min=0), default=None)
@click.option("--decode-seq-ms", type=click.FloatRange(min=0), default=None)
@click.option("--context-token-ms", type=click.FloatRange(min=0), default=None)
@click.option(
    "--defaults",
    type=click.Choice(["engine", "unit"]),
    default="engine",
    show_default=True,
    help="engine: vLLM 0.33's (sparse retention, full-prompt admission, async tokens in "
    "flight); unit: vLLM's unit tests' (dense retention).",
)
@click.option(
    "--retention-interval",
    "retention",
    default="default",
    show_default=True,
    help="prefix_cache_retention_interval: 'dense', or tokens (0: sparse, as the engine); "
    "'default' takes --defaults'.",
)
@click.option(
    "--admission",
    type=click.Choice(["default", "full", "first-chunk"]),
    default="default",
    show_default=True,
    help="full: a request is admitted only when its whole sequence fits (the engine's); "
    "first-chunk: when its first chunk does (vLLM's unit tests').",
)
@click.option(
    "--async-scheduling/--no-async-scheduling",
    default=None,
    help="Async scheduling's tokens in flight  [default: --defaults']",
)
@click.option(
    "--prefix-caching/--no-prefix-caching",
    default=True,
    show_default=True,
    help="Off: no prefix caching (the baseline; Mamba groups run 'none').",
)
@click.option(
    "--host-memory",
    type=MemorySize(),
    default=None,
    help="A host tier of this size under the GPU pool (evicted blocks move there, LRU).",
)
@click.option(
    "--host-bandwidth",
    type=click.FloatRange(min=0, min_open=True),
    default=25.0,
    show_default=True,
    help="GB/s from host to GPU: a host hit's load time.",
)
@click.option(
    "--host-accounting",
    default="vllm,hybrid",
    show_default=True,
    help="vllm: a chunk of every group's pages per (hash, group) key, as vLLM 0.33's "
    "OffloadingConnector; hybrid: each group's own pages, and each window's last blocks at "
    "every trace block boundary written as computed. A comma list runs both.",
)
@click.option("--max-model-len", type=click.IntRange(min=1), default=262144, show_default=True)
@model_options(max_num_batched_tokens=8192)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="PNG (matplotlib).")
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
)
def replay(**options: Any) -> None:
    """Replay a block-hash trace (Mooncake FAST'25's format) on MODEL's planned KV cache.

    Prints, per memory and eviction policy, the prompt tokens hit at first admission beside
    the trace's infinite-cache bound, re-admission hits, per-group hits, preemptions,
    evictions and simulated TTFT.
    """
    grid = {name: options.pop(name) for name in GRID_OPTIONS}
    run_block_trace(
        setup_from_options(options),
        memories=parse_memories(grid["memory"]),
        evictions=parse_evictions(grid["eviction"]),
        host_accountings=(
            parse_accountings(grid["host_accounting"]) if options["host_memory"] else None
        ),
        trace_format=grid["trace_format"],
        jobs=grid["jobs"],
        output_format=grid["output_format"],
        plot=grid["plot"],
    )


GRID_OPTIONS = (
    "memory",
    "eviction",
    "host_accounting",
    "trace_format",
    "jobs",
    "output_format",
    "plot",
)
"""The command's options that shape the grid and its output, not one replay."""

RENAMED = {
    "trace_block_tokens": "block_tokens",
    "host_memory": "host_memory_bytes",
    "host_bandwidth": "host_bandwidth_gbps",
}
"""Command-line names whose ``ReplaySetup`` field is named otherwise."""


def setup_from_options(options: dict[str, Any]) -> ReplaySetup:
    """One replay's ``ReplaySetup`` from the command's other options (cost coefficients given
    on the command line override the model's)."""
    values = {RENAMED.get(name, name): value for name, value in options.items()}
    values["cost"] = tuple(
        (name, value) for name in COST_FIELDS if (value := values.pop(name)) is not None
    )
    return ReplaySetup(**values)


def replays_block_trace(trace: str, options: dict[str, Any]) -> bool:
    """``hybridkv simulate --trace``: a block-hash trace (Mooncake's format) is replayed on a
    clock by this command's loop, with simulate's model and engine options (``options``: its
    arguments by name); ``False`` for the project's token traces, which simulate reads."""
    if not is_block_trace(trace):
        return False
    names = (
        "model",
        "backend",
        "max_model_len",
        "max_num_batched_tokens",
        "max_num_seqs",
        "block_size",
        "kv_dtype",
        "mamba_ssm_dtype",
    )
    setup = ReplaySetup(
        trace=trace,
        memory_bytes=options["memory"],
        device=options["device"] or "cpu",
        **{name: options[name] for name in names},
    )
    run_block_trace(setup, output_format=options["output_format"], plot=options["plot"])
    return True
