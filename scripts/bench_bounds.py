"""What bounds the benchmark's missed targets, measured.

docs/optimized-backend.md, "What bounds them", holds its output.

``python scripts/bench_bounds.py`` prints, on this interpreter, one torch thread:

1. floors: the least work an implementation of the scheduler API does in pure Python —
   a decode ``allocate_slots`` call that validates its arguments, reads the request's counters
   and its row's thresholds and finds nothing to do; the SHA-256 chain of 8,192 block hashes
   (the hash function is vLLM's, fixed); the benchmark's 131,072-token hit as the tuples of
   Python ints ``KVCacheBlocks`` holds (one full-attention group of 8,191 ids, six window
   groups of nulls and 64 ids); comparing two 131,072-token prompts packed (the collision
   check); and building the admission scenario's request (validating and packing 4,352 ids);
2. the optimized backend's decode step at B = 1,024 (the benchmark's scenario) split by what
   each ``allocate_slots`` call does: nothing, take new blocks, or release and cache blocks
   (left pending), beside ``new_step_starts`` (which makes them); once as is, once with other
   work between the steps that leaves the caches cold, as vLLM's step does in the benchmark;
3. its lookup of a fully cached 131,072-token prompt, with the time spent reading the hit (from
   the memo's run, or else from runs of the sources' blocks), and after it reading the hit's
   ids as tuples;
4. its admission of a request sharing a 4,096-token prefix split into building the request
   (with the manager's block hasher), ``get_computed_blocks`` and ``allocate_slots``;
5. the floor of that admission (``admission_floor``: ``hybridkv.bench_floor``, the same steps
   on plain buffers, no checks and no function layers, which the benchmark times in its own
   admission loop too), as is, with other work between admissions, and, when vLLM
   imports, with one of vLLM's own admissions between each (the benchmark's setting), beside
   those admissions' time: vLLM ÷ that floor is the most an admission could gain.

Each figure is a median; the machine's noise moves them by up to 2×.
``scripts/admission_parts.py`` splits the admission further, cold: each part taken out in turn.
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
from array import array
from collections.abc import Callable, Sequence

import numpy as np  # noqa: TID251 (buffers as the optimized backend holds them)
import torch  # noqa: TID251 (the optimized backend's int32 buffers, as it holds them)

from hybridkv.bench import BLOCK, decode_blocks, gemma_like, tokens
from hybridkv.bench_backends import GROUPS, Backend, Manager, vllm_backend, vllm_version
from hybridkv.bench_floor import AdmissionFloor
from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized import hits as hits_module
from hybridkv.optimized.lookup import Lookup, TypeProbe
from hybridkv.optimized.state import ManagerState
from hybridkv.reference import Request
from hybridkv.reference.request import pack_token_ids


def median_seconds(job: Callable[[], object], repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        job()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class FloorManager:
    """Only what a decode call must do when no group crosses a block boundary."""

    def __init__(self, requests: list[Request]) -> None:
        self.rows = {r.request_id: i for i, r in enumerate(requests)}
        never = array("q", [10**9] * len(requests))
        self.capacity, self.release_at, self.cache_at = (memoryview(never) for _ in range(3))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool | None:
        if type(num_new_tokens) is not int or num_new_tokens <= 0:
            raise ValueError(num_new_tokens)
        if len(request.block_hashes) > request.num_tokens // 16:
            raise ValueError(request.request_id)
        row = self.rows[request.request_id]
        computed = request.num_computed_tokens
        processed = computed - request.num_in_flight_tokens
        if (
            processed >= self.release_at[row]
            or computed + num_new_tokens > self.capacity[row]
            or min(computed + num_new_tokens, request.num_tokens) >= self.cache_at[row]
        ):
            return None
        return True


def floors() -> None:
    requests = [Request(f"r{i}", list(range(100)), hash_block_size=16) for i in range(1024)]
    manager = FloorManager(requests)
    seconds = median_seconds(lambda: [manager.allocate_slots(r, 1) for r in requests])
    print(f"decode call floor (validation + row thresholds): {seconds / 1024 * 1e6:.2f} µs")

    rng = random.Random(0)
    messages = [rng.randbytes(80) for _ in range(8192)]

    def chain() -> None:
        parent = b"\0" * 32
        for message in messages:
            digest = hashlib.sha256(parent)
            digest.update(message)
            parent = digest.digest()

    seconds = median_seconds(chain)
    print(
        f"SHA-256 chain over 8,192 blocks of 80 bytes: {seconds * 1e3:.2f} ms "
        f"({seconds / 8192 * 1e6:.2f} µs per block)"
    )

    found = array("i", range(1000, 1000 + 8191))
    window = array("i", range(5000, 5064))

    def hit() -> object:
        full = tuple(found)
        nulls = (0,) * 8127
        return (full, *(nulls + tuple(window) for _ in range(6)))

    seconds = median_seconds(hit)
    print(
        "a 131,072-token hit as KVCacheBlocks' tuples (8,191 ids + 6 × (8,127 nulls + 64 ids)): "
        f"{seconds * 1e6:.0f} µs"
    )
    prompt = tokens(rng, 131_072)
    one, two = array("Q", prompt), array("Q", list(prompt))
    seconds = median_seconds(lambda: one == two)
    print(f"comparing two 131,072-token prompts packed: {seconds * 1e6:.0f} µs")
    shared = tokens(rng, 4352)
    seconds = median_seconds(lambda: pack_token_ids("prompt_token_ids", list(shared)), 31)
    print(f"validating and packing a 4,352-token prompt: {seconds * 1e6:.0f} µs")


def crossing_floors(between: Callable[[], object] | None = None) -> tuple[float, float]:
    """The least Python a decode step's crossing call does, on buffers of the benchmark's sizes
    (7 groups, 1,032 table rows of 132 positions, a 924,736-block pool), with no checks, no
    thresholds and no function calls: a call entering a new block takes one block per group
    from a linked free queue and writes it to the group's table; a call filling a block nulls
    the position leaving each of the 6 windows (noting the block for release) and notes the
    newly full block of each group for caching. Returns the two medians in µs, over 64 calls
    of each on distinct rows (as one step makes), ``between`` run before each batch of calls."""
    groups, rows, width, blocks = 7, 1032, 132, 924_736
    tab = memoryview(np.zeros(groups * rows * width, dtype=np.int32)).cast("B").cast("i")
    nxt = memoryview(np.arange(1, blocks + 1, dtype=np.int32)).cast("B").cast("i")
    prv = memoryview(np.arange(-1, blocks - 1, dtype=np.int32)).cast("B").cast("i")
    ref = memoryview(np.zeros(blocks, dtype=np.int32)).cast("B").cast("i")
    length = memoryview(np.zeros(rows * groups, dtype=np.int64)).cast("B").cast("q")
    nulls = memoryview(np.zeros(rows * groups, dtype=np.int64)).cast("B").cast("q")
    bases = [g * rows * width for g in range(groups)]
    head = [1]
    rng = random.Random(3)
    picked = rng.sample(range(rows), 64)
    new_times, fill_times = [], []
    for repeat in range(9):
        if between is not None:
            between()
        pending: list[int] = []
        for row in picked:
            pos = 2 * repeat
            start = time.perf_counter_ns()
            block = head[0]
            taken = []
            for base in bases:
                taken.append(block)
                following = nxt[block]
                prv[block] = nxt[block] = -1
                ref[block] = 1
                tab[base + row * width + pos] = block
                block = following
            head[0] = block
            for i in range(row * groups, row * groups + groups):
                length[i] = pos + 1
            result = tuple(zip(taken))
            new_times.append(time.perf_counter_ns() - start)
            start = time.perf_counter_ns()
            for g in range(1, groups):
                at = bases[g] + row * width + pos
                pending.append(tab[at])
                tab[at] = 0
                nulls[row * groups + g] = pos + 1
            full = [tab[base + row * width + pos + 1] for base in bases]
            pending.extend(full)
            fill_times.append(time.perf_counter_ns() - start)
            del result
    return statistics.median(new_times) / 1e3, statistics.median(fill_times) / 1e3


def decode_split(
    batch: int = 1024,
    steps: int = 33,
    prompt: int = 2000,
    between: Callable[[], object] | None = None,
) -> None:
    """The benchmark's decode scenario on the optimized backend (each step begins with
    ``new_step_starts``, which makes the previous step's pending releases and inserts), each
    call timed and sorted by what it did; the first step, which releases what left each window
    after the prefill, is not counted. ``between`` runs between steps (other work that leaves
    the caches cold, as vLLM's step does between the benchmark's)."""
    rng = random.Random(batch)
    config = gemma_like(decode_blocks(batch, steps, prompt))
    manager = TorchKVCacheManager(config, prompt + steps + 64, max_num_reqs=batch + 8)
    requests = []
    for i in range(batch):
        r = Request(f"r{i}", tokens(rng, prompt - i % BLOCK), hash_block_size=BLOCK)
        if manager.allocate_slots(r, r.num_tokens) is None:
            raise RuntimeError("the prompts do not fit in the pool")
        r.num_computed_tokens = r.num_tokens
        requests.append(r)
    kinds: dict[str, list[int]] = {
        "new_step_starts (the last step's pending work)": [],
        "nothing to do": [],
        "new blocks": [],
        "release and cache (left pending)": [],
    }
    names = list(kinds)
    pending = manager.pool.pending
    for step in range(steps):
        if between is not None:
            between()
        new_tokens = tokens(rng, batch)
        for r, token in zip(requests, new_tokens, strict=True):
            r.append_output_token_ids(token)
        start = time.perf_counter_ns()
        manager.new_step_starts()
        if step:
            kinds[names[0]].append(time.perf_counter_ns() - start)
        for r in requests:
            waiting = len(pending)
            start = time.perf_counter_ns()
            out = manager.allocate_slots(r, 1)
            took = time.perf_counter_ns() - start
            r.num_computed_tokens += 1
            if out is None:
                raise RuntimeError("the pool ran out")
            if not step:
                continue
            if any(out.get_block_ids()):
                kinds[names[2]].append(took)
            elif len(pending) != waiting:
                kinds[names[3]].append(took)
            else:
                kinds[names[1]].append(took)
    total = sum(sum(times) for times in kinds.values()) / (steps - 1) / 1e3
    label = "" if between is None else ", other work between steps"
    print(f"optimized decode step, B = {batch:,}{label}: {total:,.0f} µs per step")
    for kind, times in kinds.items():
        per_step = len(times) / (steps - 1)
        median = statistics.median(times) / 1e3
        print(
            f"  {kind}: {per_step:,.0f} calls per step × {median:.1f} µs (median) = "
            f"{per_step * median:,.0f} µs"
        )


def other_work(count: int = 300_000) -> Callable[[], object]:
    """A stand-in for what runs between two scheduler steps (the engine's, or vLLM's step in
    the benchmark): reading a third of ``count`` small Python objects, which evicts the
    manager's state from the caches."""
    objects = [{"id": i, "name": str(i)} for i in range(count)]

    def walk() -> int:
        return sum(o["id"] + len(o["name"]) for o in objects[::3])

    return walk


def admission_floor(
    count: int = 128,
    shared: int = 4096,
    own: int = 256,
    between: Callable[[], object] | None = None,
) -> float:
    """The least an admission of the benchmark's scenario does (``hybridkv.bench_floor``: a
    prompt of ``shared`` ids that a cached request holds, then ``own`` ids of its own): the
    median µs over ``count`` admissions, ``between`` run before each (as vLLM's admission runs
    between the benchmark's)."""
    rng = random.Random(11)
    system = tokens(rng, shared)
    floor = AdmissionFloor(system + tokens(rng, own), shared, count)
    times = []
    for _ in range(count):
        prompt = system + tokens(rng, own)
        if between is not None:
            between()
        start = time.perf_counter()
        result = floor.admit(prompt)
        times.append(time.perf_counter() - start)
        del result
    return statistics.median(times) * 1e6


def vllm_admissions(count: int = 128, shared: int = 4096, own: int = 256) -> Admissions:
    """The benchmark's admission scenario on vLLM's own manager (its ``Request`` and
    ``sha256_cbor`` hasher), one admission a call, each timed (``Admissions.times``)."""
    backend = vllm_backend()
    rng = random.Random(12)
    system = tokens(rng, shared)
    per_request = GROUPS * ((shared + own) // BLOCK + 1)
    manager = backend.make(gemma_like((count + 2) * per_request), shared + own + 1, count + 8)
    warm = backend.request_of(manager, "warm", system + tokens(rng, own))
    manager.allocate_slots(warm, warm.num_tokens)
    return Admissions(backend, manager, system, own, rng)


class Admissions:
    """Admissions of prompts sharing ``system`` into one manager, each call one, timed."""

    def __init__(
        self, backend: Backend, manager: Manager, system: list[int], own: int, rng: random.Random
    ) -> None:
        self.backend, self.manager, self.system, self.own, self.rng = (
            backend, manager, system, own, rng
        )  # fmt: skip
        self.times: list[float] = []

    def __call__(self) -> None:
        prompt = self.system + tokens(self.rng, self.own)
        start = time.perf_counter()
        r = self.backend.request_of(self.manager, f"r{len(self.times)}", prompt)
        blocks, hit, _ = self.manager.get_computed_blocks(r)
        if self.manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
            raise RuntimeError("the pool ran out")
        self.times.append(time.perf_counter() - start)


def admission_split(count: int = 128, shared: int = 4096, own: int = 256) -> None:
    """The benchmark's admission scenario on the optimized backend, each part timed."""
    rng = random.Random(11)
    system = tokens(rng, shared)
    per_request = 7 * ((shared + own) // BLOCK + 1)
    manager = TorchKVCacheManager(
        gemma_like((count + 2) * per_request), shared + own + 1, max_num_reqs=count + 8
    )
    hasher = manager.block_hasher
    warm = Request("warm", system + tokens(rng, own), hash_block_size=BLOCK, block_hasher=hasher)
    manager.allocate_slots(warm, warm.num_tokens)
    parts: dict[str, list[float]] = {"build the request": [], "lookup": [], "allocate": []}
    for i in range(count):
        prompt = system + tokens(rng, own)
        start = time.perf_counter()
        r = Request(f"r{i}", prompt, hash_block_size=BLOCK, block_hasher=hasher)
        built = time.perf_counter()
        blocks, hit, _ = manager.get_computed_blocks(r)
        looked = time.perf_counter()
        if manager.allocate_slots(r, r.num_tokens - hit, hit, blocks) is None:
            raise RuntimeError("the pool ran out")
        done = time.perf_counter()
        parts["build the request"].append(built - start)
        parts["lookup"].append(looked - built)
        parts["allocate"].append(done - looked)
    medians = {part: statistics.median(times) * 1e6 for part, times in parts.items()}
    print(
        f"optimized admission, {shared:,}-token shared prefix + {own} own tokens: "
        f"{sum(medians.values()):,.0f} µs per request"
    )
    for part, median in medians.items():
        print(f"  {part}: {median:,.0f} µs (median)")


def lookup_split(length: int = 131_072, repeat: int = 9) -> None:
    """The benchmark's lookup scenario on the optimized backend: the whole call, the hit read
    within it from the memo's run (``memo_hit``) or else from sources' runs (chain walk,
    checks, verification: ``lead_run`` and ``Lookup.source_run``), and, after it, reading the
    hit's ids as ``KVCacheBlocks``' tuples (what ``allocate_slots`` does with a hit; the lookup
    itself returns them unread)."""
    rng = random.Random(7)
    prompt = tokens(rng, length)
    manager = TorchKVCacheManager(gemma_like(7 * (length // BLOCK + 1) + 64), length + 1)
    hasher = manager.block_hasher
    first = Request("a", list(prompt), hash_block_size=BLOCK, block_hasher=hasher)
    manager.allocate_slots(first, length)
    manager.free(first)
    spent = {
        "the memo's run": 0.0,
        "sources' runs": 0.0,
        "the hit read as tuples, after the call": 0.0,
    }
    run, lead, memo_run = Lookup.source_run, hits_module.lead_run, hits_module.memo_hit

    def timed_memo_run(s: ManagerState, request: Request, max_length: int) -> object:
        start = time.perf_counter()
        try:
            return memo_run(s, request, max_length)
        finally:
            spent["the memo's run"] += time.perf_counter() - start

    def timed_run(
        self: Lookup, lo: int, hi: int, group_ids: Sequence[int], first: int | None = None
    ) -> object:
        start = time.perf_counter()
        try:
            return run(self, lo, hi, group_ids, first)
        finally:
            spent["sources' runs"] += time.perf_counter() - start

    def timed_lead(memos: Sequence[TypeProbe]) -> list[int]:
        start = time.perf_counter()
        try:
            return lead(memos)
        finally:
            spent["sources' runs"] += time.perf_counter() - start

    Lookup.source_run = timed_run  # type: ignore[method-assign]
    hits_module.lead_run = timed_lead
    hits_module.memo_hit = timed_memo_run
    try:
        totals = []
        for i in range(repeat):
            r = Request(f"p{i}", list(prompt), hash_block_size=BLOCK, block_hasher=hasher)
            start = time.perf_counter()
            blocks, _, _ = manager.get_computed_blocks(r)
            totals.append(time.perf_counter() - start)
            start = time.perf_counter()
            blocks.block_ids  # noqa: B018 (read for its cost)
            spent["the hit read as tuples, after the call"] += time.perf_counter() - start
    finally:
        Lookup.source_run = run  # type: ignore[method-assign]
        hits_module.lead_run = lead
        hits_module.memo_hit = memo_run
    print(
        f"optimized lookup of a fully cached {length:,}-token prompt: "
        f"{statistics.median(totals) * 1e6:,.0f} µs (median)"
    )
    for part, seconds in spent.items():
        print(f"  {part}: {seconds / repeat * 1e6:,.0f} µs (mean)")


def main() -> None:
    torch.set_num_threads(1)
    floors()
    walk = other_work()
    for label, between in (("", None), (", other work between steps", walk)):
        new, fill = crossing_floors(between)
        print(
            f"crossing-call floors{label}: entering a block {new:.1f} µs, "
            f"filling one (release and cache noted) {fill:.1f} µs"
        )
    decode_split()
    decode_split(between=walk)
    lookup_split()
    admission_split()
    for label, between in (("", None), (", other work between admissions", walk)):
        print(
            f"admission floor{label} (validate and pack, hash, read the hit, hold it, take, "
            f"write, key, the result's tuples): {admission_floor(between=between):,.0f} µs"
        )
    if vllm_version() is not None:
        vllm = vllm_admissions()
        floor = admission_floor(between=vllm)
        theirs = statistics.median(vllm.times) * 1e6
        print(
            f"admission floor, a vLLM admission between each: {floor:,.0f} µs; vLLM's "
            f"admissions between them {theirs:,.0f} µs (vLLM ÷ floor {theirs / floor:.1f}×)"
        )


if __name__ == "__main__":
    main()
