"""The plan's memory summary: page size, tensors, blocks, what fits, and the full-attention
comparison, every figure per GPU (with pipeline stages each GPU holds its stage's layers)."""

from __future__ import annotations

from rich import box
from rich.table import Table
from rich.text import Text

from hybridkv.cli.options import format_bytes
from hybridkv.cli.plan_data import Plan


def summary_table(plan: Plan) -> Table:
    """Page size, tensors, blocks, requests and tokens that fit, and the saving."""
    report, settings = plan.report, plan.settings
    table = Table(box=box.SIMPLE, show_header=False, title="Memory", title_justify="left")
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    raised = report.block_size != settings.block_size
    table.add_row(
        "block size",
        f"{report.block_size} tokens"
        + (f" (raised from {settings.block_size} so a page holds a Mamba state)" if raised else ""),
    )
    table.add_row(
        "page size",
        f"{format_bytes(report.layer_page_size_bytes)} per layer · "
        f"{format_bytes(report.page_size_bytes)} per block "
        f"({report.layers_per_group} layers × {report.layer_page_size_bytes:,} B)",
    )
    table.add_row("tensors", _tensors_line(plan))
    table.add_row("blocks", f"{report.num_blocks:,} (the null block included)")
    table.add_row(
        "padding",
        f"{report.num_padding_slots} slots = {report.padding_fraction:.1%} of the pool",
    )
    table.add_row(
        "one request",
        f"{report.blocks_per_request:,} blocks = {format_bytes(report.bytes_per_request)}"
        f"{_per_gpu(plan)} at {report.max_model_len:,} tokens",
    )
    table.add_row("fits", _fits_line(plan))
    table.add_row("vLLM logs", plan.vllm_log_line)
    table.add_row("full attention only", _full_attention_line(plan))
    table.add_row(
        "memory used",
        f"{format_bytes(report.memory_bytes)} of {format_bytes(settings.memory_bytes)}"
        f"{_per_gpu(plan)}",
    )
    return table


def _per_gpu(plan: Plan) -> str:
    """`` per GPU`` with pipeline stages (each GPU holds one stage), else nothing."""
    return " per GPU" if plan.report.pipeline_parallel_size > 1 else ""


def _tensors_line(plan: Plan) -> str:
    """The tensors, counted per GPU (stage) when there are pipeline stages."""
    report = plan.report
    size = format_bytes(report.config.tensors[0].size)
    shared = f"each shared by one layer of each group (up to {len(report.groups)})"
    if report.pipeline_parallel_size == 1:
        return f"{len(report.config.tensors)} × {size}, {shared}"
    per_stage = [report.tensor_stages.count(s) for s in range(report.pipeline_parallel_size)]
    return (
        f"{max(per_stage)} per GPU × {size} ({len(report.tensor_stages)} over "
        f"{report.pipeline_parallel_size} stages: {' + '.join(map(str, per_stage))}), {shared}"
    )


def _fits_line(plan: Plan) -> Text:
    """Requests that fit, vLLM's maximum concurrency, and the longest length that fits."""
    report = plan.report
    text = Text(
        f"{report.max_num_requests:,} requests at once = {report.max_tokens:,} tokens "
        f"(maximum concurrency {report.max_concurrency:.2f}x at {report.max_model_len:,} tokens)"
    )
    if report.max_num_requests == 0:
        if report.max_fitting_model_len == 0:
            text.append("; not even one token fits: add --memory", "red")
        else:
            text.append(
                f"; the longest max_model_len that fits one request is "
                f"{report.max_fitting_model_len:,} (vLLM's auto-fit)",
                "red",
            )
    return text


def _full_attention_line(plan: Plan) -> Text:
    """What a non-hybrid manager (every attention layer keeps every token) would need."""
    report = plan.report
    text = Text(
        f"{format_bytes(report.full_attention_bytes_per_request)} per request{_per_gpu(plan)} "
        f"(hybrid: {format_bytes(report.bytes_per_request)}); "
        f"{report.full_attention_max_num_requests:,} fit in this memory. "
    )
    if report.max_num_requests == 0:
        text.append(
            f"No request of max_model_len fits: use --max-model-len "
            f"{report.max_fitting_model_len:,} or less, or add --memory",
            "red",
        )
        return text
    saved = report.memory_saved_bytes
    if saved == 0:
        text.append("The hybrid manager needs the same: every layer keeps every token or a state")
        return text
    share = saved / report.full_attention_memory_bytes
    text.append(
        f"For {report.max_num_requests:,} requests the hybrid manager needs "
        f"{format_bytes(abs(saved))} ({abs(share):.0%}) {'less' if saved >= 0 else 'more'}",
        "green" if saved > 0 else "red",
    )
    return text
