"""Every entry point, run with the optional extras unimportable, prints one line naming what to
install, with a command that works from where the user stands, and no traceback.

The extras are hidden from a subprocess by a ``sitecustomize`` on ``PYTHONPATH`` that puts
``None`` in ``sys.modules`` for them, as in a plain install. From this checkout's root the
command is ``pip install '.[EXTRA]'``; an install outside a checkout gets the plain dependency
names the extra declares.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hybridkv.extras
from hybridkv.extras import install_command

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = ("torch", "numpy", "hypothesis", "crosshair", "matplotlib", "mutmut", "vllm")
VLLM_LINE = "./scripts/install-vllm-cpu.sh installs vLLM 0.33 for the CPU"
HYBRIDKV = str(Path(sys.executable).parent / "hybridkv")

SWEEP = [
    (
        [sys.executable, "-m", "hybridkv.conformance", "--backend", "reference"],
        "error: python -m hybridkv.conformance needs hypothesis, which is not installed: "
        "pip install '.[dev]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.conformance", "--crosshair"],
        "error: python -m hybridkv.conformance needs hypothesis, which is not installed: "
        "pip install '.[dev]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.conformance.kill_table", "--table"],
        "python -m hybridkv.conformance.kill_table needs hypothesis, which is not installed: "
        "pip install '.[dev]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.conformance.mutation_score"],
        "python -m hybridkv.conformance.mutation_score needs mutmut, which is not installed: "
        "pip install '.[dev]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.bench", "--quick"],
        "python -m hybridkv.bench needs torch, which is not installed: pip install '.[torch]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.integrations.vllm.check", "--layout", "gemma3"],
        f"python -m hybridkv.integrations.vllm.check needs vllm, which is not installed: "
        f"{VLLM_LINE}",
    ),
    (
        [sys.executable, "-m", "hybridkv.integrations.vllm.bench"],
        f"python -m hybridkv.integrations.vllm.bench needs vllm, which is not installed: "
        f"{VLLM_LINE}",
    ),
    (
        [sys.executable, "-m", "hybridkv.integrations.vllm.own_tests"],
        f"python -m hybridkv.integrations.vllm.own_tests needs vllm, which is not installed: "
        f"{VLLM_LINE}",
    ),
    (
        [sys.executable, "-m", "hybridkv", "simulate", "--backend", "optimized"],
        "Error: --backend optimized needs torch, which is not installed: pip install '.[torch]'",
    ),
    (
        [HYBRIDKV, "simulate", "--plot", "run.png", "--requests", "1"],
        "Error: --plot needs matplotlib, which is not installed: pip install '.[plot]'",
    ),
    (
        [HYBRIDKV, "conformance", "--no-golden"],
        "error: python -m hybridkv.conformance needs hypothesis, which is not installed: "
        "pip install '.[dev]'",
    ),
    (
        [sys.executable, "-m", "hybridkv.integrations.vllm.own_test_runs", "runs.json"],
        f"python -m hybridkv.integrations.vllm.own_test_runs needs vllm, which is not installed: "
        f"{VLLM_LINE}",
    ),
    (
        [HYBRIDKV, "bench", "--quick"],
        "python -m hybridkv.bench needs torch, which is not installed: pip install '.[torch]'",
    ),
    (
        [HYBRIDKV, "vllm-check", "--layout", "gemma3"],
        f"python -m hybridkv.integrations.vllm.check needs vllm, which is not installed: "
        f"{VLLM_LINE}",
    ),
]


@pytest.fixture(scope="module")
def without_extras(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    blocker = tmp_path_factory.mktemp("no_extras")
    (blocker / "sitecustomize.py").write_text(
        f"import sys\nfor _name in {EXTRAS!r}:\n    sys.modules[_name] = None\n"
    )
    return {**os.environ, "PYTHONPATH": str(blocker), "COLUMNS": "200"}


@pytest.mark.parametrize(
    ("command", "line"), SWEEP, ids=[" ".join(c[1:3]) if c[1] == "-m" else c[1] for c, _ in SWEEP]
)
def test_entry_point_without_its_extra_prints_one_line_naming_the_install(
    without_extras: dict[str, str], command: list[str], line: str
) -> None:
    done = subprocess.run(
        command, capture_output=True, text=True, env=without_extras, cwd=ROOT, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert done.stderr.strip().splitlines()[-1] == line


def test_outside_the_checkout_the_command_names_the_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert install_command("torch") == f"pip install '{ROOT}[torch]'"
    assert install_command("vllm") == (
        f"{ROOT}/scripts/install-vllm-cpu.sh installs vLLM 0.33 for the CPU"
    )


def test_outside_any_checkout_the_command_names_the_plain_dependencies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hybridkv.extras, "checkout_root", lambda: None)
    assert install_command("torch") == "pip install 'torch>=2.3' 'numpy>=1.24'"
    assert install_command("numpy") == "pip install 'torch>=2.3' 'numpy>=1.24'"
    assert install_command("hypothesis") == "pip install 'hypothesis>=6.100'"
    assert install_command("crosshair") == "pip install 'crosshair-tool>=0.0.80'"
    assert install_command("matplotlib") == "pip install 'matplotlib'"
    assert install_command("vllm") == "pip install vllm==0.33.0"


@pytest.mark.parametrize("module", ["check", "bench", "own_tests"])
def test_vllm_entry_points_with_vllm_but_without_torch_name_torch(
    tmp_path: Path, module: str
) -> None:
    """vLLM cannot import without torch: the line names torch, not a vLLM traceback."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, "-m", f"hybridkv.integrations.vllm.{module}"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"python -m hybridkv.integrations.vllm.{module} needs torch, which is not installed: "
        "pip install '.[torch]'"
    )
