"""Input validation shared by every layer: each error names the field and the value."""

from __future__ import annotations

ZERO = 0
"""The int 0, for a hot path's ``count is ZERO``: true of the int 0 alone (the interpreter
keeps one 0; ``0.0``, ``False`` and an int subclass are other objects), one identity test where
``type(count) is int and count == 0`` takes four operations. A value it does not match must
take the checked path, so it lets nothing through unchecked."""


def check_positive(field: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) greater than zero."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{field} must be a positive int, got {value!r}")


def check_non_negative(field: str, value: object) -> None:
    """Raise ``ValueError`` unless ``value`` is an ``int`` (not a ``bool``) of at least zero."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{field} must be a non-negative int, got {value!r}")


class InvariantError(AssertionError):
    """A stateful part's bookkeeping is inconsistent (raised by ``check_invariants``)."""


def require(condition: bool, message: str) -> None:
    """Raise ``InvariantError(message)`` unless ``condition`` holds (unlike ``assert``, never
    stripped by ``python -O``)."""
    if not condition:
        raise InvariantError(message)
