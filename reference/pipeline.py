"""Pipeline stages: which GPU holds which layer when a model is split over ``pp`` stages.

With pipeline parallelism every stage allocates its own tensors for its own layers, while one
scheduler hands out block ids for all of them: a KV cache group keeps its id on every stage,
and a stage's block costs as many pages as the group with the most layers *on that stage*.
vLLM splits the decoder layers evenly over the stages, the remainder to the stages before the
last (``rules.pipeline_stage_sizes``).
"""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.spec import rules
from hybridkv.spec.errors import check_positive


def layer_stages(
    layers: Mapping[str, object],
    pipeline_parallel_size: int,
    stages: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """The stage of every layer: ``stages`` when given (checked), else the layers in model
    order split by vLLM's rule. ``ValueError`` names the field and the value."""
    check_positive("pipeline_parallel_size", pipeline_parallel_size)
    if stages is not None:
        return _checked_stages(layers, pipeline_parallel_size, stages)
    if pipeline_parallel_size > len(layers):
        raise ValueError(
            f"pipeline_parallel_size must be at most the number of layers ({len(layers)}), "
            f"got {pipeline_parallel_size!r}"
        )
    sizes = rules.pipeline_stage_sizes(len(layers), pipeline_parallel_size)
    stage_of = [stage for stage, size in enumerate(sizes) for _ in range(size)]
    return dict(zip(layers, stage_of, strict=True))


def _checked_stages(
    layers: Mapping[str, object], pipeline_parallel_size: int, stages: Mapping[str, int]
) -> dict[str, int]:
    """Every layer has a stage in ``0 … pp − 1`` and every stage has a layer."""
    for name in layers:
        stage = stages.get(name)
        if not isinstance(stage, int) or isinstance(stage, bool):
            raise ValueError(f"layer_stages[{name!r}] must be an int stage, got {stage!r}")
        if not 0 <= stage < pipeline_parallel_size:
            raise ValueError(
                f"layer_stages[{name!r}] must be in 0 … {pipeline_parallel_size - 1} "
                f"(pipeline_parallel_size={pipeline_parallel_size}), got {stage!r}"
            )
    empty = sorted(set(range(pipeline_parallel_size)) - {stages[name] for name in layers})
    if empty:
        raise ValueError(f"layer_stages must give every stage a layer, stage {empty[0]} has none")
    return {name: stages[name] for name in layers}
