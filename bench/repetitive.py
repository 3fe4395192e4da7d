"""The repetitive stream: what an agent or a batch job sends one Engine, request after request.

Requests of three task shapes, interleaved, each with its own values: a JSON object from a sentence, a short Python
function with a docstring, a polite email declining something. Their answers share text that is NOT in each prompt
(the JSON keys and braces, the function's frame, the letter's greeting and closing), so only a proposer that learns
across requests (the suffix cache) can draft it. The stream is measured in order on one Engine
(``bench.suite``'s ``repetitive`` category; ``python -m bench.suffix stream``): request ``i`` may draft from the
outputs of requests ``0 .. i - 1``, never from its own.
"""

from __future__ import annotations

NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Julia")
CITIES = ("Lisbon", "Osaka", "Nairobi", "Lima", "Oslo", "Perth", "Quebec", "Riga", "Seoul", "Turin")
THINGS = ("a list of numbers", "a string", "a dictionary", "two lists", "a file path", "a sentence")
GOALS = ("its largest item", "its length", "its keys sorted", "their common items", "its extension", "its words")
EVENTS = ("the Monday meeting", "a lunch invitation", "a conference talk", "a weekend trip", "a project review")
SHAPES = ("json", "function", "email")


def repetitive_prompt(i: int) -> tuple[str, str]:
    """The stream's request ``i`` (from 0): its shape (one of ``SHAPES``, in turn) and its text. Request ``i`` of a
    shape is that shape's round ``i // 3``, whose values no earlier round of the shape had (for 30 rounds)."""
    shape, k = SHAPES[i % 3], i // 3
    if shape == "json":
        name, city, age = NAMES[k % len(NAMES)], CITIES[(3 * k) % len(CITIES)], 21 + 7 * k
        return shape, (
            "Turn this sentence into a JSON object with the fields name, age, city and country, and output only the "
            f"JSON: {name} is {age} years old and lives in {city}."
        )
    if shape == "function":
        thing, goal = THINGS[k % len(THINGS)], GOALS[(k + k // len(THINGS)) % len(GOALS)]
        return shape, f"Write a short Python function with a docstring that takes {thing} and returns {goal}."
    name, event = NAMES[k % len(NAMES)], EVENTS[(k + k // len(NAMES)) % len(EVENTS)]
    return shape, f"Write a short, polite email to {name} declining {event}."


def repetitive_stream(n: int) -> list[str]:
    """The stream's first ``n`` requests' texts, in order."""
    return [repetitive_prompt(i)[1] for i in range(n)]
