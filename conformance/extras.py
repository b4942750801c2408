"""What an optional command needs: one line naming what to install (``hybridkv.extras``)."""

from __future__ import annotations

from hybridkv.extras import is_missing, needs_line


def missing_extra(module: str, extra: str, command: str) -> str | None:
    """``None`` when ``module`` imports; else the one line that says how to install it from
    where the user stands (``extra`` names the extra of ``pyproject.toml`` it is in)."""
    if not is_missing(module):
        return None
    return needs_line(command, module)
