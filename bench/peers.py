"""Runners for the peer engines ortspec is compared against, each optional.

Every runner has the same interface::

    runner.run(prompt, max_new_tokens, seed=None) -> PeerRun

where ``prompt`` is the rendered prompt text or its token ids (a list of ints),
``seed`` the sampler's seed (sampling runners only), and :class:`PeerRun` holds
the new token ids, their text, time to first token, total time and decode-only
tokens/s. :func:`make_peer` returns ``(runner, None)`` or ``(None, reason)``
when a peer package cannot be imported or the model cannot be loaded: a missing
peer is reported as missing, never faked.

Peers (names accepted by :func:`make_peer`):

``ortgenai``
    ONNX Runtime GenAI (``onnxruntime_genai``) greedy search on the model folder.
``ortgenai-ngram``
    The same with its built-in n-gram (prompt lookup) speculation
    (``GeneratorParams.set_speculative_options(ngram_size=, max_draft_tokens=)``).
``ortgenai-sampled``, ``ortgenai-ngram-sampled``
    The same two, sampling (``do_sample=True``, ``temperature``, ``top_p``, ``top_k``,
    ``random_seed``: see :class:`OrtGenAIRunner`). ORT GenAI's RNG is not ortspec's:
    at the same seed they draw different tokens from the same distribution.
``ortgenai-draft-model``
    ``ortgenai`` with its draft-model speculation: a second model folder of the target's vocabulary drafts
    (``model.draft`` in an overlay of the folder; ``bench.genai_draft_model``).
``onnx_genai``
    ``onnx_genai.Engine`` greedy (``temperature=0``) on a patched copy of the folder
    whose symbolic KV-cache dimension is made concrete.
``llamacpp``
    llama.cpp (``llama-cpp-python``) greedy on the model's own GGUF, at its native precision
    (``bench.llamacpp``).

Timing is the same for all peers: the clock starts once the prompt (text or
ids) is in hand, ``ttft_s`` is the time until the first new token is available,
``total_s`` the time until generation ends, and ``decode_tok_s`` is
``ortspec.driver.decode_rate`` of them. Thread counts are pinned (intra-op
threads = ``threads``; sessions run sequentially). The end-of-sequence token is
not part of ``token_ids``/``new_tokens``; ``finish_reason`` is OpenAI's word, as
``FinishReason.openai`` gives it for ortspec: ``"stop"`` (EOS) or ``"length"``
(each runner turns its peer's own report into it).
Prompt text is tokenized and token ids are decoded with ortspec's ``Tokenizer``
for the model folder; its facts (EOS ids, graph file, head size) come from
``ModelFolder.load``.

The original model folder is never modified: configuration changes go into a
temporary or cache folder holding edited copies of the config files and hard
links to (or, across file systems, copies of) the other files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ortspec.adapters.engine.cache import cache_root as ortspec_cache_root
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import ModelFolder
from ortspec.driver import decode_rate

PEER_NAMES = (
    "ortgenai",
    "ortgenai-ngram",
    "onnx_genai",
    "ortgenai-sampled",
    "ortgenai-ngram-sampled",
    "llamacpp",
    "ortgenai-draft-model",
)
DEFAULT_SAMPLING = {"temperature": 0.7, "top_p": 0.9}  # the sampled peers' options unless given (the suite's)


@dataclass
class PeerRun:
    """Result of one generation by a peer engine."""

    token_ids: list[int]
    text: str
    ttft_s: float
    total_s: float
    decode_tok_s: float | None
    new_tokens: int
    finish_reason: str = ""
    prompt_tokens: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "token_ids": list(self.token_ids),
            "text": self.text,
            "ttft_s": self.ttft_s,
            "total_s": self.total_s,
            "decode_tok_s": self.decode_tok_s,
            "new_tokens": self.new_tokens,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "extra": dict(self.extra),
        }


@dataclass
class BatchRun:
    """One static batch of a peer: every row's new token ids (``rows[i]`` for prompt ``i``), the wall seconds from
    the padded prompts in hand to the last token, and the peer's generation steps."""

    rows: list[list[int]]
    seconds: float
    steps: int


class PeerRunner:
    """Common interface. Subclasses implement :meth:`run`."""

    name: str = "peer"
    version: str = ""
    tokenizer: Tokenizer  # the folder's tokenizer, set by each subclass

    def run(self, prompt: str | Sequence[int], max_new_tokens: int, seed: int | None = None) -> PeerRun:
        raise NotImplementedError  # pragma: no cover

    def warmup(self, prompt: str | Sequence[int] = "Hello", max_new_tokens: int = 8) -> None:
        """One short generation so that first-call costs are not measured."""
        self.run(prompt, max_new_tokens)

    def describe(self) -> dict:
        return {"name": self.name, "version": self.version}

    def close(self) -> None:
        pass

    def _result(self, new: list[int], ttft: float, total: float, finish: str, prompt_tokens: int,
                extra: dict) -> PeerRun:  # fmt: skip
        """A ``PeerRun`` for ``new`` tokens (text through the folder's Tokenizer, decode rate after the first)."""
        return PeerRun(
            token_ids=new,
            text=self.tokenizer.decode(new),
            ttft_s=ttft,
            total_s=total,
            decode_tok_s=decode_rate(len(new), ttft, total),
            new_tokens=len(new),
            finish_reason=finish,
            prompt_tokens=prompt_tokens,
            extra=extra,
        )


# --------------------------------------------------------------------------
# Folder helpers (never touch the original folder)
# --------------------------------------------------------------------------


def _link_or_copy(src: Path, dst: Path) -> str:
    """Hard link ``src`` at ``dst`` (copy across file systems); returns the mode.

    Weights and graphs cannot be symlinked: ONNX Runtime resolves the links of
    external data files and rejects data that lies outside the model's folder.
    """
    try:
        os.link(src, dst)
        return "hardlink"
    except OSError:
        shutil.copy2(src, dst)
        return "copy"


def _overlay_folder(src: Path, dst: Path, edits: dict[str, Callable[[bytes], bytes]]) -> Path:
    """Mirror ``src`` into ``dst``: files in ``edits`` (file name -> function of
    the original bytes) are written as edited copies, every other file is hard
    linked (copied when hard links are impossible)."""
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        if not entry.is_file():
            continue
        target = dst / entry.name
        if target.exists() or target.is_symlink():
            target.unlink()
        if entry.name in edits:
            target.write_bytes(edits[entry.name](entry.read_bytes()))
        else:
            _link_or_copy(entry.resolve(), target)
    return dst


# --------------------------------------------------------------------------
# ONNX Runtime GenAI
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# onnx_genai
# --------------------------------------------------------------------------


def _concretize_dims(model, names: dict[str, int]) -> int:
    """Replace symbolic dims (``dim_param`` in ``names``) by values on graph
    inputs, outputs and value_info; returns how many dims changed."""
    changed = 0
    g = model.graph
    for vi in [*g.input, *g.output, *g.value_info]:
        t = vi.type
        if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            continue
        for d in t.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param in names:
                value = names[d.dim_param]
                d.Clear()
                d.dim_value = value
                changed += 1
    return changed


# Graph outputs an ortspec folder declares for its own readers that onnx_genai cannot place: ``hidden_states`` (the
# final norm's output, which ortspec's shared-KV drafter reads; onnx_genai refuses a graph whose extra output has no
# port role: "cannot resolve decoder state from tensor shapes").
ONNX_GENAI_DROPPED_OUTPUTS = ("hidden_states",)


def _drop_outputs(model, names: Sequence[str]) -> int:
    """Remove the graph outputs called ``names`` (their values stay inside the graph); returns how many."""
    g = model.graph
    kept = [o for o in g.output if o.name not in names]
    dropped = len(g.output) - len(kept)
    if dropped:
        del g.output[:]
        g.output.extend(kept)
    return dropped


def patch_for_onnx_genai(
    model_dir: str | os.PathLike, threads: int = 2, cache_root: str | os.PathLike | None = None
) -> Path:
    """Folder ``onnx_genai.Engine.from_dir`` can load, built next to (never in)
    ``model_dir``.

    The ONNX Runtime GenAI builder leaves the last axis of every
    ``past_key_values.*`` input and ``present.*`` output symbolic
    (``kv_cache_dim``) so one export can serve plain and quantized KV caches.
    onnx_genai allocates its KV cache from the declared shapes and refuses a
    non-concrete axis ("cannot infer KV head_dim from 'present.0.key'"), so the
    copy declares it as the head size (``ModelFolder.head_size``), and it drops the
    ``hidden_states`` output that ortspec's folders declare for the shared-KV
    drafter (``ONNX_GENAI_DROPPED_OUTPUTS``; onnx_genai refuses it). Only the
    graph proto is rewritten; the external weight file and every other file are
    hard linked (copied across file systems; symlinks do not work because ONNX
    Runtime rejects external data that resolves outside the model folder). The result is cached under
    ``cache_root`` (default ``peers/onnx_genai`` in ``ortspec.adapters.engine.cache.cache_root()``) keyed by the
    source path, size and mtime. If the graph has no such symbolic axis the
    original folder is returned unchanged. ``threads`` is not written anywhere:
    onnx_genai ignores ``session_options`` in genai_config.json and reads
    ``ONNX_GENAI_INTRA_OP_THREADS`` instead.
    """
    import onnx

    folder = ModelFolder.load(Path(model_dir).resolve())
    src, onnx_path, head = folder.path, folder.model_path, folder.head_size
    onnx_name = onnx_path.name
    st = onnx_path.stat()
    key = hashlib.sha256(f"{src}|{st.st_size}|{st.st_mtime_ns}|{head}|v2".encode()).hexdigest()[:16]
    root = Path(cache_root) if cache_root else ortspec_cache_root() / "peers" / "onnx_genai"
    dst = root / f"{src.name}-{key}"
    if (dst / ".ortspec-complete").is_file():
        return dst

    model = onnx.load(str(onnx_path), load_external_data=False)
    dropped = _drop_outputs(model, ONNX_GENAI_DROPPED_OUTPUTS)
    if _concretize_dims(model, {"kv_cache_dim": head}) == 0 and not dropped:
        return src
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}-", dir=str(root if root.exists() else _mk(root))))
    try:
        _overlay_folder(src, tmp, {})
        (tmp / onnx_name).unlink()
        # Initializers keep their external_data references (relative file names),
        # which resolve to the linked weight files next to the new graph.
        onnx.save(model, str(tmp / onnx_name))
        (tmp / ".ortspec-complete").write_text(
            json.dumps({"source": str(src), "kv_cache_dim": head, "dropped_outputs": dropped}, indent=2)
        )
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _mk(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


class _CaptureStderr:
    """Send file descriptor 2 to a temporary file for the block (native code
    writes there directly); the text is in ``.text`` afterwards. A failure to
    redirect leaves stderr alone."""

    def __init__(self) -> None:
        self.text = ""

    def __enter__(self) -> _CaptureStderr:
        import sys

        self._saved = None
        try:
            sys.stderr.flush()
            self._file = tempfile.TemporaryFile(mode="w+b")
            self._saved = os.dup(2)
            os.dup2(self._file.fileno(), 2)
        except OSError:
            self._saved = None
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.text = self._file.read().decode("utf-8", "replace")
        self._file.close()
        if exc and exc[0] is not None and self.text:
            import sys

            sys.stderr.write(self.text)  # keep diagnostics when loading failed


class OnnxGenAIRunner(PeerRunner):
    """``onnx_genai.Engine`` greedy generation (``temperature=0.0``).

    The engine keeps a prefix cache across calls, so a repeated prompt (or a
    shared prefix such as the chat template's system turn) skips part of its
    prefill. ``fresh_engine`` controls this: ``"always"`` (default) loads a new
    engine for each run, ``"repeat"`` only when a prompt repeats exactly,
    ``"never"`` keeps one engine. ``extra["prefix_cache_hit_len"]`` shows hits.
    Engine loading is never inside the timed span.

    Time to first token: in 0.1.0.dev6 ``generate_stream`` delivers all of its
    callbacks in one burst when generation has finished (on the engine's own
    thread; the GIL is released meanwhile), so callback times cannot show the
    first token. ``ttft="probe"`` (default) therefore times a separate
    ``generate(prompt, max_tokens=1)`` on a fresh engine (prefill + first
    token, the same span the other peers report); ``ttft="stream"`` uses the
    first callback's time, for engines that really stream.
    """

    name = "onnx_genai"

    def __init__(
        self,
        model_dir: str | os.PathLike,
        threads: int = 2,
        fresh_engine: str = "always",
        ttft: str = "probe",
        cache_root: str | os.PathLike | None = None,
    ):
        import onnx_genai

        if fresh_engine not in ("always", "repeat", "never"):
            raise ValueError("fresh_engine must be 'always', 'repeat' or 'never'")
        if ttft not in ("probe", "stream"):
            raise ValueError("ttft must be 'probe' or 'stream'")
        self._mod = onnx_genai
        self.version = str(getattr(onnx_genai, "__version__", ""))
        self.model_dir = Path(model_dir)
        self.threads = int(threads)
        self.fresh_engine = fresh_engine
        self.ttft_mode = ttft
        self.folder = patch_for_onnx_genai(self.model_dir, threads=self.threads, cache_root=cache_root)
        self.tokenizer = Tokenizer.from_folder(self.model_dir)
        self.eos_ids = set(ModelFolder.load(self.model_dir).eos_token_ids)
        self._seen: set[str] = set()
        self.load_s = 0.0
        self.load_log = ""
        self._engine = self._new_engine()
        self._engine_used = False

    def _new_engine(self):
        os.environ["ONNX_GENAI_INTRA_OP_THREADS"] = str(self.threads)
        t0 = time.perf_counter()
        with _CaptureStderr() as cap:  # it prints a "decode_path: ..." line per load
            engine = self._mod.Engine.from_dir(str(self.folder))
        self.load_s = time.perf_counter() - t0
        if cap.text.strip():
            self.load_log = cap.text.strip()
        return engine

    def prompt_text(self, prompt: str | Sequence[int]) -> tuple[str, int]:
        """The text onnx_genai is given for ``prompt`` and the prompt's token count. ``Engine.generate`` takes
        text only (a list raises TypeError), so token ids are decoded with their special tokens spelled out."""
        if isinstance(prompt, str):
            return prompt, len(self.tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        return self.tokenizer.decode(ids, skip_special_tokens=False), len(ids)

    def retokenize(self, ids: Sequence[int]) -> list[int]:
        """The token ids onnx_genai's own tokenizer makes of the text this runner gives it for ``ids``: equal to
        ``ids`` when the prompt reaches onnx_genai exactly as the other engines get it."""
        text, _ = self.prompt_text(ids)
        return [int(t) for t in self._engine.tokenize(text)]

    def _probe_ttft(self, text: str) -> float:
        engine = self._new_engine()
        t0 = time.perf_counter()
        engine.generate(text, max_tokens=1, temperature=0.0)
        ttft = time.perf_counter() - t0
        del engine
        return ttft

    def _engine_for(self, text: str):
        """The engine to run ``text`` on, reloaded as ``fresh_engine`` asks (never inside a timed span)."""
        key = hashlib.sha256(text.encode("utf-8")).hexdigest()
        rebuild = (self.fresh_engine == "always" and self._engine_used) or (
            self.fresh_engine == "repeat" and key in self._seen
        )
        if rebuild:
            self._engine = None  # free the old one before loading its successor
            self._engine = self._new_engine()
        self._seen.add(key)
        self._engine_used = True
        return self._engine

    def run(self, prompt, max_new_tokens: int, seed: int | None = None) -> PeerRun:
        if seed is not None:
            raise ValueError("onnx_genai runs greedily here: it takes no seed")
        text, n_prompt = self.prompt_text(prompt)
        probe_ttft = self._probe_ttft(text) if self.ttft_mode == "probe" else None
        engine = self._engine_for(text)
        stamps: list[float] = []
        ids: list[int] = []
        reasons: list[Any] = []

        def on_token(piece, token_id, finish_reason):
            stamps.append(time.perf_counter())
            if token_id is not None:
                ids.append(int(token_id))
            if finish_reason is not None:
                reasons.append(finish_reason)

        t0 = time.perf_counter()
        result = engine.generate_stream(text, on_token, max_tokens=int(max_new_tokens), temperature=0.0)
        total = time.perf_counter() - t0
        extra: dict[str, Any] = {
            "engine_load_s": self.load_s,
            "fresh_engine": self.fresh_engine,
            "ttft_mode": self.ttft_mode,
        }
        if stamps:
            extra["first_callback_s"] = stamps[0] - t0
        finish = self._read_result(result, ids, str(reasons[-1]) if reasons else "", extra)
        new = ids[:-1] if ids and ids[-1] in self.eos_ids else list(ids)
        if probe_ttft is not None:
            extra["probe_ttft_s"] = probe_ttft
            if probe_ttft >= total:  # noise (e.g. background load): no decode span left
                extra["probe_exceeds_total"] = True
            ttft = min(probe_ttft, total)
        else:
            ttft = (stamps[0] - t0) if stamps else total
        return self._result(new, ttft, total, finish, n_prompt, extra)

    @staticmethod
    def _read_result(result: Any, ids: list[int], finish: str, extra: dict[str, Any]) -> str:
        """Complete ``ids`` and ``extra`` from ``generate_stream``'s result; return the finish reason in OpenAI's
        words (the raw one goes to ``extra["raw_finish_reason"]``)."""
        if result is not None:
            fr = getattr(result, "finish_reason", None)
            if fr is not None:
                finish = str(fr)
            hit = getattr(result, "prefix_cache_hit_len", None)
            if hit is not None:
                extra["prefix_cache_hit_len"] = int(hit)
            rid = getattr(result, "token_ids", None)
            if rid is not None and not ids:
                ids.extend(int(t) for t in rid)
        extra["raw_finish_reason"] = finish
        # 0.1.0.dev6 says "eos_token" or "max_tokens" (a stop string would be "stop").
        return "length" if finish in ("max_tokens", "length") else ("stop" if finish else "")

    def describe(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "threads": self.threads,
            "thread_pinning": "ONNX_GENAI_INTRA_OP_THREADS",
            "patched_folder": str(self.folder),
            "fresh_engine": self.fresh_engine,
            "ttft_mode": self.ttft_mode,
            "load_log": self.load_log,
        }

    def close(self) -> None:
        self._engine = None


# --------------------------------------------------------------------------
# Factory
# --------------------------------------------------------------------------


def make_peer(
    name: str, model_dir: str | os.PathLike, threads: int = 2, **options
) -> tuple[PeerRunner | None, str | None]:
    """Build a peer runner, or return ``(None, reason)`` when it is unavailable.

    ``options`` go to the runner: ``ngram_size`` / ``max_draft_tokens`` for
    ``ortgenai-ngram`` and ``ortgenai-ngram-sampled`` (defaults 3 and 8),
    ``sampling`` for the sampled peers (default ``DEFAULT_SAMPLING``),
    ``fresh_engine`` / ``ttft`` / ``cache_root`` for ``onnx_genai``, ``draft_model`` (the draft folder; without
    it the peer is missing) / ``draft_tokens`` (default 4) for ``ortgenai-draft-model``.
    """
    if name not in PEER_NAMES:
        return None, f"unknown peer {name!r}; known: {', '.join(PEER_NAMES)}"
    module = {"onnx_genai": "onnx_genai", "llamacpp": "llama_cpp"}.get(name, "onnxruntime_genai")
    try:
        __import__(module)
    except Exception as exc:  # ImportError, or a broken native library
        return None, f"{module} is not importable: {type(exc).__name__}: {exc}"
    try:
        sampling = (options.get("sampling") or DEFAULT_SAMPLING) if name.endswith("-sampled") else None
        if name == "llamacpp":
            from bench.llamacpp import LlamaCppRunner

            return LlamaCppRunner(model_dir, threads=threads, gguf=options.get("gguf")), None
        if name in ("ortgenai", "ortgenai-sampled"):
            return OrtGenAIRunner(model_dir, threads=threads, sampling=sampling), None
        if name == "ortgenai-draft-model":
            from bench.genai_draft_model import draft_model_peer

            return draft_model_peer(model_dir, threads, options.get("draft_model"), options.get("draft_tokens"))
        if name in ("ortgenai-ngram", "ortgenai-ngram-sampled"):
            return OrtGenAIRunner(
                model_dir,
                threads=threads,
                ngram_size=options.get("ngram_size", 3),
                max_draft_tokens=options.get("max_draft_tokens", 8),
                sampling=sampling,
            ), None
        return OnnxGenAIRunner(
            model_dir,
            threads=threads,
            fresh_engine=options.get("fresh_engine", "always"),
            ttft=options.get("ttft", "probe"),
            cache_root=options.get("cache_root"),
        ), None
    except Exception as exc:
        return None, f"{name} could not load {model_dir}: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------
# Command line smoke test
# --------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    import argparse
    import sys

    from bench.workloads import build_workloads, encode_chat

    ap = argparse.ArgumentParser(description="Run the peer engines on a few workloads.")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default=",".join(PEER_NAMES))
    ap.add_argument("--categories", default="code_edit,open_ended")
    ap.add_argument("--n", type=int, default=1, help="prompts per category")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--ngram-size", type=int, default=3)
    ap.add_argument("--max-draft-tokens", type=int, default=8)
    ap.add_argument("--draft-model", help="the draft model folder of ortgenai-draft-model")
    ap.add_argument("--seed", type=int, default=0, help="the sampled peers' seed (default 0)")
    ap.add_argument("--text", action="store_true", help="include generated text")
    args = ap.parse_args(argv)

    tok = Tokenizer.from_folder(args.model_dir)
    cats = [c for c in args.categories.split(",") if c]
    wls = build_workloads(args.n, 1500, tok, categories=cats)
    prompts = [(w.name, encode_chat(w.messages, tok)) for w in wls]
    report: dict[str, Any] = {"threads": args.threads, "peers": {}, "missing": {}}
    outputs: dict[str, dict[str, list[int]]] = {}
    for name in [p for p in args.peers.split(",") if p]:
        runner, why = make_peer(
            name,
            args.model_dir,
            threads=args.threads,
            ngram_size=args.ngram_size,
            max_draft_tokens=args.max_draft_tokens,
            draft_model=args.draft_model,
        )
        if runner is None:
            report["missing"][name] = why
            continue
        runner.warmup()
        runs = {}
        for wname, ids in prompts:
            seed = args.seed if name.endswith("-sampled") else None
            r = runner.run(ids, args.max_new_tokens, seed=seed)
            d = r.to_dict()
            d.pop("token_ids")
            if not args.text:
                d.pop("text")
            d["extra"] = {k: v for k, v in d["extra"].items() if k != "speculative_stats"} | (
                {"acceptance_rate": r.extra["speculative_stats"].get("acceptance_rate")}
                if "speculative_stats" in r.extra
                else {}
            )
            runs[wname] = d
            outputs.setdefault(wname, {})[name] = r.token_ids
        report["peers"][name] = {"describe": runner.describe(), "runs": runs}
        runner.close()
    # greedy peers should agree with each other; each sampled peer with its own family only
    report["same_tokens"] = {
        w: len({tuple(v) for k, v in o.items() if not k.endswith("-sampled")}) <= 1 for w, o in outputs.items()
    }
    report["same_tokens_sampled"] = {
        w: len({tuple(v) for k, v in o.items() if k.endswith("-sampled")}) <= 1 for w, o in outputs.items()
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
