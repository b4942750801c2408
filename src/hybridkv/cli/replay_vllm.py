"""``hybridkv replay --scheduler vllm``: a cell replayed by vLLM 0.33's own ``Scheduler``.

The groups and the pool are the plan's under vLLM's grouping (the ``"vllm"`` policy: vLLM's
group order, the cell's memory as ``num_blocks``); the manager is vLLM's own (``--backend
vllm``, LRU only) or a hybridkv backend behind vLLM's manager API. What cannot run this way is
refused in one line before anything runs: ``--host-memory`` (no host tier in vLLM's loop),
``--backend vllm`` under the built-in scheduler, a policy other than LRU on vLLM's manager, and
vLLM itself missing. The single engine settings (``--retention-interval``, ``--admission``,
``--async-scheduling``, ``--no-prefix-caching``) reach vLLM's configs as they reach the built-in
loop (``hybridkv.lab.vllm_engine``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from hybridkv.cli.options import UserError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from hybridkv.block_trace import BlockTraceRequest
    from hybridkv.cli.plan_data import Plan
    from hybridkv.cli.replay_setup import ReplaySetup
    from hybridkv.lab import ReplayResult

SCHEDULERS = ("built-in", "vllm")


def check_scheduler(setup: ReplaySetup) -> None:
    """``UserError`` (one line naming the flag and value) for a combination that cannot run."""
    from hybridkv.extras import first_missing, needs_line

    if setup.scheduler not in SCHEDULERS:
        raise UserError(f"--scheduler must be one of {SCHEDULERS}, got {setup.scheduler!r}")
    if setup.scheduler != "vllm":
        if setup.backend == "vllm":
            raise UserError("--backend vllm (vLLM's own manager) needs --scheduler vllm")
        return
    if setup.host_memory_bytes is not None:
        raise UserError("--host-memory is not supported with --scheduler vllm")
    if setup.backend == "vllm" and setup.eviction != "lru":
        raise UserError(
            f"--eviction {setup.eviction}: vLLM's own manager (--backend vllm) evicts lru only"
        )
    missing = first_missing(["vllm", "torch"])
    if missing is not None:
        raise UserError(needs_line("--scheduler vllm", missing))


def run_vllm(
    setup: ReplaySetup,
    plan: Plan,
    config: object,
    trace: Iterable[BlockTraceRequest],
    on_step: Callable[[ReplayResult], None] | None = None,
) -> ReplayResult:
    """Replay ``setup``'s trace through vLLM's scheduler on the plan's pool (under vLLM's
    grouping); ``UserError`` for what vLLM or the backend refuses."""
    from hybridkv.cli.replay_setup import EngineSettings
    from hybridkv.lab import ReplayConfig

    check_scheduler(setup)
    settings = EngineSettings.of(setup)
    if setup.backend == "optimized":
        from hybridkv.cli.devices import device_problem

        if (problem := device_problem(setup.device)) is not None:
            raise UserError(problem)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from hybridkv.integrations.vllm.errors import UnsupportedSetting
    from hybridkv.integrations.vllm.model_layout import ModelLayout, display_name
    from hybridkv.lab.vllm_replay import VllmEngine, VllmReplay
    from hybridkv.reference.planner import with_mamba_cache_mode

    report = plan.by_policy.get("vllm")
    if report is None or isinstance(report, str):
        raise UserError(f"--scheduler vllm: vLLM 0.33 cannot group {plan.choice.name}: {report}")
    layout = ModelLayout(
        display_name(plan.choice.name),
        with_mamba_cache_mode(report.config, settings.prefix_caching),
    )
    assert isinstance(config, ReplayConfig)
    try:
        engine = VllmEngine(
            layout,
            report.num_blocks,
            manager=setup.backend,
            defaults=setup.defaults,
            eviction_policy=setup.eviction,
            device=None if setup.backend != "optimized" else setup.device,
            retention=settings.retention_interval,
            full_prompt_admission=settings.full_prompt_admission,
            async_scheduling=settings.async_scheduling,
            prefix_caching=settings.prefix_caching,
        )
        replay = VllmReplay(trace, engine, config=config)
    except (UnsupportedSetting, ValueError) as error:
        raise UserError(f"--scheduler vllm --backend {setup.backend}: {_one_line(error)}") from None
    return replay.run(on_step)


def _one_line(error: ValueError) -> str:
    """What vLLM's config validation (pydantic) or the backend says, on one line."""
    errors = getattr(error, "errors", None)
    if callable(errors):
        found = errors()
        if found and isinstance(found[0], dict) and "msg" in found[0]:
            return str(found[0]["msg"])
    return " ".join(str(error).split())
