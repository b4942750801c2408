"""Token ids and hit ids are validated at C speed when they are plain ints; the result and the
error (naming the first bad id) stay those of the id-by-id check, and the packed copy holds the
ids' values."""

from __future__ import annotations

import enum
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv.reference.request import all_small_plain_ints, check_token_ids, pack_token_ids


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


SMALL_OR_NOT = st.one_of(
    st.sampled_from([0, 1, 23, 2**31 - 1, 2**31, 2**32, -1, -(2**31), -(2**31) - 1, 2**64]),
    st.integers(0, 2**31 - 1),
    ANY_ID,
)


@given(st.lists(SMALL_OR_NOT, max_size=12))
def test_small_plain_ints_are_recognised_exactly(tokens: list[object]) -> None:
    expected = all(type(t) is int and 0 <= t < 2**31 for t in tokens)
    assert all_small_plain_ints(tokens) is expected


@given(st.lists(st.one_of(st.integers(0, 2**70), st.sampled_from([2**31, 2**64 - 1])), max_size=12))
def test_the_packed_copy_holds_the_ids_while_they_fit_64_bits(tokens: list[int]) -> None:
    ids, packed = pack_token_ids("prompt", tokens)
    assert ids == tokens
    if all(t < 2**64 for t in tokens):
        assert packed == array("Q", tokens)
    else:
        assert packed is None


def test_an_int_subclass_is_kept_as_given_and_packed_as_its_value() -> None:
    ids, packed = pack_token_ids("prompt", [1, Token.A])
    assert ids == [1, Token.A]
    assert type(ids[1]) is Token
    assert packed == array("Q", [1, 3])
