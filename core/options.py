"""What to generate and when to stop: the core's options, each declared once (``core/declare.py``).

``Limits`` holds the options every layer shares (``max_tokens``, ``stop``, ``top_logprobs``, ``tie_margin``); the
core's ``Options`` adds what only the core needs (``eos_token_ids``, ``max_context``) and holds a ``Sampling``
(``core/sampling.py``). The Engine's ``GenerationOptions`` combines ``Limits`` and ``Sampling`` with its own
keywords, so each of these is declared here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from .checks import ArgumentError, int_at_least, is_int, token_ids
from .constraint import Grammar
from .declare import Bounds, option
from .sampling import Sampling

# Stop strings are searched in the text after every token (cost ~ the number and length of the strings), and a
# stop token sequence is compared with the newest tokens: these bounds keep that a small part of a step.
MAX_STOPS = 64
MAX_STOP_LENGTH = 1000

Stop = str | tuple[int, ...]


def _to_eos_ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if is_int(value):
        value = (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentError("eos_token_ids", f"eos_token_ids: expected a set of token ids, got {value!r}")
    return frozenset(token_ids("eos_token_ids", value))


def _stop_string(item: str) -> str:
    if not item:
        raise ArgumentError("stop", "stop: an empty string would match before any text; remove it")
    if len(item) > MAX_STOP_LENGTH:
        raise ArgumentError(
            "stop", f"stop: a stop string of {len(item)} characters; at most {MAX_STOP_LENGTH} are allowed"
        )
    for i, ch in enumerate(item):
        if "\ud800" <= ch <= "\udfff":
            raise ArgumentError(
                "stop",
                f"stop: {item!r} holds a lone surrogate (U+{ord(ch):04X} at index {i}), which no decoded text "
                "contains: it could never match (was it cut from UTF-16, or decoded with surrogateescape?)",
            )
    return item


def _to_stops(value: object) -> tuple[Stop, ...]:
    """``stop`` as a tuple of stop strings and stop token-id sequences; ``ValueError`` naming ``stop`` for anything
    that could never match or is not a stop: an empty string or sequence, bytes, a lone surrogate (no decoded text
    holds one), a negative id, more than ``MAX_STOPS`` entries, or one longer than ``MAX_STOP_LENGTH``. ``None``:
    no stops. (Ids are checked against the vocabulary when a generation starts.)"""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, (bytes, bytearray)):
        raise ArgumentError(
            "stop", "stop: bytes are not a stop string; decode them to str (stop strings match decoded text)"
        )
    if isinstance(value, Mapping) or not isinstance(value, Iterable):
        raise ArgumentError(
            "stop", f"stop must be a string, a list of strings or a list of token-id lists, got {type(value).__name__}"
        )
    items = list(value)
    if len(items) > MAX_STOPS:
        raise ArgumentError("stop", f"stop holds {len(items)} entries; at most {MAX_STOPS} are allowed")
    out: list[Stop] = []
    for item in items:
        if isinstance(item, str):
            out.append(_stop_string(item))
        elif isinstance(item, (bytes, bytearray)):
            raise ArgumentError("stop", f"stop: {item!r} is bytes; decode it to str (stop strings match decoded text)")
        elif isinstance(item, Iterable) and not isinstance(item, Mapping):
            ids = token_ids("stop", item)
            if not ids:
                raise ArgumentError("stop", "stop: an empty token-id sequence would match before any token; remove it")
            if len(ids) > MAX_STOP_LENGTH:
                raise ArgumentError(
                    "stop", f"stop: a token-id sequence of {len(ids)} ids; at most {MAX_STOP_LENGTH} are allowed"
                )
            out.append(ids)
        else:
            raise ArgumentError("stop", f"stop: {item!r} is neither a string nor a sequence of token ids")
    return tuple(out)


def _is_grammar(instance: object, field: object, value: Any) -> None:
    if not isinstance(value, Grammar):
        raise ArgumentError("grammar", f"grammar must have a matcher() method (core.constraint.Grammar), got {value!r}")


@attrs.frozen(kw_only=True, slots=False)  # not slotted: the Engine's options combine it with ``Sampling``
class Limits:
    """The options every layer shares, declared once (``core/declare.py``): when to stop, and what to report."""

    max_tokens: int = option(128, "the most new tokens to generate", bounds=Bounds("int", minimum=1))
    stop: tuple[Stop, ...] = option(
        (),
        "stop strings (cut from the text) and stop token-id sequences (kept): generation ends at the first match",
        converter=_to_stops,
    )
    top_logprobs: int = option(
        0,
        "report each token's log-probability and the N most likely alternatives",
        bounds=Bounds("int", minimum=0),
    )
    tie_margin: float = option(
        0.0,
        "the near-tie guard, in logits: a pick of a multi-token pass closer than this to a tie is re-decided by a "
        "1-token pass; 0 = off",
        bounds=Bounds(minimum=0),
        converter=lambda v: float(v) if is_int(v) else v,
    )

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings of ``stop``, in order."""
        return tuple(s for s in self.stop if isinstance(s, str))

    @property
    def stop_token_sequences(self) -> tuple[tuple[int, ...], ...]:
        """The stop token-id sequences of ``stop``, in order."""
        return tuple(s for s in self.stop if not isinstance(s, str))


@attrs.frozen(kw_only=True)
class Options(Limits):
    """What to generate and when to stop, as the core sees it. Every field is validated; a bad one raises
    ``ValueError`` naming it.

    The shared options (``Limits``): ``max_tokens``, ``stop``, ``top_logprobs`` (> 0 records, for each committed
    token, its log-probability and the N most likely alternatives), ``tie_margin`` (> 0 turns on the near-tie guard,
    see the module docstring). ``eos_token_ids``: the tokens that end generation (kept). ``max_context`` bounds
    prompt + generated tokens; ``None`` leaves the bound to the backend's KV capacity (the state's context limit
    is the smaller of the two). ``sampling``: how each pick is made (``core/sampling.py``); sampling
    (``temperature > 0``) needs a ``seed``: the core has no randomness of its own. ``grammar``: a constraint every
    generated token obeys (``core/constraint.py``: structured outputs); None: unconstrained.
    """

    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_to_eos_ids)
    max_context: int | None = attrs.field(default=None, validator=attrs.validators.optional(int_at_least(1)))
    sampling: Sampling = attrs.field(default=Sampling(), validator=attrs.validators.instance_of(Sampling))
    grammar: Grammar | None = attrs.field(default=None, validator=attrs.validators.optional(_is_grammar))

    def __attrs_post_init__(self) -> None:
        if self.sampling.temperature > 0 and self.sampling.seed is None:
            raise ArgumentError("seed", "temperature > 0 needs a seed (an int): the core has no randomness of its own")

    @property
    def device_picks_suffice(self) -> bool:
        """True when every pick is the raw row's argmax and nothing else is read from the row (no logprobs): a
        backend that makes argmax picks where its logits live (``DevicePicks``) may then stand in for the rows (a
        grammar's mask needs the rows)."""
        return not self.top_logprobs and self.sampling.is_plain_greedy and self.grammar is None

    @property
    def replay_seed(self) -> int | None:
        """The sampler's seed when sampling (what reproduces the run), None when decoding greedily."""
        return self.sampling.seed if self.sampling.temperature > 0 else None
