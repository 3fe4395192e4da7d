"""Prefix reuse: what a KV cache holds that a next prompt may reuse, how much of it a prompt pass reuses, and which
cache a prompt should go to.

A KV cache (an Engine's backend, a slot of a batch backend) holds the KV of its *resident* tokens at its first
positions: after a generation, its context up to the KV length, as far as the cache's length reaches
(``resident_tokens``). A prompt that starts with some of them keeps those positions and prefills only the rest, but
never reuses its last token, whose row picks the first token (``reused_length``; ``DecodeState.start`` applies it,
``reusing`` for a caller that learns what a cache holds after the state is made). The output is the same either
way: a token's KV depends only on the tokens before it.

Routing a prompt among several free caches scores each one by what the prompt reuses there net of the resident
KV it drops: ``shared - (len(resident) - shared)`` (``reuse_score``). The next turn of a conversation shares all
of its own cache's resident tokens and goes there; a new conversation that shares only a system prompt with every
cache goes where it has the least to lose (an empty cache, score 0, first) instead of dropping the KV of a
conversation that may continue. Ties are broken by the caller (the server's pool and the batch driver both take
the least recently used cache).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np

from .checks import check_int

if TYPE_CHECKING:
    from .state import DecodeState


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (compared in C: the first ``min`` of both as tuples, then, where
    they differ, as arrays)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    head_a, head_b = tuple(a[:n]), tuple(b[:n])
    if head_a == head_b:
        return n
    return int(np.flatnonzero(np.asarray(head_a, dtype=np.int64) != np.asarray(head_b, dtype=np.int64))[0])


def reuse_score(resident: Sequence[int], prompt: Sequence[int]) -> int:
    """How well a cache holding the KV of ``resident`` serves ``prompt`` (higher is better): the shared prefix it
    reuses less the resident positions it drops, ``2 * shared - len(resident)``."""
    return 2 * common_prefix_length(resident, prompt) - len(resident)


def reused_length(cached_prefix: int, prompt_len: int) -> int:
    """How many leading prompt tokens a prompt pass of ``prompt_len`` tokens reuses when the cache holds the KV of
    ``cached_prefix`` of them (the caller vouches): all but the last at most. ``ValueError`` for a negative count."""
    return min(check_int("cached_prefix", cached_prefix, 0), prompt_len - 1)


def reusing(state: DecodeState, cached_prefix: int) -> DecodeState:
    """``state``, not yet stepped, with its prompt pass reusing ``reused_length`` of ``cached_prefix`` (its
    ``cached_prefix``). ``ValueError`` once the prompt pass has run."""
    if state.stats.steps or state.generated_tokens:
        raise ValueError("reusing: the prompt pass has run already; a cached prefix is chosen before it")
    return attrs.evolve(state, cached_prefix=reused_length(cached_prefix, len(state.prompt_tokens)))


def resident_tokens(state: DecodeState, held: int) -> tuple[int, ...]:
    """The tokens whose KV a cache holding ``held`` positions of the generation ``state`` has, whatever happened to
    it (finished, stopped early, cancelled, failed): its context up to the KV length, as far as ``held`` reaches."""
    return state.context_tokens[: min(state.kv_len, held)]
