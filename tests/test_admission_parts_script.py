"""``scripts/admission_parts.py``: every part it takes out names a function that exists, comes
back after the admissions it was taken out for, and leaves the shared prefix's hit whole."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script() -> ModuleType:
    sys.path.insert(0, str(ROOT / "scripts"))  # it imports bench_bounds beside it
    try:
        spec = importlib.util.spec_from_file_location(
            "admission_parts", ROOT / "scripts/admission_parts.py"
        )
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["admission_parts"] = module
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_every_part_is_taken_out_only_inside_and_put_back(script: ModuleType) -> None:
    for part, stubs in script.PARTS.items():
        originals = [getattr(owner, name) for owner, name, _ in stubs]
        with script.taken_out(part):
            assert [getattr(owner, name) for owner, name, _ in stubs] == [s for *_, s in stubs]
        assert [getattr(owner, name) for owner, name, _ in stubs] == originals, part


@pytest.mark.parametrize("part", ["none", "validate", "enter", "checks", "result"])
def test_a_part_taken_out_still_admits_the_shared_prefix(script: ModuleType, part: str) -> None:
    base, without = script.measure(part, 4, lambda: None)
    assert base > 0
    assert without > 0
