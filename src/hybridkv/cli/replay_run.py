"""One cell of a ``hybridkv replay`` grid: plan the model, build the manager, replay the trace.

A cell is a frozen ``ReplaySetup`` (plain values only, ``hybridkv.cli.replay_setup``), so a
grid's cells run in worker processes as well as in this one, and each returns a ``CellResult``
of plain values.

Engine defaults (``defaults="engine"``) are vLLM 0.33's, as ``hybridkv plan`` assumes: sparse
retention (``prefix_cache_retention_interval=0``), full-prompt admission, async scheduling's
tokens in flight (the plan's ``max_in_flight_tokens``), Mamba ``"align"`` with caching.
``defaults="unit"`` is vLLM's unit tests' manager: dense retention, first-chunk admission, one
step in flight. Each of these settings can be set alone (``ReplaySetup.retention``,
``admission``, ``async_scheduling``, ``prefix_caching``), the others keeping the defaults'.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridkv.cli.options import UserError, resolve_model
from hybridkv.cli.plan_data import Plan, PlanSettings, make_plan
from hybridkv.cli.replay_setup import TRACE_FORMATS, CellResult, EngineSettings, ReplaySetup

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from hybridkv.block_trace import BlockTraceRequest
    from hybridkv.lab import ReplayResult
    from hybridkv.lab.host_tier import HostTier
    from hybridkv.reference import Request
    from hybridkv.scheduling import Manager


def is_block_trace(path: str) -> bool:
    """Whether ``path``'s first line reads as a block-hash trace line (it holds ``hash_ids``);
    anything unreadable is left to the token-trace reader, which names the problem."""
    try:
        with Path(path).open(encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), "")
        record = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(record, dict) and "hash_ids" in record


def check_trace(path: str, trace_format: str | None) -> None:
    """``UserError`` unless ``path`` reads as a block-hash trace (``--trace-format`` or its
    first line's fields say so)."""
    from hybridkv.block_trace import FIELDS

    if trace_format is not None:
        if trace_format not in TRACE_FORMATS:
            raise UserError(f"--trace-format must be one of {TRACE_FORMATS}, got {trace_format!r}")
        return
    try:
        with Path(path).open(encoding="utf-8") as handle:
            first = next((line for line in handle if line.strip()), None)
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {path}: {error}") from None
    if first is None:
        raise UserError(f"{path} holds no requests")
    try:
        record = json.loads(first)
    except json.JSONDecodeError as error:
        raise UserError(f"{path}:1: not valid JSON: {error.msg}") from None
    if not isinstance(record, dict) or "hash_ids" not in record:
        raise UserError(
            f"{path} is not a block-hash trace: its first line lacks 'hash_ids' (a block-hash "
            f"trace line holds {', '.join(FIELDS)}; token traces go to hybridkv simulate --trace)"
        )


def run_cell(
    setup: ReplaySetup, on_step: Callable[[ReplayResult], None] | None = None
) -> CellResult:
    """Replay ``setup``'s trace once; ``UserError`` for what cannot run."""
    from hybridkv.block_trace import BlockTraceError
    from hybridkv.cli.replay_vllm import check_scheduler

    check_scheduler(setup)
    plan = _plan(setup)
    try:
        result = _replay(setup, plan, on_step)
    except BlockTraceError as error:
        raise UserError(str(error)) from None
    return CellResult(_summary(setup, plan, result), tuple(result.ttft_ms))


def _replay(
    setup: ReplaySetup, plan: Plan, on_step: Callable[[ReplayResult], None] | None
) -> ReplayResult:
    """The cell's replay on the scheduler ``setup`` names."""
    from hybridkv.lab import Replay
    from hybridkv.lab.hit_profile import walked_groups

    if setup.scheduler == "vllm":
        from hybridkv.cli.replay_vllm import run_vllm

        return run_vllm(setup, plan, _config(setup, plan), trace_of(setup), on_step)
    manager = build_manager(setup, plan)
    groups = plan.report.config.groups
    replay = Replay(
        manager,
        trace_of(setup),
        _request_maker(manager),
        block_size=plan.report.block_size,
        config=_config(setup, plan),
        mamba_block_size=_mamba_block_size(plan),
        group_block_sizes=[group.spec.block_size for group in groups],
        walked_groups=walked_groups([group.spec for group in groups], plan.report.block_size),
        events=manager.take_events,  # type: ignore[attr-defined]
        host=_host_tier(setup, plan),
    )
    return replay.run(on_step)


def _host_tier(setup: ReplaySetup, plan: Plan) -> HostTier | None:
    """The host tier ``setup`` asks for, its groups' needs read from the plan."""
    if setup.host_memory_bytes is None:
        return None
    from hybridkv.lab.host_tier import FULL, STATE, GroupNeed, HostTier
    from hybridkv.spec import ChunkedLocalAttentionSpec, MambaSpec, SlidingWindowSpec, rules

    size = plan.report.block_size
    needs = []
    for group in plan.report.groups:
        spec = group.spec
        if spec.block_size != size:
            raise UserError(
                f"--host-memory needs one block size in every group; {plan.choice.name} has "
                f"{spec.block_size} beside {size}"
            )
        window, chunk = FULL, 0
        if isinstance(spec, MambaSpec):
            window = STATE
        elif isinstance(spec, SlidingWindowSpec):
            window = rules.sliding_window_hit_blocks_needed(spec.sliding_window, size)
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            window, chunk = -(-spec.attention_chunk_size // size), spec.attention_chunk_size
        needs.append(GroupNeed(window, spec.page_size_bytes * group.num_own_layers, chunk))
    try:
        return HostTier(
            setup.host_memory_bytes,
            needs,
            accounting=setup.host_accounting,
            bandwidth_gbps=setup.host_bandwidth_gbps,
            block_size=size,
        )
    except ValueError as error:
        raise UserError(str(error)) from None


def _plan(setup: ReplaySetup) -> Plan:
    engine = EngineSettings.of(setup).async_scheduling
    settings = PlanSettings(
        setup.memory_bytes,
        setup.max_model_len,
        setup.max_num_batched_tokens,
        setup.block_size,
        setup.kv_dtype,
        setup.mamba_ssm_dtype,
        async_scheduling=engine,
        enable_prefix_caching=setup.prefix_caching,
    )
    return make_plan(resolve_model(setup.model), settings)


def trace_of(setup: ReplaySetup) -> Iterator[BlockTraceRequest]:
    """The cell's trace requests, read as the replay consumes them."""
    from hybridkv.block_trace import read_block_trace

    return read_block_trace(
        setup.trace, block_tokens=setup.block_tokens, max_requests=setup.max_requests
    )


def build_manager(setup: ReplaySetup, plan: Plan) -> Manager:
    """The manager as the engine (or vLLM's unit tests) configures it, with KV events on so
    evictions are counted; ``UserError`` for a backend or policy that cannot run here."""
    from hybridkv.reference.planner import with_mamba_cache_mode

    engine = EngineSettings.of(setup)
    config = with_mamba_cache_mode(plan.report.config, engine.prefix_caching)
    config = dataclasses.replace(config, prefix_cache_retention_interval=engine.retention_interval)
    in_flight = plan.report.max_in_flight_tokens if engine.async_scheduling else None
    if setup.backend == "reference":
        from hybridkv.reference import KVCacheManager

        try:
            return KVCacheManager(
                config,
                setup.max_model_len,
                enable_caching=engine.prefix_caching,
                enable_kv_cache_events=True,
                max_in_flight_tokens=in_flight,
                eviction_policy=setup.eviction,
            )
        except ValueError as error:
            raise UserError(f"cannot start the reference backend: {error}") from None
    return _optimized(setup, config, in_flight)


def _optimized(setup: ReplaySetup, config: Any, in_flight: int | None) -> Manager:
    try:
        from hybridkv.optimized import TorchKVCacheManager
    except ModuleNotFoundError as error:
        if error.name in ("torch", "numpy"):
            raise UserError(
                "--backend optimized needs torch: pip install '.[torch]' from a checkout "
                "(or hybridkv[torch])"
            ) from None
        raise
    from hybridkv.cli.devices import device_problem

    if (problem := device_problem(setup.device)) is not None:
        raise UserError(problem)
    try:
        manager: Manager = TorchKVCacheManager(
            config,
            setup.max_model_len,
            enable_caching=setup.prefix_caching,
            enable_kv_cache_events=True,
            device=setup.device,
            max_in_flight_tokens=in_flight,
            eviction_policy=setup.eviction,
        )
    except (RuntimeError, ValueError) as error:
        raise UserError(f"cannot start the optimized backend: {error}") from None
    return manager


def _request_maker(manager: Manager) -> Callable[[str, Sequence[int]], Request]:
    """Requests hashed at the manager's hash block size, with its hashing memo when it has one
    (the optimized backend's ``block_hasher``)."""
    from hybridkv.reference import Request

    size = int(manager.hash_block_size)  # type: ignore[attr-defined]
    hasher = getattr(manager, "block_hasher", None)

    def make(request_id: str, tokens: Sequence[int]) -> Request:
        if hasher is None:
            return Request(request_id, tokens, hash_block_size=size)
        return Request(request_id, tokens, hash_block_size=size, block_hasher=hasher)

    return make


def _config(setup: ReplaySetup, plan: Plan) -> Any:
    from hybridkv.lab import ReplayConfig

    cost, mix = cost_model(setup, plan)
    return ReplayConfig(
        max_num_batched_tokens=setup.max_num_batched_tokens,
        max_num_seqs=setup.max_num_seqs,
        max_model_len=setup.max_model_len,
        time_scale=setup.time_scale,
        cost_model=cost,
        attention_mix=mix,
        full_prompt_admission=EngineSettings.of(setup).full_prompt_admission,
    )


def cost_model(setup: ReplaySetup, plan: Plan) -> tuple[Any, tuple[tuple[float, int | None], ...]]:
    """The model's roofline coefficients on the GPU preset, overridden by the given ones, and
    its attention mix; a model without a published active-parameter count keeps the
    ``CostModel`` defaults."""
    from hybridkv.lab import CostModel
    from hybridkv.lab.model_costs import active_parameters, attended_kv

    kv_bytes, mix = attended_kv((g.spec, g.num_own_layers) for g in plan.report.groups)
    params = active_parameters(plan.choice.name)
    try:
        base = CostModel() if params is None else CostModel.for_gpu(params, kv_bytes, setup.gpu)
        return dataclasses.replace(base, **dict(setup.cost)), mix
    except ValueError as error:
        raise UserError(str(error)) from None


def _mamba_block_size(plan: Plan) -> int | None:
    from hybridkv.spec import MambaSpec

    sizes = [g.spec.block_size for g in plan.report.config.groups if isinstance(g.spec, MambaSpec)]
    return sizes[0] if sizes else None


def _summary(setup: ReplaySetup, plan: Plan, result: ReplayResult) -> dict[str, Any]:
    """Item 9's keys first, then the rest of the result."""
    figures = result.summary()
    head = {
        "model": plan.choice.name,
        "memory_bytes": setup.memory_bytes,
        "eviction": setup.eviction,
        "scheduler": setup.scheduler,
        "backend": setup.backend,
        "defaults": setup.defaults,
        "engine_settings": dataclasses.asdict(EngineSettings.of(setup)),
        "num_blocks": plan.report.num_blocks,
        "block_size": plan.report.block_size,
        "host_memory_bytes": setup.host_memory_bytes,
        "host_accounting": setup.host_accounting if setup.host_memory_bytes else None,
        "host_hit_rate": round(result.host_hit_rate, 6) if setup.host_memory_bytes else None,
    }
    return {**head, **figures}
