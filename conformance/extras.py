"""What an optional command needs: one line naming the extra that provides it."""

from __future__ import annotations

import importlib.util


def missing_extra(module: str, extra: str, command: str) -> str | None:
    """``None`` when ``module`` imports; else the one line that says which extra installs it
    (the optional commands print it instead of a traceback)."""
    if importlib.util.find_spec(module) is not None:
        return None
    return f"{command} needs {module}, in the `{extra}` extra: pip install 'hybridkv[{extra}]'"
