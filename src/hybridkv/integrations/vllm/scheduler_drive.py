"""vLLM 0.33's real scheduler for a ``vllm-check`` run (``build_scheduler``: vLLM's manager or a
hybridkv backend swapped in), the seeded token workload (``make_workload``) and the run itself
(``drive``): ``schedule()`` / ``update_from_output()`` with a fake model, one record per step
(``step_records``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections import deque
from typing import Any

from hybridkv.integrations.vllm import mm_workload
from hybridkv.integrations.vllm.run_config import (
    EOS_TOKEN_ID,
    VOCAB,
    Arrival,
    RunConfig,
    RunResult,
    Workload,
)
from hybridkv.integrations.vllm.step_records import (
    engine_output_record,
    output_record,
    recording,
    runner_output,
    sampled_token,
    stats_record,
)

_TINY_POSITIONS = 4096
_TINY_MODEL = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "ffn_dim": 128,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 50272,
    "max_position_embeddings": _TINY_POSITIONS,
    "word_embed_proj_dim": 64,
    "do_layer_norm_before": True,
    "torch_dtype": "float16",
    "bos_token_id": 2,
    "eos_token_id": 2,
    "pad_token_id": 1,
}


def _tiny_model_dir(max_model_len: int = 0) -> str:
    """A model directory with only a ``config.json``: the scheduler needs no weights. Its
    positions cover ``max_model_len`` (a replay's 262,144 tokens), so vLLM accepts that length."""
    positions = max(_TINY_POSITIONS, max_model_len)
    name = "hybridkv-vllm-check-model"
    if positions != _TINY_POSITIONS:
        name += f"-{positions}"
    path = os.path.join(tempfile.gettempdir(), name)
    os.makedirs(path, exist_ok=True)
    config = os.path.join(path, "config.json")
    if not os.path.exists(config):
        with open(config, "w", encoding="utf-8") as f:
            json.dump({**_TINY_MODEL, "max_position_embeddings": positions}, f)
    return path


def build_scheduler(
    cfg: RunConfig,
    manager: str,
    kv_cache_config: Any | None = None,
    *,
    scheduler_cls: str | None = None,
    eviction_policy: str | None = None,
    device: str | None = None,
    policy: str = "priority",
    kv_transfer_config: Any | None = None,
) -> Any:
    """vLLM's scheduler for ``cfg`` with ``manager``'s KV cache manager (or, with
    ``scheduler_cls``, the class ``SchedulerConfig.scheduler_cls`` names, as an engine picks).

    ``eviction_policy`` and ``device`` go to a hybridkv manager; ``policy`` is vLLM's
    scheduling policy (the check's workload has priorities, a replay runs ``"fcfs"``);
    ``kv_transfer_config`` attaches a KV connector (``connector_check``)."""
    from vllm.config import (
        CacheConfig,
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridkv.integrations.vllm.scheduler import install

    multimodal = cfg.workload == "multimodal"
    model_config = ModelConfig(
        model=_tiny_model_dir(cfg.max_model_len),
        skip_tokenizer_init=True,
        dtype="float16",
        seed=42,
        max_model_len=cfg.max_model_len,
    )
    is_async = cfg.run == "async"
    scheduler_config = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_model_len=cfg.max_model_len,
        enable_chunked_prefill=True,
        async_scheduling=is_async,
        is_encoder_decoder=False,
        watermark=0.0,
        policy=policy,
        scheduler_reserve_full_isl=cfg.reserves_full_sequence,
        scheduler_cls=scheduler_cls,
    )
    cache_config = CacheConfig(
        block_size=cfg.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=cfg.prefix_caching,
    )
    if cfg.has_mamba and cfg.prefix_caching:
        cache_config.mamba_cache_mode = "align"
    speculative_config = None
    if cfg.run == "spec":
        speculative_config = SpeculativeConfig(
            model="ngram",
            num_speculative_tokens=cfg.num_speculative_tokens,
            method="ngram",
            prompt_lookup_max=cfg.num_speculative_tokens,
            prompt_lookup_min=1,
        )
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
        speculative_config=speculative_config,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null"),
        kv_transfer_config=kv_transfer_config,
        lora_config=mm_workload.lora_config() if multimodal else None,
    )
    if kv_cache_config is None:
        kv_cache_config = cfg.kv_cache_config()
    cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    register_all_kvcache_specs(vllm_config)
    chosen = scheduler_config.get_scheduler_cls()
    if scheduler_cls is None:
        chosen = AsyncScheduler if is_async else Scheduler
    kwargs = {
        "vllm_config": vllm_config,
        "kv_cache_config": kv_cache_config,
        "block_size": cfg.block_size,
        "log_stats": True,
        "structured_output_manager": StructuredOutputManager(vllm_config),
    }
    if manager == "vllm" or scheduler_cls is not None:
        scheduler = chosen(**kwargs)
    else:
        with install(
            manager,
            device,
            max(cfg.max_num_seqs, 256),
            eviction_policy=eviction_policy,
        ):
            scheduler = chosen(**kwargs)
    scheduler.use_v2_model_runner = False
    if multimodal:
        mm_workload.equip(scheduler)
    return scheduler


def make_workload(cfg: RunConfig) -> Workload:
    """A seeded mix: shared system prompts, multi-turn continuations, resends, salts, aborts,
    priorities; prefix-cache resets at a few steps (``mm_workload``'s under ``multimodal``)."""
    if cfg.workload == "multimodal":
        return mm_workload.make_workload(cfg)
    rng = random.Random(cfg.seed)
    system_prompts = [
        [rng.randrange(VOCAB) for _ in range(rng.choice((32, 48, 80, 100)))] for _ in range(3)
    ]
    arrivals: list[Arrival] = []
    step = 0
    for i in range(cfg.num_requests):
        step += rng.choice((0, 0, 1, 1, 2, 3))
        kind = rng.random()
        salt = rng.choice(("alice", "bob")) if rng.random() < 0.15 else None
        if kind < 0.15 and arrivals:
            # A resend: the same prompt again.
            old = rng.choice(arrivals)
            prompt, salt = list(old.prompt), old.cache_salt
        else:
            system = rng.choice(system_prompts) if rng.random() < 0.7 else []
            user = [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 120))]
            prompt = system + user
        prompt = prompt[: cfg.max_model_len // 2]
        abort_after = rng.randrange(1, 12) if rng.random() < 0.1 else None
        continues = f"t{i}" if rng.random() < 0.25 else None
        arrivals.append(
            Arrival(
                step=step,
                request_id=f"r{i}",
                prompt=prompt,
                max_tokens=rng.randrange(1, 40),
                priority=rng.randrange(0, 3),
                cache_salt=salt,
                abort_after=abort_after,
                continues=continues,
            )
        )
    reset_steps = {rng.randrange(10, 120) for _ in range(3)}
    return Workload(arrivals, reset_steps)


def drive(cfg: RunConfig, manager: str) -> RunResult:
    """Run ``cfg``'s workload through vLLM's scheduler with ``manager``; one record per step."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request, RequestStatus

    init_none_hash(sha256)
    hasher = get_request_block_hasher(cfg.block_size, sha256)
    try:
        scheduler = build_scheduler(cfg, manager)
    except Exception as error:  # a setting the backend refuses, by name
        return RunResult(manager, [], 0.0, f"{type(error).__name__}: {error}")
    kv = scheduler.kv_cache_manager
    events: list[Any] = []
    take_events = kv.take_events
    kv.take_events = recording(take_events, events)
    stats_log: list[Any] = []
    make_stats = kv.make_prefix_cache_stats

    def recording_make_stats() -> Any:
        stats = make_stats()
        stats_log.append(stats_record(stats))
        return stats

    kv.make_prefix_cache_stats = recording_make_stats

    workload = make_workload(cfg)
    rng = random.Random(cfg.seed + 1)
    pending = deque(sorted(workload.arrivals, key=lambda a: a.step))
    followups: deque[Arrival] = deque()
    admitted_at: dict[str, int] = {}
    abort_after: dict[str, int] = {}
    continuations: dict[str, Arrival] = {}
    in_flight: deque[tuple[Any, set[str]]] = deque()
    records: list[dict[str, Any]] = []
    depth = 2 if cfg.run == "async" else 1
    start = time.perf_counter()

    def add(arrival: Arrival, step: int) -> None:
        params = SamplingParams(max_tokens=arrival.max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, EOS_TOKEN_ID)
        request = Request(
            request_id=arrival.request_id,
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(step),
            cache_salt=arrival.cache_salt,
            priority=arrival.priority,
            block_hasher=hasher,
            **{"prompt_token_ids": arrival.prompt, **arrival.request_kwargs},
        )
        scheduler.add_request(request)
        admitted_at[arrival.request_id] = step
        if arrival.abort_after is not None:
            abort_after[arrival.request_id] = step + arrival.abort_after
        if arrival.continues is not None:
            continuations[arrival.request_id] = arrival

    def model_output(output: Any, chunks: set[str]) -> Any:
        req_ids = list(output.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests.get(req_id)
            if request is None or req_id in chunks:
                sampled.append([])  # gone, or a prefill chunk that does not end the prompt
                continue
            spec = output.scheduled_spec_decode_tokens.get(req_id, [])
            accepted = rng.randrange(0, len(spec) + 1) if spec else 0
            base = request.num_tokens
            sampled.append([sampled_token(req_id, base + k) for k in range(accepted + 1)])
        return runner_output(req_ids, sampled)

    step = 0
    try:
        while step < cfg.max_steps:
            while pending and pending[0].step <= step:
                add(pending.popleft(), step)
            while followups and followups[0].step <= step:
                add(followups.popleft(), step)
            to_abort = sorted(r for r, s in abort_after.items() if s == step)
            if to_abort:
                scheduler.finish_requests(to_abort, RequestStatus.FINISHED_ABORTED)
            reset = None
            if step in workload.reset_steps:
                # Every other reset preempts the running requests first (an RLHF weight update).
                reset = scheduler.reset_prefix_cache(reset_running_requests=step % 2 == 1)
            output = scheduler.schedule()
            record = output_record(output)
            record["step"] = step
            record["reset"] = reset
            chunks = {
                r for r in output.num_scheduled_tokens if scheduler.requests[r].is_prefill_chunk
            }
            in_flight.append((output, chunks))
            finished: list[str] = []
            engine_records: list[Any] = []
            while in_flight and (len(in_flight) >= depth or not output.num_scheduled_tokens):
                done, done_chunks = in_flight.popleft()
                # The fake model runs the step now: outputs are computed at processing time.
                reply = model_output(done, done_chunks)
                engine_outputs = scheduler.update_from_output(done, reply)
                for outputs in engine_outputs.values():
                    for out in outputs.outputs:
                        engine_records.append(engine_output_record(out))
                        if out.finish_reason is not None:
                            finished.append(out.request_id)
                if cfg.run == "spec":
                    draft_ids = [
                        r
                        for r in reply.req_ids
                        if r in scheduler.requests and not scheduler.requests[r].is_finished()
                    ]
                    scheduler.update_draft_token_ids(
                        DraftTokenIds(
                            draft_ids,
                            [
                                [
                                    sampled_token(r, 10_000 + k)
                                    for k in range(cfg.num_speculative_tokens)
                                ]
                                for r in draft_ids
                            ],
                        )
                    )
            record["finished_outputs"] = sorted(finished)
            record["outputs"] = engine_records
            record["events"] = list(events)
            events.clear()
            record["stats"] = list(stats_log)
            stats_log.clear()
            record["usage"] = round(float(kv.usage), 9)
            records.append(record)
            for request_id in finished:
                arrival = continuations.pop(request_id, None)
                if arrival is None:
                    continue
                request_tokens = list(arrival.prompt) + [
                    sampled_token(request_id, len(arrival.prompt) + k) for k in range(3)
                ]
                turn = [sampled_token(request_id + "u", k) for k in range(rng.randrange(4, 40))]
                prompt = (request_tokens + turn)[: cfg.max_model_len // 2]
                followups.append(
                    Arrival(
                        step=step + 1,
                        request_id=f"{request_id}.next",
                        prompt=prompt,
                        max_tokens=rng.randrange(1, 20),
                        priority=arrival.priority,
                        cache_salt=arrival.cache_salt,
                    )
                )
            step += 1
            if not (pending or followups or in_flight or scheduler.has_unfinished_requests()):
                break
    except Exception as error:  # the record so far, and what went wrong
        return RunResult(
            manager, records, time.perf_counter() - start, f"{type(error).__name__}: {error}"
        )
    finally:
        kv.take_events, kv.make_prefix_cache_stats = take_events, make_stats
    return RunResult(manager, records, time.perf_counter() - start)
