"""Token ids and hit ids are validated at C speed when they are plain ints; the result and the
error (naming the first bad id) stay those of the id-by-id check."""

from __future__ import annotations

import enum

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.reference.request import check_token_ids


class Token(enum.IntEnum):
    A = 3


def _by_hand(field: str, tokens: list[object]) -> list[object]:
    for index, token in enumerate(tokens):
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise ValueError(f"{field}[{index}] must be a non-negative int, got {token!r}")
    return list(tokens)


ANY_ID = st.one_of(
    st.integers(0, 50_000),
    st.integers(-3, -1),
    st.booleans(),
    st.just(Token.A),
    st.floats(0, 3),
    st.none(),
)


@given(st.lists(st.one_of(st.integers(0, 50_000), ANY_ID), max_size=12))
def test_the_fast_check_equals_the_id_by_id_check(tokens: list[object]) -> None:
    try:
        expected: list[object] | str = _by_hand("prompt", tokens)
    except ValueError as error:
        expected = str(error)
    try:
        got: list[object] | str = list(check_token_ids("prompt", tokens))
    except ValueError as error:
        got = str(error)
    assert got == expected


def test_a_bool_among_plain_ints_is_named() -> None:
    with pytest.raises(ValueError, match=r"^prompt\[2\] must be a non-negative int, got True$"):
        check_token_ids("prompt", [1, 2, True, 4])
