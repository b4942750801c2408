"""docs/eviction.md, "Write your own", as written: the page's policy, saved as my_policy.py, runs
in ``hybridkv simulate`` and passes the conformance suite on both backends."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_pages import fenced_block

PAGE, HEADING = "docs/eviction.md", "Write your own"


def _commands() -> list[list[str]]:
    return [shlex.split(line) for line in fenced_block(PAGE, HEADING, "sh").splitlines()]


def _run(tmp_path: Path, argv: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    env_part, program, *args = argv
    assert env_part == "PYTHONPATH=."
    command = [sys.executable, "-m", "hybridkv"] if program == "hybridkv" else [sys.executable]
    if program == "python":
        command = [sys.executable]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [*command, *args, *extra],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.fixture
def policy_folder(tmp_path: Path) -> Path:
    (tmp_path / "my_policy.py").write_text(fenced_block(PAGE, HEADING, "python"), "utf-8")
    return tmp_path


def test_the_pages_policy_is_twenty_lines_of_code() -> None:
    code = [line for line in fenced_block(PAGE, HEADING, "python").splitlines() if line.strip()]
    assert len(code) <= 24


def test_the_pages_policy_runs_in_simulate(policy_folder: Path) -> None:
    simulate, _ = _commands()
    done = _run(policy_folder, simulate, "--format", "json")
    assert done.returncode == 0, done.stderr
    assert '"finished": 30' in done.stdout


def test_the_conformance_suite_checks_the_pages_policy(policy_folder: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("hypothesis")
    _, conformance = _commands()
    done = _run(
        policy_folder, conformance, "--examples", "20", "--steps", "20", "--hit-states", "40"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS" in done.stdout
    assert "FAIL" not in done.stdout


def test_the_pages_policy_changes_the_order_against_lru(policy_folder: Path) -> None:
    """The seam really uses it: newest-first and LRU reuse different blocks."""
    sys.path.insert(0, str(policy_folder))
    try:
        from hybridkv.reference import KVCacheManager
        from hybridkv.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup

        spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
        ids = {}
        for policy in ("lru", "my_policy:NewestFirst"):
            config = KVCacheConfig(6, (KVCacheGroup(("layer",), spec),))
            manager = KVCacheManager(config, max_model_len=64, eviction_policy=policy)
            first = manager.make_request("a", list(range(8)))
            manager.allocate_slots(first, 8)
            manager.free(first)
            second = manager.make_request("b", list(range(100, 104)))
            manager.allocate_slots(second, 4)
            ids[policy] = manager.get_block_ids("b")
            manager.check_invariants()
        assert ids["lru"] != ids["my_policy:NewestFirst"]
    finally:
        sys.path.remove(str(policy_folder))
        sys.modules.pop("my_policy", None)
