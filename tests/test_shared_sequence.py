"""``Shared`` (core/tokens.py) reads like the tuple it stands for, whatever order values are extended in."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec.core.tokens import Shared


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 9), max_size=4),
    st.lists(st.tuples(st.integers(0, 6), st.lists(st.integers(0, 9), max_size=4)), max_size=12),
    st.integers(-12, 12),
    st.integers(-12, 12),
    st.sampled_from([1, 2, -1]),
)
def test_shared_values_read_like_tuples(head, moves, a, b, step):
    values: list[tuple[Shared[int], tuple[int, ...]]] = [(Shared(), ())]
    for back, items in moves:
        base, expected = values[max(0, len(values) - 1 - back)]
        values.append((base.extended(items), expected + tuple(items)))
    for value, expected in values:  # extending never changed an older value
        for seq, want in ((value, expected), (value.with_head(tuple(head)), tuple(head) + expected)):
            assert len(seq) == len(want) and tuple(seq) == want and list(seq) == list(want)
            assert seq == want and want == seq and seq == list(want) and seq != (*want, 99)
            assert seq[a:b] == want[a:b] and seq[a:] == want[a:] and seq[::step] == want[::step]
            assert isinstance(seq[a:b], tuple)
            for i in range(-len(want), len(want)):
                assert seq[i] == want[i]
            assert hash(seq) == hash(want) and repr(seq) == repr(want)
            assert seq + (7,) == (*want, 7) and (7,) + seq == (7, *want)
            assert (3 in seq) == (3 in want)
            with pytest.raises(IndexError):
                seq[len(want)]


def test_extending_the_newest_value_shares_storage_and_an_older_one_copies():
    a = Shared([1, 2])
    b = a.extended([3])
    assert b.parts()[1] is a.parts()[1]  # appended in place
    c = a.extended([4])  # `a` no longer ends its storage: copied
    assert c.parts()[1] is not a.parts()[1]
    assert (tuple(a), tuple(b), tuple(c)) == ((1, 2), (1, 2, 3), (1, 2, 4))
    with pytest.raises(ValueError, match="already has a head"):
        b.with_head((0,)).with_head((9,))
