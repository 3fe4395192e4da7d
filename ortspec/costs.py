"""Measuring a backend: what a target pass costs (the curve a cost-aware width policy needs) and how far a
multi-token verify pass drifts from one-token decodes (what the near-tie guard must cover).

``pass_costs[k]`` is the wall time of one pass over the pending token plus ``k`` draft tokens, divided by the
time of a plain 1-token decode step (``pass_costs[0]`` = 1.0). It is a property of the model, the backend and the
machine, so ``Engine`` measures it once per model folder, provider and thread count and caches it on disk.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ortspec.backends.base import Backend
from ortspec.core.proposers import Proposer


def measure_pass_costs(
    backend: Backend, context_ids: Sequence[int], feed_ids: Sequence[int], kmax: int = 16, repeats: int = 15
) -> dict[str, Any]:
    """Median wall time of one pass over ``1 + K`` tokens after ``context_ids``, for K = 0..``kmax``.

    K = 0 is a 1-token ``decode``; K >= 1 is ``decode_verify`` over K + 1 tokens (``feed_ids[:K + 1]``). Each
    sample is rewound to the same base; the K values are interleaved within every round (rotated per round) so
    machine noise spreads over the whole curve. Returns ``curve`` (time(K) / time(0)), ``pass_s``,
    ``decode_step_s``, ``context_tokens``, ``repeats`` and the raw ``samples_s``. Resets the backend.
    """
    feed = list(feed_ids)[: kmax + 1]
    if len(feed) < kmax + 1:
        raise ValueError(f"measuring up to K = {kmax} needs {kmax + 1} tokens to feed, got {len(feed)}")
    backend.reset()
    backend.decode(list(context_ids), 0)
    base = backend.current_len()

    def one(k: int) -> float:
        t0 = time.perf_counter()
        if k == 0:
            backend.decode(feed[:1], base)
        else:
            backend.decode_verify(feed[: k + 1], base)
        dt = time.perf_counter() - t0
        backend.rewind(base)
        return dt

    for k in range(kmax + 1):  # warm-up: buffer growth, first-shape costs
        one(k)
    samples: dict[int, list[float]] = {k: [] for k in range(kmax + 1)}
    for r in range(repeats):
        order = list(range(kmax + 1))
        shift = r % len(order)
        for k in order[shift:] + order[:shift]:
            samples[k].append(one(k))
    backend.reset()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "context_tokens": base,
        "repeats": repeats,
        "decode_step_s": med[0],
        "pass_s": [med[k] for k in range(kmax + 1)],
        "curve": [med[k] / med[0] for k in range(kmax + 1)],
        "samples_s": {str(k): v for k, v in samples.items()},
    }


def probe_ids(vocab_size: int, count: int) -> list[int]:
    """``count`` token ids for a measurement, spread over the first ``min(vocab_size, 1000)`` ids by a fixed
    recipe, so every measurement of a model feeds the same tokens."""
    n = min(vocab_size, 1000)
    return [(i * 7919) % n for i in range(count)]


def cached_pass_costs(backend: Backend, cache_file: Path, kmax: int = 16, repeats: int = 5) -> tuple[float, ...]:
    """``measure_pass_costs(...)["curve"]``, read from ``cache_file`` when it holds a curve for ``kmax``, else
    measured (after a context of up to 256 ``probe_ids``) and written there."""
    try:
        cached = json.loads(cache_file.read_text())
        if len(cached["curve"]) == kmax + 1:
            return tuple(float(c) for c in cached["curve"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    context = max(1, min(256, backend.max_length - kmax - 2))
    ids = probe_ids(backend.vocab_size, context + kmax + 1)
    result = measure_pass_costs(backend, ids[:context], ids[context:], kmax, repeats)
    # Noise can make a longer pass look cheaper than a shorter one; costs never fall as K grows.
    curve = [result["curve"][0]]
    for c in result["curve"][1:]:
        curve.append(max(c, curve[-1]))
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(
            json.dumps(
                {
                    "curve": curve,
                    "decode_step_s": result["decode_step_s"],
                    "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
                }
            )
        )
    except OSError:
        pass
    return tuple(curve)


def measure_verify_drift(
    backend: Backend, context_ids: Sequence[int], feed_ids: Sequence[int], windows: int = 3
) -> float:
    """The largest |logit| difference between a multi-token verify pass and one-token decodes of the same tokens.

    For each of ``windows`` windows of ``feed_ids`` (split evenly), after ``context_ids``: one ``decode_verify``
    over the window, then the same tokens decoded one at a time; the maximum absolute difference over all rows.
    Exact float32 kernels give 0 or ~1e-5; kernels whose numerics depend on the batch (int8 MatMulNBits with
    quantized activations) give tenths of a logit, enough to flip near-tied argmaxes. Resets the backend.
    """
    feed = list(feed_ids)
    size = len(feed) // windows
    if size < 2:
        raise ValueError(f"need at least {2 * windows} tokens to feed, got {len(feed)}")
    backend.reset()
    backend.decode(list(context_ids), 0)
    base = backend.current_len()
    drift = 0.0
    for w in range(windows):
        window = feed[w * size : (w + 1) * size]
        batched = backend.decode_verify(window, base).copy()
        backend.rewind(base)
        for i, token in enumerate(window):
            row = backend.decode([token], base + i)
            drift = max(drift, float(abs(batched[i] - row).max()))
        backend.rewind(base)
    backend.reset()
    return drift


def measure_draft_cost(
    backend: Backend, proposer: Proposer, context_ids: Sequence[int], width: int = 4, repeats: int = 15
) -> dict[str, Any]:
    """What a proposer that reads the target (a shared-KV draft head) costs per draft token, relative to a plain
    decode step of the same backend at the same context.

    The backend is put in the state the driver promises such a proposer (the KV of every context token but the
    last, the last pass over the one before); then, interleaved ``repeats`` times: one ``propose(context, width)``
    and one 1-token ``decode`` (rewound). Returns ``draft_s`` (median seconds of one ``propose``), ``tokens``
    (median tokens it drafted), ``step_s`` (``draft_s / tokens``), ``decode_step_s`` and ``cost`` (``step_s /
    decode_step_s``: the ``draft_cost`` of ``CostAwareWidth``). Resets the backend."""
    context = list(context_ids)
    if len(context) < 3:
        raise ValueError("measuring a draft needs a context of at least 3 tokens")
    backend.reset()
    backend.decode(context[:-2], 0)
    backend.decode(context[-2:-1], len(context) - 2)  # the last pass computed position len(context) - 2
    base = backend.current_len()
    drafts, sizes, decodes = [], [], []
    for r in range(repeats + 2):
        t0 = time.perf_counter()
        size = len(proposer.propose(context, width))
        t1 = time.perf_counter()
        backend.decode(context[-1:], base)
        t2 = time.perf_counter()
        if r >= 2:  # the first two are warm-up
            drafts.append(t1 - t0)
            sizes.append(size)
            decodes.append(t2 - t1)
        # the decode moved the last pass past position base - 1: restore the promised state
        backend.rewind(base - 1)
        backend.decode(context[-2:-1], base - 1)
    backend.reset()
    draft_s, decode_s = statistics.median(drafts), statistics.median(decodes)
    tokens = max(1.0, float(statistics.median(sizes)))
    return {
        "width": width,
        "repeats": repeats,
        "context_tokens": len(context),
        "draft_s": draft_s,
        "tokens": tokens,
        "step_s": draft_s / tokens,
        "decode_step_s": decode_s,
        "cost": draft_s / tokens / decode_s,
    }


def cached_draft_cost(
    backend: Backend, proposer: Proposer, cache_file: Path, context_ids: Sequence[int], width: int = 4
) -> float:
    """``measure_draft_cost(...)["cost"]``, read from ``cache_file`` when present, else measured after
    ``context_ids`` and written there (with the step and decode times)."""
    try:
        return float(json.loads(cache_file.read_text())["cost"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    result = measure_draft_cost(backend, proposer, context_ids, width)
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        cache_file.write_text(
            json.dumps(
                {
                    "cost": result["cost"],
                    "step_s": result["step_s"],
                    "decode_step_s": result["decode_step_s"],
                    "measured": time.strftime("%Y-%m-%dT%H:%M:%S"),
                }
            )
        )
    except OSError:
        pass
    return float(result["cost"])
