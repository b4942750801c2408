"""A failure of the differential machine comes with the scheduler calls that show it, as a
program a person can paste: it replays the shortest failing example and stops at the same call
with the same values: a report a person can act on."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv.conformance.__main__ import main
from hybridkv.conformance.adapters import EngineOptions, reference_backend
from hybridkv.conformance.invariants import ConformanceError
from hybridkv.conformance.lockstep import Lockstep, repro
from hybridkv.conformance.machine import run_differential
from hybridkv.conformance.strategies import SIZES, Layout
from hybridkv.spec import FullAttentionSpec

WRONG = """
from hybridkv.conformance.adapters import ProtocolAdapter, reference_backend


class FreesOneBlockTooMany(ProtocolAdapter):
    def num_free_blocks(self):
        used = self.manager.num_free_blocks < self.manager.block_pool.num_blocks - 1
        return self.manager.num_free_blocks + used


def make_adapter(config, max_model_len, enable_caching, events, engine):
    adapter = reference_backend()[1](config, max_model_len, enable_caching, events, engine)
    adapter.__class__ = FreesOneBlockTooMany
    adapter.name = "wrong"
    return adapter
"""


@pytest.fixture
def wrong_module(tmp_path: Path) -> Iterator[str]:
    """An outside implementation whose free count is one too high while blocks are in use."""
    (tmp_path / "wrong_manager.py").write_text(WRONG)
    sys.path.insert(0, str(tmp_path))
    try:
        yield "wrong_manager:make_adapter"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("wrong_manager", None)


def test_the_failure_carries_a_program_that_replays_it(wrong_module: str) -> None:
    from wrong_manager import make_adapter  # type: ignore[import-not-found]

    with pytest.raises(ConformanceError) as caught:
        run_differential(
            [reference_backend(), ("wrong", make_adapter)],
            max_examples=20,
            steps=10,
            families=("one_type",),
            adapter_specs={"wrong": wrong_module},
        )
    script = caught.value.repro  # type: ignore[attr-defined]
    assert "m = Lockstep.build(Layout(" in script
    assert f"['reference', '{wrong_module}']" in script
    assert script.splitlines()[-1] == "m.check()"
    # Pasted, it stops at the same observable with the same values side by side.
    with pytest.raises(ConformanceError) as replayed:
        exec(script, {})
    assert str(replayed.value) == str(caught.value).split("\n\n")[0].split("\nFalsifying")[0]
    assert "num_free_blocks: wrong differs from reference:" in str(replayed.value)


def test_the_command_prints_the_program_and_the_rerun(
    wrong_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--adapter", wrong_module, "--no-golden", "--examples", "14", "--steps", "10"]
    status = main([*args, "--hit-states", "4"])
    out = capsys.readouterr().out
    assert status == 1
    assert "num_free_blocks: wrong differs from reference:" in out
    assert "the shortest failing example as scheduler calls" in out
    assert "m = Lockstep.build(Layout(" in out
    assert "rerun: python -m hybridkv.conformance --adapter" in out
    assert "FAIL  differential machine" in out


def test_a_script_replays_on_lockstep_by_hand() -> None:
    """The calls a script is made of, written by hand: two references agree on everything."""
    layout = Layout(
        (FullAttentionSpec(block_size=2, **SIZES),), 9, 16, True, True, engine=EngineOptions()
    )
    script = [
        "m.new_request('r0', [1, 2, 3, 4, 5], None)",
        "hit_r0 = m.lookup('r0')",
        "m.set_shared_prefix_boundary('r0', hit_r0)",
        "m.allocate('r0', 5, hit_r0, 0, False, False)",
        "m.set_num_computed_tokens('r0', 5)",
        "m.check()",
        "m.free('r0')",
        "m.forget('r0')",
        "m.new_request('r1', [1, 2, 3, 4, 9], None)",
        "hit_r1 = m.lookup('r1')",
        "m.check()",
    ]
    program = repro(layout, ["reference", "reference"], script)
    namespace: dict[str, object] = {}
    exec(program, namespace)
    m = namespace["m"]
    assert isinstance(m, Lockstep)
    hit = namespace["hit_r1"]
    assert [(f.block_ids, f.num_hit_tokens) for f in hit] == [(((1, 2),), 4)] * 2  # type: ignore[attr-defined]
    assert m.script == script
    assert textwrap.dedent(program).startswith("from hybridkv.conformance.adapters import")


def test_the_machine_compares_the_planners_of_implementations_that_plan() -> None:
    """A planner bug (types ordered as the model lists them, not full attention first) is
    caught by the machine alone: every example plans a drawn model with each planner."""
    from hybridkv.conformance.mutants import MUTANTS, load_mutant, mutant_backend

    mutant = next(m for m in MUTANTS if m.name == "types_in_model_order")
    stats = run_differential([reference_backend(), reference_backend()], max_examples=14, steps=5)
    assert stats.plans == stats.examples
    with pytest.raises(ConformanceError, match=r"^plan_model\("):
        run_differential(
            [reference_backend(), mutant_backend(load_mutant(mutant))],
            max_examples=14,
            steps=5,
            shrink=False,
        )


def test_a_full_attention_scan_past_a_miss_is_unobservable_through_scheduler_calls() -> None:
    """The planted ``full_hit_no_stop`` (count every cached block, not stop at the first miss)
    cannot be seen through the scheduler API: a request frees its blocks last-first, so a
    full-attention block's parent enters the free queue after it and is evicted after it; the
    cached blocks of a prompt are always a prefix, and the stop never fires. States built
    through scheduler calls (the adapter's longest-hit oracle) never tell the mutant apart."""
    from hybridkv.conformance.mutants import MUTANTS, load_mutant, mutant_backend
    from hybridkv.conformance.oracles import run_adapter_hit_oracle

    mutant = next(m for m in MUTANTS if m.name == "full_hit_no_stop")
    name, factory = mutant_backend(load_mutant(mutant))
    found = run_adapter_hit_oracle(name, factory, 400, seed=3)
    assert found.failures == []
    assert found.hits > 400


def test_a_program_names_each_backend_as_the_run_reported_it() -> None:
    """The printed program rebuilds the very backends that differed: the optimized backend on
    its device (not the reference, which the model already is) and the stand-in as a
    reference."""
    from hybridkv.conformance.lockstep import backend_by_name

    pytest.importorskip("torch")
    assert backend_by_name("optimized[cpu]")[0] == "optimized[cpu]"
    assert backend_by_name("optimized")[0] == "optimized[cpu]"
    assert backend_by_name("reference-again")[0] == "reference"
    assert backend_by_name("reference")[0] == "reference"
