"""The onnx_genai peer: ``OnnxGenAIRunner`` (``onnx_genai.Engine`` greedy) and ``patch_for_onnx_genai``, the copy of
a model folder that onnx_genai can load (a concrete KV-cache dimension, no ``hidden_states`` output)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.peer_base import PeerRun, PeerRunner, _overlay_folder
from ortspec.adapters.engine.cache import cache_root as ortspec_cache_root
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.backends.onnx import ModelFolder


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
