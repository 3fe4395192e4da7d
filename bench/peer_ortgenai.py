"""The ONNX Runtime GenAI peers (``onnxruntime_genai``): ``OrtGenAIRunner``, greedy search or sampling, optionally
with its n-gram speculation, one prompt at a time (``run``) or as one static batch (``run_batch``)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.peer_base import BatchRun, PeerRun, PeerRunner, _overlay_folder
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import ModelFolder


class OrtGenAIRunner(PeerRunner):
    """ONNX Runtime GenAI greedy search or sampling, optionally with n-gram speculation.

    ``sampling`` (``temperature``, ``top_p``, optionally ``top_k``; empty: greedy) turns on sampling:
    ``set_search_options(do_sample=True, temperature=, top_p=, top_k=, random_seed=seed)``, the seed given to
    each :meth:`run`. ``top_k``: ORT GenAI would otherwise take the folder's ``search.top_k`` (50 in these
    folders: a cut ortspec's setting does not make), and in 0.18 ``top_k=0`` does not give the ``top_p``
    distribution (on the tiny model, 6% of 1,500 first-token draws fell outside the ``top_p`` set), so unless
    ``sampling`` names one the runner asks for ``top_k`` = the vocabulary size: no cut, and those draws matched
    the exact ``temperature``/``top_p`` distribution within sampling noise (total variation 0.074, the noise
    floor of 1,500 draws; 0.156 with the folder's 50).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        threads: int = 2,
        ngram_size: int | None = None,
        max_draft_tokens: int | None = None,
        sampling: dict[str, float] | None = None,
    ):
        import onnxruntime_genai as og

        self._og = og
        self.model_dir = Path(model_dir)
        self.threads = int(threads)
        self.ngram_size = ngram_size
        self.max_draft_tokens = max_draft_tokens
        self.name = ("ortgenai-ngram" if ngram_size else "ortgenai") + ("-sampled" if sampling else "")
        self.version = str(getattr(og, "__version__", ""))
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.thread_pinning = ""
        self.model = self._load_model()
        self.tokenizer = Tokenizer.from_folder(self.model_dir)
        folder = ModelFolder.load(self.model_dir)
        self.eos_ids = set(folder.eos_token_ids)
        model_config = json.loads((self.model_dir / "genai_config.json").read_text(encoding="utf-8"))["model"]
        self.pad_token_id = int(model_config.get("pad_token_id", folder.eos_token_ids[0]))  # run_batch's padding
        self.sampling: dict[str, Any] = {}
        if sampling:
            self.sampling = {
                "temperature": float(sampling["temperature"]),
                "top_p": float(sampling.get("top_p", 1.0)),
                "top_k": int(sampling.get("top_k") or folder.vocab_size),
            }

    def _session_overlay(self) -> dict:
        return {"model": {"decoder": {"session_options": {"intra_op_num_threads": self.threads}}}}

    def _load_model(self):
        og = self._og
        try:
            cfg = og.Config(str(self.model_dir))
            cfg.overlay(json.dumps(self._session_overlay()))
            model = og.Model(cfg)
            self.thread_pinning = "og.Config.overlay(session_options)"
            return model
        except Exception as exc:  # older/odd builds: edit a copy of the config
            overlay_error = exc
        self._tmp = tempfile.TemporaryDirectory(prefix="ortspec-ogcfg-")

        def edit(raw: bytes) -> bytes:
            cfg = json.loads(raw)
            so = cfg.setdefault("model", {}).setdefault("decoder", {}).setdefault("session_options", {})
            so.update(self._session_overlay()["model"]["decoder"]["session_options"])
            return json.dumps(cfg, indent=2).encode()

        folder = _overlay_folder(self.model_dir, Path(self._tmp.name), {"genai_config.json": edit})
        model = og.Model(str(folder))
        self.thread_pinning = f"edited genai_config.json copy (overlay failed: {overlay_error})"
        return model

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def speculative_options(self) -> dict:
        if not self.ngram_size:
            return {}
        opts: dict[str, Any] = {"ngram_size": int(self.ngram_size)}
        if self.max_draft_tokens:
            opts["max_draft_tokens"] = int(self.max_draft_tokens)
        return opts

    def search_options(self, seed: int | None) -> dict[str, Any]:
        """The sampling part of ``set_search_options`` (``do_sample=False`` when greedy)."""
        if not self.sampling:
            if seed is not None:
                raise ValueError(f"{self.name} decodes greedily: it takes no seed")
            return {"do_sample": False}
        return {"do_sample": True, **self.sampling, "random_seed": 0 if seed is None else int(seed)}

    def run(self, prompt, max_new_tokens: int, seed: int | None = None) -> PeerRun:
        og = self._og
        ids = self._prompt_ids(prompt)
        search = self.search_options(seed)
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        params.set_search_options(**search, max_length=len(ids) + int(max_new_tokens), batch_size=1)
        spec = self.speculative_options()
        if spec:
            params.set_speculative_options(**spec)
        gen = og.Generator(self.model, params)
        gen.append_tokens(np.asarray(ids, dtype=np.int32))
        t_first = None
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
            if t_first is None:
                t_first = time.perf_counter()
        t_end = time.perf_counter()
        seq = [int(t) for t in gen.get_sequence(0)]
        new = seq[len(ids) :]
        extra: dict[str, Any] = {"generate_next_token_calls": steps}
        if self.sampling:
            extra["search_options"] = search
        finish = "length"
        if new and new[-1] in self.eos_ids:
            new = new[:-1]
            finish = "stop"
        elif len(new) < max_new_tokens:
            # ORT GenAI 0.18 leaves the EOS token out of get_sequence(): a run that ended before the budget ended
            # at EOS. "peer_finish_reason" is what the sequence alone shows.
            extra["peer_finish_reason"] = finish
            finish = "stop"
        if spec:
            try:
                extra["speculative_stats"] = dict(gen.get_speculative_stats())
            except Exception as exc:  # stats are informative only
                extra["speculative_stats_error"] = str(exc)
            extra["speculative_options"] = spec
        del gen
        ttft = (t_first if t_first is not None else t_end) - t0
        return self._result(new, ttft, t_end - t0, finish, len(ids), extra)

    def run_batch(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, seed: int | None = None) -> BatchRun:
        """One static batch: ``prompts`` (token ids) right-padded with the folder's ``pad_token_id`` (the padding ORT
        GenAI 0.18's own ``Tokenizer.encode_batch`` makes, which keeps each row's output its own), generated
        together for exactly ``max_new_tokens`` new tokens each (``min_length`` = ``max_length``: EOS is not
        sampled, as ``ignore_eos`` in ortspec). Sampling runners draw with one ``seed`` for the whole batch."""
        og = self._og
        width = max(len(p) for p in prompts)
        padded = np.full((len(prompts), width), self.pad_token_id, dtype=np.int32)
        for row, ids in enumerate(prompts):
            padded[row, : len(ids)] = ids
        search = self.search_options(seed)
        t0 = time.perf_counter()
        params = og.GeneratorParams(self.model)
        length = width + int(max_new_tokens)
        params.set_search_options(**search, max_length=length, min_length=length, batch_size=len(prompts))
        gen = og.Generator(self.model, params)
        gen.append_tokens(padded)
        steps = 0
        while not gen.is_done():
            gen.generate_next_token()
            steps += 1
        seconds = time.perf_counter() - t0
        rows = [[int(t) for t in gen.get_sequence(row)][width:] for row in range(len(prompts))]
        del gen
        return BatchRun(rows, seconds, steps)

    def describe(self) -> dict:
        d = {
            "name": self.name,
            "version": self.version,
            "threads": self.threads,
            "thread_pinning": self.thread_pinning,
            "model_dir": str(self.model_dir),
        }
        if self.ngram_size:
            d["speculative_options"] = self.speculative_options()
        if self.sampling:
            d["sampling"] = {"do_sample": True, **self.sampling, "random_seed": "the prompt's seed"}
        return d

    def close(self) -> None:
        self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
