"""Hypothesis draws that depend on the seed alone, not on what the process ran before.

Hypothesis (6.131 and later) mixes into its draws the literal constants of every *local*
module imported so far in the process (``hypothesis.internal.conjecture.providers``: a pool
grown from ``sys.modules`` before each example). A derandomized run of the differential
machine then draws different examples first in a process, after other test files, in a
pytest-xdist worker, or after a mutant hunt (each mutant is a patched copy of a module, whose
new literals join the pool): the same command would catch a planted bug in one process and
miss it in another. ``seed_only_draws`` empties that pool while a run lasts, so that the
examples follow from the seed (or the derandomized test's digest) and nothing else.

The pool is Hypothesis's internal state, reached here by name and restored afterwards; on a
Hypothesis without it (older than 6.131) there is nothing to pin.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["seed_only_draws"]

_POOL_FUNCTION = "_get_local_constants"
_POOL_CACHE = "CONSTANTS_CACHE"


def _providers() -> Any | None:
    """Hypothesis's provider module when it keeps a pool of local constants, else ``None``."""
    try:
        module = importlib.import_module("hypothesis.internal.conjecture.providers")
    except ImportError:  # pragma: no cover - every supported Hypothesis has it
        return None
    if not hasattr(module, _POOL_FUNCTION) or not hasattr(module, "Constants"):
        return None
    return module


def _clear_cache(providers: Any) -> None:
    """Forget the constants Hypothesis already filtered per choice type (drawn from the pool)."""
    cache = getattr(providers, _POOL_CACHE, None)
    inner = getattr(cache, "cache", None)
    if inner is not None:
        inner.clear()


@contextmanager
def seed_only_draws() -> Iterator[None]:
    """Within this block Hypothesis draws no constants of local modules (its global constants,
    the same in every process, stay)."""
    providers = _providers()
    if providers is None:
        yield
        return
    original = getattr(providers, _POOL_FUNCTION)
    empty = providers.Constants()
    setattr(providers, _POOL_FUNCTION, lambda: empty)
    _clear_cache(providers)
    try:
        yield
    finally:
        setattr(providers, _POOL_FUNCTION, original)
        _clear_cache(providers)
