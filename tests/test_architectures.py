"""Architectures beyond Llama, on tiny random-weight folders built by the onnxruntime-genai builder
(``tests.support.architectures``): a representative few in CI, the whole matrix with
``python scripts/arch_matrix.py`` (docs/architectures.md).

* Qwen3 (Q/K norms), Gemma 2 (sliding-window layers with a window-sized cache in the graph), LFM2 (a hybrid whose
  conv layers carry a recurrent state: snapshot and replay on rewind), Mistral (a sliding window in
  genai_config.json that the graph ignores: applied at load): load as is, greedy equals ONNX Runtime GenAI's greedy
  (Mistral: transformers', as ONNX Runtime GenAI fails on that folder), speculative equals greedy with drafts
  verified and accepted, verify rows equal one-token decodes.
* Quantized MatMulNBits: at the builder's accuracy level 4 a verify pass drifts from one-token decodes; at level 1
  (set at load, or built so) it does not.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from ortspec import Options, generate
from ortspec.adapters.engine.measurements import measure_verify_drift, probe_ids
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig, ModelFolder, OrtBackend

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")),
    reason="building the tiny models needs the convert extra: pip install 'ortspec[convert]'",
)

PROMPT_TEXT = "def merge(a, b):\n    return sorted(a + b)\n\n" * 3
ROW_TOL = 1e-4


@pytest.fixture(scope="session")
def arch_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("arch")


def _build(root: Path, arch: str, precision: str = "fp32", *, hidden: int = 64) -> Path:
    from tests.support.architectures import make_tiny_arch_model

    return make_tiny_arch_model(
        root / f"{arch}-{precision}-h{hidden}", arch, precision, hidden=hidden, hf_dir=root / f"hf-{arch}-h{hidden}"
    )


def _prompt(folder: Path) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json")).encode(PROMPT_TEXT).ids


def _tokens(n: int, vocab: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, size=n)]


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "lfm2", "mistral"])
def test_folder_loads_as_is_and_speculation_is_exact(arch_root, arch):
    from tests.support.conformance import check_folder

    folder = _build(arch_root, arch)
    report = check_folder(folder, _prompt(folder), max_tokens=48, hf_dir=arch_root / f"hf-{arch}-h64")
    assert report.load_error is None and report.run_error is None
    assert len(report.greedy) > 0
    if arch == "mistral":
        # ONNX Runtime GenAI 0.18 cannot run this folder past its window (the config's window, the graph's full
        # cache); ortspec applies the window and matches transformers.
        assert report.genai_agree is None and report.genai_error
        assert report.rewrites
    else:
        assert report.greedy_matches_genai, report.genai_agree
        assert not report.rewrites
    assert report.hf_agree is not None and report.hf_agree[0] == report.hf_agree[1], report.hf_agree
    assert report.speculative_exact, report.speculative
    assert report.drafts_accepted, report.speculative
    assert report.drift is not None and report.drift <= ROW_TOL
    assert report.stateful == (arch == "lfm2")


# -------------------------------------------------------------------------------------------------------------
# recurrent state (LFM2)


def test_hybrid_folder_names_its_states_and_kv_layers(arch_root):
    folder = ModelFolder.load(_build(arch_root, "lfm2"))
    assert folder.layer_types == ("conv", "full_attention", "conv")
    assert folder.kv_layers == (1,)
    assert folder.state_patterns == (("conv", "past.%d.conv", "present.%d.conv"),)
    backend = OrtBackend.from_folder(folder, BackendConfig(threads=1))
    assert backend.stateful
    assert [(s.layer, s.kind, s.past) for s in backend.graph.states] == [
        (0, "conv", "past.0.conv"),
        (2, "conv", "past.2.conv"),
    ]
    assert [names.layer for names in backend.graph.kv_names] == [1]


def test_recurrent_state_rewinds_like_a_fresh_backend(arch_root):
    path = _build(arch_root, "lfm2")
    b = OrtBackend.from_folder(path, BackendConfig(threads=1))
    toks = _tokens(40, b.vocab_size, seed=3)
    b.decode(toks[:20], 0)
    rows = b.decode_verify(toks[20:28], 20).copy()
    b.rewind(20)  # back to the start of the last pass: the snapshot, no replay
    seq = np.stack([b.decode([t], 20 + i).copy() for i, t in enumerate(toks[20:28])])
    assert float(np.abs(rows - seq).max()) <= ROW_TOL

    def fresh(n: int) -> np.ndarray:
        return OrtBackend.from_folder(path, BackendConfig(threads=1)).decode(toks[:n], 0).copy()

    b.rewind(24)  # into the last pass (a one-token decode): restore, replay
    assert b.current_len() == 24
    b.decode_verify(toks[24:30], 24)
    b.rewind(26)  # into the last pass: the snapshot at 24, replay 24..25
    assert float(np.abs(b.decode(toks[26:27], 26) - fresh(27)).max()) <= ROW_TOL
    b.rewind(12)  # before the last pass: replay from the start
    assert float(np.abs(b.decode(toks[12:15], 12) - fresh(15)).max()) <= ROW_TOL
    b.reset()
    assert b.current_len() == 0 and float(np.abs(b.decode(toks[:9], 0) - fresh(9)).max()) <= ROW_TOL


def test_a_hybrid_config_without_state_names_is_refused_clearly(arch_root, tmp_path):
    broken = tmp_path / "lfm2-no-states"
    shutil.copytree(_build(arch_root, "lfm2"), broken)
    path = broken / "genai_config.json"
    cfg = json.loads(path.read_text())
    del cfg["model"]["decoder"]["inputs"]["past_conv_names"]
    del cfg["model"]["decoder"]["outputs"]["present_conv_names"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(BackendError, match=r"past\.0\.conv.*past_<kind>_names"):
        OrtBackend.from_folder(broken, BackendConfig(threads=1))


def test_engine_speculates_on_a_hybrid_folder(arch_root):
    from ortspec.adapters.engine import Engine
    from tests.support.conformance import GreedyReplay

    engine = Engine.from_dir(_build(arch_root, "lfm2"), BackendConfig(threads=1))
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    greedy = engine.generate(prompt, max_tokens=32, ignore_eos=True)
    ids = engine.tokenize(prompt)
    for proposer in ("prompt-lookup", GreedyReplay(ids, greedy.token_ids, engine.backend.vocab_size, wrong_every=3)):
        spec = engine.generate(prompt, max_tokens=32, ignore_eos=True, speculative=proposer, draft_width=6)
        assert spec.token_ids == greedy.token_ids and spec.text == greedy.text
    assert spec.stats.multi_token_accepts > 0


# -------------------------------------------------------------------------------------------------------------
# sliding windows


def test_a_window_the_graph_ignores_is_applied_and_named(arch_root, caplog):
    path = _build(arch_root, "mistral")
    folder = ModelFolder.load(path)
    assert folder.sliding_window == 32 and folder.sliding_window_layers == ()
    with caplog.at_level(logging.WARNING, logger="ortspec.backends.onnx"):
        applied = OrtBackend.from_folder(path, BackendConfig(threads=1))
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "genai_config.json" in message and "window_size = 32" in message and "local_window_size = -1" in message
    assert len(applied.rewrites) == 2
    as_written = OrtBackend.from_folder(path, BackendConfig(threads=1, sliding_window="graph"))
    short = OrtBackend.from_folder(path, BackendConfig(threads=1, max_length=32))  # the window cannot matter
    assert not as_written.rewrites and not short.rewrites
    prompt = _prompt(path)
    options = Options(max_tokens=40)
    with_window = generate(applied, prompt, options).token_ids
    without = generate(as_written, prompt, options).token_ids
    assert with_window != without  # 75 + 40 positions: the window of 32 matters


def test_a_window_that_contradicts_the_graph_is_refused(arch_root, tmp_path):
    conflicting = tmp_path / "gemma2-window-16"
    shutil.copytree(_build(arch_root, "gemma2"), conflicting)
    path = conflicting / "genai_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"]["decoder"]["sliding_window"]["window_size"] = 16
    path.write_text(json.dumps(cfg))
    with pytest.raises(BackendError, match=r"genai_config.json.*window_size = 16.*local_window_size = 32"):
        OrtBackend.from_folder(conflicting, BackendConfig(threads=1))
    assert OrtBackend.from_folder(conflicting, BackendConfig(threads=1, sliding_window="graph")).rewrites == ()
    with pytest.raises(ValueError, match="sliding_window"):
        OrtBackend.from_folder(conflicting, BackendConfig(threads=1, sliding_window="both"))


def test_a_sliding_window_cache_layer_rewinds_past_the_window(arch_root):
    path = _build(arch_root, "gemma2")
    b = OrtBackend.from_folder(path, BackendConfig(threads=1))
    toks = _tokens(120, b.vocab_size, seed=11)
    b.decode(toks[:90], 0)
    rows = b.decode_verify(toks[90:106], 90).copy()
    b.rewind(90)
    seq = np.stack([b.decode([t], 90 + i).copy() for i, t in enumerate(toks[90:106])])
    assert float(np.abs(rows - seq).max()) <= ROW_TOL
    b.rewind(50)
    again = b.decode(toks[50:100], 50).copy()
    fresh = OrtBackend.from_folder(path, BackendConfig(threads=1)).decode(toks[:100], 0)
    assert float(np.abs(again - fresh).max()) <= ROW_TOL


# -------------------------------------------------------------------------------------------------------------
# quantized MatMulNBits


def test_matmul_accuracy_level_one_makes_verify_agree_with_decodes(arch_root):
    """hidden 256: large enough for the int8-activation kernels of level 4 (hidden 64 takes another path)."""
    path = _build(arch_root, "llama", "int4", hidden=256)
    built = OrtBackend.from_folder(path, BackendConfig(threads=1))
    exact = OrtBackend.from_folder(path, BackendConfig(threads=1, matmul_accuracy_level=1))
    assert built.rewrites == ()
    assert exact.rewrites and "accuracy_level [4] -> 1" in exact.rewrites[0]
    ids = probe_ids(built.vocab_size, 60 + 27)
    drift_built = measure_verify_drift(built, ids[:60], ids[60:])
    drift_exact = measure_verify_drift(exact, ids[:60], ids[60:])
    print(f"[verify drift] int4 level 4: {drift_built:.3g}; level 1: {drift_exact:.3g}")
    assert drift_built > 1e-3
    assert drift_exact <= ROW_TOL
    unchanged = OrtBackend.from_folder(path, BackendConfig(threads=1, matmul_accuracy_level=4))
    assert unchanged.rewrites == ()
    with pytest.raises(ValueError, match="matmul_accuracy_level"):
        OrtBackend.from_folder(path, BackendConfig(threads=1, matmul_accuracy_level=7))


def test_a_folder_built_at_level_one_is_exact_as_is(arch_root, tmp_path):
    from ortspec.backends.onnx.model_graph import read_graph_facts
    from tests.support.architectures import make_tiny_arch_model

    path = make_tiny_arch_model(tmp_path / "int4-level1", "llama", "int4", hidden=256, accuracy_level=1)
    assert dict(read_graph_facts(path / "model.onnx").matmul_nbits) == {(4, 1): 11}
    b = OrtBackend.from_folder(path, BackendConfig(threads=1))
    ids = probe_ids(b.vocab_size, 60 + 27)
    assert measure_verify_drift(b, ids[:60], ids[60:]) <= ROW_TOL


def test_engine_warning_names_the_exact_setting(arch_root):
    from ortspec.adapters.engine import Engine

    engine = Engine.from_dir(_build(arch_root, "llama", "int4", hidden=256), BackendConfig(threads=1))
    with pytest.warns(RuntimeWarning, match="matmul_accuracy_level=1"):
        engine.generate("abc abc abc", max_tokens=4, speculative="prompt-lookup", draft_width=2)
    exact = Engine.from_dir(
        _build(arch_root, "llama", "int4", hidden=256), BackendConfig(threads=1, matmul_accuracy_level=1)
    )
    assert exact.measurements.verify_drift() <= ROW_TOL


def test_a_state_without_its_present_name_is_refused(arch_root, tmp_path):
    from ortspec.backends.onnx import ModelFolderError

    broken = tmp_path / "lfm2-half-state"
    shutil.copytree(_build(arch_root, "lfm2"), broken)
    path = broken / "genai_config.json"
    cfg = json.loads(path.read_text())
    del cfg["model"]["decoder"]["outputs"]["present_conv_names"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(ModelFolderError, match="past_conv_names names a state with no .*present_conv_names"):
        ModelFolder.load(broken)


def test_conversion_settings_name_their_folders(monkeypatch, tmp_path):
    from ortspec.adapters.cli.main import build_parser
    from ortspec.adapters.tools.convert import default_model_dir

    monkeypatch.setenv("ORTSPEC_CACHE", str(tmp_path))
    assert default_model_dir("fp32").name == "SmolLM2-135M-Instruct-fp32"
    assert default_model_dir("int4").name == "SmolLM2-135M-Instruct-int4-acc1"  # exact by default
    assert default_model_dir("int8", 4).name == "SmolLM2-135M-Instruct-int8-acc4"
    with pytest.raises(ValueError, match="accuracy_level applies"):
        default_model_dir("fp32", 1)
    with pytest.raises(ValueError, match="accuracy_level must be"):
        default_model_dir("int4", 5)
    args = build_parser().parse_args(["convert", "--precision", "int4", "--accuracy-level", "4"])
    assert (args.precision, args.accuracy_level) == ("int4", 4)
    args = build_parser().parse_args(["generate", "hi", "--matmul-accuracy-level", "1", "--sliding-window", "graph"])
    assert (args.matmul_accuracy_level, args.sliding_window) == (1, "graph")


def test_readme_table_is_the_matrix_runs():
    """The README's architecture table is the summary table of docs/architectures.md (both written by one run of
    scripts/arch_matrix.py), with a row for every architecture and a column for every setting."""
    from tests.support.architectures import ARCHITECTURES

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text(encoding="utf-8")
    begin, end = "<!-- scripts/arch_matrix.py writes this table -->", "<!-- end of the table -->"
    readme_table = [ln for ln in readme.split(begin, 1)[1].split(end, 1)[0].splitlines() if ln.startswith("|")]
    doc = (root / "docs" / "architectures.md").read_text(encoding="utf-8")
    summary = doc.split("## Summary: greedy / speculative", 1)[1].split("## Details", 1)[0]
    doc_table = [ln for ln in summary.splitlines() if ln.startswith("|")]
    assert readme_table == doc_table
    assert [ln.split("|")[1].strip() for ln in doc_table[2:]] == [spec.label for spec in ARCHITECTURES.values()]
    assert len(doc_table[0].split("|")) - 3 == 6  # fp32, fp16, int8 at levels 4 and 1, int4 at levels 4 and 1
