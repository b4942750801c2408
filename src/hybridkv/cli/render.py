"""The terminal view of a plan and of the catalogue, drawn with rich.

The memory layout picture follows the design document's figure ("Memory Layout"): one row per
KV cache tensor, one column per KV cache group; the cell names the layer whose KV that group
keeps in that tensor, and a block is one slice of every tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from hybridkv.cli.options import format_bytes
from hybridkv.cli.plan_data import POLICIES, Plan, layer_type_counts
from hybridkv.cli.render_memory import summary_table
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    spec_kind,
)

if TYPE_CHECKING:
    from hybridkv.catalogue import CatalogueEntry

KIND_STYLES = {
    "full": "blue",
    "sliding_window": "green",
    "chunked_local": "magenta",
    "mamba": "yellow",
}
KIND_LABELS = {
    "full": "full",
    "sliding_window": "sliding",
    "chunked_local": "chunked",
    "mamba": "mamba",
}
_LAYER_NAME = re.compile(r"layers\.(\d+)(\.\w+)?")
_MAX_ROWS = 16


def render_plan(plan: Plan, *, svg_path: str | None = None, console: Console | None = None) -> None:
    """Print every part of the plan, the layout picture last but one, the caveats last."""
    out = console or Console(highlight=False)
    out.print(_header(plan))
    out.print(_policy_table(plan))
    out.print(_layer_table(plan))
    out.print(_group_table(plan))
    out.print(summary_table(plan))
    out.print(_layout_title(plan))
    out.print(_layout_table(plan))
    out.print(_layout_caption(plan))
    if svg_path is not None:
        out.print(f"layout written to [bold]{svg_path}[/bold]")
    for note in plan.notes:
        out.print(Text(f"note: {note}", style="dim"))


def _header(plan: Plan) -> Text:
    """Model, status, source and the settings the plan assumed."""
    settings = plan.settings
    text = Text()
    text.append(plan.choice.name, style="bold")
    text.append(f"  ({plan.choice.status})\n", style="dim")
    text.append(f"source: {plan.choice.source}\n", style="dim")
    counts = layer_type_counts(plan.choice.facts.layer_kinds)
    text.append("layer types: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + "\n")
    text.append(
        f"{format_bytes(settings.memory_bytes)} for KV cache · {settings.kv_dtype} KV · "
        f"{_ssm_dtype(plan)}block size {settings.block_size} · "
        f"max_model_len {settings.max_model_len:,} · "
        f"{settings.max_num_batched_tokens:,} batched tokens per step\n"
    )
    text.append(
        f"engine: async scheduling {_on(settings.async_scheduling)} · prefix caching "
        f"{_on(settings.enable_prefix_caching)} · {settings.pipeline_parallel_size} pipeline "
        f"stage{'s' if settings.pipeline_parallel_size > 1 else ''} · "
        f"{plan.report.max_in_flight_tokens:,} tokens in flight · policy {settings.policy}"
    )
    return text


def _ssm_dtype(plan: Plan) -> str:
    """``SSM state float32 (auto) · `` for a model with recurrent layers: which dtype ``auto``
    chose, as vLLM's ``mamba_ssm_cache_dtype="auto"`` does for the model."""
    if plan.ssm_dtype is None:
        return ""
    how = " (auto)" if plan.settings.mamba_ssm_dtype == "auto" else ""
    return f"SSM state {plan.ssm_dtype}{how} · "


def _on(flag: bool) -> str:
    return "on" if flag else "off"


def _policy_table(plan: Plan) -> Table:
    """The three grouping policies side by side; ★ marks the most requests that fit."""
    table = Table(
        title="Grouping policies (★ fits the most requests; width: layer slots per group)",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    table.add_column("policy", no_wrap=True)
    for column in ("groups", "width", "padding", "blocks", "requests", "concurrency"):
        table.add_column(column, justify="right", no_wrap=True)
    best = plan.best_policy
    for policy in POLICIES:
        report = plan.by_policy[policy]
        mark = policy + (" ★" if policy == best else "")
        label = Text(mark, style="bold" if policy == plan.settings.policy else "")
        if isinstance(report, str):
            table.add_row(label, Text(report, style="red"), "", "", "", "", "")
            continue
        table.add_row(
            label,
            str(len(report.groups)),
            str(report.layers_per_group),
            str(report.num_padding_slots),
            f"{report.num_blocks:,}",
            f"{report.max_num_requests:,}",
            f"{report.max_concurrency:.2f}x",
        )
    return table


def _layer_table(plan: Plan) -> Table:
    """One row per distinct layer spec: which layers have it and what each of them keeps."""
    table = Table(title="Layers", box=box.SIMPLE_HEAD, title_justify="left")
    for column in ("type", "count", "layers", "each layer keeps"):
        table.add_column(column, overflow="fold")
    by_spec: dict[KVCacheSpec, list[str]] = {}
    for name, spec in plan.layers.layers.items():
        if name not in plan.layers.kv_sharing:
            by_spec.setdefault(spec, []).append(name)
    for spec, names in by_spec.items():
        kind = spec_kind(spec)
        table.add_row(
            Text(KIND_LABELS[kind], style=KIND_STYLES[kind]),
            str(len(names)),
            describe_layers(names),
            describe_spec(spec),
        )
    if plan.layers.kv_sharing:
        readers = list(plan.layers.kv_sharing)
        table.add_row(
            "KV reader",
            str(len(readers)),
            describe_layers(readers),
            "nothing: reads another layer's KV",
        )
    return table


def _group_table(plan: Plan) -> Table:
    """The KV cache groups: their layers, padding and blocks per request."""
    report = plan.report
    table = Table(
        title=f"KV cache groups: {len(report.groups)} × {report.layers_per_group} layer slots",
        box=box.SIMPLE_HEAD,
        title_justify="left",
    )
    for column in ("group", "type", "layers", "own", "padding", "max blocks / request"):
        table.add_column(column, overflow="fold")
    for group in report.groups:
        own = group.layer_names[: group.num_own_layers]
        layers = describe_layers(own)
        if group.num_kv_sharing_layers:
            layers += f" (+ readers {describe_layers(group.layer_names[group.num_own_layers :])})"
        table.add_row(
            str(group.group_id),
            Text(KIND_LABELS[group.kind], style=KIND_STYLES[group.kind]),
            layers,
            str(group.num_own_layers),
            Text(str(group.num_padding_slots), style="red" if group.num_padding_slots else ""),
            f"{group.max_blocks_per_request:,}",
        )
    return table


def _layout_title(plan: Plan) -> Text:
    report = plan.report
    stages = report.pipeline_parallel_size
    where = f" over {stages} pipeline stages (one GPU each)" if stages > 1 else ""
    return Text(
        f"Memory layout: {len(report.config.tensors)} tensors{where} × {len(report.groups)} groups",
        style="italic",
    )


def _layout_caption(plan: Plan) -> Text:
    report = plan.report
    return Text(
        f"each tensor: {report.num_blocks:,} blocks × "
        f"{format_bytes(report.layer_page_size_bytes)}; block b = slice b of every tensor",
        style="dim",
    )


def _layout_table(plan: Plan) -> Table:
    """The document's figure: tensors (rows) × groups (columns), layer names in the cells.

    With pipeline stages every stage has its own tensors, listed stage by stage.
    """
    report = plan.report
    table = Table(box=box.SQUARE)
    staged = report.pipeline_parallel_size > 1
    if staged:
        table.add_column("stage", style="dim", justify="right")
    table.add_column("tensor", style="dim", justify="right")
    for group in report.groups:
        label = f"G{group.group_id} {KIND_LABELS[group.kind]}"
        table.add_column(Text(label, style=KIND_STYLES[group.kind]), justify="center")
    own = [set(group.layer_names[: group.num_own_layers]) for group in report.groups]
    tensors = report.config.tensors
    for row in _visible_rows(len(tensors)):
        if row is None:
            table.add_row(*(["⋮"] if staged else []), "⋮", *("⋮" for _ in own))
            continue
        cells = [
            _layout_cell(tensors[row].shared_by, names, group.kind)
            for group, names in zip(report.groups, own, strict=True)
        ]
        stage = [str(report.tensor_stages[row])] if staged else []
        table.add_row(*stage, str(row), *cells)
    return table


def _layout_cell(shared_by: tuple[str, ...], own: set[str], kind: str) -> Text:
    """The group's layer in this tensor, or ``pad`` when the group leaves its slice unused."""
    for name in shared_by:
        if name in own:
            return Text(short_name(name), style=KIND_STYLES[kind])
    return Text("pad", style="red dim")


def _visible_rows(num_rows: int) -> Sequence[int | None]:
    """All rows of a small layout; the first and last rows of a tall one (``None``: elided)."""
    if num_rows <= _MAX_ROWS:
        return list(range(num_rows))
    return [*range(10), None, *range(num_rows - 4, num_rows)]


# --- Describing layers and specs --------------------------------------------------------------


def short_name(name: str) -> str:
    """``layers.12`` → ``L12``; ``layers.3.mamba`` → ``L3.mamba``; other names unchanged."""
    match = _LAYER_NAME.fullmatch(name)
    return f"L{match.group(1)}{match.group(2) or ''}" if match else name


def describe_layers(names: Iterable[str]) -> str:
    """Layer names as index ranges: ``layers 0–4, 6–10, 12`` (names kept if not ``layers.i``)."""
    names = list(names)
    matches = [_LAYER_NAME.fullmatch(name) for name in names]
    if not names or any(match is None for match in matches):
        return ", ".join(names)
    suffixes = {match.group(2) or "" for match in matches if match}
    indices = [int(match.group(1)) for match in matches if match]
    suffix = f" ({', '.join(sorted(s.lstrip('.') for s in suffixes))})" if suffixes != {""} else ""
    return "layers " + ", ".join(_ranges(indices)) + suffix


def _ranges(indices: list[int]) -> list[str]:
    """Consecutive runs of indices: [0, 1, 2, 4] → ["0–2", "4"]."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return [f"{run[0]}–{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs]


def describe_spec(spec: KVCacheSpec) -> str:
    """What one layer of ``spec`` keeps: bytes per token and which tokens, or its state."""
    if isinstance(spec, MambaSpec):
        return f"a {format_bytes(spec.state_bytes)} state per request ({spec.state_bytes:,} B)"
    shape = f"{spec.num_kv_heads} KV heads × {spec.head_size} × {spec.dtype_bytes} B"
    per_token = f"{format_bytes(spec.kv_hidden_size)}/token ({shape})"
    if isinstance(spec, SlidingWindowSpec):
        return f"{per_token}, last {spec.sliding_window:,} tokens"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"{per_token}, current {spec.attention_chunk_size:,}-token chunk"
    return f"{per_token}, every token"


# --- models -----------------------------------------------------------------------------------


_SHORT_KINDS = {
    "full_attention": "full",
    "sliding_attention": "sliding",
    "chunked_attention": "chunked",
    "full_attention_mla": "MLA",
    "mamba": "mamba1",
    "linear_attention_gdn": "deltanet",
    "linear_attention_lightning": "lightning",
    "hybrid_parallel_attention_mamba2": "attn+mamba2",
    "mlp_only": "mlp",
}


def render_models(entries: Sequence[CatalogueEntry], console: Console | None = None) -> None:
    """The catalogue as a table: id, layer types, how sure the numbers are."""
    table = Table(title=f"{len(entries)} models", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("model", no_wrap=True)
    table.add_column("layers", overflow="fold")
    table.add_column("status", no_wrap=True)
    for entry in entries:
        counts = layer_type_counts(entry.facts.layer_kinds)
        table.add_row(
            entry.model_id,
            ", ".join(f"{n} {_SHORT_KINDS.get(kind, kind)}" for kind, n in counts.items()),
            entry.status.replace("_", " "),
        )
    (console or Console(highlight=False)).print(table)
