"""``hybridkv vllm-check``: vLLM 0.33's real scheduler, driven step by step on vLLM's manager and
on each hybridkv backend, with every step's record compared for exact equality.

A run builds vLLM's ``Scheduler`` (or ``AsyncScheduler``) on a hybrid layout, feeds it a seeded
workload (shared system prompts, multi-turn continuations, resends, cache salts, aborts,
priorities, preemption under memory pressure, prefix-cache resets; KV events and statistics on)
and calls ``schedule()`` / ``update_from_output()`` with a fake model. A step's record holds the
scheduled tokens per request, every block id handed to the worker, the preemptions, the
finished requests, the new blocks to zero, the KV events, the prefix-cache statistics and the
usage. The first step whose records differ is printed.

The layouts are three small hybrids (``--layout gemma3|llama4|jamba``: one layer per group,
blocks of 16 tokens); ``--model MODEL`` checks a real model's groups instead, every one with
all its layer names and specs, as vLLM 0.33 groups that model's layers (``model_layout``).

Runs: ``sync``, ``async`` (two steps in flight) and ``spec`` (n-gram speculative decoding with
seeded acceptance), each under ``engine`` defaults (retention interval 0, full-prompt
admission) and ``unit`` defaults (dense retention, first-chunk admission).

``--workload multimodal`` sends images (scheduled through vLLM's encoder budget and encoder
cache), LoRA adapters, salts and prompt embeddings instead (``mm_workload``).

``--connector offloading`` attaches vLLM's ``OffloadingConnector`` (CPU tier) instead, with a
worker stand-in that checks every transferred block's bytes (``connector_check``).

Run it with ``python -m hybridkv.integrations.vllm.check`` or ``hybridkv vllm-check``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridkv.extras import exit_if_missing
from hybridkv.integrations.vllm.step_records import (
    engine_output_record,
    output_record,
    recording,
    runner_output,
    stats_record,
)

if TYPE_CHECKING:
    from hybridkv.integrations.vllm.model_layout import ModelLayout

LAYOUTS = ("gemma3", "llama4", "jamba")
RUNS = ("sync", "async", "spec")
DEFAULTS = ("engine", "unit")
MANAGERS = ("vllm", "reference", "optimized")
BLOCK_SIZE = 16
VOCAB = 50000
EOS_TOKEN_ID = 50256

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


@dataclass(frozen=True)
class RunConfig:
    layout: str = "gemma3"
    run: str = "sync"
    defaults: str = "engine"
    seed: int = 0
    num_requests: int = 48
    num_blocks: int = 96
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 128
    max_model_len: int = 1024
    num_speculative_tokens: int = 2
    max_steps: int = 4000
    model: ModelLayout | None = None
    """A real model's groups (``--model``), which replace ``layout``'s."""
    retention: int | str | None = "defaults"
    """``prefix_cache_retention_interval``: ``"defaults"`` (an engine's 0, a unit test's
    dense), ``None`` (dense) or an interval in tokens."""
    full_prompt_admission: bool | None = None
    """``scheduler_reserve_full_isl`` (admit a request only when its whole sequence fits);
    ``None``: the defaults' (the engine's)."""
    prefix_caching: bool = True
    """``enable_prefix_caching``; off, Mamba groups run ``"none"``."""
    workload: str = "tokens"
    """``"tokens"`` (``make_workload``'s) or ``"multimodal"`` (``mm_workload``'s)."""

    @property
    def name(self) -> str:
        layout = self.layout if self.model is None else self.model.name
        suffix = "" if self.workload == "tokens" else f"/{self.workload}"
        return f"{layout}/{self.run}/{self.defaults}{suffix}"

    @property
    def block_size(self) -> int:
        """Tokens per block of every group (and of the scheduler and the block hashes)."""
        return BLOCK_SIZE if self.model is None else self.model.block_size

    @property
    def has_mamba(self) -> bool:
        """Whether a group is Mamba: the engine runs its cache in ``"align"`` mode."""
        return self.layout == "jamba" if self.model is None else self.model.has_mamba

    @property
    def retention_interval(self) -> int | None:
        """The retention interval the run gives vLLM (``None``: dense)."""
        return retention_interval(self.retention, self.defaults)

    @property
    def reserves_full_sequence(self) -> bool:
        """Whether the scheduler admits a request only when its whole sequence fits."""
        return reserves_full_sequence(self.full_prompt_admission, self.defaults)

    def kv_cache_config(self) -> Any:
        """vLLM's ``KVCacheConfig`` of the run: the layout's or the model's groups, the pool,
        and the retention interval (``retention_interval``)."""
        retention = self.retention_interval
        if self.model is not None:
            return self.model.vllm_config(self.num_blocks, retention=retention)
        return kv_cache_config_for(
            self.layout,
            self.num_blocks,
            retention=retention,
            mamba_cache_mode="align" if self.prefix_caching else "none",
        )


def retention_interval(retention: int | str | None, defaults: str) -> int | None:
    """``prefix_cache_retention_interval`` for ``retention`` under ``defaults``: ``"defaults"``
    is an engine's 0 and a unit test's dense (``None``); ``ValueError`` unless it is that,
    ``None`` or tokens ``>= 0``."""
    if retention == "defaults":
        return 0 if defaults == "engine" else None
    if retention is None or (type(retention) is int and retention >= 0):
        return retention
    raise ValueError(
        f"retention must be 'defaults', None (dense) or tokens >= 0, got {retention!r}"
    )


def reserves_full_sequence(full_prompt_admission: bool | None, defaults: str) -> bool:
    """``scheduler_reserve_full_isl``: the setting, or (``None``) the engine defaults' on."""
    return defaults == "engine" if full_prompt_admission is None else full_prompt_admission


def kv_cache_config_for(
    layout: str, num_blocks: int, *, retention: int | None, mamba_cache_mode: str = "align"
) -> Any:
    """vLLM's ``KVCacheConfig`` of a hybrid layout (groups as vLLM's grouping makes them)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": BLOCK_SIZE, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float16}
    full = KVCacheGroupSpec(["full.0"], FullAttentionSpec(**attn))
    if layout == "gemma3":
        # Gemma 3: one full-attention layer in six; vLLM groups them 1 full + 5 sliding.
        sliding = SlidingWindowSpec(**attn, sliding_window=64)
        groups = [full] + [KVCacheGroupSpec([f"sliding.{i}"], sliding) for i in range(2)]
    elif layout == "llama4":
        chunked = ChunkedLocalAttentionSpec(**attn, attention_chunk_size=64)
        groups = [full] + [KVCacheGroupSpec([f"chunked.{i}"], chunked) for i in range(3)]
    elif layout == "jamba":
        mamba = MambaSpec(
            block_size=BLOCK_SIZE,
            shapes=((4, 8),),
            dtypes=(torch.float16,),
            mamba_cache_mode=mamba_cache_mode,
        )
        groups = [full, KVCacheGroupSpec(["mamba.0"], mamba)]
    else:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


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

    from hybridkv.integrations.vllm import mm_workload
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


# --- The workload --------------------------------------------------------------------------


@dataclass
class Arrival:
    step: int
    request_id: str
    prompt: list[int]
    max_tokens: int
    priority: int
    cache_salt: str | None
    abort_after: int | None = None
    continues: str | None = None  # a later turn of this request's conversation
    request_kwargs: dict[str, Any] = field(default_factory=dict)  # images, LoRA, embeddings


@dataclass
class Workload:
    arrivals: list[Arrival]
    reset_steps: set[int] = field(default_factory=set)


def make_workload(cfg: RunConfig) -> Workload:
    """A seeded mix: shared system prompts, multi-turn continuations, resends, salts, aborts,
    priorities; prefix-cache resets at a few steps (``mm_workload``'s under ``multimodal``)."""
    if cfg.workload == "multimodal":
        from hybridkv.integrations.vllm import mm_workload

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


def _token(request_id: str, position: int) -> int:
    """The fake model's token at ``position`` of a request (the same on every manager)."""
    value = 0
    for ch in f"{request_id}:{position}":
        value = (value * 131 + ord(ch)) % 1_000_003
    return value % VOCAB


@dataclass
class RunResult:
    manager: str
    records: list[dict[str, Any]]
    seconds: float
    error: str | None = None


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
            sampled.append([_token(req_id, base + k) for k in range(accepted + 1)])
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
                                [_token(r, 10_000 + k) for k in range(cfg.num_speculative_tokens)]
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
                    _token(request_id, len(arrival.prompt) + k) for k in range(3)
                ]
                turn = [_token(request_id + "u", k) for k in range(rng.randrange(4, 40))]
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


# --- Comparison ----------------------------------------------------------------------------


@dataclass
class Comparison:
    run: str
    manager: str
    steps: int
    equal_steps: int
    divergence: str | None

    summary: str = ""
    refused: bool = False

    @property
    def ok(self) -> bool:
        return self.divergence is None

    @property
    def status(self) -> str:
        return "equal" if self.ok else "REFUSED" if self.refused else "DIFFERENT"


def summarize(records: Sequence[dict[str, Any]]) -> str:
    """What a run exercised: preemptions, cache hits, events, resets."""
    preemptions = sum(len(r["preempted"]) for r in records)
    hits = sum(s[2] + s[5] for r in records for s in r["stats"] if s is not None)
    events = sum(len(r["events"]) for r in records)
    resets = sum(1 for r in records if r["reset"])
    drafts = sum(len(tokens) for r in records for _, tokens in r["spec"])
    blocks = sum(len(g) for r in records for _, _, groups in r["new"] for g in groups)
    text = (
        f"{preemptions} preemptions, {hits} hit tokens, {events} events, "
        f"{resets} resets, {drafts} draft tokens, {blocks} new-request block ids"
    )
    if any(r["encoder"] for r in records):
        from hybridkv.integrations.vllm import mm_workload

        text += "; " + mm_workload.summarize(records)
    return text


def _is_refusal(error: str) -> bool:
    """A setting the backend refuses by name (not a wrong answer)."""
    return error.startswith("UnsupportedSetting") or "does not implement" in error


def compare(run: str, expected: RunResult, actual: RunResult) -> Comparison:
    """Step by step, the first field that differs (or the error either run raised)."""
    equal = 0
    for i, (want, got) in enumerate(zip(expected.records, actual.records, strict=False)):
        if want != got:
            keys = [k for k in want if want.get(k) != got.get(k)]
            detail = "; ".join(
                f"{k}: vllm={want.get(k)!r} {actual.manager}={got.get(k)!r}" for k in keys
            )
            return Comparison(
                run, actual.manager, len(expected.records), i, f"step {i}: {detail}"[:2000]
            )
        equal += 1
    for result in (expected, actual):
        if result.error is not None:
            return Comparison(
                run,
                actual.manager,
                len(expected.records),
                equal,
                f"{result.manager}: {result.error}",
                refused=result is actual and _is_refusal(result.error),
            )
    if len(expected.records) != len(actual.records):
        return Comparison(
            run,
            actual.manager,
            len(expected.records),
            equal,
            f"vllm ran {len(expected.records)} steps, {actual.manager} {len(actual.records)}",
        )
    return Comparison(
        run, actual.manager, len(expected.records), equal, None, summarize(expected.records)
    )


def run_check(
    configs: Sequence[RunConfig],
    backends: Sequence[str],
    echo: Callable[[str], None] = print,
) -> list[Comparison]:
    """Every config on vLLM's manager and on each backend; one comparison per backend."""
    comparisons: list[Comparison] = []
    width = max([22] + [len(cfg.name) + 1 for cfg in configs])  # the longest name fits
    for cfg in configs:
        expected = drive(cfg, "vllm")
        for backend in backends:
            result = compare(cfg.name, expected, drive(cfg, backend))
            comparisons.append(result)
            status = result.status
            echo(
                f"{cfg.name:<{width}} {backend:<10} "
                f"{result.equal_steps}/{result.steps} steps {status}"
                + (f" ({result.summary})" if result.ok else f"\n    {result.divergence}")
            )
    return comparisons


def _parser() -> argparse.ArgumentParser:
    """The command line; ``--layout`` and ``--model`` name the groups, one way or the other."""
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.integrations.vllm.check",
        description=(__doc__ or "").split("\n\n")[0],
    )
    groups = parser.add_mutually_exclusive_group()
    groups.add_argument("--layout", action="append", choices=LAYOUTS)
    groups.add_argument(
        "--model",
        metavar="MODEL",
        help="a model's own groups, as vLLM 0.33 groups its layers: a catalogue name or Hub "
        "id, a config.json or a Hugging Face snapshot directory (what `hybridkv plan` takes)",
    )
    parser.add_argument("--run", action="append", choices=RUNS)
    parser.add_argument("--defaults", action="append", choices=DEFAULTS)
    parser.add_argument("--backend", action="append", choices=MANAGERS[1:])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=None,
        help="blocks in the pool, the null block included [default: 96 for a layout; for a "
        "model, the null block and what one request of the longest length holds in every group]",
    )
    parser.add_argument(
        "--connector",
        choices=("offloading",),
        help="attach vLLM's OffloadingConnector (CPU tier) with a worker stand-in that checks "
        "every transferred block's bytes; runs sync and async (connector_check)",
    )
    parser.add_argument("--cpu-chunks", type=int, help="with --connector: CPU chunks [128]")
    parser.add_argument(
        "--workload",
        choices=("tokens", "multimodal"),
        default="tokens",
        help="multimodal: images through vLLM's encoder budget and cache, LoRA adapters, salts "
        "and prompt embeddings; layouts gemma3 and llama4, runs sync and async unless given "
        "(mm_workload) [tokens]",
    )
    return parser


def _configs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[RunConfig]:
    """Every run the arguments ask for; a model that cannot be checked is a usage error."""
    from hybridkv.integrations.vllm.model_layout import ModelLayoutError, load_model_layout

    if args.workload == "multimodal":
        from hybridkv.integrations.vllm.mm_workload import configs

        return configs(args, parser)
    base = RunConfig(seed=args.seed, num_requests=args.requests)
    model = None
    if args.model is not None:
        try:
            model = load_model_layout(args.model, BLOCK_SIZE)
        except ModelLayoutError as error:
            parser.error(f"argument --model: {error}")
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = base.num_blocks
        if model is not None:
            num_blocks = model.default_num_blocks(base.max_model_len, base.max_num_batched_tokens)
    layouts = (base.layout,) if model is not None else args.layout or LAYOUTS  # a model's own
    return [
        dataclasses.replace(
            base, layout=layout, run=run, defaults=defaults, num_blocks=num_blocks, model=model
        )
        for layout in layouts
        for run in args.run or RUNS
        for defaults in args.defaults or DEFAULTS
    ]


def _notes(configs: Sequence[RunConfig]) -> list[str]:
    """What a model's own layout leaves the workload unable to exercise, said before the runs."""
    cfg = configs[0] if configs else None
    if cfg is None or cfg.model is None or 2 * cfg.block_size <= cfg.max_model_len // 2:
        return []
    return [
        f"{cfg.model.name}'s Mamba states raise its block size to {cfg.block_size} tokens, as "
        f"vLLM does; the workload's prompts (at most {cfg.max_model_len // 2} tokens) fill few "
        "blocks, so prefix-cache hits are rare (see the hit tokens)"
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    exit_if_missing("python -m hybridkv.integrations.vllm.check", ["vllm", "torch"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.connector is not None:
        if args.workload != "tokens":
            parser.error("argument --connector: runs the tokens workload only")
        from hybridkv.integrations.vllm.connector_check import connector_comparisons

        comparisons = connector_comparisons(args, parser)
    else:
        configs = _configs(args, parser)
        for note in _notes(configs):
            print(f"note: {note}")
        comparisons = run_check(configs, args.backend or ["reference"])
    equal = sum(c.ok for c in comparisons)
    refused = sum(c.refused for c in comparisons)
    different = len(comparisons) - equal - refused
    print(
        f"{equal}/{len(comparisons)} runs equal, {refused} refused by name, {different} different"
    )
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
