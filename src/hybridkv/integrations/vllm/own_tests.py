"""vLLM's own scheduler tests, on vLLM's manager and on each hybridkv backend, compared.

``python -m hybridkv.integrations.vllm.own_tests`` takes vLLM 0.33.0's test tree from its source
distribution (downloaded once into ``~/.cache/hybridkv``, see ``fetch_source``; or ``--source
DIR``), runs ``tests/v1/core/test_scheduler.py`` and ``test_async_scheduler.py`` three times
through ``hybridkv.integrations.vllm.pytest_plugin`` (``--hybridkv-backend vllm``, ``reference``,
``optimized``; models served offline; the three runs one after another in one process), and
compares the outcomes test by test.

A test that passes on vLLM's manager must pass on each backend, unless it fails on a setting
the integration refuses by name (``UnsupportedSetting``, ``UnsupportedInternal``) or on an
assertion about vLLM's coordinator class; any other lost test is a difference and the command
exits 1. The summary counts each outcome and each refusal reason.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridkv.extras import exit_if_missing

VLLM_VERSION = "0.33.0"
TEST_FILES = ("tests/v1/core/test_scheduler.py", "tests/v1/core/test_async_scheduler.py")
RUNS = ("vllm", "reference", "optimized")
INDEX = os.environ.get("HYBRIDKV_PYPI_URL", "https://pypi.org")
"""The package index whose simple API (PEP 691) lists vLLM's source distribution."""

_REFUSAL_MARKERS = ("UnsupportedSetting", "UnsupportedInternal")
# vLLM tests that assert ``isinstance(manager.coordinator, HybridKVCacheCoordinator)``: the
# integration's coordinator is a read-only view, not vLLM's class.
_COORDINATOR_MARKER = "CoordinatorView"


class SourceUnavailable(RuntimeError):
    """vLLM's test tree is neither cached nor downloadable (no network, no pip)."""


@dataclass(frozen=True)
class Outcome:
    """One test's outcome: ``passed``, ``failed``, ``error`` or ``skipped``, and the message."""

    status: str
    message: str = ""

    @property
    def refused(self) -> str | None:
        """The refusal this failure stops on (its first line), or ``None``."""
        if self.status not in ("failed", "error"):
            return None
        if any(marker in self.message for marker in _REFUSAL_MARKERS):
            first = self.message.split("\n", 1)[0].split(": ", 1)[-1]
            return re.sub(r"=\d+", "=N", first)  # one reason per setting, whatever its value
        if _COORDINATOR_MARKER in self.message:
            return "asserts vLLM's coordinator class"
        return None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hybridkv" / f"vllm-{VLLM_VERSION}-src"


def fetch_source(target: Path | None = None) -> Path:
    """vLLM's source tree holding its tests: cached, or downloaded and unpacked once.

    The source distribution comes from the package index's simple API and is checked against
    the SHA-256 digest the index publishes; only its ``tests/`` tree is unpacked (``pip
    download`` would build the package's metadata, which needs vLLM's build requirements).
    """
    root = target or Path(os.environ.get("HYBRIDKV_VLLM_SOURCE") or cache_dir())
    if all((root / name).is_file() for name in TEST_FILES):
        return root
    archive_bytes = _download_sdist()
    prefix = f"vllm-{VLLM_VERSION}/"
    staging = Path(tempfile.mkdtemp(prefix="hybridkv-vllm-src-"))
    with tarfile.open(fileobj=io.BytesIO(archive_bytes), mode="r:gz") as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix + "tests/")]
        for member in members:
            member.name = member.name.removeprefix(prefix)
        archive.extractall(staging, members=members, filter="data")
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        shutil.rmtree(root)
    shutil.move(str(staging), root)
    return root


def _download_sdist() -> bytes:
    """The source distribution's bytes, from the index's simple API (PEP 691 JSON)."""
    url = f"{INDEX}/simple/vllm/"
    name = f"vllm-{VLLM_VERSION}.tar.gz"
    request = urllib.request.Request(url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            files = json.load(response)["files"]
        (sdist,) = [f for f in files if f["filename"] == name]
        with urllib.request.urlopen(sdist["url"], timeout=600) as response:
            data: bytes = response.read()
    except (OSError, ValueError, KeyError) as error:
        raise SourceUnavailable(f"cannot download {name} from {url}: {error}") from error
    digest = hashlib.sha256(data).hexdigest()
    if digest != sdist["hashes"]["sha256"]:
        raise SourceUnavailable(
            f"{name} has SHA-256 {digest}, the index publishes {sdist['hashes']['sha256']}"
        )
    return data


def run_tests(source: Path, backend: str, report: Path) -> dict[str, Outcome]:
    """Run vLLM's scheduler tests with ``backend``'s manager; each test's outcome."""
    return run_backends(source, {backend: report})[backend]


def run_backends(source: Path, reports: dict[str, Path]) -> dict[str, dict[str, Outcome]]:
    """Run vLLM's scheduler tests once per backend, one pytest session after another in one
    process (``own_test_runs``: vLLM is imported and its tests collected once); each run's
    outcomes, from the JUnit report it wrote."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    runs = {backend: pytest_arguments(backend, report) for backend, report in reports.items()}
    with tempfile.TemporaryDirectory() as tmp:
        arguments = Path(tmp) / "runs.json"
        arguments.write_text(json.dumps(runs), encoding="utf-8")
        command = [sys.executable, "-m", "hybridkv.integrations.vllm.own_test_runs", str(arguments)]
        done = subprocess.run(
            command, cwd=source, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, check=False,
        )  # fmt: skip
    outcomes: dict[str, dict[str, Outcome]] = {}
    for backend, report in reports.items():
        if not report.is_file():
            raise RuntimeError(
                f"pytest wrote no report for backend {backend!r} (exit {done.returncode}): "
                f"{runs[backend]} {done.stderr[-500:]}"
            )
        outcomes[backend] = parse_report(report)
    return outcomes


def pytest_arguments(backend: str, report: Path) -> list[str]:
    """The arguments of one pytest run of vLLM's scheduler tests with ``backend``'s manager.
    ``--tb=native``: pytest's own traceback format, with source context for every frame, took
    most of a run that has a hundred refused tests to report; the outcomes and messages in the
    report are the same."""
    return [
        "-q", "-p", "no:cacheprovider",
        "-p", "hybridkv.integrations.vllm.pytest_plugin", "--hybridkv-backend", backend,
        "--hybridkv-offline-models", "--confcutdir", "tests/v1/core", "--tb=native",
        f"--junitxml={report}", *TEST_FILES,
    ]  # fmt: skip


def parse_report(report: Path) -> dict[str, Outcome]:
    """Test id → outcome, from a JUnit XML report."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(report).iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome = Outcome("passed")
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                status = {"failure": "failed"}.get(child.tag, child.tag)
                outcome = Outcome(status, child.get("message") or child.text or "")
        outcomes[test_id] = outcome
    return outcomes


@dataclass(frozen=True)
class Comparison:
    """One backend against vLLM's manager."""

    backend: str
    passed: int
    refused: Counter[str]
    unexplained: tuple[str, ...]
    passes_only_here: tuple[str, ...]


def compare(baseline: dict[str, Outcome], backend: str, run: dict[str, Outcome]) -> Comparison:
    """Every test passing on vLLM must pass on ``run`` or stop on a named refusal."""
    refused: Counter[str] = Counter()
    unexplained: list[str] = []
    for test_id, outcome in baseline.items():
        if outcome.status != "passed":
            continue
        mine = run.get(test_id, Outcome("missing"))
        if mine.status == "passed":
            continue
        reason = mine.refused
        if reason is None:
            unexplained.append(f"{test_id}: {mine.status} {mine.message[:200]!r}")
        else:
            refused[reason] += 1
    only_here = tuple(
        test_id
        for test_id, outcome in run.items()
        if outcome.status == "passed"
        and baseline.get(test_id, Outcome("missing")).status != "passed"
    )
    passed = sum(outcome.status == "passed" for outcome in run.values())
    return Comparison(backend, passed, refused, tuple(unexplained), only_here)


def summary(baseline: dict[str, Outcome], comparisons: Sequence[Comparison]) -> str:
    total = len(baseline)
    lines = [
        f"vLLM {VLLM_VERSION}'s scheduler tests ({', '.join(TEST_FILES)}): {total} collected",
        f"  vllm: {sum(o.status == 'passed' for o in baseline.values())} passed",
    ]
    for comparison in comparisons:
        lines.append(
            f"  {comparison.backend}: {comparison.passed} passed, "
            f"{sum(comparison.refused.values())} refused by name, "
            f"{len(comparison.unexplained)} unexplained, "
            f"{len(comparison.passes_only_here)} passing only here"
        )
        lines.extend(
            f"      {count} × {reason[:110]}" for reason, count in comparison.refused.most_common()
        )
        lines.extend(f"    DIFFERENT {line}" for line in comparison.unexplained)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridkv.integrations.vllm.own_tests")
    parser.add_argument(
        "--source",
        type=Path,
        help="vLLM's source tree (default: $HYBRIDKV_VLLM_SOURCE, else the cache, filled once)",
    )
    parser.add_argument(
        "--backend", action="append", choices=RUNS[1:], help="backends to run (default: both)"
    )
    args = parser.parse_args(argv)
    exit_if_missing(parser.prog, ["vllm", "torch", "pytest"])
    try:
        source = args.source or fetch_source()
    except SourceUnavailable as error:
        print(f"vLLM's tests unavailable: {error}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        backends = args.backend or list(RUNS[1:])
        runs = run_backends(
            source, {name: Path(tmp) / f"{name}.xml" for name in ["vllm", *backends]}
        )
        baseline = runs["vllm"]
        comparisons = [compare(baseline, backend, runs[backend]) for backend in backends]
    print(summary(baseline, comparisons))
    return 1 if any(c.unexplained for c in comparisons) else 0


if __name__ == "__main__":
    raise SystemExit(main())
