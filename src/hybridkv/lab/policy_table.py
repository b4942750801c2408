"""The policy table: prompt tokens hit at first admission under each eviction policy.

``python -m hybridkv.lab.policy_table`` runs ``simulate``'s scheduler loop (FCFS admission,
chunked prefill, preemption) over the synthetic ``agent`` and ``mixed`` workloads, for four
models at three KV cache memories each, under every shipped policy, for several seeds, and
prints each cell's mean and spread beside the bound.

What a cell runs is what a vLLM 0.33 engine runs, LRU included: sparse prefix-cache retention
(``prefix_cache_retention_interval=0``, which drops most out-of-window tails) and full-prompt
admission (``full_sequence_must_fit``), on the optimized backend (which reuses exactly the
reference's blocks under every policy: ``tests/test_optimized_eviction_seam.py``). The hit
rate counts each request once, at its first admission (a preempted request admitted again is
left out). The bound is the same requests on a pool so large that nothing is evicted, with
dense retention (every block kept): no policy can hit more.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20

MEMORIES: dict[str, tuple[int, ...]] = {
    "gpt-oss-120b": (512 * MIB, 1 * GIB, 2 * GIB),
    "gemma-3-27b-it": (4 * GIB, 8 * GIB, 16 * GIB),
    "Llama-4-Scout-17B-16E": (1 * GIB, 2 * GIB, 4 * GIB),
    "Jamba-v0.1": (512 * MIB, 1 * GIB, 2 * GIB),
}
"""Per model, three memories, each twice the one before. The first is the smallest of the
powers of two at which no request of ``agent`` (seed 0) is refused for want of room for its
whole sequence (below it, refusals leave the rest more room and inflate the rate), or, where LRU
still hits more than half the bound there, the one where it hits about half (Jamba-v0.1: 1 GiB).
With sparse retention LRU hits 61-62 % at the first memory of the three attention models, not
half their bound: smaller pools refuse requests first (``docs/eviction.md``, the policy table)."""

WORKLOADS = ("agent", "mixed")
POLICIES = ("lru", "hybrid", "cost", "arc", "hybrid-arc")
BOUND_MEMORY = 64 * GIB
"""The bound's pool: far more than the 120 requests of a workload ever hold at once."""


@dataclass(frozen=True)
class Cell:
    """One run: a model, a workload, a memory, a policy and a seed."""

    model: str
    workload: str
    memory_bytes: int
    policy: str
    seed: int
    requests: int = 120
    engine: bool = True


@dataclass(frozen=True)
class CellResult:
    """What one run measured (a function of the cell alone: no clock). ``group_hit_rates`` and
    ``group_evictions``: per KV cache group, prompt tokens whose blocks first admissions found
    cached / prompt tokens, and cached keys evicted; ``group_reached_again``: of those, the keys
    a later first admission reached again (``hit_profile``)."""

    cell: Cell
    num_blocks: int
    hit_rate: float
    preemptions: int
    rejected: int
    group_hit_rates: tuple[float, ...] = ()
    group_evictions: tuple[int, ...] = ()
    group_reached_again: tuple[int, ...] = ()
    group_reached_rates: tuple[float, ...] = ()
    """Per group, the tokens of the keys reached again (× the group's block size) / prompt
    tokens: at most what a policy that evicted none of them would have added to the group's
    hit."""


def run_cell(cell: Cell) -> CellResult:
    """Plan the model at the cell's memory and run its workload under its policy."""
    from hybridkv.cli.options import resolve_model
    from hybridkv.cli.plan_data import PlanSettings, make_plan
    from hybridkv.lab.hit_profile import ProfiledManager
    from hybridkv.optimized import TorchKVCacheManager
    from hybridkv.reference.planner import with_mamba_cache_mode
    from hybridkv.simulate import Scheduler, SchedulerConfig
    from hybridkv.spec import MambaSpec
    from hybridkv.workloads import make_workload

    settings = PlanSettings(cell.memory_bytes, 16384, 2048, 16, "bf16", "auto")
    plan = make_plan(resolve_model(cell.model), settings)
    config = with_mamba_cache_mode(plan.report.config, True)
    if cell.engine:
        config = dataclasses.replace(config, prefix_cache_retention_interval=0)
    torch_manager = TorchKVCacheManager(
        config,
        16384,
        enable_caching=True,
        enable_kv_cache_events=True,
        eviction_policy=cell.policy,
    )
    block_sizes = [g.spec.block_size for g in config.groups]
    specs = [g.spec for g in config.groups]
    manager = ProfiledManager(torch_manager, specs, plan.report.block_size)
    mamba = [g.spec.block_size for g in config.groups if isinstance(g.spec, MambaSpec)]
    requests = make_workload(cell.workload, cell.requests, seed=cell.seed, max_model_len=16384)
    limits = SchedulerConfig(full_prompt_admission=cell.engine)
    scheduler = Scheduler(
        manager,
        requests,
        block_size=plan.report.block_size,
        config=limits,
        mamba_block_size=mamba[0] if mamba else None,
    )
    result = scheduler.run()
    prompt = result.first_prompt_tokens or 1
    return CellResult(
        cell,
        plan.report.num_blocks,
        result.first_admission_hit_rate,
        result.preemptions,
        result.num_rejected,
        tuple(tokens / prompt for tokens in manager.profile.hit_tokens),
        tuple(manager.profile.evicted_keys),
        tuple(manager.profile.reached_again),
        tuple(
            keys * size / prompt
            for keys, size in zip(manager.profile.reached_again, block_sizes, strict=True)
        ),
    )


def bound_cell(model: str, workload: str, seed: int, requests: int = 120) -> Cell:
    """The bound's run: LRU, dense retention, a pool nothing is evicted from."""
    return Cell(model, workload, BOUND_MEMORY, "lru", seed, requests, engine=False)


def table_cells(
    models: Iterable[str], seeds: Sequence[int], requests: int, policies: Sequence[str]
) -> list[Cell]:
    """Every cell of the table and every bound run, the bounds first."""
    cells: list[Cell] = []
    for model in models:
        for workload in WORKLOADS:
            cells += [bound_cell(model, workload, seed, requests) for seed in seeds]
            for memory in MEMORIES[model]:
                for policy in policies:
                    cells += [
                        Cell(model, workload, memory, policy, seed, requests) for seed in seeds
                    ]
    return cells


def run_all(cells: Sequence[Cell], jobs: int) -> list[CellResult]:
    """Each cell's result, in order; ``jobs`` processes at once."""
    if jobs <= 1:
        return [run_cell(cell) for cell in cells]
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(run_cell, cells, chunksize=1))


Key = tuple[str, str, int, str]
"""(model, workload, memory, policy); memory 0 stands for the bound's run."""


@dataclass(frozen=True)
class Summary:
    """The seeds of one (model, workload, memory, policy): mean and spread, in percent."""

    mean: float
    stdev: float

    @classmethod
    def of(cls, results: Sequence[CellResult]) -> Summary:
        rates = [100 * r.hit_rate for r in results]
        stdev = statistics.stdev(rates) if len(rates) > 1 else 0.0
        return cls(statistics.fmean(rates), stdev)


def by_key(results: Sequence[CellResult]) -> dict[Key, list[CellResult]]:
    """The results grouped by their ``Key`` (the seeds of one cell together)."""
    grouped: dict[Key, list[CellResult]] = {}
    for result in results:
        cell = result.cell
        memory = cell.memory_bytes if cell.engine else 0
        grouped.setdefault((cell.model, cell.workload, memory, cell.policy), []).append(result)
    return grouped


def summarise(results: Sequence[CellResult]) -> dict[Key, Summary]:
    """Each ``Key``'s seeds summarised."""
    return {key: Summary.of(group) for key, group in by_key(results).items()}


def memory_text(memory_bytes: int) -> str:
    if memory_bytes % GIB == 0:
        return f"{memory_bytes // GIB} GiB"
    return f"{memory_bytes // MIB} MiB"


def markdown(summaries: dict[Key, Summary], policies: Sequence[str]) -> str:
    """The table: one row per model, workload and memory; each policy's mean ± stdev."""
    head = "| model | workload | memory | bound | " + " | ".join(policies) + " | best − lru |"
    lines = [head, "|" + " --- |" * (len(policies) + 5)]
    keys = sorted({k[:3] for k in summaries if k[2]}, key=lambda k: (k[0], k[1], k[2]))
    for model, workload, memory in keys:
        bound = summaries[(model, workload, 0, "lru")]
        row = [summaries[(model, workload, memory, p)] for p in policies]
        lru = row[policies.index("lru")].mean
        best = max(s.mean for s in row)
        cells = [f"{s.mean:.1f} ± {s.stdev:.1f}" for s in row]
        lines.append(
            f"| {model} | {workload} | {memory_text(memory)} | {bound.mean:.1f} | "
            + " | ".join(cells)
            + f" | {best - lru:+.1f} |"
        )
    return "\n".join(lines)


def profile_markdown(results: Sequence[CellResult], policies: Sequence[str]) -> str:
    """Per cell of the table and policy, each group's first-admission hit rate (percent), cached
    keys evicted and those of them a later prompt reached again (keys, and their tokens in
    percent of prompt tokens), means over the seeds: where a policy's hits are lost."""
    lines = [
        "| model | workload | memory | policy | hit rate "
        "| per group: hit % / keys evicted (reached again: keys, % of prompt tokens) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    grouped = {key: group for key, group in by_key(results).items() if key[2]}
    order = {policy: n for n, policy in enumerate(policies)}
    for key in sorted(grouped, key=lambda k: (k[0], k[1], k[2], order[k[3]])):
        group = grouped[key]
        rate = statistics.fmean(100 * r.hit_rate for r in group)
        per_group = [
            f"g{g} {statistics.fmean(100 * r.group_hit_rates[g] for r in group):.1f} / "
            f"{statistics.fmean(r.group_evictions[g] for r in group):,.0f} "
            f"({statistics.fmean(r.group_reached_again[g] for r in group):,.0f}, "
            f"{statistics.fmean(100 * r.group_reached_rates[g] for r in group):.1f} %)"
            for g in range(len(group[0].group_hit_rates))
        ]
        model, workload, memory, policy = key
        lines.append(
            f"| {model} | {workload} | {memory_text(memory)} | {policy} | {rate:.1f} | "
            + "; ".join(per_group)
            + " |"
        )
    return "\n".join(lines)


def positive(text: str) -> int:
    """An argparse type: an int of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int of at least 1, got {text!r}")
    return value


def policies_problem(policies: Sequence[str]) -> str | None:
    """Why ``--policies`` cannot run (lru missing, a policy that does not resolve), or None."""
    from hybridkv.policies import resolve_policy

    if "lru" not in policies:
        return f"--policies must include lru (the baseline), got {','.join(policies)!r}"
    for policy in policies:
        try:
            resolve_policy(policy)
        except ValueError as error:
            return f"--policies: {error}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.lab.policy_table")
    parser.add_argument("--models", default=",".join(MEMORIES), help="comma list")
    parser.add_argument("--seeds", type=positive, default=5, help="seeds 0 … N-1")
    parser.add_argument("--requests", type=positive, default=120)
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--jobs", type=positive, default=1)
    parser.add_argument("--json", help="also write every cell's result here")
    parser.add_argument(
        "--memories", help="comma list of byte counts: only these of each model's memories"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print each group's hit rate and evictions per cell (where hits are lost)",
    )
    args = parser.parse_args(argv)
    from hybridkv.extras import exit_if_missing

    exit_if_missing(parser.prog, ["torch", "numpy"])
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MEMORIES]
    if unknown:
        parser.error(f"--models: {', '.join(unknown)} not in the table ({', '.join(MEMORIES)})")
    policies = [p for p in args.policies.split(",") if p]
    if problem := policies_problem(policies):
        parser.error(problem)
    cells = table_cells(models, range(args.seeds), args.requests, policies)
    if args.memories:
        keep = set(args.memories.split(","))
        tabled = {str(m) for model in models for m in MEMORIES[model]}
        if not keep <= tabled:
            parser.error(
                f"--memories: {', '.join(sorted(keep - tabled))} not among the byte counts of "
                f"{', '.join(models)} ({', '.join(sorted(tabled, key=int))})"
            )
        cells = [c for c in cells if not c.engine or str(c.memory_bytes) in keep]
    results = run_all(cells, args.jobs)
    if args.json:
        rows = [{**dataclasses.asdict(r.cell), **dataclasses.asdict(r)} for r in results]
        for row in rows:
            row.pop("cell")
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=1)
    print(markdown(summarise(results), policies))
    if args.profile:
        print()
        print(profile_markdown(results, policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
