"""What an optional feature needs, and the one line that says how to install it.

hybridkv is not on the package index, so ``pip install 'hybridkv[torch]'`` cannot work. From a
checkout (an install whose package sits in a source tree with hybridkv's ``pyproject.toml``)
the extra installs from that tree: ``pip install '.[torch]'`` from its root, the tree's path
from elsewhere. Otherwise the line names the plain dependencies the extra declares
(``pip install 'torch>=2.3' 'numpy>=1.24'``). Every entry point prints this line, exit status
2, instead of a ``ModuleNotFoundError`` traceback.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

EXTRA_OF = {
    "torch": "torch",
    "numpy": "torch",
    "matplotlib": "plot",
    "crosshair": "crosshair",
    "hypothesis": "dev",
    "mutmut": "dev",
    "pytest": "dev",
}
"""The optional modules, and the extra of ``pyproject.toml`` that installs each."""

DISTRIBUTIONS = {"crosshair": "crosshair-tool"}
"""Modules whose distribution has another name."""

VLLM = "vllm"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def is_missing(module: str) -> bool:
    """Whether ``module`` cannot be imported (absent, or blocked in ``sys.modules``)."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def first_missing(modules: Iterable[str]) -> str | None:
    """The first of ``modules`` that cannot be imported, or ``None``."""
    return next((module for module in modules if is_missing(module)), None)


def checkout_root() -> Path | None:
    """The source tree hybridkv was installed from (editable or in place), or ``None``."""
    import hybridkv

    for parent in Path(hybridkv.__file__).resolve().parents:
        pyproject = parent / "pyproject.toml"
        if pyproject.is_file() and 'name = "hybridkv"' in pyproject.read_text("utf-8"):
            return parent
    return None


def install_command(module: str) -> str:
    """The command that installs ``module`` from where the user stands."""
    root = checkout_root()
    if module == VLLM:
        if root is not None:
            script = _relative(root, "scripts/install-vllm-cpu.sh")
            return f"{script} installs vLLM 0.33 for the CPU"
        return "pip install vllm==0.33.0"
    extra = EXTRA_OF.get(module)
    if extra is None:
        return f"pip install {module}"
    if root is not None:
        return f"pip install '{_relative(root, '')}[{extra}]'"
    return "pip install " + " ".join(f"'{req}'" for req in _requirements(extra, module))


def needs_line(command: str, module: str) -> str:
    """``COMMAND needs MODULE, which is not installed: INSTALL``."""
    return f"{command} needs {module}, which is not installed: {install_command(module)}"


def exit_if_missing(command: str, modules: Iterable[str]) -> None:
    """Print ``needs_line`` for the first missing module to stderr and exit 2, if any is."""
    missing = first_missing(modules)
    if missing is not None:
        exit_missing(command, missing)


def exit_missing(command: str, module: str) -> NoReturn:
    """Print ``needs_line`` to stderr and exit with status 2."""
    print(needs_line(command, module), file=sys.stderr)
    raise SystemExit(2)


def exit_for_import_error(error: ModuleNotFoundError, command: str) -> NoReturn:
    """The one line for an optional module ``error`` failed to import; ``error`` itself for
    any other module (a bug, not a missing extra)."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRA_OF and module != VLLM:
        raise error
    exit_missing(command, module)


def _relative(root: Path, path: str) -> str:
    """``path`` in the checkout, as the user types it from the current directory."""
    if root == Path.cwd().resolve():
        return f"./{path}" if path.endswith(".sh") else "."
    return str(root / path) if path else str(root)


def _requirements(extra: str, module: str) -> list[str]:
    """The requirements the extra declares (for ``dev``, only the module's own)."""
    try:
        declared = importlib.metadata.requires("hybridkv") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    marker = f'extra == "{extra}"'
    found = [req.split(";")[0].strip() for req in declared if marker in req]
    if extra == "dev":
        wanted = DISTRIBUTIONS.get(module, module)
        found = [req for req in found if (m := _NAME.match(req)) and m.group() == wanted]
    return found or [DISTRIBUTIONS.get(module, module)]
