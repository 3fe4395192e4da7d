"""Prefix reuse: how much of a KV cache's resident tokens a prompt shares, and which cache a prompt should go to.

A KV cache (an Engine's backend, a slot of a batch backend) holds the KV of its *resident* tokens at its first
positions. A prompt that starts with some of them may keep those positions and prefill only the rest; how many
it keeps is the core's decision (``DecodeState.start``'s ``cached_prefix``: never the last prompt token, whose
row picks the first token).

Routing a prompt among several free caches scores each one by what the prompt reuses there net of the resident
KV it drops: ``shared - (len(resident) - shared)`` (``reuse_score``). The next turn of a conversation shares all
of its own cache's resident tokens and goes there; a new conversation that shares only a system prompt with every
cache goes where it has the least to lose (an empty cache, score 0, first) instead of dropping the KV of a
conversation that may continue. Ties are broken by the caller (the server's pool and the batch driver both take
the least recently used cache).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def reuse_score(resident: Sequence[int], prompt: Sequence[int]) -> int:
    """How well a cache holding the KV of ``resident`` serves ``prompt`` (higher is better): the shared prefix it
    reuses less the resident positions it drops, ``2 * shared - len(resident)``."""
    return 2 * common_prefix_length(resident, prompt) - len(resident)
