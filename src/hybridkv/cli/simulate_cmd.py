"""``hybridkv simulate``: drive the manager with a workload through a small scheduler loop."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import click

from hybridkv.cli.options import (
    ASSUME_FULL_ATTENTION_HELP,
    MemorySize,
    RunFailed,
    TokenCount,
    UserError,
    resolve_model,
)
from hybridkv.cli.plan_cmd import model_options
from hybridkv.cli.plan_data import Plan, PlanSettings, make_plan
from hybridkv.cli.replay_cmd import replays_block_trace
from hybridkv.extras import first_missing, is_missing, needs_line

if TYPE_CHECKING:
    from hybridkv.scheduling import Manager
    from hybridkv.simulate import SimulationResult
    from hybridkv.workloads import RequestSpec


@click.command()
@click.argument("model", required=False, metavar="[MODEL | CONFIG.json]")
@click.option(
    "--workload",
    type=click.Choice(["chat", "rag", "agent", "mixed"]),
    default=None,
    help="Synthetic workload with prefix sharing  [default: mixed]",
)
@click.option(
    "--trace",
    type=click.Path(dir_okay=False),
    default=None,
    help="JSONL trace instead of a workload: output_len, prompt_token_ids or prompt_len "
    "(+ prefix_id, prefix_len), arrival_step, id.",
)
@click.option(
    "--requests", "num_requests", type=click.IntRange(min=1), default=48, show_default=True
)
@click.option(
    "--backend",
    type=click.Choice(["reference", "optimized"]),
    default="reference",
    show_default=True,
)
@click.option(
    "--device",
    default=None,
    help="Torch device of the optimized backend: cpu, cuda, cuda:N  [default: cpu]",
)
@click.option(
    "--memory",
    type=MemorySize(),
    default="4GiB",
    show_default=True,
    help="KV cache memory; lower it (e.g. 2GiB) to see preemption.",
)
@click.option("--max-model-len", type=TokenCount(), default=16384, show_default=True)
@model_options(max_num_batched_tokens=2048)
@click.option("--max-num-seqs", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write usage and hit rate over time (PNG; needs matplotlib).",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
)
@click.option("--assume-full-attention", is_flag=True, help=ASSUME_FULL_ATTENTION_HELP)
@click.option(
    "--eviction",
    default="lru",
    show_default=True,
    help="Eviction policy: lru (vLLM's), hybrid, cost, arc, hybrid-arc or module:Class.",
)
def simulate(
    model: str | None,
    workload: str | None,
    trace: str | None,
    num_requests: int,
    backend: str,
    device: str | None,
    memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    block_size: int,
    kv_dtype: str,
    mamba_ssm_dtype: str,
    max_num_seqs: int,
    prefix_caching: bool,
    seed: int,
    plot: str | None,
    output_format: str,
    assume_full_attention: bool,
    eviction: str,
) -> None:
    """Replay a workload on MODEL's planned KV cache (default gemma-3-27b-it, 4 GiB).

    A scheduler loop (FCFS admission with a token budget, chunked prefill, decode, preemption
    when the pool is full, freeing on finish) drives the manager. Prints the prefix-hit rate,
    tokens computed and saved, peak and mean usage, preemptions, steps and the manager's time.
    """
    _check_options(workload, trace, plot, backend)
    from hybridkv.policies import resolve_policy

    try:
        resolve_policy(eviction)
    except ValueError as error:
        raise UserError(str(error)) from None
    if trace is not None and replays_block_trace(trace, locals()):
        return
    if device is not None and backend == "reference":
        click.echo(
            f"note: --device {device} is ignored: the reference backend is pure Python on the "
            "CPU (--backend optimized puts its tensors on a device)",
            err=True,
        )
    settings = PlanSettings(
        memory, max_model_len, max_num_batched_tokens, block_size, kv_dtype, mamba_ssm_dtype
    )
    plan = make_plan(resolve_model(model, assume_full_attention=assume_full_attention), settings)
    caching = prefix_caching
    requests, too_long = _requests(workload or "mixed", trace, num_requests, seed, max_model_len)
    manager = _build_manager(
        backend, plan, caching, device or "cpu", output_format == "table", eviction
    )
    result = _run(
        manager,
        requests,
        plan,
        max_num_seqs,
        show_progress=output_format == "table",
        caching=caching,
    )
    header = {
        "model": plan.choice.name,
        "workload": f"trace {trace}" if trace else workload or "mixed",
        "backend": backend,
        "seed": seed,
        "num_blocks": plan.report.num_blocks,
        "block_size": plan.report.block_size,
        "prefix_caching": caching,
        "skipped_too_long": len(too_long),
    }
    if plot is not None:
        _write_plot(result, plot, title=f"{plan.choice.name}, {header['workload']}")
    if output_format == "json":
        click.echo(json.dumps({**header, **result.summary()}, indent=2))
    else:
        _print_result(header, result, plot, too_long, max_model_len)
    if result.num_finished == 0:
        raise RunFailed(
            f"no request fits: all {result.num_rejected} need more than the pool of "
            f"{plan.report.num_blocks:,} blocks ({plan.settings.memory_bytes:,} bytes) holds; "
            "add --memory or lower --max-model-len"
        )


def _check_options(workload: str | None, trace: str | None, plot: str | None, backend: str) -> None:
    """Options that conflict, and the extras the chosen ones need: ``UserError`` naming them."""
    if workload is not None and trace is not None:
        raise UserError("give --workload or --trace, not both")
    if trace is not None and _given(click.get_current_context(), "num_requests"):
        raise UserError(
            f"give --requests or --trace, not both: the trace {trace} has its own requests"
        )
    if plot is not None and is_missing("matplotlib"):
        raise UserError(needs_line("--plot", "matplotlib"))
    if backend == "optimized" and (missing := first_missing(("torch", "numpy"))) is not None:
        raise UserError(needs_line("--backend optimized", missing))


def _given(ctx: click.Context, name: str) -> bool:
    """Whether the user typed option ``name`` (not its default)."""
    from click.core import ParameterSource

    return ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE


def _requests(
    workload: str, trace: str | None, num_requests: int, seed: int, max_model_len: int
) -> tuple[tuple[RequestSpec, ...], tuple[int, ...]]:
    """The workload's requests, or the trace's with the lines skipped as too long;
    ``UserError`` for a bad trace."""
    from hybridkv.workload_trace import load_trace
    from hybridkv.workloads import make_workload

    try:
        if trace is not None:
            loaded = load_trace(trace, seed=seed, max_model_len=max_model_len)
            return loaded.requests, loaded.too_long
        workload_requests = make_workload(
            workload, num_requests, seed=seed, max_model_len=max_model_len
        )
    except ValueError as error:
        raise UserError(str(error)) from None
    return workload_requests, ()


def _build_manager(
    backend: str, plan: Plan, caching: bool, device: str, show_progress: bool, eviction: str
) -> Manager:
    """The manager, with a spinner on a terminal: a large pool takes seconds to build."""
    if not show_progress:
        return _manager(backend, plan, caching, device, eviction)
    from rich.console import Console

    console = Console(stderr=True)
    if not console.is_terminal:
        return _manager(backend, plan, caching, device, eviction)
    with console.status(f"building a pool of {plan.report.num_blocks:,} blocks"):
        return _manager(backend, plan, caching, device, eviction)


def _manager(backend: str, plan: Plan, caching: bool, device: str, eviction: str) -> Manager:
    """The reference manager, or the torch backend (``simulate`` checked torch and numpy),
    under the ``eviction`` policy."""
    from hybridkv.reference.planner import with_mamba_cache_mode

    config = with_mamba_cache_mode(plan.report.config, caching)
    max_model_len = plan.settings.max_model_len
    if backend == "reference":
        from hybridkv.reference import KVCacheManager

        return KVCacheManager(
            config, max_model_len, enable_caching=caching, eviction_policy=eviction
        )
    from hybridkv.cli.devices import device_problem
    from hybridkv.optimized import TorchKVCacheManager

    if (problem := device_problem(device)) is not None:
        raise UserError(problem)
    try:
        manager: Manager = TorchKVCacheManager(
            config, max_model_len, enable_caching=caching, device=device, eviction_policy=eviction
        )
    except (RuntimeError, ValueError) as error:
        raise UserError(f"cannot start the optimized backend on {device!r}: {error}") from None
    return manager


def _run(
    manager: Manager,
    requests: tuple[RequestSpec, ...],
    plan: Plan,
    max_num_seqs: int,
    *,
    show_progress: bool,
    caching: bool,
) -> SimulationResult:
    """Run the scheduler loop, with a progress bar on stderr for people."""
    from hybridkv.simulate import Scheduler, SchedulerConfig

    config = SchedulerConfig(
        max_num_batched_tokens=plan.settings.max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=plan.settings.max_model_len,
    )
    from hybridkv.spec import MambaSpec

    mamba = [g.spec.block_size for g in plan.report.config.groups if isinstance(g.spec, MambaSpec)]
    scheduler = Scheduler(
        manager,
        requests,
        block_size=plan.report.block_size,
        config=config,
        mamba_block_size=mamba[0] if mamba and caching else None,
    )
    from rich.console import Console

    if not show_progress or not Console(stderr=True).is_terminal:
        return scheduler.run()
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (
        TextColumn("simulating"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("step {task.fields[step]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("requests", total=len(requests), step=0)

        def on_step(result: SimulationResult) -> None:
            done = result.num_finished + result.num_rejected
            progress.update(task, completed=done, step=result.steps)

        return scheduler.run(on_step)


def _print_result(
    header: dict[str, Any],
    result: SimulationResult,
    plot: str | None,
    too_long: tuple[int, ...],
    max_model_len: int,
) -> None:
    """The numbers as a two-column table (the trace lines skipped as too long first)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)
    console.print(
        f"[bold]{header['model']}[/bold] · {header['workload']} · {result.num_requests} requests · "
        f"seed {header['seed']} · {header['backend']} backend · {header['num_blocks']:,} blocks "
        f"of {header['block_size']} tokens"
    )
    table = Table(box=box.SIMPLE, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    if too_long:
        lines = ", ".join(map(str, too_long[:10])) + (" …" if len(too_long) > 10 else "")
        table.add_row(
            "skipped",
            f"{len(too_long)} trace lines longer than max_model_len {max_model_len:,} "
            f"(lines {lines})",
        )
    for label, value in _result_rows(result):
        table.add_row(label, value)
    console.print(table)
    if plot is not None:
        console.print(f"plot written to [bold]{plot}[/bold]")


def _result_rows(result: SimulationResult) -> list[tuple[str, str]]:
    """Label and value of every number the simulation reports."""
    per_step = result.manager_seconds / result.steps if result.steps else 0.0
    return [
        ("requests", f"{result.num_finished} finished, {result.num_rejected} rejected (too large)"),
        ("steps", f"{result.steps:,}"),
        (
            "prefix hits",
            f"{result.hit_rate:.1%} of prompt tokens "
            f"({result.hit_tokens:,} of {result.prompt_tokens:,})",
        ),
        (
            "tokens",
            f"{result.computed_tokens:,} computed, {result.hit_tokens:,} saved by the prefix cache",
        ),
        ("KV usage", f"peak {result.peak_usage:.1%}, mean {result.mean_usage:.1%}"),
        ("preemptions", f"{result.preemptions:,}"),
        (
            "manager time",
            f"{per_step * 1e3:.3f} ms per step ({result.manager_seconds:.2f} s in all)",
        ),
    ]


def _write_plot(result: SimulationResult, path: str, *, title: str) -> None:
    """Usage and cumulative hit rate per step, as a PNG (matplotlib's Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, result.steps + 1)
    figure, (usage, hits) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    usage.plot(steps, [100 * u for u in result.usage_per_step], color="tab:blue")
    usage.set_ylabel("KV usage (%)")
    usage.set_ylim(0, 105)
    usage.set_title(title)
    hits.plot(steps, [100 * h for h in result.hit_rate_per_step], color="tab:green")
    hits.set_ylabel("prefix-hit rate (%)")
    hits.set_xlabel("scheduler step")
    hits.set_ylim(0, 105)
    figure.tight_layout()
    try:
        figure.savefig(path, dpi=100)
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None
    finally:
        plt.close(figure)
