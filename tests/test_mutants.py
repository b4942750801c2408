"""Planted bugs: each mutant of the reference must be caught by the conformance suite.

A mutant is a source patch of one module of spec/ or reference/, imported as a private copy;
``hunt`` runs the suite's checks against it until one fails. Each test fails if the suite stays
green for its mutant, and the unpatched reference must pass the very same checks (so a mutant
is caught for its bug, not for the harness).
"""

from __future__ import annotations

import sys

import pytest

from hybridkv.conformance import mutants
from hybridkv.conformance.mutants import MUTANTS, Mutant, hunt, load_mutant


def test_there_are_at_least_fifteen_mutants_with_unique_names() -> None:
    assert len(MUTANTS) >= 15
    assert sum(mutants.is_optimized(m) for m in MUTANTS) == 23
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)
    assert {m.suite for m in MUTANTS} == {"manager", "planner"}


@pytest.mark.slow(seconds=3)
@pytest.mark.parametrize(
    "mutant",
    MUTANTS,
    ids=[m.name for m in MUTANTS],
)
def test_the_suite_catches_the_mutant(mutant: Mutant) -> None:
    result = hunt(mutant)
    assert result.caught_by is not None, f"{mutant.name} survived: {mutant.description}"


@pytest.mark.slow(seconds=11)
@pytest.mark.parametrize("suite", ["manager", "planner"])
def test_the_unpatched_reference_passes_every_check(suite: str) -> None:
    unpatched = Mutant("none", "no change", "hybridkv.reference.block_pool", (), suite)  # type: ignore[arg-type]
    result = hunt(unpatched)
    assert result.caught_by is None, result.detail


def test_loading_a_mutant_leaves_the_real_modules_alone() -> None:
    import hybridkv.reference
    import hybridkv.spec
    from hybridkv.reference import KVCacheManager

    before = dict(sys.modules)
    rules = hybridkv.spec.rules
    bundle = load_mutant(MUTANTS[0])
    assert bundle.KVCacheManager is not KVCacheManager
    assert hybridkv.spec.rules is rules
    assert hybridkv.reference.KVCacheManager is KVCacheManager
    assert {k: v for k, v in sys.modules.items() if k in before} == before


def test_a_patch_that_no_longer_applies_fails_loudly() -> None:
    stale = Mutant("stale", "gone", "hybridkv.reference.block_pool", (("no such text", "x"),))
    with pytest.raises(ValueError, match="found 0 times"):
        mutants.patched_source(stale)


ENGINE_MUTANTS = {
    "mamba_same_step_rule_removed",
    "eagle_drop_not_applied",
    "full_prompt_without_window_cap",
    "retention_mask_ignored",
    "hash_view_first_hash",
}


def test_the_engine_rules_have_mutants_and_the_engine_traces_are_in_the_kill_set() -> None:
    assert {m.name for m in MUTANTS} >= ENGINE_MUTANTS
    unpatched = Mutant("none", "no change", "hybridkv.reference.block_pool", ())
    names = [name for name, _ in mutants.manager_checks(load_mutant(unpatched))]
    assert names == [
        "differential machine",
        "differential machine, roomy pools",
        "longest-hit oracle",
        "engine golden traces",
        "golden traces",
    ]


def test_a_first_check_names_a_mutant_and_one_of_its_suites_checks() -> None:
    """``FIRST_CHECK`` only reorders a hunt: a stale name would silently stop doing that."""
    unpatched = Mutant("none", "no change", "hybridkv.reference.block_pool", ())
    checks = [name for name, _ in mutants.manager_checks(load_mutant(unpatched))]
    names = {m.name for m in MUTANTS}
    for mutant, check in mutants.FIRST_CHECK.items():
        assert mutant in names
        assert check in checks
