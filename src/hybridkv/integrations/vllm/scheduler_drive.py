"""vLLM 0.33's real scheduler for a ``vllm-check`` run (``build_scheduler``: vLLM's manager or a
hybridkv backend swapped in), the seeded token workload (``make_workload``) and the run itself
(``drive``): ``schedule()`` / ``update_from_output()`` with a fake model, one record per step
(``step_records``), in ``drive_loop``'s loop with this run's resets, draft tokens and records
(``TokenDrive``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Any

from hybridkv.integrations.vllm import mm_workload
from hybridkv.integrations.vllm.drive_loop import DriveLoop, Processed, refusal, request_hasher
from hybridkv.integrations.vllm.run_config import (
    VOCAB,
    Arrival,
    RunConfig,
    RunResult,
    Workload,
)
from hybridkv.integrations.vllm.step_records import sampled_token, stats_record

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
    kv_events: bool = True,
) -> Any:
    """vLLM's scheduler for ``cfg`` with ``manager``'s KV cache manager (or, with
    ``scheduler_cls``, the class ``SchedulerConfig.scheduler_cls`` names, as an engine picks).

    ``eviction_policy`` and ``device`` go to a hybridkv manager; ``policy`` is vLLM's
    scheduling policy (the check's workload has priorities, a replay runs ``"fcfs"``);
    ``kv_transfer_config`` attaches a KV connector (``connector_check``); ``kv_events`` turns on
    vLLM's KV cache events (with a null publisher), which the check's step records compare
    and a default engine leaves off."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.structured_output import StructuredOutputManager

    from hybridkv.integrations.vllm.scheduler import install

    vllm_config = engine_config(
        cfg,
        scheduler_cls=scheduler_cls,
        policy=policy,
        kv_transfer_config=kv_transfer_config,
        kv_events=kv_events,
    )
    if kv_cache_config is None:
        kv_cache_config = cfg.kv_cache_config()
    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    register_all_kvcache_specs(vllm_config)
    chosen = vllm_config.scheduler_config.get_scheduler_cls()
    if scheduler_cls is None:
        chosen = AsyncScheduler if cfg.run == "async" else Scheduler
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
        with install(manager, device, max(cfg.max_num_seqs, 256), eviction_policy=eviction_policy):
            scheduler = chosen(**kwargs)
    scheduler.use_v2_model_runner = False
    if cfg.workload == "multimodal":
        mm_workload.equip(scheduler)
    return scheduler


def engine_config(
    cfg: RunConfig,
    *,
    scheduler_cls: str | None,
    policy: str,
    kv_transfer_config: Any | None,
    kv_events: bool,
) -> Any:
    """vLLM's ``VllmConfig`` for ``cfg``: the tiny model, the scheduler's limits and policy,
    the cache (Mamba "align" caching where the layout has Mamba and caching is on), n-gram
    speculative decoding for a ``spec`` run, KV events and a KV connector as asked, LoRA for
    the multimodal workload."""
    from vllm.config import (
        KVEventsConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
        VllmConfig,
    )

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
    cache_config = _cache_config(cfg)
    return VllmConfig(
        scheduler_config=scheduler_config,
        model_config=model_config,
        cache_config=cache_config,
        parallel_config=ParallelConfig(),
        speculative_config=_speculative_config(cfg),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
        ),
        kv_transfer_config=kv_transfer_config,
        lora_config=mm_workload.lora_config() if multimodal else None,
    )


def _cache_config(cfg: RunConfig) -> Any:
    """vLLM's ``CacheConfig`` for ``cfg``: its block size and prefix caching, Mamba "align"
    caching where the layout has Mamba and caching is on."""
    from vllm.config import CacheConfig

    cache_config = CacheConfig(
        block_size=cfg.block_size,
        gpu_memory_utilization=0.9,
        cache_dtype="auto",
        enable_prefix_caching=cfg.prefix_caching,
    )
    if cfg.has_mamba and cfg.prefix_caching:
        cache_config.mamba_cache_mode = "align"
    return cache_config


def _speculative_config(cfg: RunConfig) -> Any:
    """n-gram speculative decoding of ``cfg.num_speculative_tokens`` for a ``spec`` run, else
    ``None``."""
    if cfg.run != "spec":
        return None
    from vllm.config import SpeculativeConfig

    return SpeculativeConfig(
        model="ngram",
        num_speculative_tokens=cfg.num_speculative_tokens,
        method="ngram",
        prompt_lookup_max=cfg.num_speculative_tokens,
        prompt_lookup_min=1,
    )


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


class TokenDrive(DriveLoop):
    """The token and multimodal runs' loop: prefix-cache resets at the workload's steps, draft
    tokens under ``spec`` (the fake model accepts a seeded number of them), and the manager's
    prefix-cache statistics as it makes them (``make_prefix_cache_stats`` wrapped)."""

    def __init__(self, cfg: RunConfig, scheduler: Any, workload: Workload, hasher: Any) -> None:
        super().__init__(cfg, scheduler, workload, hasher)
        self.stats_log: list[Any] = []
        self.make_stats = self.kv.make_prefix_cache_stats
        self.kv.make_prefix_cache_stats = self.recording_make_stats

    def recording_make_stats(self) -> Any:
        """``make_prefix_cache_stats``, every result noted for the step's record."""
        stats = self.make_stats()
        self.stats_log.append(stats_record(stats))
        return stats

    def open_step(self, step: int) -> Any:
        """Admissions and aborts, then the workload's reset at its steps."""
        super().open_step(step)
        if step not in self.workload.reset_steps:
            return None
        # Every other reset preempts the running requests first (an RLHF weight update).
        return self.scheduler.reset_prefix_cache(reset_running_requests=step % 2 == 1)

    def accepted_tokens(self, output: Any, req_id: str) -> int:
        """A seeded number of the request's scheduled draft tokens (none without any)."""
        spec = output.scheduled_spec_decode_tokens.get(req_id, [])
        return self.rng.randrange(0, len(spec) + 1) if spec else 0

    def draft_tokens(self, reply: Any) -> Any | None:
        """Under ``spec``, the next draft tokens of every request the reply left running (what
        an engine's drafter proposes after each step)."""
        if self.cfg.run != "spec":
            return None
        from vllm.v1.outputs import DraftTokenIds

        requests = self.scheduler.requests
        draft_ids = [r for r in reply.req_ids if r in requests and not requests[r].is_finished()]
        drafts = [
            [sampled_token(r, 10_000 + k) for k in range(self.cfg.num_speculative_tokens)]
            for r in draft_ids
        ]
        return DraftTokenIds(draft_ids, drafts)

    def close_record(self, record: dict[str, Any], processed: Processed) -> None:
        """The finishes, engine outputs, KV events, statistics and usage of the step."""
        record["finished_outputs"] = sorted(processed.finished)
        record["outputs"] = processed.outputs
        record["events"] = self.take_events()
        record["stats"] = list(self.stats_log)
        self.stats_log.clear()
        record["usage"] = round(float(self.kv.usage), 9)

    def restore(self) -> None:
        super().restore()
        self.kv.make_prefix_cache_stats = self.make_stats


def drive(cfg: RunConfig, manager: str) -> RunResult:
    """Run ``cfg``'s workload through vLLM's scheduler with ``manager``; one record per step."""
    hasher = request_hasher(cfg)
    try:
        scheduler = build_scheduler(cfg, manager)
    except Exception as error:  # a setting the backend refuses, by name
        return refusal(manager, error)
    return TokenDrive(cfg, scheduler, make_workload(cfg), hasher).run(manager)
