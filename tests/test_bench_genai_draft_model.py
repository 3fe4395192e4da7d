"""The ``ortgenai-draft-model`` peer (``bench.genai_draft_model``): ORT GenAI's own draft-model speculation on a
temporary overlay of the target folder whose ``genai_config.json`` has a ``model.draft`` section and whose
``draft/`` subfolder links the draft's graph and weights; the overlay goes when the peer is closed or the
interpreter exits; without a draft folder the peer is missing; greedy, it gives ORT GenAI greedy's tokens."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PROMPT = [1, 5, 9, 33, 70, 12, 40, 2, 100, 7, 7, 7]


def _genai_available() -> bool:
    return importlib.util.find_spec("onnxruntime_genai") is not None


@pytest.fixture
def draft_dir(tiny_model_dir, tmp_path) -> Path:
    """A copy of the tiny model (so its files are not the target's) whose graph is called ``small.onnx``."""
    folder = tmp_path / "draft-model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model.onnx").rename(folder / "small.onnx")  # its weights keep their name, model.onnx.data
    config = json.loads((folder / "genai_config.json").read_text(encoding="utf-8"))
    config["model"]["decoder"]["filename"] = "small.onnx"
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def test_the_overlay_has_the_draft_section_and_links_the_draft_files(tiny_model_dir, draft_dir):
    from bench.genai_draft_model import DraftOverlay

    overlay = DraftOverlay(tiny_model_dir, draft_dir, threads=3)
    try:
        root = overlay.path
        target = json.loads((Path(tiny_model_dir) / "genai_config.json").read_text(encoding="utf-8"))
        draft = json.loads((draft_dir / "genai_config.json").read_text(encoding="utf-8"))
        written = json.loads((root / "genai_config.json").read_text(encoding="utf-8"))

        expected = json.loads(json.dumps(draft["model"]["decoder"]))
        expected["filename"] = "draft/small.onnx"
        expected["session_options"]["intra_op_num_threads"] = 3
        assert written["model"]["draft"] == expected == overlay.section
        # the target's own decoder, its threads pinned; everything else as the target folder has it
        assert written["model"]["decoder"]["session_options"]["intra_op_num_threads"] == 3
        assert written["model"]["decoder"]["filename"] == target["model"]["decoder"]["filename"]
        assert written["search"] == target["search"]
        assert {k: v for k, v in written["model"].items() if k not in ("draft", "decoder")} == {
            k: v for k, v in target["model"].items() if k != "decoder"
        }

        # draft/: the draft's graph and the external data it names, linked to the draft folder's files
        assert sorted(p.name for p in (root / "draft").iterdir()) == ["model.onnx.data", "small.onnx"]
        assert set(overlay.links) == {"draft/small.onnx", "draft/model.onnx.data"}
        for name in ("small.onnx", "model.onnx.data"):
            linked = root / "draft" / name
            assert linked.is_file() and not linked.is_symlink()
            assert os.path.samefile(linked, draft_dir / name)
            assert not os.path.samefile(linked, Path(tiny_model_dir) / "model.onnx.data")
        # the target's files at the root, linked too; the originals untouched
        assert os.path.samefile(root / "model.onnx", Path(tiny_model_dir) / "model.onnx")
        assert json.loads((Path(tiny_model_dir) / "genai_config.json").read_text(encoding="utf-8")) == target
        assert "draft" not in target["model"]
    finally:
        overlay.close()


def test_the_overlay_is_removed_on_close_and_at_interpreter_exit(tiny_model_dir, draft_dir):
    from bench.genai_draft_model import DraftOverlay

    data = draft_dir / "model.onnx.data"
    overlay = DraftOverlay(tiny_model_dir, draft_dir, threads=1)
    assert overlay.path.is_dir() and data.stat().st_nlink == 2
    overlay.close()
    assert not overlay.path.exists() and data.stat().st_nlink == 1
    overlay.close()  # again: nothing to do

    # never closed: removed when the interpreter exits
    root = Path(__file__).resolve().parent.parent
    script = (
        "import sys; sys.path.append(sys.argv[1]); from bench.genai_draft_model import DraftOverlay; "
        "print(DraftOverlay(sys.argv[2], sys.argv[3], threads=1).path)"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(root), str(tiny_model_dir), str(draft_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        check=True,
    )
    leaked = Path(done.stdout.strip().splitlines()[-1])
    assert leaked.name.startswith("ortspec-ogdraft-") and not leaked.exists()
    assert data.stat().st_nlink == 1


def test_a_draft_folder_missing_a_file_its_graph_names_fails_and_leaves_nothing(tiny_model_dir, draft_dir):
    import tempfile

    from bench.genai_draft_model import DraftOverlay

    (draft_dir / "model.onnx.data").unlink()
    before = set(Path(tempfile.gettempdir()).glob("ortspec-ogdraft-*"))
    with pytest.raises(FileNotFoundError, match="model.onnx.data"):
        DraftOverlay(tiny_model_dir, draft_dir, threads=1)
    assert set(Path(tempfile.gettempdir()).glob("ortspec-ogdraft-*")) == before


@pytest.mark.skipif(not _genai_available(), reason="needs onnxruntime_genai")
def test_without_a_draft_folder_the_peer_is_missing_with_its_reason(tmp_path):
    from bench.engines import ALL_ENGINES, DRAFT_MODEL_PEER, PEER_ENGINES, load_peer
    from bench.peers import make_peer

    assert DRAFT_MODEL_PEER == "ortgenai-draft-model" and DRAFT_MODEL_PEER in PEER_ENGINES
    assert DRAFT_MODEL_PEER in ALL_ENGINES
    peer, why = load_peer(DRAFT_MODEL_PEER, tmp_path, threads=1)
    assert peer is None and why is not None and "--draft-model DIR" in why
    runner, why = make_peer(DRAFT_MODEL_PEER, tmp_path, threads=1)
    assert runner is None and why is not None and "no draft model" in why


def test_the_suite_takes_the_draft_length():
    from bench.suite import parse_args

    assert parse_args(["--engines", "ortgenai-draft-model"]).genai_draft_tokens == 4
    assert parse_args(["--genai-draft-tokens", "6"]).genai_draft_tokens == 6
    with pytest.raises(SystemExit):
        parse_args(["--genai-draft-tokens", "17"])  # ORT GenAI's max_draft_tokens is 1..16


@pytest.mark.skipif(not _genai_available(), reason="needs onnxruntime_genai")
def test_greedy_drafting_for_itself_gives_ortgenai_greedys_tokens(tiny_model_dir):
    from bench.engines import DRAFT_MODEL_PEER, load_peer

    data = Path(tiny_model_dir) / "model.onnx.data"
    links_before = data.stat().st_nlink
    plain, why = load_peer("ortgenai", tiny_model_dir, threads=1)
    assert plain is not None, why
    peer, why = load_peer(DRAFT_MODEL_PEER, tiny_model_dir, threads=1, draft_model=tiny_model_dir, draft_tokens=3)
    assert peer is not None, why
    overlay = peer.runner.overlay.path
    try:
        described = peer.describe()
        assert described["name"] == DRAFT_MODEL_PEER and described["speculative_options"] == {"max_draft_tokens": 3}
        assert described["model_dir"] == described["draft_model"] == str(Path(tiny_model_dir).resolve())
        assert data.stat().st_nlink == links_before + 2  # the overlay's root and its draft/
        want = plain.run(PROMPT, 24)
        got = peer.run(PROMPT, 24)
        assert got.token_ids == want.token_ids and len(got.token_ids) > 0
        assert got.finish_reason == want.finish_reason
        # GenAI's report: the draft model is the target, so every evaluated draft token is accepted
        assert got.extra["speculative_options"] == {"max_draft_tokens": 3}
        assert got.proposed is not None and got.proposed > 0 and got.accepted == got.proposed
        assert got.passes is not None and 0 < got.passes < len(got.token_ids)
    finally:
        peer.close()
        plain.close()
    assert not overlay.exists()
    assert data.stat().st_nlink == links_before
