"""The README's quick start runs, and `.ci/run` runs exactly the README's test command."""

from __future__ import annotations

import re
from typing import Any

import pytest
from markdown_pages import ROOT, fenced_block, read_page

README = read_page("README.md")


def test_the_quick_start_runs() -> None:
    code = fenced_block("README.md", "Quick start", "python")
    namespace: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["num_hit_tokens"] == 0


def test_the_quick_start_takes_the_optimized_backends_fast_path_with_the_same_lines() -> None:
    """The same lines with ``TorchKVCacheManager``: the same blocks and hashes, and the request
    hashed by the backend's memo (``make_request``), with no keyword a user has to know."""
    pytest.importorskip("torch")
    from hybridkv.optimized import TorchKVCacheManager

    code = fenced_block("README.md", "Quick start", "python")
    fast = code.replace("manager = KVCacheManager(", "manager = TorchKVCacheManager(")
    assert fast != code
    reference: dict[str, Any] = {}
    optimized: dict[str, Any] = {"TorchKVCacheManager": TorchKVCacheManager}
    exec(compile(code, "README.md", "exec"), reference)
    exec(compile(fast, "README.md", "exec"), optimized)
    assert optimized["req"].block_hasher == optimized["manager"].block_hasher
    assert optimized["req"].block_hashes == reference["req"].block_hashes
    assert optimized["new"].get_block_ids() == reference["new"].get_block_ids()


def test_the_readme_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    commands = re.findall(r"```sh\n(.*?)\n```", README, flags=re.DOTALL)
    assert len(commands) == 2
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert ci_lines[-1] == commands[1]


def test_the_document_demo_prints_the_worked_example(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.demo import main

    main()
    out = capsys.readouterr().out
    assert "A request of length 112 holds 11 blocks: [7, 2, 2] per group" in out
    assert "tensor 0 shared by full.0, sw.0, sw.10" in out
