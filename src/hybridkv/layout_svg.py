"""The memory layout of a plan as an SVG image, like the design document's figure.

One row per KV cache tensor (buffer), one column per KV cache group. A cell is the slice of a
tensor that a group's layer uses, labelled with that layer and coloured by attention type;
padding slots are hatched grey. With pipeline stages each stage (GPU) has its own tensors: a
band labelled with the stage spans its rows. Plain SVG 1.1 text, no dependencies, so it opens
in a browser.
"""

from __future__ import annotations

from xml.sax.saxutils import escape

from hybridkv.reference.plan_report import PlanReport

KIND_COLOURS = {
    "full": "#4c78a8",
    "sliding_window": "#54a24b",
    "chunked_local": "#b279a2",
    "mamba": "#eeca3b",
}
KIND_LABELS = {
    "full": "full attention",
    "sliding_window": "sliding window",
    "chunked_local": "chunked local",
    "mamba": "mamba",
}
_CELL_W, _CELL_H, _LEFT, _TOP, _GAP = 104, 24, 200, 96, 4


def layout_svg(report: PlanReport, *, title: str) -> str:
    """The SVG document (a string) of ``report``'s tensors × groups."""
    num_tensors, num_groups = len(report.config.tensors), len(report.groups)
    width = max(_LEFT + num_groups * (_CELL_W + _GAP) + 24, 720)
    height = _TOP + num_tensors * (_CELL_H + _GAP) + 96
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        _defs(),
        f'<rect width="{width}" height="{height}" fill="white"/>',
        _text(16, 24, f"{title}: memory layout", size=16, weight="bold"),
        _text(16, 44, _subtitle(report), size=12, fill="#555"),
    ]
    parts += _group_headers(report)
    for row in range(num_tensors):
        parts += _tensor_row(report, row)
    parts += _legend(report, 16, _TOP + num_tensors * (_CELL_H + _GAP) + 24)
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _subtitle(report: PlanReport) -> str:
    """Blocks, page size and what a block is."""
    stages = report.pipeline_parallel_size
    per_stage = " + ".join(str(report.tensor_stages.count(s)) for s in range(stages))
    where = f" ({per_stage} on {stages} GPUs, a pipeline stage each)" if stages > 1 else ""
    return (
        f"{len(report.config.tensors)} tensors{where} × {report.num_blocks:,} blocks of "
        f"{report.layer_page_size_bytes:,} B; block b = slice b of every tensor "
        f"({report.page_size_bytes:,} B); {report.num_padding_slots} padding slots"
    )


def _group_headers(report: PlanReport) -> list[str]:
    """One label above each group's column."""
    parts = []
    for group in report.groups:
        x, colour = _column_x(group.group_id) + _CELL_W / 2, KIND_COLOURS[group.kind]
        parts.append(_text(x, _TOP - 24, f"group {group.group_id}", anchor="middle", weight="bold"))
        parts.append(_text(x, _TOP - 8, KIND_LABELS[group.kind], anchor="middle", fill=colour))
    return parts


def _tensor_row(report: PlanReport, row: int) -> list[str]:
    """Tensor ``row``: its label and size, then one cell per group (a layer or padding)."""
    y = _TOP + row * (_CELL_H + _GAP)
    tensor = report.config.tensors[row]
    parts = _stage_band(report, row, y)
    parts.append(_text(48, y + 16, f"KVCacheTensor {row} ({tensor.size / 2**30:.2f} GiB)"))
    for group in report.groups:
        x = _column_x(group.group_id)
        own = group.layer_names[: group.num_own_layers]
        layer = next((name for name in tensor.shared_by if name in own), None)
        if layer is not None:
            colour = KIND_COLOURS[group.kind]
            parts.append(_rect(x, y, colour))
            parts.append(_text(x + _CELL_W / 2, y + 16, layer, anchor="middle", fill="white"))
        else:
            parts.append(_rect(x, y, "url(#padding)"))
            parts.append(_text(x + _CELL_W / 2, y + 16, "padding", size=11, anchor="middle"))
    return parts


def _stage_band(report: PlanReport, row: int, y: float) -> list[str]:
    """At a stage's first tensor, a band over its rows labelled with the stage (GPU)."""
    stages = report.tensor_stages
    if report.pipeline_parallel_size == 1 or (row > 0 and stages[row - 1] == stages[row]):
        return []
    rows = stages.count(stages[row])
    height = rows * (_CELL_H + _GAP) - _GAP
    return [
        f'<rect x="8" y="{y}" width="32" height="{height}" rx="3" fill="#f2f2f2" '
        'stroke="#999" stroke-width="0.5"/>',
        _text(24, y + height / 2 + 4, f"GPU {stages[row]}", size=10, anchor="middle"),
    ]


def _legend(report: PlanReport, x: float, y: float) -> list[str]:
    """A swatch per attention type present, and one for padding."""
    kinds = list(dict.fromkeys(group.kind for group in report.groups))
    parts = []
    for i, kind in enumerate([*kinds, "padding"]):
        fill = "url(#padding)" if kind == "padding" else KIND_COLOURS[kind]
        parts.append(
            f'<rect x="{x + i * 140}" y="{y}" width="16" height="16" fill="{fill}" stroke="#333"/>'
        )
        parts.append(_text(x + i * 140 + 22, y + 13, KIND_LABELS.get(kind, kind)))
    return parts


def _defs() -> str:
    """The hatch pattern of padding slots."""
    return (
        '<defs><pattern id="padding" width="8" height="8" patternUnits="userSpaceOnUse" '
        'patternTransform="rotate(45)"><rect width="8" height="8" fill="#eee"/>'
        '<line x1="0" y1="0" x2="0" y2="8" stroke="#bbb" stroke-width="3"/></pattern></defs>'
    )


def _column_x(group_id: int) -> float:
    return _LEFT + group_id * (_CELL_W + _GAP)


def _rect(x: float, y: float, fill: str) -> str:
    return (
        f'<rect x="{x}" y="{y}" width="{_CELL_W}" height="{_CELL_H}" rx="3" '
        f'fill="{fill}" stroke="#333" stroke-width="0.5"/>'
    )


def _text(
    x: float,
    y: float,
    content: str,
    *,
    size: int = 12,
    anchor: str = "start",
    fill: str = "#222",
    weight: str = "normal",
) -> str:
    return (
        f'<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" fill="{fill}" '
        f'font-weight="{weight}">{escape(content)}</text>'
    )
