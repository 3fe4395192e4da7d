"""OrtBackend on tiny random-weight Llama folders built by the onnxruntime-genai builder (make_tiny_model).

The CPU tests need the ``convert`` extra to build the tiny model (skipped without it). The ``cuda`` tests also
need onnxruntime's CUDA execution provider and CuPy (or torch with CUDA); ``ORTSPEC_CUDA_TINY_MODEL`` may name a
prebuilt fp16/cuda tiny folder (``scripts/gpu_check.sh`` passes one) for machines without the builder.
The ``real_model`` test uses the converted SmolLM2 folder when it is cached, and skips otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

from ortspec.adapters.tools.convert import is_complete
from ortspec.backends.base import Backend, BackendError
from ortspec.backends.onnx import (
    BackendConfig,
    ModelFolder,
    ModelFolderError,
    OrtBackend,
    argmax_margin,
    physical_cores,
)
from ortspec.backends.onnx.arrays import torch_argmax_margin, xp_argmax_margin
from tests.support.models import make_tiny_model

ROW_TOL = 1e-4  # float32 logits: batched rows vs one-token steps
MAX_DIFFS: dict[str, float] = {}


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _builder_available() -> bool:
    return _have("torch", "transformers", "onnx", "onnxruntime_genai")


@pytest.fixture(scope="session")
def tiny_dir(tiny_model_dir) -> Path:
    return tiny_model_dir  # the shared fixture of tests/conftest.py


@pytest.fixture(scope="session")
def tiny16_dir(tmp_path_factory) -> Path:
    if not _builder_available():
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    return make_tiny_model(tmp_path_factory.mktemp("tiny16") / "tiny-fp16", precision="fp16", execution_provider="cuda")


@pytest.fixture
def backend(tiny_dir) -> OrtBackend:
    return OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1))


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def _sequential(b, tokens: list[int], start: int = 0) -> np.ndarray:
    """Logits after each token, one-token decodes from ``start`` (the cache must hold ``start`` positions)."""
    rows = []
    for i, t in enumerate(tokens):
        rows.append(b.decode([t], start + i).copy())
    return np.stack(rows)


def _record(name: str, diff: float, record_property=None) -> None:
    MAX_DIFFS[name] = max(MAX_DIFFS.get(name, 0.0), diff)
    print(f"[max abs diff] {name}: {diff:.3g}")
    if record_property is not None:
        record_property(f"max_abs_diff_{name}", diff)


def _reference_logits(folder: Path, tokens: list[int]) -> np.ndarray:
    """All-position logits of one plain ``session.run`` from an empty cache: no IO binding, no shared buffers."""
    import onnxruntime as ort

    mf = ModelFolder.load(folder)
    sess = ort.InferenceSession(str(mf.model_path), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([tokens], np.int64), "attention_mask": np.ones((1, len(tokens)), np.int64)}
    kv_type = np.float16 if "float16" in sess.get_inputs()[2].type else np.float32
    for layer in range(mf.num_layers):
        for name in (mf.past_key_pattern % layer, mf.past_value_pattern % layer):
            feeds[name] = np.zeros((1, mf.num_kv_heads, 0, mf.head_size), kv_type)
    return sess.run([mf.logits_name], feeds)[0][0].astype(np.float32)


# -------------------------------------------------------------------------------------------------------------
# ModelFolder


def test_model_folder_reads_builder_config(tiny_dir):
    mf = ModelFolder.load(tiny_dir)
    assert mf.num_layers == 2 and mf.num_kv_heads == 2 and mf.num_attention_heads == 4 and mf.head_size == 16
    assert mf.context_length == 256 and mf.vocab_size == 384
    assert mf.eos_token_ids == (0,)
    assert mf.past_key_pattern % 1 == "past_key_values.1.key" and mf.present_value_pattern % 0 == "present.0.value"
    assert mf.past_present_share_buffer is True
    assert mf.model_path.name == "model.onnx" and mf.tokenizer_path.is_file()


def _copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, edit) -> None:
    path = folder / "genai_config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


def test_model_folder_errors_name_the_problem(tiny_dir, tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist"):
        ModelFolder.load(tmp_path / "nope")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="genai_config.json"):
        ModelFolder.load(empty)

    broken = _copy_folder(tiny_dir, tmp_path / "broken")
    (broken / "genai_config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="not valid JSON"):
        ModelFolder.load(broken)

    no_layers = _copy_folder(tiny_dir, tmp_path / "no_layers")
    _edit_config(no_layers, lambda c: c["model"]["decoder"].pop("num_hidden_layers"))
    with pytest.raises(ModelFolderError, match="num_hidden_layers"):
        ModelFolder.load(no_layers)

    bad_eos = _copy_folder(tiny_dir, tmp_path / "bad_eos")
    _edit_config(bad_eos, lambda c: c["model"].__setitem__("eos_token_id", "x"))
    with pytest.raises(ModelFolderError, match="eos_token_id"):
        ModelFolder.load(bad_eos)

    eos_list = _copy_folder(tiny_dir, tmp_path / "eos_list")
    _edit_config(eos_list, lambda c: c["model"].__setitem__("eos_token_id", [2, 0]))
    assert ModelFolder.load(eos_list).eos_token_ids == (2, 0)

    bad_pattern = _copy_folder(tiny_dir, tmp_path / "bad_pattern")
    _edit_config(bad_pattern, lambda c: c["model"]["decoder"]["inputs"].__setitem__("past_key_names", "past"))
    with pytest.raises(ModelFolderError, match="past_key_names"):
        ModelFolder.load(bad_pattern)

    no_model = _copy_folder(tiny_dir, tmp_path / "no_model")
    (no_model / "model.onnx").unlink()
    with pytest.raises(ModelFolderError, match="model.onnx"):
        ModelFolder.load(no_model)
    with pytest.raises(ModelFolderError, match="model.onnx"):
        OrtBackend.from_folder(no_model)


def test_backend_rejects_a_config_that_does_not_match_the_graph(tiny_dir, tmp_path):
    wrong = _copy_folder(tiny_dir, tmp_path / "wrong_names")
    _edit_config(wrong, lambda c: c["model"]["decoder"]["outputs"].__setitem__("present_key_names", "kv.%d.k"))
    with pytest.raises(BackendError, match="kv.0.k"):
        OrtBackend.from_folder(wrong, BackendConfig(threads=1))

    heads = _copy_folder(tiny_dir, tmp_path / "wrong_heads")
    _edit_config(heads, lambda c: c["model"]["decoder"].__setitem__("num_key_value_heads", 4))
    with pytest.raises(BackendError, match="num_key_value_heads"):
        OrtBackend.from_folder(heads, BackendConfig(threads=1))

    layers = _copy_folder(tiny_dir, tmp_path / "fewer_layers")
    _edit_config(layers, lambda c: c["model"]["decoder"].__setitem__("num_hidden_layers", 1))
    with pytest.raises(BackendError, match="inputs this backend does not know how to feed|more layers"):
        OrtBackend.from_folder(layers, BackendConfig(threads=1))


# -------------------------------------------------------------------------------------------------------------
# the protocol on CPU


def test_protocol_shape_and_defaults(tiny_dir, backend):
    assert isinstance(backend, Backend)
    assert backend.vocab_size == 384 and backend.max_length == 256 and backend.current_len() == 0
    assert backend.share_buffer
    assert backend.session.get_session_options().intra_op_num_threads == 1
    default = OrtBackend.from_folder(tiny_dir, BackendConfig(max_length=64))
    assert default.session.get_session_options().intra_op_num_threads == physical_cores()
    assert default.max_length == 64
    with pytest.raises(ValueError, match="max_length"):
        OrtBackend.from_folder(tiny_dir, BackendConfig(max_length=257))
    with pytest.raises(ValueError, match="provider"):
        OrtBackend.from_folder(tiny_dir, BackendConfig(provider="tpu"))


def test_decode_returns_last_row_of_a_reusable_float32_buffer(backend):
    toks = _tokens(6, backend.vocab_size)
    a = backend.decode(toks[:5], 0)
    assert a.shape == (backend.vocab_size,) and a.dtype == np.float32
    assert backend.current_len() == 5
    b = backend.decode(toks[5:], 5)
    rows = backend.decode_verify(toks[:2], 6)
    assert rows.shape == (2, backend.vocab_size) and rows.dtype == np.float32
    assert a.base is not None and a.base is b.base is rows.base  # views of one preallocated logits buffer
    assert np.shares_memory(b, rows)


@pytest.mark.parametrize("prefix,k", [(1, 1), (5, 4), (9, 16), (0, 8)])
def test_verify_rows_equal_sequential_decodes(backend, record_property, prefix, k):
    toks = _tokens(prefix + k, backend.vocab_size, seed=prefix * 31 + k)
    if prefix:
        backend.decode(toks[:prefix], 0)
    rows = backend.decode_verify(toks[prefix:], prefix).copy()
    assert backend.current_len() == prefix + k
    backend.rewind(prefix)
    seq = _sequential(backend, toks[prefix:], prefix)
    diff = float(np.abs(rows - seq).max())
    _record("verify_vs_sequential_fp32", diff, record_property)
    assert diff <= ROW_TOL
    assert (rows.argmax(axis=1) == seq.argmax(axis=1)).all()


def test_rows_equal_a_plain_session_run_without_shared_buffers(tiny_dir, backend, record_property):
    toks = _tokens(24, backend.vocab_size, seed=7)
    ref = _reference_logits(tiny_dir, toks)
    backend.decode(toks[:10], 0)
    rows = np.concatenate([backend.decode_verify(toks[10:17], 10).copy(), backend.decode_verify(toks[17:], 17).copy()])
    diff = float(np.abs(rows - ref[10:]).max())
    _record("verify_vs_plain_run", diff, record_property)
    assert diff <= ROW_TOL


def test_rewind_then_decode_equals_a_fresh_decode(tiny_dir, backend, record_property):
    toks = _tokens(30, backend.vocab_size, seed=3)
    backend.decode(toks[:20], 0)
    backend.decode_verify(toks[20:28], 20)
    backend.rewind(12)
    assert backend.current_len() == 12
    after = backend.decode(toks[12:15], 12).copy()
    fresh = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1))
    expect = fresh.decode(toks[:15], 0)
    diff = float(np.abs(after - expect).max())
    _record("rewind_vs_fresh", diff, record_property)
    assert diff <= ROW_TOL
    backend.rewind(0)
    assert backend.current_len() == 0
    assert np.abs(backend.decode(toks[:15], 0) - expect).max() <= ROW_TOL
    backend.reset()
    assert backend.current_len() == 0


def test_contract_violations_raise_and_leave_the_cache_usable(tiny_dir):
    b = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, max_length=16))
    toks = _tokens(20, b.vocab_size, seed=5)
    b.decode(toks[:10], 0)
    bad_calls = [
        (lambda: b.decode(toks[10:17], 10), "capacity"),  # 10 + 7 > 16
        (lambda: b.decode_verify(toks[10:17], 10), "capacity"),
        (lambda: b.decode([5], 9), "must be equal"),
        (lambda: b.decode([5], 11), "must be equal"),
        (lambda: b.decode_verify([5, 6], 3), "must be equal"),
        (lambda: b.decode([b.vocab_size], 10), "outside the vocabulary"),
        (lambda: b.decode([-1], 10), "outside the vocabulary"),
        (lambda: b.decode_verify([3, 10**9], 10), "outside the vocabulary"),
        (lambda: b.decode([], 10), "empty"),
        (lambda: b.verify_picks([], 10), "empty"),
        (lambda: b.decode([[1, 2]], 10), "flat"),
        (lambda: b.rewind(11), "rewind"),
        (lambda: b.rewind(-1), "rewind"),
    ]
    for call, match in bad_calls:
        with pytest.raises(BackendError, match=match):
            call()
        assert b.current_len() == 10
    rows = b.decode_verify(toks[10:16], 10).copy()  # exactly fills the cache
    assert b.current_len() == 16
    with pytest.raises(BackendError, match="capacity"):
        b.decode([1], 16)
    fresh = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, max_length=16))
    fresh.decode(toks[:10], 0)
    assert np.abs(rows - fresh.decode_verify(toks[10:16], 10)).max() <= ROW_TOL


def test_a_prompt_runs_the_lm_head_over_its_last_position_only(tiny_dir, record_property):
    """On the CPU the graph takes KEEP_LOGITS_INPUT: each prefill chunk computes one logits row (the chunk's last),
    which equals the plain run's row at that position; a verify pass still computes every row."""
    from ortspec.backends.onnx.model_graph import KEEP_LOGITS_INPUT

    toks = _tokens(30, 384, seed=5)
    ref = _reference_logits(tiny_dir, toks)
    b = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, prefill_chunk=8))
    assert b.graph.keep_name == KEEP_LOGITS_INPUT and b.rewrites == ()
    last = b.decode(toks[:20], 0).copy()  # chunks of 8, 8 and 4 tokens
    assert b._rows.hidden_span == (19, 1)  # the last position's hidden state only
    rows = b.decode_verify(toks[20:], 20).copy()
    assert b._rows.hidden_span == (20, 10)
    diff = max(float(np.abs(last - ref[19]).max()), float(np.abs(rows - ref[20:]).max()))
    _record("kept_rows_vs_plain_run", diff, record_property)
    assert diff <= ROW_TOL
    static = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, static_shapes=True))
    assert static.graph.keep_name is None  # static shapes bind every row of a width


def test_chunked_prefill_equals_unchunked(tiny_dir, record_property):
    toks = _tokens(100, 384, seed=11)
    whole = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1))
    chunked = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, prefill_chunk=7))
    a = whole.decode(toks[:90], 0).copy()
    b = chunked.decode(toks[:90], 0).copy()
    diff = float(np.abs(a - b).max())
    assert chunked.current_len() == whole.current_len() == 90
    va = whole.decode_verify(toks[90:], 90).copy()
    vb = chunked.decode_verify(toks[90:], 90).copy()  # 10 rows > the 7-row chunk: the buffer grows
    diff = max(diff, float(np.abs(va - vb).max()))
    _record("chunked_vs_unchunked", diff, record_property)
    assert diff <= ROW_TOL


def test_verify_picks_matches_numpy_argmax_of_decode_verify(backend):
    toks = _tokens(40, backend.vocab_size, seed=13)
    backend.decode(toks[:24], 0)
    rows = backend.decode_verify(toks[24:], 24).copy()
    backend.rewind(24)
    ids, margins = backend.verify_picks(toks[24:], 24)
    assert backend.current_len() == 40
    assert ids.dtype == np.int64 and margins.dtype == np.float32 and ids.shape == margins.shape == (16,)
    assert (ids == rows.argmax(axis=1)).all()
    top2 = np.sort(rows, axis=1)[:, -2:]
    np.testing.assert_allclose(margins, top2[:, 1] - top2[:, 0], rtol=0, atol=1e-6)


def test_argmax_margin_breaks_ties_to_the_lowest_id():
    rows = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 2.0, 5.0], [1.0, 2.0, 0.5, 1.5]], np.float32)
    ids, margins = argmax_margin(rows)
    assert ids.tolist() == [1, 0, 1]
    assert margins.tolist() == [0.0, 0.0, 0.5]


def _picks_rows(vocab: int) -> np.ndarray:
    """float32 ``[12, vocab]`` rows: non-finite ones (NaN, +inf, all -inf), exact ties, and plain random ones."""
    rng = np.random.default_rng(37)
    rows = rng.normal(size=(12, vocab)).astype(np.float32)
    rows[0, 5] = np.nan  # one NaN among finite values
    rows[1, :] = np.nan  # all NaN
    rows[2, vocab - 1] = np.inf  # +inf in the last column
    rows[3, 3] = rows[3, 7] = np.inf  # two +inf
    rows[4, :] = -np.inf  # all -inf
    rows[5, :] = -np.inf
    rows[5, vocab - 2] = 1.5  # one finite value among -inf: a finite pick, margin +inf
    rows[6, 2] = rows[6, vocab - 3] = 50  # an exact tie: the lowest id, margin 0
    rows[7, :] = 1  # all equal
    rows[8, 0], rows[8, 1] = 60, np.nan  # a NaN after the largest value
    rows[9, 1], rows[9, 2] = np.inf, -np.inf  # +inf and -inf
    rows[10, 123 % vocab], rows[10, vocab // 2] = 70, 69.5
    return rows


NON_FINITE_ROWS = [0, 1, 2, 3, 4, 8, 9]


def _assert_picks_match_numpy(ids, margins, rows: np.ndarray) -> None:
    """``(ids, margins)`` keep the picks contract and equal numpy ``argmax_margin`` on ``rows``: the same NaN
    margins, ids in range everywhere, and the same ids and margins on every row with a finite pick."""
    expect_ids, expect_margins = argmax_margin(rows)
    vocab = rows.shape[1]
    assert ids.dtype == np.int64 and margins.dtype == np.float32 and ids.shape == margins.shape == (len(rows),)
    assert ((ids >= 0) & (ids < vocab)).all(), ids
    refused = np.isnan(expect_margins)
    assert np.isnan(margins).tolist() == refused.tolist()
    assert ids[~refused].tolist() == expect_ids[~refused].tolist()
    np.testing.assert_array_equal(margins[~refused], expect_margins[~refused])


@pytest.mark.parametrize("vocab", [384, 49152])
def test_argmax_margin_is_nan_where_the_pick_is_not_finite(vocab):
    rows = _picks_rows(vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "invalid value" warning from inf - inf
        ids, margins = argmax_margin(rows)
    assert ids.tolist() == np.argmax(rows, axis=1).tolist()  # core.state.step's pick
    refused = [not np.isfinite(row[np.argmax(row)]) for row in rows]  # the rows core.state.step refuses
    assert np.isnan(margins).tolist() == refused
    assert [i for i, r in enumerate(refused) if r] == NON_FINITE_ROWS
    assert ids[6] == 2 and margins[6] == 0 and ids[7] == 0 and margins[7] == 0
    assert ids[5] == vocab - 2 and margins[5] == np.inf
    assert ids[10] == 123 % vocab and margins[10] == 0.5


@pytest.mark.parametrize("vocab", [384, 49152])
def test_xp_argmax_margin_on_numpy_matches_argmax_margin(vocab):
    """The CuPy-reductions fallback, run with numpy as the array module."""
    rows = _picks_rows(vocab)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ids, margins = xp_argmax_margin(np, rows)
    assert ids.tolist() == np.argmax(rows, axis=1).tolist()  # numpy's pick even where a NaN is picked
    _assert_picks_match_numpy(ids.astype(np.int64), margins, rows)


@pytest.mark.parametrize("vocab", [384, 49152])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_torch_argmax_margin_on_cpu_matches_argmax_margin(vocab, dtype):
    """The torch path (the CUDA fallback when CuPy is missing), run on CPU tensors."""
    torch = pytest.importorskip("torch")
    rows = _picks_rows(vocab).astype(dtype)
    ids, margins = torch_argmax_margin(torch.from_numpy(rows))
    assert ids.tolist() == np.argmax(rows, axis=1).tolist()
    _assert_picks_match_numpy(ids, margins, rows.astype(np.float32))


def test_grow_copy_path_equals_shared_buffers(tiny_dir, caplog, record_property):
    with caplog.at_level("WARNING", logger="ortspec.backends.onnx"):
        copy = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1, share_buffer=False))
    assert not copy.share_buffer
    assert sum("grow/copy" in r.getMessage() for r in caplog.records) == 1
    shared = OrtBackend.from_folder(tiny_dir, BackendConfig(threads=1))
    toks = _tokens(40, 384, seed=17)
    diffs = []
    for b in (copy, shared):
        b.decode(toks[:20], 0)
        b.decode_verify(toks[20:30], 20)
        b.rewind(25)
    diffs.append(np.abs(copy.decode(toks[25:28], 25) - shared.decode(toks[25:28], 25)).max())
    ra, rb = copy.decode_verify(toks[28:36], 28).copy(), shared.decode_verify(toks[28:36], 28).copy()
    diffs.append(np.abs(ra - rb).max())
    ia, _ = copy.verify_picks(toks[36:], 36)
    ib, _ = shared.verify_picks(toks[36:], 36)
    diff = float(max(diffs))
    _record("grow_copy_vs_shared", diff, record_property)
    assert diff <= ROW_TOL and (ia == ib).all()


def test_float16_kv_model_on_cpu(tiny16_dir, record_property):
    b = OrtBackend.from_folder(tiny16_dir, BackendConfig(threads=1))
    assert b.share_buffer and str(b.graph.kv_dtype) == "float16"
    toks = _tokens(20, b.vocab_size, seed=19)
    b.decode(toks[:8], 0)
    rows = b.decode_verify(toks[8:], 8).copy()
    assert rows.dtype == np.float32
    b.rewind(8)
    seq = _sequential(b, toks[8:], 8)
    diff = float(np.abs(rows - seq).max())
    _record("verify_vs_sequential_fp16_cpu", diff, record_property)
    assert diff <= 2e-2
    b.rewind(8)
    ids, _ = b.verify_picks(toks[8:], 8)
    assert (ids == rows.argmax(axis=1)).all()


# -------------------------------------------------------------------------------------------------------------
# CUDA


def _cuda_ready() -> str | None:
    """None if the CUDA tests can run, else why not."""
    try:
        import onnxruntime as ort
    except ImportError:
        return "onnxruntime is not installed"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)"
    if _have("cupy"):
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return None
        except Exception as exc:  # noqa: BLE001
            return f"CuPy cannot see a GPU: {exc}"
    if _have("torch"):
        import torch

        if torch.cuda.is_available():
            return None
    return "neither CuPy nor torch can allocate CUDA memory"


@pytest.fixture(scope="session")
def cuda_dir(tmp_path_factory) -> Path:
    why = _cuda_ready()
    if why:
        pytest.skip(why)
    given = os.environ.get("ORTSPEC_CUDA_TINY_MODEL")
    if given:
        if not is_complete(given):
            pytest.fail(f"ORTSPEC_CUDA_TINY_MODEL={given} is not a model folder")
        return Path(given)
    if not _builder_available():
        pytest.skip("no ORTSPEC_CUDA_TINY_MODEL folder and no builder to make one")
    return make_tiny_model(
        tmp_path_factory.mktemp("tinycuda") / "tiny-fp16-cuda", precision="fp16", execution_provider="cuda"
    )


def _array_modules() -> list[str]:
    mods = []
    if _have("cupy"):
        mods.append("cupy")
    if _have("torch"):
        mods.append("torch")
    return mods or ["cupy"]


@pytest.mark.cuda
@pytest.mark.parametrize("array_module", _array_modules())
def test_cuda_rows_rewind_and_argmax(cuda_dir, array_module, record_property):
    try:
        b = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda", array_module=array_module))
    except BackendError as exc:
        if "needs CuPy" in str(exc):
            pytest.skip(str(exc))
        raise
    assert b.share_buffer
    toks = _tokens(60, b.vocab_size, seed=23)
    last = b.decode(toks[:40], 0).copy()
    rows = b.decode_verify(toks[40:50], 40).copy()
    assert rows.dtype == np.float32 and rows.shape == (10, b.vocab_size)
    b.rewind(40)
    seq = _sequential(b, toks[40:50], 40)
    diff = float(np.abs(rows - seq).max())
    _record(f"verify_vs_sequential_cuda_{array_module}", diff, record_property)
    assert diff <= 3e-2  # float16 model
    b.rewind(40)
    ids, margins = b.verify_picks(toks[40:50], 40)
    assert (ids == rows.argmax(axis=1)).all()
    top2 = np.sort(rows, axis=1)[:, -2:]
    np.testing.assert_allclose(margins, top2[:, 1] - top2[:, 0], rtol=0, atol=1e-6)
    # rewind, then the same prefix again matches a fresh backend
    b.rewind(20)
    again = b.decode(toks[20:40], 20).copy()
    fresh = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda", array_module=array_module))
    np.testing.assert_allclose(again, fresh.decode(toks[:40], 0), atol=3e-2, rtol=0)
    np.testing.assert_allclose(again, last, atol=3e-2, rtol=0)
    # chunked prefill and errors
    chunked = OrtBackend.from_folder(
        cuda_dir, BackendConfig(provider="cuda", array_module=array_module, prefill_chunk=9)
    )
    np.testing.assert_allclose(chunked.decode(toks[:40], 0), last, atol=3e-2, rtol=0)
    with pytest.raises(BackendError):
        chunked.decode([b.vocab_size], 40)
    with pytest.raises(BackendError):
        chunked.decode([1], 39)
    assert chunked.current_len() == 40
    # and the CPU backend on the same folder agrees
    cpu = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cpu"))
    cpu.decode(toks[:40], 0)
    cpu_rows = cpu.decode_verify(toks[40:50], 40)
    diff_cpu = float(np.abs(cpu_rows - rows).max())
    _record(f"cuda_vs_cpu_{array_module}", diff_cpu, record_property)
    assert diff_cpu <= 5e-2


@pytest.mark.cuda
@pytest.mark.parametrize("array_module", _array_modules())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_cuda_argmax_margin_kernel_ties_and_wide_rows(cuda_dir, array_module, dtype):
    from ortspec.backends.onnx.arrays import cuda_arrays

    xp = cuda_arrays(0, array_module)
    rng = np.random.default_rng(31)
    rows = rng.normal(size=(7, 49152)).astype(dtype)
    rows[1, 7] = rows[1, 40000] = 50  # a tie: lowest id, margin 0
    rows[2, :] = 1  # all equal
    rows[3, 49151] = 60  # the last column
    rows[4, 0] = 60  # the first column
    rows[5, 123], rows[5, 9000] = 70, 69.5
    expect_ids, expect_margins = argmax_margin(rows.astype(np.float32))
    ids, margins = xp.argmax_margin(xp.from_host(rows))
    assert ids.tolist() == expect_ids.tolist()
    np.testing.assert_allclose(margins, expect_margins, rtol=0, atol=1e-6)
    assert ids[1] == 7 and margins[1] == 0 and ids[2] == 0 and margins[2] == 0 and ids[3] == 49151
    one = xp.argmax_margin(xp.from_host(rows[5:6]))
    assert one[0].tolist() == [123] and abs(float(one[1][0]) - 0.5) < 1e-6


@pytest.mark.cuda
@pytest.mark.parametrize("array_module", _array_modules())
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("vocab", [384, 49152])
def test_cuda_argmax_margin_non_finite_rows(cuda_dir, array_module, dtype, vocab):
    """The fused kernel (CuPy) or torch_argmax_margin (torch) on device rows with NaN, +inf, all -inf and ties;
    with CuPy also the reductions fallback."""
    from ortspec.backends.onnx.arrays import cuda_arrays

    arrays = cuda_arrays(0, array_module)
    rows = _picks_rows(vocab).astype(dtype)
    ids, margins = arrays.argmax_margin(arrays.from_host(rows))
    _assert_picks_match_numpy(ids, margins, rows.astype(np.float32))
    if arrays.name == "cupy":
        cp = arrays.cp
        ids, margins = xp_argmax_margin(cp, arrays.from_host(rows.astype(np.float32)))
        _assert_picks_match_numpy(cp.asnumpy(ids).astype(np.int64), cp.asnumpy(margins), rows.astype(np.float32))


@pytest.mark.cuda
def test_cuda_grow_copy_path(cuda_dir):
    arr = _array_modules()[0]
    shared = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda", array_module=arr))
    copy = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda", array_module=arr, share_buffer=False))
    toks = _tokens(30, shared.vocab_size, seed=29)
    for b in (shared, copy):
        b.decode(toks[:20], 0)
        b.rewind(15)
    np.testing.assert_allclose(
        shared.decode_verify(toks[15:30], 15), copy.decode_verify(toks[15:30], 15), atol=3e-2, rtol=0
    )


def test_cuda_provider_errors_clearly_without_cuda(tiny_dir):
    if _cuda_ready() is None:
        pytest.skip("this machine has CUDA")
    with pytest.raises(BackendError, match="CUDA|CuPy"):
        OrtBackend.from_folder(tiny_dir, BackendConfig(provider="cuda"))


# -------------------------------------------------------------------------------------------------------------
# the real model


@pytest.mark.real_model
def test_real_model_rows_and_greedy_match_onnxruntime_genai(real_model_dir, record_property):
    folder = real_model_dir  # converted on first use (tests/conftest.py)
    b = OrtBackend.from_folder(folder, BackendConfig(max_length=512))
    assert b.vocab_size == 49152
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ModelFolder.load(folder).tokenizer_path))
    prompt = tok.encode("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n").ids
    logits = b.decode(prompt, 0)
    greedy = []
    for _ in range(12):
        t = int(logits.argmax())
        greedy.append(t)
        logits = b.decode([t], b.current_len())
    # verify the greedy continuation in one pass: rows equal the one-token steps, argmaxes reproduce it
    b.rewind(len(prompt))
    rows = b.decode_verify(greedy, len(prompt)).copy()
    assert (rows[:-1].argmax(axis=1) == np.array(greedy[1:])).all()
    b.rewind(len(prompt))
    seq = _sequential(b, greedy, len(prompt))
    diff = float(np.abs(rows - seq).max())
    _record("verify_vs_sequential_smollm2", diff, record_property)
    assert diff <= 1e-3
    print("greedy:", repr(tok.decode(greedy)))
    if _have("onnxruntime_genai"):
        import onnxruntime_genai as og

        model = og.Model(str(folder))
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + len(greedy))
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        theirs = []
        while not gen.is_done() and len(theirs) < len(greedy):
            gen.generate_next_token()
            theirs.append(int(gen.get_next_tokens()[0]))
        assert len(theirs) >= len(greedy) // 2
        assert theirs == greedy[: len(theirs)]


@pytest.mark.cuda
def test_cuda_engine_speculative_equals_greedy_via_device_accept(cuda_dir, record_property):
    """The whole loop on CUDA: the driver feeds core.step_from_picks from verify_picks (K + 1 ids and margins copied to
    the host per pass), and speculative output equals greedy output. Agreement with the CPU run of the same fp16
    folder is recorded, not asserted (fp16 kernels differ between providers)."""
    from ortspec import Options, PromptLookup, generate

    cuda = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda"))
    assert cuda.picks_on_device
    calls = {"verify_picks": 0}
    original = cuda.verify_picks

    def counting(tokens, base):
        calls["verify_picks"] += 1
        return original(tokens, base)

    cuda.verify_picks = counting
    prompt = _tokens(12, cuda.vocab_size, seed=3) * 3
    options = Options(max_tokens=48)
    greedy = generate(cuda, prompt, options)
    spec = generate(cuda, prompt, options, PromptLookup(ngram=3, max_draft=6), draft_width=6)
    assert calls["verify_picks"] == greedy.stats.steps + spec.stats.steps
    assert spec.token_ids == greedy.token_ids
    assert spec.stats.steps <= greedy.stats.steps
    guarded = generate(cuda, prompt, Options(max_tokens=48, tie_margin=1e-3), PromptLookup(), draft_width=6)
    assert guarded.token_ids == greedy.token_ids
    cpu_ids = generate(
        OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cpu", threads=2)), prompt, options
    ).token_ids
    same = sum(a == b for a, b in zip(cpu_ids, greedy.token_ids, strict=False))
    print(f"CUDA vs CPU greedy: {same}/{len(greedy.token_ids)} tokens agree")
    record_property("cuda_vs_cpu_greedy_agreement", f"{same}/{len(greedy.token_ids)}")
