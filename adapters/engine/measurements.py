"""Measuring a backend: what a target pass costs (the curve a cost-aware width policy needs) and how far a
multi-token verify pass drifts from one-token decodes (what the near-tie guard must cover), and, for continuous
batching, what a pass of several one-token rows costs against one (``decode_costs``, how the batch driver prices a
plain step).

``pass_costs[k]`` is the wall time of one pass over the pending token plus ``k`` draft tokens, divided by the
time of a plain 1-token decode step (``pass_costs[0]`` = 1.0). Both are properties of the model, the backend and
the machine, so ``Engine`` measures them once per model file, provider, thread count and onnxruntime version and
keeps them on disk, in one file per such key, through one mechanism (``cached_measurement``). The probes are cut
to fit any KV capacity, so a measurement never fails for a small ``max_length``.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ortspec.backends.base import Backend, BatchBackend, BatchRow, DevicePicks, uses_device_picks
from ortspec.core import MAX_DRAFT
from ortspec.core.proposers import DraftContext, Proposer


def measure_pass_costs(
    backend: Backend,
    context_ids: Sequence[int],
    feed_ids: Sequence[int],
    kmax: int = MAX_DRAFT,
    repeats: int = 15,
    picks: bool = False,
) -> dict[str, Any]:
    """Median wall time of one pass over ``1 + K`` tokens after ``context_ids``, for K = 0..``kmax``.

    K = 0 is a 1-token ``decode``; K >= 1 is ``decode_verify`` over K + 1 tokens (``feed_ids[:K + 1]``). With
    ``picks`` (a ``DevicePicks`` backend) every K is a ``verify_picks`` pass instead, the pass the driver makes
    where the logits live on a device (so no logits rows are copied to the host). Each sample is rewound to the
    same base; the K values are interleaved within every round (rotated per round) so machine noise spreads over
    the whole curve. Returns ``curve`` (time(K) / time(0)), ``pass_s``, ``decode_step_s``, ``context_tokens``,
    ``repeats``, ``picks`` and the raw ``samples_s``. Resets the backend.
    """
    picker = backend if picks else None
    if picker is not None and not isinstance(picker, DevicePicks):
        raise ValueError("picks=True needs a backend with verify_picks (DevicePicks)")
    feed = list(feed_ids)[: kmax + 1]
    if len(feed) < kmax + 1:
        raise ValueError(f"measuring up to K = {kmax} needs {kmax + 1} tokens to feed, got {len(feed)}")
    backend.reset()
    backend.decode(list(context_ids), 0)
    base = backend.current_len()

    def one(k: int) -> float:
        t0 = time.perf_counter()
        if picker is not None:
            picker.verify_picks(feed[: k + 1], base)
        elif k == 0:
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
        "picks": picker is not None,
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


def cached_measurement(
    cache_file: Path | None, name: str, params: Mapping[str, Any], measure: Callable[[], Mapping[str, Any]]
) -> dict[str, Any]:
    """The measurement ``name`` of a backend, made once and kept on disk: the one cache for all of them.

    ``cache_file`` is a JSON object with one record per measurement name (``{"params": ..., "result": ...,
    "measured": ...}``); a record is reused when its ``params`` equal ``params`` (which must be JSON values), else
    ``measure()`` runs and its result (a JSON object) replaces it. The file is replaced atomically, so readers never
    see half of one; an unreadable file is measured again, an unwritable one is not an error. ``cache_file`` None:
    always measure (a backend with no identity to key a cache on)."""
    wanted = json.loads(json.dumps(dict(params)))  # as it reads back
    records: dict[str, Any] = {}
    if cache_file is not None:
        try:
            loaded = json.loads(cache_file.read_text(encoding="utf-8"))
            if isinstance(loaded, dict):
                records = loaded
            record = records.get(name)
            if isinstance(record, dict) and record.get("params") == wanted and isinstance(record.get("result"), dict):
                return dict(record["result"])
        except (OSError, ValueError):
            pass
    result = dict(measure())
    if cache_file is not None:
        records[name] = {"params": wanted, "result": result, "measured": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tmp = None
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=cache_file.name, suffix=".tmp", dir=cache_file.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(records, out, indent=1)
            os.replace(tmp, cache_file)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
    return result


def pass_cost_probe(capacity: int, kmax: int) -> tuple[int, int]:
    """``(context tokens, largest K measured)`` for a verify cost curve up to ``kmax`` on a KV cache of
    ``capacity`` positions: a context of up to 256 tokens and K up to ``kmax``, both cut so that the context and
    a pass of 1 + K tokens fit. K is 0 when no pass with a draft fits (capacity < 3)."""
    k = max(0, min(kmax, capacity - 2))
    return max(1, min(256, capacity - k - 1)), k


def cached_pass_costs(
    backend: Backend,
    cache_file: Path | None,
    kmax: int = MAX_DRAFT,
    repeats: int = 5,
    *,
    before: Callable[[], None] | None = None,
) -> tuple[float, ...]:
    """The verify cost curve ``(1.0, cost(1), ..., cost(kmax))`` (``measure_pass_costs(...)["curve"]``, made
    non-decreasing: noise can make a longer pass look cheaper), measured after a context of ``probe_ids`` and
    kept by ``cached_measurement``. The probe fits any capacity (``pass_cost_probe``): widths the capacity cannot
    hold are never verified, and repeat the largest measured cost. Measured with device picks when the driver
    will use them (as on CUDA). ``before()`` runs just before the backend is used (not on a cache hit); the
    measurement resets the backend."""
    picks = uses_device_picks(backend)
    context, k = pass_cost_probe(backend.max_length, kmax)

    def measure() -> dict[str, Any]:
        if before is not None:
            before()
        if k == 0:
            return {"curve": [1.0], "decode_step_s": None}
        ids = probe_ids(backend.vocab_size, context + k + 1)
        result = measure_pass_costs(backend, ids[:context], ids[context:], k, repeats, picks=picks)
        curve = [result["curve"][0]]
        for c in result["curve"][1:]:
            curve.append(max(c, curve[-1]))
        return {"curve": curve, "decode_step_s": result["decode_step_s"]}

    params = {"kmax": k, "context_tokens": context, "repeats": repeats, "probe": "probe_ids", "picks": picks}
    curve = [float(c) for c in cached_measurement(cache_file, "pass_costs", params, measure)["curve"]]
    return tuple(curve + [curve[-1]] * (kmax + 1 - len(curve)))


def drift_probe(capacity: int, windows: int = 3, window: int = 9) -> tuple[int, int] | None:
    """``(context tokens, tokens per window)`` for ``measure_verify_drift`` on a KV cache of ``capacity``
    positions: a context of up to 256 tokens, then windows of up to ``window`` tokens, cut to fit. None when no
    pass of two or more tokens fits after a one-token context (capacity < 3): such a backend never verifies a
    draft, so it cannot drift."""
    if capacity < 3:
        return None
    size = min(window, capacity - 1)
    return max(1, min(256, capacity - size)), size


def cached_verify_drift(
    backend: Backend, cache_file: Path | None, windows: int = 3, *, before: Callable[[], None] | None = None
) -> float:
    """``measure_verify_drift`` with a probe that fits the backend (``drift_probe``; 0.0 when none does), kept
    by ``cached_measurement``; ``before`` as for ``cached_pass_costs``."""
    probe = drift_probe(backend.max_length, windows)
    if probe is None:
        return 0.0
    context, size = probe

    def measure() -> dict[str, Any]:
        if before is not None:
            before()
        ids = probe_ids(backend.vocab_size, context + windows * size)
        return {"drift": measure_verify_drift(backend, ids[:context], ids[context:], windows=windows)}

    params = {"context_tokens": context, "window": size, "windows": windows, "probe": "probe_ids"}
    return float(cached_measurement(cache_file, "verify_drift", params, measure)["drift"])


def measure_verify_drift(
    backend: Backend, context_ids: Sequence[int], feed_ids: Sequence[int], windows: int = 3
) -> float:
    """The largest |logit| difference between a multi-token verify pass and one-token decodes of the same tokens.

    For each of ``windows`` windows of ``feed_ids`` (split evenly), after ``context_ids``: one ``decode_verify``
    over the window, then the same tokens decoded one at a time; the maximum absolute difference over all rows.
    Exact float32 kernels give 0 or float32 rounding; kernels whose numerics depend on the batch (int8 MatMulNBits
    with quantized activations) give more, which can flip near-tied argmaxes. Resets the backend.
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
    backend: Backend,
    proposer: Proposer,
    context_ids: Sequence[int],
    width: int = 4,
    repeats: int = 15,
    slot: int = 0,
) -> dict[str, Any]:
    """What a proposer that reads the target (a shared-KV draft head), or a separate draft model, costs per draft
    token, relative to a plain decode step of the same backend at the same context. (A draft model's first
    ``propose``, a warm-up, prefills its own KV; each later one re-feeds the context's last token and drafts from
    there, as after a verified step.)

    The backend is put in the state the driver promises such a proposer (the KV of every context token but the
    last, the last pass over the one before); then, interleaved ``repeats`` times: one ``propose`` (its context
    naming ``slot``, where the proposer finds ``backend``: 0 for one bound to it, a batch backend's lone slot for
    ``SlotDrafters``) and one 1-token ``decode`` (rewound). Returns ``draft_s`` (median seconds of one
    ``propose``), ``tokens`` (median tokens it drafted), ``step_s`` (``draft_s / tokens``), ``decode_step_s`` and
    ``cost`` (``step_s / decode_step_s``: the ``draft_cost`` of ``CostAwareWidth``). Resets the backend."""
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
        size = len(proposer.propose(DraftContext(context, width, slot=slot)))
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
    backend: Backend,
    proposer: Proposer,
    cache_file: Path | None,
    drafter_key: str,
    width: int = 4,
    *,
    slot: int = 0,
    before: Callable[[], None] | None = None,
    name: str = "draft cost",
) -> float:
    """``measure_draft_cost(...)["cost"]`` after a context of ``probe_ids`` (up to 256 tokens, cut to fit the
    capacity), at ``slot``, kept by ``cached_measurement`` under the name ``name`` (``"draft cost"``: the
    shared-KV drafter's; ``"draft model cost"``: a separate draft model's, whose steps the same measurement times)
    with ``drafter_key`` (which drafter: its folder and the version of its files) among the params, so another
    drafter is measured again. ``before()`` runs just before the backend is used (not on a cache hit); the
    measurement resets the backend."""
    context = max(3, min(256, backend.max_length - width - 2))

    def measure() -> dict[str, Any]:
        if before is not None:
            before()
        result = measure_draft_cost(backend, proposer, probe_ids(backend.vocab_size, context), width, slot=slot)
        return {key: result[key] for key in ("cost", "step_s", "decode_step_s", "tokens")}

    params = {"drafter": drafter_key, "width": width, "context_tokens": context, "probe": "probe_ids"}
    return float(cached_measurement(cache_file, name, params, measure)["cost"])


def measure_read_cost(
    backend: Backend, proposer: Proposer, context_ids: Sequence[int], repeats: int = 7, slot: int = 0
) -> dict[str, Any]:
    """What a proposer that keeps its own KV (a separate draft model) costs per context token it reads before it
    drafts (its catch-up), relative to a plain decode step of ``backend`` at the same context: interleaved
    ``repeats`` times (after a warm-up), one ``propose`` of width 1 after a context that shares no first token with
    the one before (so the proposer reads it whole, then picks one token) and one 1-token decode of the target.
    Returns ``read_s`` (median seconds of one such ``propose``), ``context_tokens``, ``decode_step_s`` and ``cost``
    (``read_s / context_tokens / decode_step_s``: the ``read_cost`` of ``CostAwareWidth``). Resets the backend."""
    context = list(context_ids)
    if len(context) < 3:
        raise ValueError("measuring a read needs a context of at least 3 tokens")
    other = [(context[0] + 1) % backend.vocab_size, *context[1:]]
    backend.reset()
    backend.decode(context[:-1], 0)
    base = backend.current_len()
    reads, decodes = [], []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        proposer.propose(DraftContext(other if r % 2 else context, 1, slot=slot))
        t1 = time.perf_counter()
        backend.decode(context[-1:], base)
        t2 = time.perf_counter()
        backend.rewind(base)
        if r >= 1:  # the first is warm-up
            reads.append(t1 - t0)
            decodes.append(t2 - t1)
    backend.reset()
    read_s, decode_s = statistics.median(reads), statistics.median(decodes)
    return {
        "repeats": repeats,
        "context_tokens": len(context),
        "read_s": read_s,
        "decode_step_s": decode_s,
        "cost": read_s / len(context) / decode_s,
    }


def cached_read_cost(
    backend: Backend,
    proposer: Proposer,
    cache_file: Path | None,
    drafter_key: str,
    *,
    slot: int = 0,
    before: Callable[[], None] | None = None,
) -> float:
    """``measure_read_cost(...)["cost"]`` over a context of ``probe_ids`` (up to 256 tokens, cut to fit the
    capacity), at ``slot``, kept by ``cached_measurement`` as ``"draft model read cost"`` with ``drafter_key`` (which
    draft model, and how its session runs) among the params. ``before()`` runs just before the backend is used (not
    on a cache hit); the measurement resets the backend."""
    context = max(3, min(256, backend.max_length - 2))

    def measure() -> dict[str, Any]:
        if before is not None:
            before()
        result = measure_read_cost(backend, proposer, probe_ids(backend.vocab_size, context), slot=slot)
        return {key: result[key] for key in ("cost", "read_s", "decode_step_s", "context_tokens")}

    params = {"drafter": drafter_key, "context_tokens": context, "probe": "probe_ids"}
    return float(cached_measurement(cache_file, "draft model read cost", params, measure)["cost"])


def batch_sizes(slots: int) -> tuple[int, ...]:
    """The pass sizes ``measure_batch_decode_costs`` times on ``slots`` slots: the powers of two below ``slots``,
    and ``slots``."""
    sizes = [1]
    while sizes[-1] * 2 < slots:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes + ([slots] if slots > 1 else []))


def measure_batch_decode_costs(
    backend: BatchBackend, context_ids: Sequence[int], sizes: Sequence[int], repeats: int = 5
) -> dict[str, Any]:
    """The median wall time of one pass of ``b`` one-token rows (slots ``0 .. b - 1``, each after ``context_ids``)
    for each ``b`` in ``sizes``, the sizes interleaved in every round (rotated per round) after one warm-up round.
    Returns ``pass_s`` (per size) and ``curve``: ``decode_costs[n]`` for ``n = 0 .. max(sizes)`` (the pass of ``n``
    rows ÷ the pass of 1; 0 rows cost 0; linear between measured sizes; made non-decreasing, as noise could make
    more rows look cheaper). Empties the slots it used."""
    top = max(sizes)
    context = list(context_ids)
    for slot in range(top):
        backend.reset(slot)
    backend.run_pass([BatchRow(slot, context, 0) for slot in range(top)])  # equal lengths at 0: one session run
    feed = probe_ids(backend.vocab_size, top + 1)[1:]

    def one(b: int) -> float:
        rows = [BatchRow(slot, (feed[slot],), len(context)) for slot in range(b)]
        t0 = time.perf_counter()
        backend.run_pass(rows)
        dt = time.perf_counter() - t0
        for slot in range(b):
            backend.rewind(slot, len(context))
        return dt

    samples: dict[int, list[float]] = {b: [] for b in sizes}
    for r in range(repeats + 1):
        order = list(sizes)
        shift = r % len(order)
        for b in order[shift:] + order[:shift]:
            dt = one(b)
            if r > 0:
                samples[b].append(dt)
    for slot in range(top):
        backend.reset(slot)
    med = {b: statistics.median(v) for b, v in samples.items()}
    points = [(0, 0.0)] + [(b, med[b] / med[1]) for b in sorted(sizes)]
    curve = [0.0]
    for n in range(1, top + 1):
        (b0, c0), (b1, c1) = next((p, q) for p, q in itertools.pairwise(points) if p[0] < n <= q[0])
        curve.append(max(curve[-1], c0 + (c1 - c0) * (n - b0) / (b1 - b0)))
    curve[1] = 1.0
    return {"pass_s": {str(b): med[b] for b in sizes}, "curve": curve}


def cached_batch_decode_costs(
    backend: BatchBackend, cache_file: Path | None, repeats: int = 5, *, before: Callable[[], None] | None = None
) -> tuple[float, ...]:
    """The ``decode_costs`` curve of ``backend`` (``measure_batch_decode_costs`` at ``batch_sizes(slots)``, after a
    context of up to 128 ``probe_ids`` cut to fit), kept by ``cached_measurement`` under ``batch decode costs``;
    ``before()`` runs just before the backend is used (not on a cache hit). Empties the slots."""
    context = max(1, min(128, backend.max_length - 1))
    sizes = batch_sizes(backend.slots)

    def measure() -> dict[str, Any]:
        if before is not None:
            before()
        return measure_batch_decode_costs(backend, probe_ids(backend.vocab_size, context), sizes, repeats)

    params = {"sizes": list(sizes), "context_tokens": context, "repeats": repeats, "probe": "probe_ids"}
    return tuple(float(c) for c in cached_measurement(cache_file, "batch decode costs", params, measure)["curve"])
