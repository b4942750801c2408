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
import os
import sys
from collections.abc import Callable, Sequence

from hybridkv.extras import exit_if_missing
from hybridkv.integrations.vllm import mm_workload
from hybridkv.integrations.vllm.comparison import Comparison, compare, run_all, summarize
from hybridkv.integrations.vllm.connector_check import connector_comparisons
from hybridkv.integrations.vllm.run_config import (
    BLOCK_SIZE,
    DEFAULTS,
    EOS_TOKEN_ID,
    LAYOUTS,
    MANAGERS,
    RUNS,
    VOCAB,
    Arrival,
    RunConfig,
    RunResult,
    Workload,
    kv_cache_config_for,
    reserves_full_sequence,
    retention_interval,
)
from hybridkv.integrations.vllm.scheduler_drive import build_scheduler, drive, make_workload

__all__ = [
    "BLOCK_SIZE",
    "DEFAULTS",
    "EOS_TOKEN_ID",
    "LAYOUTS",
    "MANAGERS",
    "RUNS",
    "VOCAB",
    "Arrival",
    "Comparison",
    "RunConfig",
    "RunResult",
    "Workload",
    "build_scheduler",
    "compare",
    "drive",
    "kv_cache_config_for",
    "main",
    "make_workload",
    "reserves_full_sequence",
    "retention_interval",
    "run_check",
    "summarize",
]


def run_check(
    configs: Sequence[RunConfig],
    backends: Sequence[str],
    echo: Callable[[str], None] = print,
) -> list[Comparison]:
    """Every config on vLLM's manager and on each backend; one comparison per backend."""
    return run_all(configs, backends, drive, echo=echo)


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
        return mm_workload.configs(args, parser)
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
