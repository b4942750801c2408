"""The optimized backend against the reference: random scheduler traffic, compared call by call.

Every call's result (hits, new blocks, ``None``s, tables), the pool snapshot (free-queue order,
reference counts, cached blocks, keys), events and statistics must be equal after each step;
the optimized backend's invariant checker runs after each step too. The probes run once with
vector (numpy) windows everywhere and once without them, so both lookup paths are compared.

Each request's ``estimate_cached_tokens``, which reads a few table positions per group, must
also equal vLLM's scan of its whole tables (``cached_tokens_by_scan`` of the reference,
``invariants.estimate_by_scan`` of the optimized backend), on both.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.optimized import TorchKVCacheManager
from hybridkv.optimized.invariants import estimate_by_scan
from hybridkv.reference import KVCacheManager, Request
from hybridkv.reference.table_invariants import cached_tokens_by_scan
from hybridkv.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

SIZES = {"num_kv_heads": 1, "head_size": 1, "dtype_bytes": 4}
MAX_MODEL_LEN = 48


@st.composite
def layouts(draw: st.DrawFn) -> tuple[tuple[KVCacheSpec, ...], bool]:
    """1–4 groups mixing every attention type (equal specs repeat), and whether caching is on."""
    b = draw(st.sampled_from([1, 2, 3, 4]))
    choices: list[KVCacheSpec] = [
        FullAttentionSpec(block_size=b, **SIZES),
        SlidingWindowSpec(block_size=b, sliding_window=draw(st.integers(2, 12)), **SIZES),
        SlidingWindowSpec(block_size=b, sliding_window=draw(st.integers(2, 12)), **SIZES),
        ChunkedLocalAttentionSpec(
            block_size=b, attention_chunk_size=draw(st.integers(1, 12)), **SIZES
        ),
    ]
    specs = tuple(draw(st.lists(st.sampled_from(choices), min_size=1, max_size=4)))
    caching = draw(st.booleans())
    if not caching and draw(st.booleans()):
        specs = (*specs, MambaSpec(block_size=b, state_bytes=16))
    return specs, caching


@dataclass(frozen=True)
class Layout:
    """A drawn layout: groups, caching, retention and the manager's engine keywords."""

    specs: tuple[KVCacheSpec, ...]
    caching: bool
    retention: int | None = None
    use_eagle: bool = False
    lookahead: int = 0


@st.composite
def align_mamba_specs(draw: st.DrawFn, block_size: int) -> MambaSpec:
    """A Mamba ``"align"`` group with speculative and prefill-checkpoint blocks."""
    return MambaSpec(
        block_size=block_size,
        state_bytes=16,
        mamba_cache_mode="align",
        num_speculative_blocks=draw(st.integers(0, 2)),
        num_prefill_checkpoint_blocks=draw(st.integers(0, 1)),
        prefill_checkpoint_alignment=draw(st.sampled_from([None, 1])),
    )


@st.composite
def unit_layouts(draw: st.DrawFn) -> Layout:
    specs, caching = draw(layouts())
    return Layout(specs, caching)


@st.composite
def engine_layouts(draw: st.DrawFn) -> Layout:
    """vLLM 0.33 engine features: groups with different block sizes, Mamba ``"align"`` groups
    (speculative and checkpoint blocks), sparse retention, EAGLE drops or lookahead hashes."""
    b = draw(st.sampled_from([1, 2, 4]))
    kind = draw(st.sampled_from(["mixed", "mamba", "retention"]))
    specs: tuple[KVCacheSpec, ...]
    if kind == "mixed":
        scale = draw(st.sampled_from([2, 4]))
        window = draw(st.integers(2, 12))
        choices: list[KVCacheSpec] = [
            FullAttentionSpec(block_size=b, **SIZES),
            FullAttentionSpec(block_size=b * scale, **SIZES),
            SlidingWindowSpec(block_size=b, sliding_window=window, **SIZES),
            SlidingWindowSpec(block_size=b * scale, sliding_window=window, **SIZES),
        ]
        specs = (choices[draw(st.sampled_from([0, 1]))], choices[draw(st.sampled_from([2, 3]))])
        if specs[0].block_size == specs[1].block_size:
            specs = (specs[0], choices[3 if specs[1] is choices[2] else 2])
    elif kind == "mamba":
        mamba = draw(align_mamba_specs(b))
        others: list[KVCacheSpec] = draw(
            st.lists(
                st.sampled_from(
                    [
                        FullAttentionSpec(block_size=b, **SIZES),
                        SlidingWindowSpec(block_size=b, sliding_window=5, **SIZES),
                    ]
                ),
                max_size=2,
            )
        )
        specs = (*others, mamba)
    else:
        specs = (
            FullAttentionSpec(block_size=b, **SIZES),
            SlidingWindowSpec(block_size=b, sliding_window=draw(st.integers(2, 12)), **SIZES),
        )
    sizes = [s.block_size for s in specs]
    scheduler = max(sizes)
    retention = draw(st.sampled_from([None, 0, scheduler, 2 * scheduler]))
    drafting = draw(st.sampled_from(["none", "none", "eagle", "lookahead"]))
    return Layout(
        specs,
        True,
        retention,
        use_eagle=drafting == "eagle",
        lookahead=1 if drafting == "lookahead" else 0,
    )


@st.composite
def estimate_layouts(draw: st.DrawFn) -> Layout:
    """Every kind of table ``estimate_cached_tokens`` reads differently: the unit and engine
    layouts, plus windows and chunks under sparse retention beside a Mamba ``"align"`` group,
    and full-attention blocks larger than the hash block (prompt-tail entries) beside one."""
    kind = draw(st.sampled_from(["unit", "engine", "local", "tail"]))
    if kind == "unit":
        return draw(unit_layouts())
    if kind == "engine":
        return draw(engine_layouts())
    b = draw(st.sampled_from([1, 2]))
    mamba = draw(align_mamba_specs(b))
    window = SlidingWindowSpec(block_size=b, sliding_window=draw(st.integers(2, 9)), **SIZES)
    specs: tuple[KVCacheSpec, ...]
    if kind == "local":
        chunk = ChunkedLocalAttentionSpec(
            block_size=b, attention_chunk_size=draw(st.integers(1, 9)), **SIZES
        )
        specs = (chunk, window, mamba)
    else:
        specs = (FullAttentionSpec(block_size=2 * b, **SIZES), window, mamba)
    order: list[KVCacheSpec] = draw(st.permutations(list(specs)))
    specs = tuple(order[: draw(st.integers(2, 3))])
    if not any(isinstance(spec, (SlidingWindowSpec, MambaSpec)) for spec in specs):
        specs = (*specs, mamba)
    scheduler = max(spec.block_size for spec in specs)
    retention = draw(st.sampled_from([None, 0, scheduler, 2 * scheduler]))
    # A chunk cannot take the EAGLE drop.
    eagle = kind == "tail" and draw(st.booleans())
    return Layout(specs, True, retention, use_eagle=eagle)


@dataclass
class Twin:
    """One request as seen by each backend (separate objects: nothing shared by accident)."""

    ref: Request
    opt: Request
    running: bool = False


def same_state(ref: KVCacheManager, opt: TorchKVCacheManager, ids: list[str]) -> None:
    assert opt.snapshot() == ref.snapshot()
    assert opt.num_free_blocks == ref.num_free_blocks
    assert opt.usage == ref.usage
    assert opt.take_events() == ref.take_events()
    assert opt.cached_block_counts() == ref.cached_block_counts()
    for rid in ids:
        assert opt.get_block_ids(rid) == ref.get_block_ids(rid)
        estimate = ref.estimate_cached_tokens(rid)
        assert estimate == cached_tokens_by_scan(ref.coordinator.get_blocks(rid)), rid
        assert opt.estimate_cached_tokens(rid) == estimate, rid
        assert estimate_by_scan(opt.state, rid) == estimate, rid
    opt.check_invariants()


def run_traffic(
    data: st.DataObject,
    vector_min: int,
    batched: bool,
    batch_min: int = 1,
    layout_strategy: st.SearchStrategy[Layout] | None = None,
    lazy: bool = False,
) -> None:
    """Random traffic on both backends, compared call by call. With ``lazy`` the optimized
    backend's state is compared only now and then and at the end, and its ``new_step_starts``
    (which makes the running steps' pending work) is called only now and then, where the
    layout lets it differ (no Mamba ``"align"`` group): the pending releases and inserts then
    live across lookups, admissions, frees and resets, which must make them first."""
    layout = data.draw(unit_layouts() if layout_strategy is None else layout_strategy)
    specs, caching = layout.specs, layout.caching
    num_blocks = data.draw(st.integers(2, 40))
    groups = tuple(KVCacheGroup((f"l{i}",), s) for i, s in enumerate(specs))
    config = KVCacheConfig(num_blocks, groups, prefix_cache_retention_interval=layout.retention)
    events = caching and data.draw(st.booleans())
    eagle, hash_lookahead = layout.use_eagle, layout.lookahead
    ref = KVCacheManager(
        config,
        MAX_MODEL_LEN,
        caching,
        enable_kv_cache_events=events,
        use_eagle=eagle,
        num_hash_lookahead_tokens=hash_lookahead,
    )
    opt = TorchKVCacheManager(
        config,
        MAX_MODEL_LEN,
        caching,
        enable_kv_cache_events=events,
        max_num_reqs=8,
        use_eagle=eagle,
        num_hash_lookahead_tokens=hash_lookahead,
    )
    b = ref.hash_block_size
    opt.vector_min = vector_min
    opt.batch_min = opt.free_batch_min = opt.busy_batch_min = batch_min
    twins: dict[str, Twin] = {}
    prefixes = [[], [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 1, 2, 3, 4, 5, 6, 7, 8]]
    aligned = any(getattr(spec, "mamba_cache_mode", None) == "align" for spec in specs)
    for step in range(data.draw(st.integers(5, 40))):
        ref.new_step_starts()
        if not lazy or aligned or data.draw(st.integers(0, 3)) == 0:
            opt.new_step_starts()
        op = data.draw(st.sampled_from(["add", "lookup", "alloc", "decode", "free", "reset"]))
        waiting = sorted(r for r, t in twins.items() if not t.running)
        running = sorted(r for r, t in twins.items() if t.running)
        if op == "add" or not twins:
            if len(twins) >= 8:
                continue
            prompt = data.draw(st.sampled_from(prefixes)) + data.draw(
                st.lists(st.integers(0, 3), min_size=1, max_size=14)
            )
            salt = data.draw(st.sampled_from([None, None, "s"]))
            rid = f"r{step}"
            twins[rid] = Twin(
                Request(
                    rid,
                    prompt,
                    hash_block_size=b,
                    cache_salt=salt,
                    num_hash_lookahead_tokens=hash_lookahead,
                ),
                Request(
                    rid,
                    list(prompt),
                    hash_block_size=b,
                    cache_salt=salt,
                    num_hash_lookahead_tokens=hash_lookahead,
                ),
            )
            # Hashes lagging behind the full blocks (an engine's lookahead hashes in flight):
            # the next appended token hashes the missing blocks.
            lag = data.draw(st.sampled_from([0, 0, 0, 1, 2]))
            for r in (twins[rid].ref, twins[rid].opt):
                hashed = len(r.block_hashes)  # a request not yet met hashes when read
                del r._block_hashes[max(0, hashed - lag) :]
        elif op == "lookup" and waiting:
            t = twins[data.draw(st.sampled_from(waiting))]
            cap = data.draw(st.sampled_from([None, None, 0, 3, 8, 100]))
            assert opt.get_computed_blocks(t.opt, cap) == ref.get_computed_blocks(t.ref, cap)
        elif op == "alloc" and waiting:
            # A scheduler looks a waiting request up right before admitting it.
            t = twins[data.draw(st.sampled_from(waiting))]
            cap = data.draw(st.sampled_from([None, None, None, 4, 9]))
            found = opt.get_computed_blocks(t.opt, cap)
            assert found == ref.get_computed_blocks(t.ref, cap)
            blocks, hit = found[:2] if data.draw(st.booleans()) else (None, 0)
            n = t.ref.num_tokens - t.ref.num_computed_tokens - hit
            if n <= 0:
                continue
            n = data.draw(st.integers(1, n))
            lookahead = data.draw(st.sampled_from([0, 0, 1, 3]))
            delay = caching and data.draw(st.booleans())
            reserved, watermark = data.draw(st.sampled_from(KEPT_FREE))
            new = opt.allocate_slots(
                t.opt, n, hit, blocks, lookahead, delay,
                reserved_blocks=reserved, watermark_blocks=watermark,
            )  # fmt: skip
            assert new == ref.allocate_slots(
                t.ref, n, hit, blocks, lookahead, delay,
                reserved_blocks=reserved, watermark_blocks=watermark,
            )  # fmt: skip
            if new is not None:
                # Admitted: the admitting lookup is counted (the scheduler's call).
                opt.record_prefix_cache_stats(t.opt, hit)
                ref.record_prefix_cache_stats(t.ref, hit)
                for r in (t.ref, t.opt):
                    r.num_computed_tokens = min(r.num_computed_tokens + hit + n, r.num_tokens)
                t.running = True
                if delay and data.draw(st.booleans()):
                    opt.cache_blocks(t.opt, t.opt.num_computed_tokens)
                    ref.cache_blocks(t.ref, t.ref.num_computed_tokens)
        elif op == "decode" and running:
            chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
            for rid in chosen:
                t = twins[rid]
                if t.ref.num_tokens < MAX_MODEL_LEN - 1:
                    token = data.draw(st.integers(0, 3))
                    t.ref.append_output_token_ids(token)
                    t.opt.append_output_token_ids(token)
                # Async scheduling: some computed tokens are still in flight.
                in_flight = data.draw(st.integers(0, min(t.ref.num_computed_tokens, 6)))
                for r in (t.ref, t.opt):
                    vars(r)["num_in_flight_tokens"] = in_flight
            sizes = [
                max(1, min(twins[r].ref.num_tokens - twins[r].ref.num_computed_tokens, 3))
                for r in chosen
            ]
            reserved, watermark = data.draw(st.sampled_from(KEPT_FREE))
            if batched:
                results = opt.allocate_slots_batch(
                    [twins[r].opt for r in chosen],
                    sizes,
                    reserved_blocks=reserved,
                    watermark_blocks=watermark,
                )
            else:
                results = [
                    opt.allocate_slots(
                        twins[r].opt, n, reserved_blocks=reserved, watermark_blocks=watermark
                    )
                    for r, n in zip(chosen, sizes, strict=True)
                ]
            for rid, n, new in zip(chosen, sizes, results, strict=True):
                expected = ref.allocate_slots(
                    twins[rid].ref, n, reserved_blocks=reserved, watermark_blocks=watermark
                )
                assert new == expected, rid
                if new is not None:
                    for r in (twins[rid].ref, twins[rid].opt):
                        r.num_computed_tokens = min(r.num_computed_tokens + n, r.num_tokens)
        elif op == "free" and running:
            chosen = data.draw(st.lists(st.sampled_from(running), min_size=1, unique=True))
            preempt = data.draw(st.booleans())
            if batched:
                opt.free_batch([twins[r].opt for r in chosen])
            else:
                for rid in chosen:
                    opt.free(twins[rid].opt)
            for rid in chosen:
                ref.free(twins[rid].ref)
                if preempt:
                    twins[rid].ref.num_computed_tokens = twins[rid].opt.num_computed_tokens = 0
                    twins[rid].ref.num_preemptions += 1
                    twins[rid].opt.num_preemptions += 1
                    twins[rid].running = False
                else:
                    del twins[rid]
        elif op == "reset":
            assert opt.reset_prefix_cache() == ref.reset_prefix_cache()
        if not lazy or data.draw(st.integers(0, 3)) == 0:
            same_state(ref, opt, list(twins))
    same_state(ref, opt, list(twins))
    assert opt.make_prefix_cache_stats() == ref.make_prefix_cache_stats()


KEPT_FREE = [(0, 0), (0, 0), (2, 0), (0, 2), (1, 3)]
"""(reserved, watermark): blocks an allocation leaves free (an engine's loads and watermark)."""

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@SETTINGS
@given(st.data())
def test_random_traffic_matches_the_reference_scalar_probes(data: st.DataObject) -> None:
    run_traffic(data, vector_min=10_000, batched=False)


@SETTINGS
@given(st.data())
def test_random_traffic_matches_the_reference_tensor_probes(data: st.DataObject) -> None:
    run_traffic(data, vector_min=1, batched=False)


@SETTINGS
@given(st.data())
def test_batched_steps_match_sequential_reference_calls(data: st.DataObject) -> None:
    """Every batch vectorised (however small), and batches split between vectorised and
    single-request work (``batch_min`` 3)."""
    run_traffic(data, vector_min=1, batched=True, batch_min=data.draw(st.sampled_from([1, 3])))


@SETTINGS
@given(st.data())
def test_deferred_step_work_is_made_before_anything_reads_it(data: st.DataObject) -> None:
    """Running steps leave their releases and inserts pending (``PendingWork``); with the
    state compared only now and then, every later call (lookups, admissions, frees, resets,
    batches, the counters) must see them made, on every probe path."""
    run_traffic(data, vector_min=data.draw(st.sampled_from([1, 10_000])), batched=False, lazy=True)


@SETTINGS
@given(st.data())
def test_deferred_step_work_is_made_before_a_batch_reads_it(data: st.DataObject) -> None:
    """``test_deferred_step_work_is_made_before_anything_reads_it`` with batched decode steps
    and frees (whole or split between vectorised and single-request work)."""
    run_traffic(
        data,
        vector_min=data.draw(st.sampled_from([1, 10_000])),
        batched=True,
        batch_min=data.draw(st.sampled_from([1, 3])),
        lazy=True,
    )


@SETTINGS
@given(st.data())
def test_estimates_read_at_a_few_positions_equal_the_scan(data: st.DataObject) -> None:
    """``estimate_cached_tokens`` (a few positions per group) against the scan of the tables
    (``same_state``) on every layout kind: windows and chunks releasing cached blocks, sparse
    retention, Mamba ``"none"`` (caching off) and ``"align"`` groups, mixed block sizes,
    prompt-tail entries, delayed caching and adopted hits."""
    run_traffic(
        data,
        vector_min=data.draw(st.sampled_from([1, 10_000])),
        batched=data.draw(st.booleans()),
        layout_strategy=estimate_layouts(),
    )


@SETTINGS
@given(st.data())
def test_engine_layouts_match_the_reference(data: st.DataObject) -> None:
    """Groups with different block sizes, Mamba ``"align"`` groups, sparse retention, EAGLE
    drops and lookahead hashes: single calls and batches (served request by request where the
    layout needs it), both probe paths."""
    run_traffic(
        data,
        vector_min=data.draw(st.sampled_from([1, 10_000])),
        batched=data.draw(st.booleans()),
        layout_strategy=engine_layouts(),
    )
