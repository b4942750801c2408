"""``hybridkv plan`` and ``hybridkv models``: a real model's KV cache plan, and the catalogue."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hybridkv.cli.options import (
    ASSUME_FULL_ATTENTION_HELP,
    KV_DTYPES,
    SSM_DTYPES,
    MemorySize,
    TokenCount,
    UserError,
    check_block_size,
    default_max_model_len,
    resolve_model,
    with_max_model_len_note,
)
from hybridkv.cli.plan_data import (
    POLICIES,
    Plan,
    PlanSettings,
    layer_type_counts,
    make_plan,
    plan_json,
)

if TYPE_CHECKING:
    from hybridkv.reference.grouping import GroupingPolicy

_F = TypeVar("_F", bound=Callable[..., Any])


def model_options(*, max_num_batched_tokens: int) -> Callable[[_F], _F]:
    """The options of every command that plans a model (memory and lengths have their own)."""
    options = (
        click.option(
            "--max-num-batched-tokens",
            type=TokenCount(),
            default=max_num_batched_tokens,
            show_default=True,
            help="Tokens one scheduler step computes at most.",
        ),
        click.option(
            "--block-size",
            type=click.IntRange(min=1),
            default=16,
            show_default=True,
            callback=check_block_size,
            help="Tokens per block: a multiple of 16, as vLLM's GPU attention kernels take.",
        ),
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


def engine_options(command: _F) -> _F:
    """The engine settings the request bounds assume: vLLM 0.33's defaults on GPUs."""
    options = (
        click.option(
            "--async-scheduling/--no-async-scheduling",
            default=True,
            show_default=True,
            help="Schedule a step before the last one settles: sliding-window and chunked "
            "groups hold blocks for one more step in flight.",
        ),
        click.option(
            "--prefix-caching/--no-prefix-caching",
            default=True,
            show_default=True,
            help="With prefix caching a Mamba group holds two state blocks per request.",
        ),
        click.option(
            "--pp",
            "pipeline_parallel_size",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help="Pipeline stages: each GPU holds its stage's layers in --memory.",
        ),
    )
    for option in reversed(options):
        command = option(command)
    return command


@click.command()
@click.argument("model", required=False, metavar="[MODEL | CONFIG.json | SNAPSHOT DIR]")
@click.option(
    "--memory",
    type=MemorySize(),
    default="40GiB",
    show_default=True,
    help="KV cache memory per GPU: 40GiB, 40Gi, 40G, 512M, 4.2e10 or bytes.",
)
@click.option(
    "--max-model-len",
    type=TokenCount(),
    default=None,
    help="Longest request in tokens  [default: the model's context length]",
)
@model_options(max_num_batched_tokens=8192)
@engine_options
@click.option(
    "--policy",
    type=click.Choice(POLICIES),
    default="vllm",
    show_default=True,
    help="Grouping policy of the detailed plan (all three are compared).",
)
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
@click.option("--assume-full-attention", is_flag=True, help=ASSUME_FULL_ATTENTION_HELP)
def plan(
    model: str | None,
    memory: int,
    max_model_len: int | None,
    max_num_batched_tokens: int,
    block_size: int,
    kv_dtype: str,
    mamba_ssm_dtype: str,
    async_scheduling: bool,
    prefix_caching: bool,
    pipeline_parallel_size: int,
    policy: GroupingPolicy,
    output_format: str,
    svg: str | None,
    assume_full_attention: bool,
) -> None:
    """Plan the KV cache of MODEL (a catalogue name or Hub id, a config.json, or a Hugging
    Face snapshot directory; default gemma-3-27b-it).

    Compares the three grouping policies (the design document's, vLLM 0.33's, the fewest
    padded slots), then prints the chosen one: layer types, KV cache groups and their padding,
    page size, tensors, blocks, how many requests and tokens fit under the engine settings,
    the longest max_model_len that fits, the memory saved against a full-attention-only
    manager, and a picture of the memory layout.
    """
    choice = with_max_model_len_note(
        resolve_model(model, assume_full_attention=assume_full_attention), max_model_len
    )
    settings = PlanSettings(
        memory_bytes=memory,
        max_model_len=max_model_len or default_max_model_len(choice),
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        kv_dtype=kv_dtype,
        mamba_ssm_dtype=mamba_ssm_dtype,
        policy=policy,
        pipeline_parallel_size=pipeline_parallel_size,
        async_scheduling=async_scheduling,
        enable_prefix_caching=prefix_caching,
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
