"""``Shared``: an immutable sequence that grows in O(1) by sharing storage with the sequence it grew from.

A generation's state is a frozen value, and each step makes a new one with a few more tokens. Copying the whole
token history into a new tuple every step costs O(n) per step, O(n^2) per generation. A ``Shared`` sequence is a
view of the first ``n`` entries of an append-only list (after an optional tuple ``head``, e.g. the prompt):
``extended`` appends to that list in place when this view ends where the list ends, and copies it otherwise (when an
older value is extended a second time), so every value keeps its contents forever and a run of steps costs O(1)
each.

It behaves as a tuple for reading: ``len``, indexing, iteration, ``in``; a slice is a tuple; it equals a tuple or
list with the same items (and another ``Shared`` with them); ``+`` with a tuple gives a tuple. Entries of the
list are never changed once written, so whatever is derived from a prefix stays true: ``derived`` attaches such a
structure to the storage (``PromptLookup``'s n-gram index), and every in-place extension brings it up to date, so
it costs O(new items) per step, whoever asks.

No locks. Exactly one extender may append in place at a given length: it claims that length in the storage's
``claims`` (``dict.setdefault``, atomic), checks that the list still ends there, appends, and releases the claim;
any other extender of a value of that length copies. Derived structures are updated only by the claimant, before
the new items become visible, and published once (``setdefault``): readers never write.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar, overload

T = TypeVar("T")
D = TypeVar("D", bound="Derived")


class Derived(Protocol):
    """A structure derived from a ``Shared`` storage's items (and a head), kept up to date by the storage."""

    def follow(self, items: Sequence[Any], new: Sequence[Any]) -> None:
        """``new`` items are about to be appended after ``items`` (the whole storage so far): take them in."""
        ...


class _Storage(Generic[T]):
    """The append-only list behind ``Shared`` values, the in-place claims on it, and what is derived from it."""

    __slots__ = ("items", "claims", "derived")

    def __init__(self, items: list[T]) -> None:
        self.items = items
        self.claims: dict[int, object] = {}  # length -> the extender appending in place at that length
        self.derived: dict[Any, Derived] = {}


class Shared(Sequence[T], Generic[T]):
    """``head`` followed by the first ``n`` items of the append-only list ``store`` (see the module docstring)."""

    __slots__ = ("_head", "_store", "_n")

    def __init__(self, items: Iterable[T] = ()) -> None:
        self._head: tuple[T, ...] = ()
        self._store: _Storage[T] = _Storage(list(items))
        self._n = len(self._store.items)

    @classmethod
    def _view(cls, head: tuple[T, ...], store: _Storage[T], n: int) -> Shared[T]:
        view: Shared[T] = cls.__new__(cls)
        view._head, view._store, view._n = head, store, n
        return view

    @classmethod
    def of(cls, items: Iterable[T]) -> Shared[T]:
        """``items`` as a ``Shared`` (itself when it already is one)."""
        return items if isinstance(items, Shared) else cls(items)

    def extended(self, items: Iterable[T]) -> Shared[T]:
        """This sequence followed by ``items``: O(len(items)) when this is the newest value of its storage, one
        copy of the stored items otherwise. ``self`` is unchanged."""
        new = list(items)
        if not new:
            return self
        store, n, claim = self._store, self._n, object()
        if store.claims.setdefault(n, claim) is claim:
            try:
                if len(store.items) == n:  # nobody appended past this value: append in place
                    for follower in list(store.derived.values()):
                        follower.follow(store.items, new)
                    store.items.extend(new)
                    return Shared._view(self._head, store, n + len(new))
            finally:
                del store.claims[n]
        return Shared._view(self._head, _Storage(store.items[:n] + new), n + len(new))

    def derived(self, key: Any, build: Callable[[tuple[T, ...], Sequence[T]], D]) -> D:
        """The structure derived from this sequence's head and storage under ``key`` (one per head and key): made
        on first use by ``build(head, items)`` over the storage's items so far, then kept up to date by every
        in-place extension of the storage (``Derived.follow``). It may cover more items than this value holds
        (a longer value of the same storage), or, when an extension raced its first build, fewer: the caller
        checks what it covers."""
        store = self._store
        full_key = (id(self._head), key)
        found = store.derived.get(full_key)
        if found is None:
            found = store.derived.setdefault(full_key, build(self._head, store.items[:]))
        return found  # type: ignore[return-value]

    def with_head(self, head: tuple[T, ...]) -> Shared[T]:
        """``head`` followed by this sequence's stored items (O(1); this sequence must have no head itself)."""
        if self._head:
            raise ValueError("with_head: this sequence already has a head")
        return Shared._view(tuple(head), self._store, self._n)

    def parts(self) -> tuple[tuple[T, ...], list[T], int]:
        """``(head, items, n)``: the sequence is ``head + items[:n]``; ``items`` (the storage) only ever grows, and
        its items never change."""
        return self._head, self._store.items, self._n

    def __len__(self) -> int:
        return len(self._head) + self._n

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[T, ...]: ...

    def __getitem__(self, index: int | slice) -> T | tuple[T, ...]:
        h = len(self._head)
        if isinstance(index, slice):
            start, stop, step = index.indices(h + self._n)
            if step != 1:
                return tuple(self)[index]
            if stop <= start:
                return ()
            head = self._head[start:stop] if start < h else ()
            return head + tuple(self._store.items[max(start - h, 0) : max(stop - h, 0)])
        i = index.__index__()
        if i < 0:
            i += h + self._n
        if not 0 <= i < h + self._n:
            raise IndexError("Shared index out of range")
        return self._head[i] if i < h else self._store.items[i - h]

    def __iter__(self) -> Iterator[T]:
        return itertools.chain(self._head, itertools.islice(self._store.items, self._n))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Shared):
            if len(self) != len(other):
                return False
            if other._store is self._store and other._head == self._head and other._n == self._n:
                return True
            return tuple(self) == tuple(other)
        if isinstance(other, (tuple, list)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __add__(self, other: Any) -> tuple[T, ...]:
        if isinstance(other, (tuple, Shared)):
            return tuple(self) + tuple(other)
        return NotImplemented

    def __radd__(self, other: Any) -> tuple[T, ...]:
        if isinstance(other, tuple):
            return other + tuple(self)
        return NotImplemented

    def __repr__(self) -> str:
        return repr(tuple(self))
