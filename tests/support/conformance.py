"""Does ortspec serve a model folder exactly? :func:`check_folder` answers for one folder and prompt:

* it loads as is in :class:`~ortspec.backends.onnx.OrtBackend` (with the load-time rewrites ``OrtBackend``
  applies, which the report lists);
* ortspec's greedy tokens equal ONNX Runtime GenAI's own greedy search on the same folder
  (``onnxruntime_genai`` Model/Generator, CPU, the same thread count), and, given the Hugging Face checkpoint it
  was exported from, transformers' greedy decoding (informative: it checks the builder, not ortspec);
* speculative decoding equals greedy decoding with drafts that really are verified and accepted
  (:class:`GreedyReplay`: the known greedy continuation, all right or every third token wrong) and with prompt
  lookup;
* how far multi-token verify passes drift from one-token decodes along the greedy continuation
  (:func:`continuation_drift`).

``onnxruntime_genai`` and transformers are imported only when those comparisons run.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from ortspec.backends.onnx import BackendConfig, ModelFolder, OrtBackend
from ortspec.core import DraftContext, Options, PromptLookup
from ortspec.driver import generate


class GreedyReplay:
    """A proposer that drafts a known greedy continuation: ``prompt + greedy`` is the whole sequence, and at any
    context that is a prefix of it, the next ``width`` tokens of it are proposed (every one correct), except that
    with ``wrong_every = n`` each n-th drafted position gets a wrong id (partial acceptance). It makes a random tiny
    model speculate, which prompt lookup on its text rarely does."""

    def __init__(self, prompt: Sequence[int], greedy: Sequence[int], vocab_size: int, wrong_every: int = 0) -> None:
        self.sequence = [*prompt, *greedy]
        self.vocab_size, self.wrong_every = vocab_size, wrong_every

    def propose(self, draft_context: DraftContext) -> tuple[int, ...]:
        context, width = draft_context.tokens, draft_context.width
        n = len(context)
        if list(context) != self.sequence[:n]:
            return ()
        draft = self.sequence[n : n + width]
        if self.wrong_every:
            draft = [(t + 1) % self.vocab_size if (n + i) % self.wrong_every == 0 else t for i, t in enumerate(draft)]
        return tuple(draft)


def agreement(ours: Sequence[int], theirs: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    count = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        count += 1
    return count


def _strip_eos(tokens: Sequence[int], eos: frozenset[int]) -> list[int]:
    tokens = list(tokens)
    return tokens[:-1] if tokens and tokens[-1] in eos else tokens


def genai_greedy(folder: str | os.PathLike[str], prompt: Sequence[int], max_tokens: int, threads: int) -> list[int]:
    """ONNX Runtime GenAI's greedy search on ``folder`` (CPU, ``threads`` intra-op threads): the new tokens, without
    a final EOS. A folder built for CUDA runs on the CPU (its provider options are cleared)."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    config.clear_providers()
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": int(threads)}}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(prompt) + max_tokens, batch_size=1)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    sequence = [int(t) for t in generator.get_sequence(0)][len(prompt) :]
    eos = frozenset(ModelFolder.load(folder).eos_token_ids)
    return _strip_eos(sequence, eos)


def transformers_greedy(hf_dir: str | os.PathLike[str], prompt: Sequence[int], max_tokens: int) -> list[int]:
    """transformers' greedy decoding of the float32 checkpoint in ``hf_dir`` (no EOS stop): the new tokens."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, eos_token_id=None
        )
    return [int(t) for t in out[0, len(prompt) :]]


def continuation_drift(backend: OrtBackend, prompt: Sequence[int], continuation: Sequence[int], window: int) -> float:
    """The largest |logit| difference between verify passes and one-token decodes along ``continuation`` after
    ``prompt``: every token of it decoded one at a time, then verified in passes of ``window`` tokens (the shape
    of a speculative pass) from every ``window``-th position. Resets the backend."""
    tokens = list(continuation)
    if not tokens:
        return 0.0
    backend.reset()
    start = len(prompt)
    backend.decode(list(prompt), 0)
    decoded = np.stack([backend.decode([t], start + i).copy() for i, t in enumerate(tokens)])
    drift = 0.0
    for offset in range(0, len(tokens), window):
        chunk = tokens[offset : offset + window]
        backend.rewind(start + offset)
        rows = backend.decode_verify(chunk, start + offset)
        drift = max(drift, float(np.abs(rows - decoded[offset : offset + len(chunk)]).max()))
    backend.reset()
    return drift


@attrs.frozen
class SpeculativeRun:
    """One speculative run: its proposer, whether its tokens equal greedy's, and how many drafts were verified and
    accepted."""

    proposer: str
    identical: bool
    verification_steps: int
    accepted_tokens: int
    multi_token_accepts: int


@attrs.frozen
class FolderReport:
    """What :func:`check_folder` found (None where a check did not run). ``genai_agree`` / ``hf_agree``: how many
    leading tokens ortspec's greedy output shares with ONNX Runtime GenAI's / transformers', out of
    ``compared`` (the longer length); ``load_error`` / ``run_error``: why ortspec could not load the folder / run
    its greedy pass; ``genai_error`` / ``hf_error``: why a peer could not run."""

    folder: Path
    load_error: str | None = None
    run_error: str | None = None
    rewrites: tuple[str, ...] = ()
    stateful: bool = False
    matmul_levels: tuple[int, ...] = ()  # the MatMulNBits accuracy levels the session runs
    greedy: tuple[int, ...] = ()
    genai_agree: tuple[int, int] | None = None
    genai_error: str | None = None
    hf_agree: tuple[int, int] | None = None
    hf_error: str | None = None
    speculative: tuple[SpeculativeRun, ...] = ()
    drift: float | None = None
    seconds: float = 0.0

    @property
    def greedy_matches_genai(self) -> bool | None:
        return None if self.genai_agree is None else self.genai_agree[0] == self.genai_agree[1]

    @property
    def speculative_exact(self) -> bool | None:
        return None if not self.speculative else all(run.identical for run in self.speculative)

    @property
    def drafts_accepted(self) -> bool:
        """At least one speculative run verified drafts and accepted several tokens in one pass."""
        return any(run.verification_steps > 0 and run.multi_token_accepts > 0 for run in self.speculative)


def check_folder(
    folder: str | os.PathLike[str],
    prompt: Sequence[int],
    *,
    max_tokens: int = 64,
    threads: int = 1,
    backend_options: Mapping[str, Any] | None = None,
    genai: bool = True,
    hf_dir: str | os.PathLike[str] | None = None,
    draft_width: int = 6,
) -> FolderReport:
    """Run the checks of the module docstring on ``folder`` with ``prompt`` (token ids). ``backend_options``
    go to ``OrtBackend.from_folder``. Greedy decoding stops at the folder's EOS tokens or ``max_tokens``."""
    started = time.perf_counter()
    path = Path(folder)
    try:
        backend = OrtBackend.from_folder(path, BackendConfig(threads=threads, **dict(backend_options or {})))
    except Exception as exc:  # noqa: BLE001 - the report says why
        return FolderReport(path, load_error=f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - started)
    eos = frozenset(backend.folder.eos_token_ids)
    options = Options(max_tokens=max_tokens, eos_token_ids=eos)
    levels = tuple(sorted({level for (_bits, level) in backend.graph_facts.matmul_nbits}))
    try:
        greedy = generate(backend, list(prompt), options).token_ids
    except Exception as exc:  # noqa: BLE001 - e.g. an operator this execution provider does not implement
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        return FolderReport(
            path,
            run_error=f"{type(cause).__name__}: {cause}",
            rewrites=backend.rewrites,
            stateful=backend.stateful,
            matmul_levels=levels,
            seconds=time.perf_counter() - started,
        )
    found: dict[str, Any] = {}
    if genai:
        try:
            theirs = genai_greedy(path, prompt, max_tokens, threads)
            ours = _strip_eos(greedy, eos)
            found["genai_agree"] = (agreement(ours, theirs), max(len(ours), len(theirs)))
        except Exception as exc:  # noqa: BLE001 - a peer failure is reported, not raised
            found["genai_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    if hf_dir is not None:
        try:
            theirs = transformers_greedy(hf_dir, prompt, len(greedy))
            found["hf_agree"] = (agreement(greedy, theirs), len(greedy))
        except Exception as exc:  # noqa: BLE001
            found["hf_error"] = f"{type(exc).__name__}: {exc}"[:300]
    runs = []
    vocab = backend.vocab_size
    for label, proposer in (
        ("replay", GreedyReplay(prompt, greedy, vocab)),
        ("replay, every 3rd wrong", GreedyReplay(prompt, greedy, vocab, wrong_every=3)),
        ("prompt lookup", PromptLookup(ngram=2, max_draft=draft_width)),
    ):
        spec = generate(backend, list(prompt), options, proposer, draft_width=draft_width)
        runs.append(
            SpeculativeRun(
                proposer=label,
                identical=spec.token_ids == greedy,
                verification_steps=spec.stats.verification_steps,
                accepted_tokens=spec.stats.accepted_tokens,
                multi_token_accepts=spec.stats.multi_token_accepts,
            )
        )
    drift = continuation_drift(backend, prompt, greedy, draft_width + 1)
    return FolderReport(
        path,
        rewrites=backend.rewrites,
        stateful=backend.stateful,
        matmul_levels=levels,
        greedy=tuple(greedy),
        speculative=tuple(runs),
        drift=drift,
        seconds=time.perf_counter() - started,
        **found,
    )
