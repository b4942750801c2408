"""``scripts/admission_parts.py``: every part it takes out names a function that exists, comes
back after the admissions it was taken out for, and leaves the shared prefix's hit whole."""

from __future__ import annotations

from types import ModuleType

import pytest
from script_modules import load_script


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("admission_parts")


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


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bogus"], "unknown part(s) ['bogus']"),
        (["none", "--count", "0"], "--count must be at least 1, got 0"),
    ],
)
def test_bad_arguments_are_named_in_one_line(
    script: ModuleType,
    argv: list[str],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr("sys.argv", ["admission_parts.py", *argv])
    with pytest.raises(SystemExit) as exited:
        script.main()
    assert exited.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]
