"""Draft-width policies: how many draft tokens to verify in the next pass.

A policy is a frozen value with ``width() -> int`` (the most draft tokens it wants next; the driver still caps
it by the step's budget) and ``observe(proposed, accepted) -> policy`` (the policy after a step that verified
``proposed`` draft tokens, of which ``accepted`` were committed; a plain step observes ``(0, 0)``). A policy
only changes how many tokens are verified, never which tokens are committed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs


@runtime_checkable
class WidthPolicy(Protocol):
    def width(self) -> int: ...

    def observe(self, proposed: int, accepted: int) -> WidthPolicy: ...


def _check_width(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"draft_width must be an int >= 1, got {value!r}")


@attrs.frozen
class FixedWidth:
    """Always the same width."""

    draft_width: int = attrs.field(validator=_check_width)

    def width(self) -> int:
        return self.draft_width

    def observe(self, proposed: int, accepted: int) -> FixedWidth:
        return self
