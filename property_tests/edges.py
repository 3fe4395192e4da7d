"""How often the central property reaches the places where speculative decoding goes wrong.

The property test classifies every example it runs (``record``) and reports each class to Hypothesis as an
``event`` too. ``property_tests/conftest.py`` prints the rates after the run and fails the session when a rate
is below its target, once enough examples ran for the rates to mean something.
"""

from __future__ import annotations

from collections import Counter

TALLY: Counter[str] = Counter()
EXAMPLES = "examples"

# label -> the least fraction of examples that must carry it
TARGETS = {
    "ran a verify pass": 0.50,
    "accepted several draft tokens in one pass": 0.20,
    "ended inside a block: eos": 0.10,
    "ended inside a block: stop sequence": 0.10,
    "ended inside a block: stop string": 0.10,
    "ended inside a block: max_tokens": 0.10,
    "ended inside a block: context": 0.10,
}
# The rates are checked only when at least this many examples ran (the ci and thorough profiles).
MIN_EXAMPLES = 2000


def record(labels: list[str]) -> None:
    TALLY[EXAMPLES] += 1
    TALLY.update(set(labels))


def report() -> tuple[list[str], list[str]]:
    """(lines to print, targets missed)."""
    n = TALLY[EXAMPLES]
    if not n:
        return [], []
    lines = [f"edge coverage of the equivalence property over {n} examples:"]
    missed = []
    for label in sorted(set(TALLY) - {EXAMPLES}, key=lambda k: (k not in TARGETS, k)):
        rate = TALLY[label] / n
        target = TARGETS.get(label)
        verdict = (
            ""
            if target is None
            else (f"  (target >= {target:.0%})" if rate >= target else f"  MISSED target >= {target:.0%}")
        )
        if target is not None and rate < target and n >= MIN_EXAMPLES:
            missed.append(label)
        lines.append(f"  {rate:6.1%}  {label}{verdict}")
    for label in TARGETS:
        if label not in TALLY:
            lines.append(f"    0.0%  {label}  MISSED target >= {TARGETS[label]:.0%}")
            if n >= MIN_EXAMPLES:
                missed.append(label)
    return lines, missed
