"""``hybridkv plan`` and ``hybridkv models``: a real model's KV cache plan, and the catalogue."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hybridkv.cli.options import (
    KV_DTYPES,
    SSM_DTYPES,
    MemorySize,
    ModelChoice,
    UserError,
    default_max_model_len,
    resolve_model,
    ssm_dtype_bytes,
)

if TYPE_CHECKING:
    from hybridkv.catalogue import ModelLayers
    from hybridkv.reference.plan_report import GroupPlan, PlanReport
    from hybridkv.spec import KVCacheSpec

_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True)
class PlanSettings:
    """The knobs of a plan, as the user gave them (or their defaults)."""

    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    kv_dtype: str
    mamba_ssm_dtype: str


@dataclass(frozen=True)
class Plan:
    """A model's plan: the choice, the settings, the planner's layers and report, and caveats."""

    choice: ModelChoice
    settings: PlanSettings
    layers: ModelLayers
    report: PlanReport

    @property
    def notes(self) -> tuple[str, ...]:
        unconfirmed = tuple(f"unconfirmed: {item}" for item in self.choice.unconfirmed)
        return self.layers.notes + unconfirmed


def make_plan(choice: ModelChoice, settings: PlanSettings) -> Plan:
    """Map the model to layer specs and plan them; ``UserError`` for what cannot be planned."""
    from hybridkv.catalogue import DTYPE_BYTES, ModelError, model_layers
    from hybridkv.reference.plan_report import plan_report

    try:
        layers = model_layers(
            choice.facts,
            block_size=settings.block_size,
            kv_dtype_bytes=DTYPE_BYTES[settings.kv_dtype],
            ssm_dtype_bytes=ssm_dtype_bytes(settings.mamba_ssm_dtype),
        )
    except ModelError as error:
        raise UserError(f"cannot plan {choice.name}: {error}") from None
    try:
        report = plan_report(
            layers.layers,
            settings.memory_bytes,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_sharing=layers.kv_sharing,
        )
    except ValueError as error:
        raise UserError(f"cannot plan {choice.name}: {error}") from None
    return Plan(choice, settings, layers, report)


def model_options(*, max_num_batched_tokens: int) -> Callable[[_F], _F]:
    """The options of every command that plans a model (memory and lengths have their own)."""
    options = (
        click.option(
            "--max-num-batched-tokens",
            type=click.IntRange(min=1),
            default=max_num_batched_tokens,
            show_default=True,
            help="Tokens one scheduler step computes at most.",
        ),
        click.option("--block-size", type=click.IntRange(min=1), default=16, show_default=True),
        click.option(
            "--kv-dtype",
            type=click.Choice(KV_DTYPES),
            default="bf16",
            show_default=True,
            help="Element type of the attention KV cache.",
        ),
        click.option(
            "--mamba-ssm-dtype",
            type=click.Choice(SSM_DTYPES),
            default="auto",
            show_default=True,
            help="SSM state dtype of recurrent layers (auto: the model's; conv state: bf16).",
        ),
    )

    def decorate(command: _F) -> _F:
        for option in reversed(options):
            command = option(command)
        return command

    return decorate


@click.command()
@click.argument("model", required=False, metavar="[MODEL | CONFIG.json]")
@click.option(
    "--memory",
    type=MemorySize(),
    default="40GiB",
    show_default=True,
    help="Memory for the KV cache: 40GiB, 80GB, 512MiB or bytes.",
)
@click.option(
    "--max-model-len",
    type=click.IntRange(min=1),
    default=None,
    help="Longest request in tokens  [default: the model's context length]",
)
@model_options(max_num_batched_tokens=8192)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
)
@click.option(
    "--svg",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="Also write the memory layout as an SVG image.",
)
def plan(
    model: str | None,
    memory: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    block_size: int,
    kv_dtype: str,
    mamba_ssm_dtype: str,
    output_format: str,
    svg: str | None,
) -> None:
    """Plan the KV cache of MODEL (a catalogue name or a config.json; default gemma-3-27b-it).

    Prints the layer types, the KV cache groups and their padding, the page size, the tensors
    and the layers sharing each, the blocks, how many requests and tokens fit, the memory saved
    against a full-attention-only manager, and a picture of the memory layout.
    """
    choice = resolve_model(model)
    settings = PlanSettings(
        memory_bytes=memory,
        max_model_len=max_model_len or default_max_model_len(choice),
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_dtype=kv_dtype,
        mamba_ssm_dtype=mamba_ssm_dtype,
    )
    result = make_plan(choice, settings)
    if svg is not None:
        _write_svg(result, svg)
    if output_format == "json":
        click.echo(json.dumps(plan_json(result), indent=2))
        return
    from hybridkv.cli.render import render_plan

    render_plan(result, svg_path=svg)


def _write_svg(result: Plan, path: str) -> None:
    """The memory layout as an SVG file; ``UserError`` if the file cannot be written."""
    from hybridkv.layout_svg import layout_svg

    try:
        with open(path, "w", encoding="utf-8") as file:
            file.write(layout_svg(result.report, title=result.choice.name))
    except OSError as error:
        raise UserError(f"cannot write {path}: {error.strerror}") from None


# --- JSON -------------------------------------------------------------------------------------


def plan_json(result: Plan) -> dict[str, Any]:
    """The plan as one JSON object with stable keys (sizes in bytes, lengths in tokens)."""
    report, settings = result.report, result.settings
    return {
        "model": result.choice.name,
        "source": result.choice.source,
        "status": result.choice.status,
        "settings": {
            "memory_bytes": settings.memory_bytes,
            "max_model_len": settings.max_model_len,
            "max_num_batched_tokens": settings.max_num_batched_tokens,
            "block_size": settings.block_size,
            "kv_dtype": settings.kv_dtype,
            "mamba_ssm_dtype": settings.mamba_ssm_dtype,
        },
        "layer_types": layer_type_counts(result.choice.facts.layer_kinds),
        "num_layers": len(result.layers.layers),
        "kv_sharing": dict(result.layers.kv_sharing),
        "groups": [_group_json(group) for group in report.groups],
        "layers_per_group": report.layers_per_group,
        "block_size": report.block_size,
        "layer_page_size_bytes": report.layer_page_size_bytes,
        "page_size_bytes": report.page_size_bytes,
        "num_blocks": report.num_blocks,
        "num_padding_slots": report.num_padding_slots,
        "padding_fraction": report.padding_fraction,
        "tensors": [
            {"index": i, "size_bytes": tensor.size, "shared_by": list(tensor.shared_by)}
            for i, tensor in enumerate(report.config.tensors)
        ],
        "memory_bytes": report.memory_bytes,
        "blocks_per_request": report.blocks_per_request,
        "bytes_per_request": report.bytes_per_request,
        "max_num_requests": report.max_num_requests,
        "max_tokens": report.max_tokens,
        "full_attention_only": {
            "bytes_per_token": report.full_attention_bytes_per_token,
            "bytes_per_request": report.full_attention_bytes_per_request,
            "memory_bytes": report.full_attention_memory_bytes,
            "max_num_requests": report.full_attention_max_num_requests,
            "memory_saved_bytes": report.memory_saved_bytes,
        },
        "notes": list(result.notes),
    }


def _group_json(group: GroupPlan) -> dict[str, Any]:
    """One ``GroupPlan`` as JSON."""
    return {
        "group_id": group.group_id,
        "kind": group.kind,
        "spec": spec_json(group.spec),
        "layer_names": list(group.layer_names),
        "num_own_layers": group.num_own_layers,
        "num_kv_sharing_layers": group.num_kv_sharing_layers,
        "num_padding_slots": group.num_padding_slots,
        "max_blocks_per_request": group.max_blocks_per_request,
    }


def spec_json(spec: KVCacheSpec) -> dict[str, Any]:
    """A layer spec's fields, its class name and its page size."""
    from dataclasses import asdict

    return {"type": type(spec).__name__, **asdict(spec), "page_size_bytes": spec.page_size_bytes}


def layer_type_counts(kinds: tuple[str, ...]) -> dict[str, int]:
    """How many decoder layers of each kind, in order of first appearance."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return counts


# --- models -----------------------------------------------------------------------------------


@click.command()
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json"]),
    default="table",
    show_default=True,
)
def models(output_format: str) -> None:
    """List the embedded catalogue: the models `plan` and `simulate` know by name."""
    from hybridkv.catalogue import load_catalogue

    entries = load_catalogue()
    if output_format == "json":
        rows = [
            {
                "model_id": entry.model_id,
                "family": entry.family,
                "status": entry.status,
                "layer_types": layer_type_counts(entry.facts.layer_kinds),
                "source": entry.source,
            }
            for entry in entries
        ]
        click.echo(json.dumps(rows, indent=2))
        return
    from hybridkv.cli.render import render_models

    render_models(entries)
