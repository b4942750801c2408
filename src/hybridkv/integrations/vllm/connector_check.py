"""``hybridkv vllm-check --connector offloading``: vLLM 0.33's ``OffloadingConnector`` with its
CPU spec, attached to vLLM's real scheduler, over vLLM's manager and over each hybridkv
backend, every step compared for exact equality.

Each run (``offload_drive.drive``) feeds a seeded workload of long shared documents over a small
GPU pool and a CPU tier that evicts too; a worker stand-in (``offload_worker``) copies the bytes
of every store and load job between numpy GPU blocks and CPU chunks and checks each block
against what computing it writes. The first step whose records differ (scheduled tokens, block
ids per group, store and load jobs per group with their chunk ids, jobs to flush, engine
outputs with their connector hit tokens, KV events of the manager and of the connector,
prefix-cache statistics, usage) is printed, as ``vllm-check`` prints it.

Layouts as ``vllm-check``'s (``--layout gemma3|llama4|jamba``); runs ``sync`` and ``async``;
``--defaults engine`` unless given; ``--num-blocks`` (default per layout: ``NUM_BLOCKS``) and
``--cpu-chunks`` (default 128) size the two tiers.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from hybridkv.integrations.vllm import comparison
from hybridkv.integrations.vllm.comparison import Comparison
from hybridkv.integrations.vllm.offload_drive import CPU_CHUNKS, NUM_BLOCKS, OffloadRun, drive
from hybridkv.integrations.vllm.run_config import LAYOUTS, RunConfig, RunResult

CONNECTORS = ("offloading",)
RUNS = ("sync", "async")


def _evicted(events: list[Any]) -> int:
    return sum(len(e[1]["block_hashes"]) for e in events if e[0] == "BlockRemoved")


def summarize(records: Sequence[dict[str, Any]]) -> str:
    """What a run exercised: the transfers, the hits each tier served, the evictions."""
    loads = [job for r in records for job in r["loads"]]
    stores = [job for r in records for job in r["stores"]]

    def blocks(jobs: list[Any]) -> int:
        return sum(len(ids) for job in jobs for _, ids, _ in job[3])

    prefills = [o[3] for r in records for o in r["outputs"] if o[3] is not None]
    cpu = sum(_evicted(r["cpu_events"]) for r in records)
    gpu = sum(_evicted(r["events"]) for r in records)
    return (
        f"{len(loads)} loads ({blocks(loads)} blocks), {len(stores)} stores "
        f"({blocks(stores)} blocks), {sum(p[2] for p in prefills)} connector hit tokens, "
        f"{sum(p[1] for p in prefills)} local hit tokens, {cpu} CPU and {gpu} GPU blocks "
        f"evicted, {sum(len(r['preempted']) for r in records)} preemptions, "
        f"{sum(1 for r in records if r['reset'])} resets"
    )


def compare(name: str, expected: RunResult, actual: RunResult) -> Comparison:
    """``comparison.compare`` with this check's summary (a block whose bytes do not check is
    an error of the run, so a difference)."""
    return comparison.compare(name, expected, actual, summarize)


def run_connector_check(
    runs: Sequence[OffloadRun],
    backends: Sequence[str],
    echo: Callable[[str], None] = print,
) -> list[Comparison]:
    """Every run on vLLM's manager and on each backend; one comparison per backend."""
    return comparison.run_all(runs, backends, drive, summarize, echo)


def offload_runs(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[OffloadRun]:
    """The runs ``vllm-check --connector offloading`` asks for (usage errors for the options
    it does not take)."""
    if args.model is not None:
        parser.error("argument --connector: takes --layout, not --model")
    runs = args.run or list(RUNS)
    if any(run not in RUNS for run in runs):
        parser.error(f"argument --connector: runs {' and '.join(RUNS)} only")
    cpu_chunks = CPU_CHUNKS if args.cpu_chunks is None else args.cpu_chunks
    if cpu_chunks < 1:
        parser.error("argument --cpu-chunks: at least 1")
    return [
        OffloadRun(
            RunConfig(
                layout=layout,
                run=run,
                defaults=defaults,
                seed=args.seed,
                num_requests=args.requests,
                num_blocks=args.num_blocks or NUM_BLOCKS[layout],
            ),
            cpu_chunks,
        )
        for layout in args.layout or LAYOUTS
        for run in runs
        for defaults in args.defaults or ["engine"]
    ]


def connector_comparisons(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> list[Comparison]:
    """``vllm-check --connector offloading``'s comparisons, printed as they come."""
    return run_connector_check(offload_runs(args, parser), args.backend or ["reference"])
