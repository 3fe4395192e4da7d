"""ONNX Runtime GenAI's own draft-model speculative decoding as a benchmark peer (``ortgenai-draft-model``).

ORT GenAI 0.18 drafts with a second model when the target folder's ``genai_config.json`` has a ``model.draft``
section: a decoder section (``session_options``, ``filename``, ``head_size``, ``hidden_size``, ``inputs`` /
``outputs`` name patterns, ``num_attention_heads``, ``num_hidden_layers``, ``num_key_value_heads``) describing
the draft's graph, whose ``filename`` is relative to the target folder. Such a section alone switches the
speculation on for every ``og.Generator`` of that model; ``GeneratorParams.set_speculative_options(
max_draft_tokens=K)`` sets the draft length (1..16; GenAI's own default, with no option given, is 4 and fixed:
``min_adaptive_k`` 0). ``Generator.get_speculative_stats()`` then reports the rounds, among them
``draft_tokens_evaluated``, ``draft_tokens_accepted``, ``target_forward_passes`` (prefill included) and
``standard_fallback_steps``, the counters the n-gram peer reports too (``bench.engines.PeerEngine`` reads them).

:class:`DraftOverlay` builds that folder: a temporary overlay of the target folder (every file hard linked, as
``bench.peer_base._overlay_folder`` does, or copied across file systems) whose ``genai_config.json`` gains
``model.draft`` = the draft folder's own ``model.decoder`` with ``filename`` = ``draft/<its file>`` and
``session_options.intra_op_num_threads`` = the peer's threads (the target's ``model.decoder`` is pinned the same
way), and whose ``draft/`` subfolder holds hard links to the draft's graph and the external data files the graph
names. The original folders are never modified.

:class:`OrtGenAIDraftModelRunner` is ``bench.peer_ortgenai.OrtGenAIRunner`` (greedy; same timing, same tokenization:
ortspec's ``Tokenizer`` for the target folder, the prompt given as token ids) on such an overlay. The overlay
lives in a ``tempfile.TemporaryDirectory``, removed by :meth:`OrtGenAIDraftModelRunner.close` and, for a runner
never closed, at interpreter exit (the directory's finalizer): a leaked overlay leaves the target's external
data file with several hard links, which ``onnx.load`` refuses to read.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any

from bench.peer_base import _link_or_copy, _overlay_folder
from bench.peer_ortgenai import OrtGenAIRunner
from ortspec.adapters.engine.draft_models import check_same_vocabulary
from ortspec.backends.onnx import ModelFolder

DRAFT_MODEL_PEER = "ortgenai-draft-model"
DEFAULT_DRAFT_TOKENS = 4  # max_draft_tokens unless a run chooses another: ORT GenAI 0.18's own default
MAX_DRAFT_TOKENS = 16  # ORT GenAI 0.18 refuses max_draft_tokens outside 1..16
DRAFT_SUBFOLDER = "draft"
CONFIG_NAME = "genai_config.json"


def _relative(name: str, what: str) -> PurePosixPath:
    """``name`` as a relative path inside its folder; ``ValueError`` naming ``what`` if it leaves the folder."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or ".." in path.parts:
        raise ValueError(f"{what} {name!r} is not a path inside its folder")
    return path


def external_data_files(graph: Path) -> list[PurePosixPath]:
    """The external data files that ``graph``'s initializers name (relative to its folder, sorted, each once);
    reads the graph proto only, never the data. ``ValueError`` for a location outside the graph's folder."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    model = onnx.load(os.fspath(graph), load_external_data=False)
    found: set[PurePosixPath] = set()
    graphs = [model.graph]
    while graphs:
        g = graphs.pop()
        for tensor in g.initializer:
            if uses_external_data(tensor):
                found.add(_relative(ExternalDataInfo(tensor).location, f"{graph.name}'s external data file"))
        for node in g.node:
            for attr in node.attribute:
                graphs.extend([attr.g] if attr.HasField("g") else [])
                graphs.extend(attr.graphs)
    return sorted(found)


def draft_section(draft_dir: Path, threads: int) -> dict[str, Any]:
    """``model.draft`` for a folder drafting with ``draft_dir``: a copy of the draft folder's own ``model.decoder``
    section with ``filename`` = ``draft/<its filename>`` and ``session_options.intra_op_num_threads`` =
    ``threads``. ``KeyError`` when the draft folder's config has no ``model.decoder.filename``."""
    config = json.loads((draft_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    section = json.loads(json.dumps(config["model"]["decoder"]))  # a deep copy
    filename = _relative(str(section["filename"]), f"{draft_dir / CONFIG_NAME}'s model.decoder.filename")
    section["filename"] = str(PurePosixPath(DRAFT_SUBFOLDER) / filename)
    section.setdefault("session_options", {})["intra_op_num_threads"] = int(threads)
    return section


def _with_draft(raw: bytes, draft: dict[str, Any], threads: int) -> bytes:
    """The target's ``genai_config.json`` (``raw``) with ``model.draft`` = ``draft`` and the target decoder's
    ``session_options.intra_op_num_threads`` = ``threads``."""
    config = json.loads(raw)
    model = config.setdefault("model", {})
    model.setdefault("decoder", {}).setdefault("session_options", {})["intra_op_num_threads"] = int(threads)
    model["draft"] = draft
    return json.dumps(config, indent=2).encode()


class DraftOverlay:
    """A temporary folder ORT GenAI loads as the target drafting with the draft model (see the module docstring).

    ``path``: the overlay; ``links``: how each draft file got there (path relative to ``path`` -> ``"hardlink"``
    or ``"copy"``); ``section``: the ``model.draft`` written. :meth:`close` removes the folder (again: a no-op);
    a folder never closed is removed at interpreter exit. If building fails, the folder is removed and the error
    raised.
    """

    def __init__(self, target_dir: str | os.PathLike, draft_dir: str | os.PathLike, threads: int = 2) -> None:
        self.target_dir = Path(target_dir).resolve()
        self.draft_dir = Path(draft_dir).resolve()
        self._tmp: tempfile.TemporaryDirectory | None = tempfile.TemporaryDirectory(prefix="ortspec-ogdraft-")
        self.path = Path(self._tmp.name)
        self.links: dict[str, str] = {}
        try:
            self.section = draft_section(self.draft_dir, threads)
            _overlay_folder(
                self.target_dir, self.path, {CONFIG_NAME: lambda raw: _with_draft(raw, self.section, threads)}
            )
            self._link_draft_files()
        except BaseException:
            self.close()
            raise

    def _link_draft_files(self) -> None:
        graph = _relative(self.section["filename"], "model.draft.filename").relative_to(DRAFT_SUBFOLDER)
        names = [graph, *(graph.parent / f for f in external_data_files(self.draft_dir / graph))]
        for name in names:
            src = self.draft_dir / name
            if not src.is_file():
                raise FileNotFoundError(f"the draft model {self.draft_dir} lacks {name}, which its graph needs")
            dst = self.path / DRAFT_SUBFOLDER / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.links[str(PurePosixPath(DRAFT_SUBFOLDER) / name)] = _link_or_copy(src.resolve(), dst)

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class OrtGenAIDraftModelRunner(OrtGenAIRunner):
    """ORT GenAI greedy search with its draft-model speculation: ``OrtGenAIRunner`` on a :class:`DraftOverlay` of
    ``model_dir`` and ``draft_dir``, each run with ``set_speculative_options(max_draft_tokens=draft_tokens)``.

    ``draft_dir`` must have ``model_dir``'s vocabulary (``check_same_vocabulary``: ``VocabularyMismatch``
    otherwise). Both sessions get ``threads`` intra-op threads through the overlay's ``genai_config.json``. The
    prompt is tokenized and the output decoded with the target folder's ``Tokenizer``; ``run`` reports GenAI's
    speculative stats in ``extra["speculative_stats"]``. :meth:`close` frees the model and removes the overlay.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike,
        draft_dir: str | os.PathLike,
        threads: int = 2,
        draft_tokens: int = DEFAULT_DRAFT_TOKENS,
    ) -> None:
        if not 1 <= int(draft_tokens) <= MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens must be in 1..{MAX_DRAFT_TOKENS} (ORT GenAI's range), got {draft_tokens}")
        self.target_dir = Path(model_dir).resolve()
        self.draft_dir = Path(draft_dir).resolve()
        self.draft_tokens = int(draft_tokens)
        check_same_vocabulary(ModelFolder.load(self.target_dir), ModelFolder.load(self.draft_dir))
        self.overlay = DraftOverlay(self.target_dir, self.draft_dir, threads)
        try:
            super().__init__(self.overlay.path, threads=threads)
        except BaseException:
            self.overlay.close()
            raise
        self.name = DRAFT_MODEL_PEER

    def _load_model(self):
        """The overlay's model: its config already pins both sessions' threads (no ``og.Config`` overlay)."""
        self.thread_pinning = "genai_config.json of the overlay (model.decoder and model.draft session_options)"
        return self._og.Model(str(self.model_dir))

    def speculative_options(self) -> dict:
        return {"max_draft_tokens": self.draft_tokens}

    def describe(self) -> dict:
        return {
            "name": self.name,
            "version": self.version,
            "threads": self.threads,
            "thread_pinning": self.thread_pinning,
            "model_dir": str(self.target_dir),
            "draft_model": str(self.draft_dir),
            "speculative_options": self.speculative_options(),
            "draft_section": {"filename": self.overlay.section["filename"], "links": dict(self.overlay.links)},
        }

    def close(self) -> None:
        super().close()
        self.overlay.close()


NO_DRAFT_MODEL = "no draft model (give the draft model's folder: the suite's --draft-model DIR)"


def draft_model_peer(
    model_dir: str | os.PathLike, threads: int, draft_dir: str | os.PathLike | None, draft_tokens: int | None = None
) -> tuple[OrtGenAIDraftModelRunner | None, str | None]:
    """``(runner, None)``, or ``(None, NO_DRAFT_MODEL)`` when ``draft_dir`` is None. ``draft_tokens`` None:
    ``DEFAULT_DRAFT_TOKENS``. Errors while loading propagate (``bench.peers.make_peer`` reports them as the
    reason the peer is missing)."""
    if draft_dir is None:
        return None, NO_DRAFT_MODEL
    tokens = DEFAULT_DRAFT_TOKENS if draft_tokens is None else int(draft_tokens)
    return OrtGenAIDraftModelRunner(model_dir, draft_dir, threads=threads, draft_tokens=tokens), None
