"""``python -m hybridkv.bench``: smoke runs at tiny sizes (with vLLM when it imports, and with vLLM
made absent), the busy-core process, the equality check and ``--plot``. No timing is asserted.

The runs call ``main`` in this process with ``--threads default``, so torch's thread count is left
alone."""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

import pytest

from hybridkv import bench
from hybridkv.bench import BusyCore, Mismatch, Sizes, Way, check_same, decode, hybridkv_backends
from hybridkv.reference import KVCacheManager, Request
from hybridkv.spec import KVCacheConfig

TINY = Sizes(
    batches=(4,),
    steps=2,
    prompt=48,
    long_prompt=256,
    repeat=1,
    admitted=2,
    shared=64,
    own=16,
    pool_blocks=2000,
    scaling_batches=(2, 4, 64),
    scaling_pools=(600, 2000),
    scaling_steps=2,
)


@pytest.fixture
def tiny(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "QUICK", TINY)


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "vllm_version", lambda: None)


SCENARIOS = (
    "decode B=4", "allocate_slots_batch", "hash 256-token prompt", "lookup", "admission",
    "its floor",
)  # fmt: skip


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_benchmark_drives_vllms_own_manager(
    tiny: None, capsys: pytest.CaptureFixture[str]
) -> None:
    if bench.vllm_version() is None:
        pytest.skip("vLLM 0.33 is not importable (scripts/install-vllm-cpu.sh installs it)")
    assert bench.main(["--quick", "--threads", "default", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert "KVCacheManager and Request (sha256_cbor block hasher) driven" in out
    assert (
        "| scenario | vLLM | reference | optimized | vLLM÷ref | vLLM÷opt | target | met? |" in out
    )
    for scenario in (*SCENARIOS, "host memory"):
        assert scenario in out
    assert "--threads default" in out
    assert "n/a (no vLLM)" not in out


def test_without_vllm_the_reference_stands_in(
    tiny: None, no_vllm: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main(["--quick", "--threads", "default", "--busy-core"]) == 0
    out = capsys.readouterr().out
    stand_in = [line for line in out.splitlines() if "stands in" in line]
    assert stand_in == [
        "vLLM is not importable: the reference, hashing by the definition (one cbor2 call per "
        "block), stands in for it as `stand-in`; targets are not judged"
    ]
    assert "busy core: a separate process keeps one core busy" in out
    assert "stand-in÷opt" in out
    for scenario in SCENARIOS:
        assert scenario in out
    assert "n/a (no vLLM)" in out


def test_the_busy_core_process_starts_and_stops() -> None:
    with BusyCore() as busy:
        process = busy.process
        assert process is not None
        assert process.is_alive()
    assert busy.process is None
    assert not process.is_alive()

    started = []

    def interrupted() -> None:
        with BusyCore() as busy:
            started.append(busy.process)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    [process] = started
    assert process is not None
    assert not process.is_alive()


def test_the_equality_check_names_the_backend_that_differs() -> None:
    same = ((1, 2, 3), (4, 5))
    check_same("decode", [("vLLM", same), ("reference", ((1, 2, 3), (4, 5)))])
    with pytest.raises(Mismatch, match=r"decode: optimized returned .*first difference at \[1\]"):
        check_same(
            "decode", [("vLLM", same), ("reference", same), ("optimized", ((1, 2, 3), (4, 6)))]
        )
    with pytest.raises(Mismatch, match="hit"):
        check_same("hit", [("vLLM", 4080), ("optimized", 4064)])


def test_decode_stops_when_a_backend_hands_out_other_block_ids() -> None:
    _, reference, _, _ = hybridkv_backends("cpu")

    def shifted(config: KVCacheConfig, max_model_len: int, max_num_reqs: int) -> bench.Manager:
        manager = KVCacheManager(config, max_model_len)
        assert manager.allocate_slots(Request("other", [1] * 16, hash_block_size=16), 16)
        return manager

    other = bench.Backend("shifted", "reference", shifted, reference.request, reference.hash_job)
    with pytest.raises(Mismatch, match="decode B=2: the prefill's block ids: shifted returned"):
        decode([Way(reference), Way(other)], batch=2, steps=1, prompt=32)


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib is not installed (the extra `plot`)",
)
def test_plot_writes_a_png(
    tiny: None, no_vllm: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "decode.png"
    assert bench.main(["--quick", "--threads", "default", "--plot", str(target)]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "pool (blocks)" in out
    assert "not run" in out
    assert "pool 600: B = 64" in out


def test_plot_without_matplotlib_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: None if name == "matplotlib" else real(name, *args),
    )
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--plot", "x.png"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.endswith(
        "--plot needs matplotlib, which is not installed: pip install '.[plot]'\n"
    )


def test_hybridkv_bench_passes_the_options_through(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    from hybridkv.cli import main

    seen: list[list[str]] = []
    monkeypatch.setattr(runpy, "run_module", lambda *args, **kwargs: seen.append(list(sys.argv)))
    options = ["--quick", "--threads", "default", "--busy-core", "--scaling", "--plot", "p.png"]
    result = CliRunner().invoke(main, ["bench", *options, "--format", "markdown"])
    assert result.exit_code == 0, result.output
    assert seen == [["python -m hybridkv.bench", *options, "--format", "markdown"]]


def test_scaling_takes_each_rows_fastest_pass_and_prints_each_ways_spread(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two sweeps over two rows (B = 2 and 4), whose decode steps are made up: each row
    reads the faster of its two passes, and the last line each way's highest µs per request
    over the rows ÷ its lowest."""
    from hybridkv import bench_scaling

    made_up = iter([
        [40.0, 60.0, 8.0, 6.0], [100.0, 100.0, 40.0, 40.0],  # first sweep: B = 2, then B = 4
        [50.0, 50.0, 4.0, 5.0], [80.0, 160.0, 24.0, 12.0],  # second sweep
    ])  # fmt: skip

    def decode_made_up(ways: list[Way], batch: int, *args: object, **kwargs: object) -> object:
        return {way.label: (us, us) for way, us in zip(ways, next(made_up), strict=True)}

    monkeypatch.setattr(bench_scaling, "decode", decode_made_up)
    sizes = Sizes(**{**TINY.__dict__, "scaling_batches": (2, 4), "scaling_pools": (10**6,)})
    sizes = Sizes(**{**sizes.__dict__, "scaling_passes": 2})
    stand_in, ref, opt, _ = hybridkv_backends("cpu")
    curves = bench_scaling.run_scaling((stand_in, ref, opt), sizes, markdown=True)
    assert curves[10**6]["optimized"] == [(2, 4.0), (4, 24.0)]
    assert curves[10**6]["optimized, batched"] == [(2, 5.0), (4, 12.0)]
    out = capsys.readouterr().out
    # Per request: stand-in 20 and 20, reference 25 and 25, optimized 2 and 6, batched 2.5 and 3.
    assert out.rstrip().endswith(
        "each figure: the fastest of 2 pass(es) over every row; per request, the highest row ÷ "
        "the lowest: stand-in 1.00×, reference 1.00×, optimized 3.00×, optimized, batched 1.20× "
        "(target for the optimized backend: ≤ 1.5×)"
    )


def test_a_row_slow_in_every_pass_by_the_baseline_runs_again_until_it_is_not(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three rows, two sweeps: the baseline's cost per request is 20 µs in the rows B = 2 and
    4 and 50 then 40 in B = 8 (above 1.25× the median, 20, in both sweeps: a slow phase), so
    B = 8 runs again, once more at 30 and then at 20; it reads its fastest pass, and the
    footnote names it with its two extra passes."""
    from hybridkv import bench_scaling

    made_up = iter([
        [40.0, 50.0, 4.0, 5.0], [80.0, 100.0, 8.0, 10.0], [400.0, 400.0, 80.0, 80.0],
        [40.0, 50.0, 4.0, 5.0], [80.0, 100.0, 8.0, 10.0], [320.0, 320.0, 64.0, 64.0],
        [240.0, 240.0, 48.0, 48.0],  # the first extra pass: B = 8 only, still slow
        [160.0, 200.0, 16.0, 20.0],  # the second: no row slow any more
    ])  # fmt: skip

    def decode_made_up(ways: list[Way], batch: int, *args: object, **kwargs: object) -> object:
        return {way.label: (us, us) for way, us in zip(ways, next(made_up), strict=True)}

    monkeypatch.setattr(bench_scaling, "decode", decode_made_up)
    sizes = Sizes(**{**TINY.__dict__, "scaling_batches": (2, 4, 8), "scaling_pools": (10**6,)})
    sizes = Sizes(**{**sizes.__dict__, "scaling_passes": 2})
    stand_in, ref, opt, _ = hybridkv_backends("cpu")
    curves = bench_scaling.run_scaling((stand_in, ref, opt), sizes, markdown=True)
    assert next(made_up, None) is None
    assert curves[10**6]["stand-in"] == [(2, 40.0), (4, 80.0), (8, 160.0)]
    assert curves[10**6]["optimized"] == [(2, 4.0), (4, 8.0), (8, 16.0)]
    assert (
        capsys.readouterr()
        .out.rstrip()
        .endswith(
            "each figure: the fastest of 2 pass(es) over every row; rows where the baseline ran "
            "over 1.25× its median µs per request (a slow phase of the machine in every pass) run "
            "again, each the fastest of all its passes: pool 1,000,000 B = 8 (+2); per request, "
            "the highest row ÷ the lowest: stand-in 1.00×, reference 1.00×, optimized 1.00×, "
            "optimized, batched 1.00× (target for the optimized backend: ≤ 1.5×)"
        )
    )


def test_the_table_judges_ratio_targets_on_the_ratio_and_byte_targets_on_the_value(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hybridkv.bench_report import BenchTable, Target

    table = BenchTable("vLLM", judged=True)
    table.timed("decode", (300.0, 600.0, 20.0), per=10, target=Target(12))
    table.timed("batched", (300.0, None, 12.5), target=Target(25))
    table.row("memory", (136.5, 120.5, 33.9), ("136.5", "120.5", "33.9"), Target(34, "B"))
    table.note("  pool", "30.1 + 3.7")
    assert table.rows == [
        ("decode", "300 (30.00)", "600 (60.00)", "20 (2.00)", "0.50×", "15.0×", "≥ 12×", "yes"),
        ("batched", "300", "", "12", "", "24.0×", "≥ 25×", "no"),
        ("memory", "136.5", "120.5", "33.9", "1.13×", "4.03×", "≤ 34 B", "yes"),
        ("  pool", "", "", "30.1 + 3.7", "", "", "", ""),
    ]
    stand_in = BenchTable("stand-in", judged=False)
    stand_in.timed("lookup", (100.0, 100.0, 5.0), target=Target(10))
    stand_in.row("memory", (1.0, 1.0, 40.0), ("1.0", "1.0", "40.0"), Target(34, "B"))
    assert [row[-1] for row in stand_in.rows] == ["n/a (no vLLM)", "no"]
    stand_in.print(markdown=True)
    assert capsys.readouterr().out.splitlines()[:2] == [
        "| scenario | stand-in | reference | optimized | stand-in÷ref | stand-in÷opt | target "
        "| met? |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
