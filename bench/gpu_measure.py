"""The GPU benchmark's measurements on one model folder: every measurement of one backend mode (``MODES``) with
``OrtBackend`` (``measure_mode``: greedy speed, the verify cost curve up to ``KMAX``, time per pass by phase,
speculative == greedy on the device, speculation priced by replay), and ONNX Runtime GenAI's own greedy on the same
folder (``measure_genai``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ortspec.core.proposers import DraftContext


MODES: dict[str, dict[str, bool]] = {
    "eager": {},
    "static": {"static_shapes": True},
    "graphs": {"cuda_graphs": True},
}
KMAX = 16


# ----------------------------------------------------------------------------------------------------------------
# measurements


class OracleDrafts:
    """Drafts the known greedy continuation, with every ``wrong_every``-th drafted position wrong, so passes accept
    part of their draft (a random-weight model gives prompt lookup little to find)."""

    def __init__(self, prompt: Sequence[int], greedy: Sequence[int], vocab: int, wrong_every: int = 4) -> None:
        self.sequence = [*prompt, *greedy]
        self.vocab, self.wrong_every = vocab, wrong_every

    def propose(self, context: DraftContext) -> tuple[int, ...]:
        tokens = context.tokens
        n = len(tokens)
        if list(tokens[-8:]) != self.sequence[max(0, n - 8) : n]:
            return ()
        draft = self.sequence[n : n + context.width]
        return tuple((t + 1) % self.vocab if (n + i) % self.wrong_every == 0 else t for i, t in enumerate(draft))


def _prompt_ids(vocab: int, count: int, seed: int = 1234) -> list[int]:
    """A fixed prompt of ``count`` ids (no special ids 0-2), with a repeated stretch for prompt lookup to find."""
    rng = np.random.default_rng(seed)
    body = [int(t) for t in rng.integers(3, min(vocab, 32000), size=max(1, count - count // 4))]
    return (body + body[: count // 4])[:count]


def _timer_summary(timer, width: int) -> dict[str, float]:
    per = timer.per_pass(width)
    return {phase: round(seconds * 1e6, 1) for phase, seconds in per.items()} | {"passes": timer.passes.get(width, 0)}


def measure_mode(folder: str, provider: str, mode: str, cfg: argparse.Namespace, inputs: dict | None) -> dict:
    """Every measurement of one backend mode on one folder (see the module docstring)."""
    from bench.replay import PRICED_SETTINGS, price
    from ortspec import Options, PromptLookup, generate
    from ortspec.adapters.engine.measurements import measure_pass_costs, measure_verify_drift, probe_ids
    from ortspec.backends.onnx import BackendConfig, OrtBackend
    from ortspec.backends.onnx.cuda_graphs import PhaseTimer

    out: dict[str, Any] = {"mode": mode}
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(MODES[mode])
    if provider == "cpu":
        kwargs["threads"] = cfg.threads
    backend = OrtBackend.from_folder(folder, BackendConfig(provider=provider, max_length=cfg.max_length, **kwargs))
    out["open_s"] = round(time.perf_counter() - t0, 3)
    out["backend"] = repr(backend)
    out["array_module"] = getattr(backend.array_module, "name", None)
    if backend.graphs is not None:
        t0 = time.perf_counter()
        out["graphs"] = backend.capture_graphs()
        out["capture_s"] = round(time.perf_counter() - t0, 3)
    vocab = backend.vocab_size
    prompt = _prompt_ids(vocab, cfg.prompt_tokens)
    options = Options(max_tokens=cfg.new_tokens)
    generate(backend, prompt, Options(max_tokens=8))  # warm-up: first use of each shape

    runs = [generate(backend, prompt, options) for _ in range(cfg.repeats)]
    greedy = runs[0].token_ids
    decode = [r.decode_tokens_per_second for r in runs]
    out["greedy"] = {
        "decode_tok_s": statistics.median(decode),
        "decode_tok_s_runs": decode,
        "e2e_tok_s": statistics.median(r.tokens_per_second for r in runs),
        "prefill_ms": 1e3 * statistics.median(r.timings.first_token_s for r in runs),
        "new_tokens": len(greedy),
        "prompt_tokens": len(prompt),
        "same_tokens_every_run": all(r.token_ids == greedy for r in runs),
    }

    # time per pass: greedy steps through the driver, then 9-token verify passes
    timer = PhaseTimer()
    backend.timer = timer
    timed = generate(backend, prompt, options)
    steps = timed.stats.steps - 1
    step_s = (timed.timings.total_s - timed.timings.first_token_s) / max(steps - 1, 1)
    width1 = _timer_summary(timer, 1)
    out["step_us"] = {
        "greedy_pass": width1,
        "greedy_step_wall": round(step_s * 1e6, 1),
        "driver_per_step": round(step_s * 1e6 - width1["total"], 1),
    }
    timer.reset()
    feed = probe_ids(vocab, 9)
    backend.reset()
    backend.decode(prompt, 0)
    base = backend.current_len()
    for i in range(max(cfg.cost_repeats, 5) + 1):
        if i == 1:
            timer.reset()  # the first pass of this width was a warm-up
        if backend.picks_on_device:
            backend.verify_picks(feed, base)
        else:
            backend.decode_verify(feed, base)
        backend.rewind(base)
    out["step_us"]["verify9_pass"] = _timer_summary(timer, 9)
    backend.timer = None

    # cost curve
    ids = probe_ids(vocab, cfg.prompt_tokens + KMAX + 1)
    costs = measure_pass_costs(
        backend,
        ids[: cfg.prompt_tokens],
        ids[cfg.prompt_tokens :],
        KMAX,
        cfg.cost_repeats,
        picks=bool(backend.picks_on_device),
    )
    costs.pop("samples_s", None)
    out["costs"] = costs
    out["verify8_over_decode"] = costs["curve"][8]

    # speculative == greedy on this device
    drift = measure_verify_drift(backend, prompt[:64], probe_ids(vocab, 24))
    oracle = generate(backend, prompt, options, OracleDrafts(prompt, greedy, vocab), draft_width=8)
    lookup = generate(backend, prompt, options, PromptLookup(ngram=3, max_draft=8), draft_width=8)
    identity: dict[str, Any] = {
        "verify_drift_logits": drift,
        "oracle_drafts_identical": oracle.token_ids == greedy,
        "oracle_drafts_acceptance": f"{oracle.stats.accepted_tokens}/{oracle.stats.proposed_tokens}",
        "prompt_lookup_identical": lookup.token_ids == greedy,
        "prompt_lookup_acceptance": f"{lookup.stats.accepted_tokens}/{lookup.stats.proposed_tokens}",
    }
    if drift > 0:
        margin = 2 * drift
        guarded = generate(
            backend,
            prompt,
            Options(max_tokens=cfg.new_tokens, tie_margin=margin),
            OracleDrafts(prompt, greedy, vocab),
            draft_width=8,
        )
        identity["tie_margin"] = margin
        identity["oracle_drafts_identical_with_tie_margin"] = guarded.token_ids == greedy
    out["identity"] = identity

    # speculation priced with the CPU runs' acceptance
    if inputs is not None:
        t0 = time.perf_counter()
        priced = price(inputs, costs["curve"], PRICED_SETTINGS, limit=cfg.replay_limit, pass_s=costs["pass_s"])
        for entry in priced.values():
            entry["greedy"]["over_measured_greedy"] = entry["greedy"]["expected_tok_s"] / out["greedy"]["decode_tok_s"]
        out["priced"] = priced
        out["price_s"] = round(time.perf_counter() - t0, 2)
    del backend
    return out


def measure_genai(folder: str, provider: str, cfg: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    """ONNX Runtime GenAI's own greedy on ``folder`` (its CUDA graphs on or off on CUDA): decode tokens per second
    after the first token, median of ``--repeats`` runs of exactly ``--new-tokens`` (min_length = max_length)."""
    try:
        if provider == "cuda":
            import onnxruntime

            from ortspec.backends.onnx.session import preload_cuda_libraries

            preload_cuda_libraries(onnxruntime)  # the CUDA libraries of the nvidia-* packages, for GenAI too
        import onnxruntime_genai as og
    except Exception as exc:  # noqa: BLE001 - ImportError, or its native library failing to load
        return {"skipped": f"onnxruntime_genai is not importable: {type(exc).__name__}: {exc}"}
    try:
        config = og.Config(folder)
        config.clear_providers()
        if provider == "cuda":
            config.append_provider("cuda")
            config.set_provider_option("cuda", "enable_cuda_graph", "1" if graphs else "0")
        else:
            overlay = {"model": {"decoder": {"session_options": {"intra_op_num_threads": cfg.threads or 1}}}}
            config.overlay(json.dumps(overlay))
        model = og.Model(config)
    except Exception as exc:  # noqa: BLE001 - e.g. the CPU package asked for CUDA
        return {"skipped": f"ORT GenAI could not load the folder on {provider}: {type(exc).__name__}: {exc}"}
    prompt = _prompt_ids(model_vocab(folder), cfg.prompt_tokens)
    total = len(prompt) + cfg.new_tokens
    rates, e2e = [], []
    for i in range(cfg.repeats + 1):  # the first run warms up
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=total, min_length=total, batch_size=1)
        generator = og.Generator(model, params)
        t0 = time.perf_counter()
        generator.append_tokens(np.asarray(prompt, dtype=np.int32))
        generator.generate_next_token()
        t_first = time.perf_counter()
        steps = 1
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
        t_end = time.perf_counter()
        del generator
        if i:
            rates.append((steps - 1) / (t_end - t_first))
            e2e.append(steps / (t_end - t0))
    return {
        "cuda_graphs": graphs if provider == "cuda" else None,
        "decode_tok_s": statistics.median(rates),
        "decode_tok_s_runs": rates,
        "e2e_tok_s": statistics.median(e2e),
        "new_tokens": cfg.new_tokens,
        "version": getattr(og, "__version__", "?"),
    }


def model_vocab(folder: str) -> int:
    from ortspec.backends.onnx import ModelFolder

    return ModelFolder.load(folder).vocab_size
