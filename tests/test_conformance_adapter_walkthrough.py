"""``docs/check-your-implementation.md`` works as written, for a stranger.

The adapter is taken verbatim from that page, written to a module of its own and checked with
``python -m hybridkv.conformance --adapter`` in a subprocess (a small budget: 12 traces, a few
examples); a deliberately broken copy must fail with the trace's name in the report.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown_pages import fenced_block

PAGE = "docs/check-your-implementation.md"
ADAPTER_SOURCE = fenced_block(PAGE, "2. A worked adapter", "python")
COMMAND = fenced_block(PAGE, "3. The command", "text").strip()

BROKEN_SOURCE = '''
from hybridkv.conformance.adapters import Lookup
from my_adapter import MyAdapter, make_adapter as make_good


class DropsLastHitBlock(MyAdapter):
    """Reports every hit without its last block (a classic off-by-one)."""

    def lookup(self, request):
        found = super().lookup(request)
        ids = tuple(group[:-1] for group in found.block_ids)
        return Lookup(ids, found.num_hit_tokens, found.handle, found.shared_prefix_boundary)


def make_adapter(config, max_model_len, enable_caching, enable_kv_cache_events, engine):
    good = make_good(config, max_model_len, enable_caching, enable_kv_cache_events, engine)
    return DropsLastHitBlock(good.manager, good.hash_block_size, good.lookahead)
'''

SMALL_BUDGET = ["--traces", "12", "--examples", "40", "--steps", "6", "--hit-states", "40"]


def _run(folder: Path, spec: str, *, script: bool = False) -> subprocess.CompletedProcess[str]:
    """The command, run from ``folder`` (where the adapter module is) as the page says, with
    ``python -m`` or, with ``script``, the ``hybridkv`` script beside this interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = (
        [str(Path(sys.executable).parent / "hybridkv"), "conformance"]
        if script
        else [sys.executable, "-m", "hybridkv.conformance"]
    )
    return subprocess.run(
        [*command, "--adapter", spec, *SMALL_BUDGET],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )


@pytest.fixture
def adapter_folder(tmp_path: Path) -> Path:
    (tmp_path / "my_adapter.py").write_text(ADAPTER_SOURCE, encoding="utf-8")
    (tmp_path / "broken_adapter.py").write_text(BROKEN_SOURCE, encoding="utf-8")
    return tmp_path


def test_the_pages_command_names_the_pages_adapter() -> None:
    assert COMMAND == "python -m hybridkv.conformance --adapter my_adapter:make_adapter"
    assert "class MyAdapter:" in ADAPTER_SOURCE
    assert "ProtocolAdapter" not in ADAPTER_SOURCE


def test_the_pages_adapter_passes_the_whole_suite(adapter_folder: Path) -> None:
    result = _run(adapter_folder, "my_adapter:make_adapter")
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-2000:]
    assert "under test my_adapter:make_adapter; compared with reference" in out
    assert re.search(
        r"PASS  my_adapter:make_adapter: 12/12 traces identical, 0 failed, 0 skipped", out
    )
    assert re.search(r"PASS  differential machine: \d+ examples", out)
    assert "PASS  longest hit of my_adapter:make_adapter: 0 of 30 lookups differ" in out
    summary = out.split("== summary", 1)[1]
    assert [line.split()[0] for line in summary.strip().splitlines()[:3]] == ["PASS"] * 3


def test_an_adapter_that_drops_the_last_hit_block_fails_with_the_trace_name(
    adapter_folder: Path,
) -> None:
    """Run through the ``hybridkv`` script: the current directory is searched there too."""
    result = _run(adapter_folder, "broken_adapter:make_adapter", script=True)
    out = result.stdout
    assert result.returncode == 1, out[-4000:] + result.stderr[-2000:]
    failing = re.findall(r"FAIL ((?:gen|eng)_\w+): op (\d+) \{\"op\": \"lookup\"", out)
    assert failing, out[-4000:]
    assert "differs in ['hit_block_ids']" in out
    assert re.search(r"FAIL  broken_adapter:make_adapter: \d+/12 traces identical", out)
    assert "FAIL  differential machine" in out
    assert re.search(r"FAIL  longest hit of broken_adapter:make_adapter: [1-9]\d* of 30", out)
    assert "rerun: python -m hybridkv.conformance --adapter broken_adapter:make_adapter" in out
    # The shortest failing example, as a program of scheduler calls on both implementations.
    assert "['reference', 'broken_adapter:make_adapter'])" in out
    assert re.search(r"    hit_r\d+ = m\.lookup\('r\d+'\)\n  rerun:", out)
    summary = out.split("== summary", 1)[1]
    assert [line.split()[0] for line in summary.strip().splitlines()[:3]] == ["FAIL"] * 3
