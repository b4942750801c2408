"""The planning data the commands share: settings, a model's plan under every policy, its JSON.

``plan_cmd`` (the ``plan`` command) and ``render`` (the terminal view) both depend on this
module, and it on neither: the data does not know how it is shown.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.cli.options import ModelChoice, UserError, ssm_dtype_bytes

if TYPE_CHECKING:
    from hybridkv.model_layers import ModelLayers
    from hybridkv.reference.grouping import GroupingPolicy
    from hybridkv.reference.plan_report import GroupPlan, PlanReport
    from hybridkv.spec import KVCacheSpec

POLICIES: tuple[GroupingPolicy, ...] = ("document", "vllm", "min-padding")
"""The grouping policies, in the order the comparison shows them."""

_SSM_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class PlanSettings:
    """The knobs of a plan, as the user gave them (or their defaults).

    The engine settings default to the library's (one step in flight, no prefix caching, one
    stage); the commands pass vLLM 0.33's defaults on GPUs.
    """

    memory_bytes: int
    max_model_len: int
    max_num_batched_tokens: int
    block_size: int
    kv_dtype: str
    mamba_ssm_dtype: str
    policy: GroupingPolicy = "document"
    pipeline_parallel_size: int = 1
    async_scheduling: bool = False
    enable_prefix_caching: bool = False


@dataclass(frozen=True)
class Plan:
    """A model's plan: the choice, the settings, the planner's layers and report, and caveats.

    ``report`` follows ``settings.policy``; ``by_policy`` holds every policy's report, or the
    reason it cannot plan (memory too small for one of its blocks).
    """

    choice: ModelChoice
    settings: PlanSettings
    layers: ModelLayers
    report: PlanReport
    by_policy: dict[GroupingPolicy, PlanReport | str] = field(default_factory=dict)

    @property
    def notes(self) -> tuple[str, ...]:
        unconfirmed = tuple(f"unconfirmed: {item}" for item in self.choice.unconfirmed)
        return self.layers.notes + self.choice.notes + unconfirmed

    @property
    def ssm_dtype(self) -> str | None:
        """The SSM state dtype of the recurrent layers (what ``auto`` chose, as vLLM does), or
        ``None`` for a model without any."""
        recurrent = self.choice.facts.recurrent
        if recurrent is None:
            return None
        if self.settings.mamba_ssm_dtype == "auto":
            return recurrent.ssm_dtype
        return _SSM_DTYPE_NAMES[self.settings.mamba_ssm_dtype]

    @property
    def vllm_log_line(self) -> str:
        """vLLM 0.33's own log line for the same plan (``update_kv_cache_capacity``)."""
        report = self.report
        return (
            f"GPU KV cache size: {report.kv_cache_size_tokens:,} tokens, Maximum concurrency "
            f"for {report.max_model_len:,} tokens per request: {report.max_concurrency:.2f}x"
        )

    @property
    def best_policy(self) -> GroupingPolicy:
        """The policy under which the most requests of ``max_model_len`` fit (vLLM's maximum
        concurrency); ties go to the earlier policy in ``POLICIES``."""
        reports = {p: r for p, r in self.by_policy.items() if not isinstance(r, str)}
        return max(reports, key=lambda p: reports[p].max_concurrency)


def make_plan(choice: ModelChoice, settings: PlanSettings) -> Plan:
    """Map the model to layer specs and plan them under every policy; ``UserError`` for what
    cannot be planned under the chosen one."""
    from hybridkv.catalogue import DTYPE_BYTES, ModelError
    from hybridkv.model_layers import decoder_layer_stages, model_layers

    try:
        layers = model_layers(
            choice.facts,
            block_size=settings.block_size,
            kv_dtype_bytes=DTYPE_BYTES[settings.kv_dtype],
            ssm_dtype_bytes=ssm_dtype_bytes(settings.mamba_ssm_dtype),
        )
        stages = decoder_layer_stages(choice.facts, layers, settings.pipeline_parallel_size)
    except ModelError as error:
        raise UserError(f"cannot plan {choice.name}: {error}") from None
    by_policy = {policy: _report(layers, stages, settings, policy) for policy in POLICIES}
    chosen = by_policy[settings.policy]
    if isinstance(chosen, str):
        raise UserError(f"cannot plan {choice.name}: {chosen}")
    return Plan(choice, settings, layers, chosen, by_policy)


def _report(
    layers: ModelLayers, stages: dict[str, int], settings: PlanSettings, policy: GroupingPolicy
) -> PlanReport | str:
    """One policy's report, or the planner's reason it cannot plan."""
    from hybridkv.reference.plan_report import plan_report

    try:
        return plan_report(
            layers.layers,
            settings.memory_bytes,
            max_model_len=settings.max_model_len,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            kv_sharing=layers.kv_sharing,
            policy=policy,
            pipeline_parallel_size=settings.pipeline_parallel_size,
            layer_stages=stages,
            async_scheduling=settings.async_scheduling,
            enable_prefix_caching=settings.enable_prefix_caching,
        )
    except ValueError as error:
        return str(error)


# --- JSON -------------------------------------------------------------------------------------


def plan_json(result: Plan) -> dict[str, Any]:
    """The plan as one JSON object with stable keys (sizes in bytes, lengths in tokens)."""
    report, settings = result.report, result.settings
    return {
        "model": result.choice.name,
        "source": result.choice.source,
        "status": result.choice.status,
        "settings": asdict(settings),
        "layer_types": layer_type_counts(result.choice.facts.layer_kinds),
        "num_layers": len(result.layers.layers),
        "kv_sharing": dict(result.layers.kv_sharing),
        "policy": report.policy,
        "groups": [_group_json(group) for group in report.groups],
        "layers_per_group": report.layers_per_group,
        "block_size": report.block_size,
        "layer_page_size_bytes": report.layer_page_size_bytes,
        "page_size_bytes": report.page_size_bytes,
        "num_blocks": report.num_blocks,
        "num_padding_slots": report.num_padding_slots,
        "padding_fraction": report.padding_fraction,
        "tensors": [
            {
                "index": i,
                "stage": stage,
                "size_bytes": tensor.size,
                "shared_by": list(tensor.shared_by),
            }
            for i, (tensor, stage) in enumerate(
                zip(report.config.tensors, report.tensor_stages, strict=True)
            )
        ],
        "memory_bytes": report.memory_bytes,
        "max_in_flight_tokens": report.max_in_flight_tokens,
        "blocks_per_request": report.blocks_per_request,
        "bytes_per_request": report.bytes_per_request,
        "max_num_requests": report.max_num_requests,
        "max_concurrency": report.max_concurrency,
        "kv_cache_size_tokens": report.kv_cache_size_tokens,
        "vllm_log_line": result.vllm_log_line,
        "ssm_dtype": result.ssm_dtype,
        "max_fitting_model_len": report.max_fitting_model_len,
        "max_tokens": report.max_tokens,
        "full_attention_only": {
            "per": "GPU (the fullest pipeline stage)",
            "bytes_per_token": report.full_attention_bytes_per_token,
            "bytes_per_request": report.full_attention_bytes_per_request,
            "memory_bytes": report.full_attention_memory_bytes,
            "max_num_requests": report.full_attention_max_num_requests,
            "memory_saved_bytes": report.memory_saved_bytes,
        },
        "policies": {policy: policy_json(found) for policy, found in result.by_policy.items()},
        "best_policy": result.best_policy,
        "notes": list(result.notes),
    }


def policy_json(report: PlanReport | str) -> dict[str, Any]:
    """One policy's headline numbers (or the reason it cannot plan)."""
    if isinstance(report, str):
        return {"error": report}
    return {
        "num_groups": len(report.groups),
        "layers_per_group": report.layers_per_group,
        "num_padding_slots": report.num_padding_slots,
        "num_blocks": report.num_blocks,
        "blocks_per_request": report.blocks_per_request,
        "max_num_requests": report.max_num_requests,
        "max_concurrency": report.max_concurrency,
        "max_fitting_model_len": report.max_fitting_model_len,
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
    return {"type": type(spec).__name__, **asdict(spec), "page_size_bytes": spec.page_size_bytes}


def layer_type_counts(kinds: tuple[str, ...]) -> dict[str, int]:
    """How many decoder layers of each kind, in order of first appearance."""
    counts: dict[str, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    return counts
