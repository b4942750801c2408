"""``hybridkv policies``: every catalogue model under the three grouping policies, one table.

The policy table of docs/grouping-policies.md is this command's output (``--format markdown``): per
model and policy, the KV cache groups, padding slots, blocks and requests of ``max_model_len`` that
fit, with vLLM's maximum concurrency; the policy that fits the most is in bold. Two layouts that
are not catalogue models join them: gpt-oss-20b with an EAGLE draft layer (13 full + 12
sliding) and 6 full + 5 sliding layers of gpt-oss-20b's shape.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import click

from hybridkv.cli.options import MemorySize, TokenCount, format_bytes
from hybridkv.cli.plan_data import POLICIES

if TYPE_CHECKING:
    from hybridkv.reference.plan_report import PlanReport
    from hybridkv.spec import KVCacheSpec


@dataclass(frozen=True)
class Layout:
    """One row: a model's layers (or a made-up layout's) and its longest request."""

    name: str
    layers: Mapping[str, KVCacheSpec]
    kv_sharing: Mapping[str, str]
    max_model_len: int


@click.command()
@click.option("--memory", type=MemorySize(), default="40GiB", show_default=True)
@click.option(
    "--max-model-len",
    type=TokenCount(),
    default=32768,
    show_default=True,
    help="Longest request (capped at each model's context length).",
)
@click.option("--max-num-batched-tokens", type=TokenCount(), default=8192)
@click.option("--async-scheduling/--no-async-scheduling", default=True, show_default=True)
@click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "markdown"]),
    default="table",
    show_default=True,
)
def policies(
    memory: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    async_scheduling: bool,
    prefix_caching: bool,
    output_format: str,
) -> None:
    """Compare the grouping policies (document, vllm, min-padding) on every catalogue model."""
    rows: list[tuple[Layout, dict[str, PlanReport | None]]] = []
    for layout in _layouts(max_model_len):
        reports: dict[str, PlanReport | None] = {
            policy: _report(
                layout, memory, policy, max_num_batched_tokens, async_scheduling, prefix_caching
            )
            for policy in POLICIES
        }
        rows.append((layout, reports))
    caption = (
        f"{format_bytes(memory)} of KV cache, bf16, block size 16, max_model_len "
        f"min({max_model_len:,}, the model's context), {max_num_batched_tokens:,} batched "
        f"tokens, async scheduling {'on' if async_scheduling else 'off'}, prefix caching "
        f"{'on' if prefix_caching else 'off'}, one GPU. Each cell: groups / padding slots / "
        "blocks / requests that fit (vLLM's maximum concurrency)."
    )
    if output_format == "markdown":
        click.echo(_markdown(rows, caption))
    else:
        _print_table(rows, caption)


def _layouts(max_model_len: int) -> Iterator[Layout]:
    """The catalogue's models, then gpt-oss-20b + EAGLE and 6 full + 5 sliding."""
    from hybridkv.catalogue import ModelError, find_model, load_catalogue
    from hybridkv.model_layers import model_layers
    from hybridkv.spec import FullAttentionSpec, SlidingWindowSpec

    for entry in load_catalogue():
        length = min(max_model_len, entry.facts.max_position_embeddings or max_model_len)
        try:
            modelled = model_layers(entry.facts, block_size=16, kv_dtype_bytes=2)
        except ModelError:
            continue
        yield Layout(entry.model_id, modelled.layers, modelled.kv_sharing, length)
    gpt_oss = find_model("openai/gpt-oss-20b")
    layers = model_layers(gpt_oss.facts, block_size=16, kv_dtype_bytes=2).layers
    full = next(spec for spec in layers.values() if isinstance(spec, FullAttentionSpec))
    sliding = next(spec for spec in layers.values() if isinstance(spec, SlidingWindowSpec))
    length = min(max_model_len, gpt_oss.facts.max_position_embeddings or max_model_len)
    eagle = {**layers, "eagle.0": full}
    yield Layout("gpt-oss-20b + EAGLE (13 full + 12 sliding)", eagle, {}, length)
    small = {f"full.{i}": full for i in range(6)} | {f"sw.{i}": sliding for i in range(5)}
    yield Layout("6 full + 5 sliding (gpt-oss-20b's layers)", small, {}, length)


def _report(
    layout: Layout,
    memory: int,
    policy: str,
    max_num_batched_tokens: int,
    async_scheduling: bool,
    prefix_caching: bool,
) -> PlanReport | None:
    """One layout under one policy; ``None`` when it cannot be planned."""
    from hybridkv.reference.grouping import GROUPING_POLICIES
    from hybridkv.reference.plan_report import plan_report

    chosen = next(p for p in GROUPING_POLICIES if p == policy)
    try:
        return plan_report(
            layout.layers,
            memory,
            max_model_len=layout.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_sharing=layout.kv_sharing,
            policy=chosen,
            async_scheduling=async_scheduling,
            enable_prefix_caching=prefix_caching,
        )
    except ValueError:
        return None


def _cell(report: PlanReport | None) -> str:
    if report is None:
        return "cannot plan"
    return (
        f"{len(report.groups)} / {report.num_padding_slots} / {report.num_blocks:,} / "
        f"{report.max_num_requests:,} ({report.max_concurrency:.2f})"
    )


def _best(reports: Mapping[str, PlanReport | None]) -> str | None:
    """The policy with the highest concurrency; ``None`` when all tie or none plans."""
    found = {p: r.max_concurrency for p, r in reports.items() if r is not None}
    if not found or len(set(found.values())) == 1:
        return None
    return max(found, key=lambda p: found[p])


def _markdown(rows: list[tuple[Layout, dict[str, PlanReport | None]]], caption: str) -> str:
    lines = [
        "| model | max_model_len | " + " | ".join(POLICIES) + " |",
        "|---|---:|" + "---|" * len(POLICIES),
    ]
    for layout, reports in rows:
        best = _best(reports)
        cells = [f"**{_cell(reports[p])}**" if p == best else _cell(reports[p]) for p in POLICIES]
        lines.append(f"| {layout.name} | {layout.max_model_len:,} | " + " | ".join(cells) + " |")
    return caption + "\n\n" + "\n".join(lines)


def _print_table(rows: list[tuple[Layout, dict[str, PlanReport | None]]], caption: str) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, caption=caption)
    table.add_column("model", overflow="fold")
    table.add_column("max len", justify="right")
    for policy in POLICIES:
        table.add_column(policy, justify="right")
    for layout, reports in rows:
        best = _best(reports)
        table.add_row(
            layout.name,
            f"{layout.max_model_len:,}",
            *(
                f"[bold]{_cell(reports[p])} ★[/bold]" if p == best else _cell(reports[p])
                for p in POLICIES
            ),
        )
    Console(highlight=False).print(table)
