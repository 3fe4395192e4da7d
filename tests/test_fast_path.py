"""The fast CUDA path's parts that run on a CPU, and its CUDA checks (marked ``cuda``, skipped without a GPU).

On the CPU: the static-shape binding (``BackendConfig(static_shapes=True)``: mask ``[1, max_length]``, the length in
its values) gives the logits of the default binding bit for bit, passes of one width keep one binding and fixed
addresses, the graph-per-width bookkeeping and the eager fallback behave on a recording fake session, the timing
hook adds up, and a decode loop allocates nothing vocab-sized per step. Self-contained (no conftest fixtures), so
``scripts/gpu_check.sh`` can run its ``cuda`` tests with ``--noconftest``.
"""

from __future__ import annotations

import importlib.util
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from ortspec import Options, PromptLookup, generate
from ortspec.backends.base import BackendError
from ortspec.backends.onnx import BackendConfig, OrtBackend
from ortspec.backends.onnx.arrays import ConversionBuffer, HostArrays
from ortspec.backends.onnx.cuda_graphs import EAGER, ORT_WARMUP_RUNS, GraphBook, PhaseTimer


def _have(*modules: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in modules)


def _builder_available() -> bool:
    return _have("torch", "transformers", "onnx", "onnxruntime_genai")


def _tiny(tmp_path_factory, name: str, **kwargs) -> Path:
    if not _builder_available():
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    from tests.support.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp(name) / name, **kwargs)


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "fast-fp32")


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory) -> Path:
    return _tiny(tmp_path_factory, "fast-fp16", precision="fp16", execution_provider="cuda")


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory) -> Path:
    """SmolLM2's 49,152-wide vocabulary on a 1-layer, 64-wide body: a row is 192 KB, so a per-step row
    allocation would stand out."""
    return _tiny(tmp_path_factory, "fast-wide", layers=1, vocab=49152)


def _tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, vocab, size=n)]


def _passes(b: OrtBackend, toks: list[int]) -> list[np.ndarray]:
    """Rows from a mix of passes: a chunked prefill, verify passes of several widths, rewinds, plain steps."""
    out = [b.decode(toks[:30], 0).copy()]
    for width in (1, 2, 5, 9, 17):
        out.append(b.decode_verify(toks[30 : 30 + width], 30).copy())
        b.rewind(30)
    out.append(b.decode(toks[30:31], 30).copy())
    out.append(b.decode(toks[31:33], 31).copy())  # a 2-token decode
    b.rewind(20)
    out.append(b.decode_verify(toks[20:28], 20).copy())
    ids, margins = b.verify_picks(toks[28:40], 28)
    out += [ids.astype(np.float32), margins]
    b.reset()
    out.append(b.decode(toks[:3], 0).copy())
    return out


# -------------------------------------------------------------------------------------------------------------
# static shapes on the CPU


@pytest.mark.parametrize("which", ["fp32", "fp16"])
def test_static_shapes_give_the_default_bindings_logits_bit_for_bit(which, fp32_dir, fp16_dir):
    folder = fp32_dir if which == "fp32" else fp16_dir
    default = OrtBackend.from_folder(folder, BackendConfig(threads=1, prefill_chunk=8))
    static = OrtBackend.from_folder(folder, BackendConfig(threads=1, prefill_chunk=8, static_shapes=True))
    assert static.static_shapes and not default.static_shapes and not static.stream_ordered
    toks = _tokens(60, default.vocab_size, seed=3)
    for a, b in zip(_passes(default, toks), _passes(static, toks), strict=True):
        assert a.shape == b.shape
        assert np.array_equal(a, b, equal_nan=True)


def test_static_shapes_generation_equals_default(fp32_dir):
    default = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1))
    static = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, static_shapes=True))
    prompt = _tokens(12, default.vocab_size, seed=5) * 3
    options = Options(max_tokens=40)
    greedy = generate(default, prompt, options)
    for backend in (default, static):
        for proposer in (None, PromptLookup(ngram=2, max_draft=8)):
            assert generate(backend, prompt, options, proposer, draft_width=8).token_ids == greedy.token_ids


def test_static_passes_keep_one_binding_and_fixed_addresses(fp32_dir):
    b = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, static_shapes=True))
    toks = _tokens(40, b.vocab_size, seed=7)
    b.decode(toks[:10], 0)
    b.decode_verify(toks[10:14], 10)
    static = b.static_binding
    assert static is not None
    first = {count: (p.binding, p.run_options) for count, p in static.passes.items()}
    ptr = b.array_module.ptr
    ids_at, logits_at, mask_at = ptr(b.rows.ids), ptr(b.rows.logits), ptr(static.mask)
    b.rewind(10)
    b.decode_verify(toks[10:14], 10)
    b.decode(toks[14:24], 14)
    assert {c: (p.binding, p.run_options) for c, p in static.passes.items() if c in first} == first
    assert (ptr(b.rows.ids), ptr(b.rows.logits), ptr(static.mask)) == (ids_at, logits_at, mask_at)
    # the mask holds ones up to the length of the last pass, zeros after
    mask = np.asarray(static.mask)
    assert mask[:24].all() and not mask[24:].any() and static.mask_ones == 24
    b.rewind(5)
    b.decode(toks[5:6], 5)
    assert mask[:6].all() and not mask[6:].any()


def test_static_shapes_refused_where_the_graph_cannot_take_them(fp32_dir):
    with pytest.raises(BackendError, match="static shapes are not possible.*shared past/present buffer"):
        OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, share_buffer=False, static_shapes=True))
    with pytest.raises(ValueError, match="cuda_graphs=True needs provider='cuda'"):
        OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, cuda_graphs=True))


# -------------------------------------------------------------------------------------------------------------
# CUDA graph bookkeeping


def test_graph_book_ids_capture_and_disable():
    book = GraphBook(max_tokens=4)
    assert [book.graph_id(c) for c in (0, 1, 4, 5, 256)] == [EAGER, 1, 4, EAGER, EAGER]
    assert book.runs_to_capture(3) == ORT_WARMUP_RUNS + 1 and not book.captured(3)
    for _ in range(ORT_WARMUP_RUNS + 1):
        book.record(3)
    book.record(9)  # eager widths are not counted
    assert book.captured(3) and book.runs_to_capture(3) == 0 and book.runs == {3: ORT_WARMUP_RUNS + 1}
    book.disable("because")
    assert book.graph_id(3) == EAGER and not book.captured(3)
    assert book.summary()["disabled_reason"] == "because"
    with pytest.raises(ValueError):
        GraphBook(0)


class RecordingSession:
    """A real CPU session behind ONNX Runtime's CUDA graph rules, as far as the caller can see them: it records
    each run's ``gpu_graph_id`` and counts runs per id, and can fail the run that would capture a given id (as a
    kernel that synchronises during capture would). The CPU provider ignores the graph ids, so the rows are the
    eager rows."""

    def __init__(self, inner, fail_capture_of: int | None = None) -> None:
        self.inner = inner
        self.fail_capture_of = fail_capture_of
        self.graph_ids: list[int] = []
        self.runs: dict[int, int] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run_with_iobinding(self, binding, run_options=None):
        graph_id = int(run_options.get_run_config_entry("gpu_graph_id")) if run_options is not None else EAGER
        self.graph_ids.append(graph_id)
        if graph_id != EAGER:
            self.runs[graph_id] = self.runs.get(graph_id, 0) + 1
            if graph_id == self.fail_capture_of and self.runs[graph_id] == ORT_WARMUP_RUNS + 1:
                raise RuntimeError("operation not permitted when stream is capturing (simulated)")
        return self.inner.run_with_iobinding(binding, run_options)


def _graph_backend(folder: Path, fail_capture_of: int | None = None) -> tuple[OrtBackend, RecordingSession, list]:
    plain = OrtBackend.from_folder(folder, BackendConfig(threads=1))
    session = RecordingSession(plain.session, fail_capture_of)
    reopened: list = []

    def reopen():
        fresh = OrtBackend.from_folder(folder, BackendConfig(threads=1)).session
        reopened.append(fresh)
        return fresh

    # a CUDA configuration on host arrays: the graph bookkeeping and the eager fallback, run on the CPU
    config = BackendConfig(provider="cuda", prefill_chunk=16, cuda_graphs=True, graph_max_tokens=5)
    b = OrtBackend(session, plain.folder, config, arrays=HostArrays(), reopen_session=reopen)
    return b, session, reopened


def test_graph_ids_per_width_and_capture_up_front(fp32_dir):
    b, session, reopened = _graph_backend(fp32_dir)
    assert b.static_shapes and b.graphs is not None and b.rows.capacity >= 16
    summary = b.capture_graphs()
    assert summary["enabled"] and summary["captured_widths"] == [1, 2, 3, 4, 5]
    assert session.runs == {w: ORT_WARMUP_RUNS + 1 for w in range(1, 6)} and b.current_len() == 0
    session.graph_ids.clear()
    toks = _tokens(40, b.vocab_size, seed=11)
    reference = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, prefill_chunk=16))
    assert np.array_equal(b.decode(toks[:20], 0), reference.decode(toks[:20], 0))  # chunks of 16 and 4
    assert session.graph_ids == [EAGER, 4]
    for width in (1, 3, 5, 6):
        assert np.array_equal(
            b.decode_verify(toks[20 : 20 + width], 20), reference.decode_verify(toks[20:26][:width], 20)
        )
        b.rewind(20)
        reference.rewind(20)
    assert session.graph_ids[2:] == [1, 3, 5, EAGER]
    assert not reopened and b.graphs.enabled


def test_a_failed_capture_falls_back_to_eager_and_the_rows_stay_right(fp32_dir, caplog):
    b, session, reopened = _graph_backend(fp32_dir, fail_capture_of=2)
    reference = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, prefill_chunk=16))
    toks = _tokens(40, b.vocab_size, seed=13)
    assert np.array_equal(b.decode(toks[:12], 0), reference.decode(toks[:12], 0))
    for _ in range(ORT_WARMUP_RUNS + 2):  # the third run of width 2 would capture: it fails, the backend reopens
        assert np.array_equal(b.decode_verify(toks[12:14], 12), reference.decode_verify(toks[12:14], 12))
        b.rewind(12)
        reference.rewind(12)
    assert len(reopened) == 1 and b.session is reopened[0]
    assert b.graphs is not None and not b.graphs.enabled and "gpu_graph_id=2" in b.graphs.disabled_reason
    assert "giving up CUDA graphs" in caplog.text
    assert b.capture_graphs()["enabled"] is False  # and it resets the backend
    b.decode(toks[:12], 0)
    ids, _ = b.verify_picks(toks[12:20], 12)
    assert (ids == reference.decode_verify(toks[12:20], 12).argmax(axis=1)).all()


def test_growing_the_logits_buffer_gives_up_graphs_first(fp32_dir):
    b, _, reopened = _graph_backend(fp32_dir)
    b.capture_graphs([1])
    toks = _tokens(40, b.vocab_size, seed=17)
    b.decode(toks[:2], 0)
    rows = b.decode_verify(toks[2:30], 2)  # 28 rows > the 16-row buffer
    assert rows.shape == (28, b.vocab_size) and len(reopened) == 1 and not b.graphs.enabled
    assert "logits buffer grew" in b.graphs.disabled_reason


# -------------------------------------------------------------------------------------------------------------
# timing hook and allocations


def test_phase_timer_adds_up_each_pass(fp32_dir):
    b = OrtBackend.from_folder(fp32_dir, BackendConfig(threads=1, static_shapes=True))
    timer = PhaseTimer()
    b.timer = timer
    toks = _tokens(20, b.vocab_size, seed=23)
    b.decode(toks[:10], 0)
    for _ in range(3):
        b.verify_picks(toks[10:14], 10)
        b.rewind(10)
    assert dict(timer.passes) == {10: 1, 4: 3}
    per = timer.per_pass(4)
    assert per["run"] > 0 and per["host"] > 0 and per["readback"] > 0
    assert per["total"] == pytest.approx(per["host"] + per["run"] + per["sync"] + per["readback"])
    b.timer = None
    b.verify_picks(toks[10:14], 10)
    assert timer.passes[4] == 3


def test_conversion_buffer_grows_only_for_more_rows():
    made = []
    buffer = ConversionBuffer(lambda n: made.append(n) or np.empty(n, np.float32))
    a = buffer.rows(3, 10)
    b = buffer.rows(2, 10)
    c = buffer.rows(9, 10)
    d = buffer.rows(1, 10)
    assert a.shape == (3, 10) and b.shape == (2, 10) and c.shape == (9, 10) and d.shape == (1, 10)
    assert made == [30, 90] and buffer.grown == 2
    out = np.empty(5, np.float32)
    HostArrays().download(np.arange(5, dtype=np.float16), out)  # a dtype change into an existing array
    assert out.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("static", [False, True])
def test_a_decode_loop_allocates_nothing_vocab_sized_per_step(wide_dir, static):
    b = OrtBackend.from_folder(wide_dir, BackendConfig(threads=1, static_shapes=static))
    row_bytes = b.vocab_size * 4
    toks = _tokens(80, b.vocab_size, seed=29)
    b.decode(toks[:16], 0)
    b.decode_verify(toks[16:25], 16)  # warm-up: first use of each width
    b.rewind(16)
    b.decode(toks[16:17], 16)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(17, 57):
            b.decode(toks[i : i + 1], i)
            if i % 8 == 0:
                b.decode_verify(toks[i + 1 : i + 10], i + 1)
                b.rewind(i + 1)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert peak < row_bytes // 2, f"{peak} bytes traced during the loop (a row is {row_bytes})"


# -------------------------------------------------------------------------------------------------------------
# CUDA (scripts/gpu_check.sh)


def _cuda_ready() -> str | None:
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


@pytest.fixture(scope="module")
def cuda_dir(tmp_path_factory) -> Path:
    why = _cuda_ready()
    if why:
        pytest.skip(why)
    given = os.environ.get("ORTSPEC_CUDA_TINY_MODEL")
    if given:
        return Path(given)
    return _tiny(tmp_path_factory, "fast-cuda", precision="fp16", execution_provider="cuda")


def _cuda_array_modules() -> list[str]:
    return [m for m in ("cupy", "torch") if _have(m)] or ["cupy"]


@pytest.mark.cuda
@pytest.mark.parametrize("array_module", _cuda_array_modules())
def test_cuda_static_and_graphs_match_the_default_path(cuda_dir, array_module):
    default = OrtBackend.from_folder(
        cuda_dir, BackendConfig(provider="cuda", array_module=array_module, prefill_chunk=8)
    )
    static = OrtBackend.from_folder(
        cuda_dir, BackendConfig(provider="cuda", array_module=array_module, prefill_chunk=8, static_shapes=True)
    )
    graphs = OrtBackend.from_folder(
        cuda_dir, BackendConfig(provider="cuda", array_module=array_module, prefill_chunk=8, cuda_graphs=True)
    )
    assert static.stream_ordered and graphs.stream_ordered and graphs.graphs is not None
    summary = graphs.capture_graphs()
    print(f"[{array_module}] graphs: {summary}")
    toks = _tokens(60, default.vocab_size, seed=31)
    rows = {name: _passes(b, toks) for name, b in (("default", default), ("static", static), ("graphs", graphs))}
    worst_static = 0.0
    for a, s, g in zip(rows["default"], rows["static"], rows["graphs"], strict=True):
        # graph replays run the static path's kernels on the same inputs: identical
        assert np.array_equal(s, g, equal_nan=True)
        worst_static = max(worst_static, float(np.nanmax(np.abs(a - s))))
    print(f"[{array_module}] max |default - static| = {worst_static:.3g}")
    assert worst_static <= 2e-2  # the prompt pass takes GroupQueryAttention's other (non first-prompt) route
    # picks (the ids rows of _passes) agree everywhere
    assert np.array_equal(rows["default"][-3], rows["static"][-3])
    assert summary["enabled"], f"CUDA graphs fell back: {summary['disabled_reason']}"


@pytest.mark.cuda
def test_cuda_graphs_speculative_equals_greedy_via_device_picks(cuda_dir):
    b = OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda", cuda_graphs=True))
    b.capture_graphs()
    prompt = _tokens(12, b.vocab_size, seed=3) * 3
    options = Options(max_tokens=48)
    greedy = generate(b, prompt, options)
    spec = generate(b, prompt, options, PromptLookup(ngram=3, max_draft=6), draft_width=6)
    eager = generate(OrtBackend.from_folder(cuda_dir, BackendConfig(provider="cuda")), prompt, options)
    assert spec.token_ids == greedy.token_ids
    print(
        f"graphs: {b.graphs.summary() if b.graphs else None}; eager greedy agreement: "
        f"{sum(x == y for x, y in zip(greedy.token_ids, eager.token_ids, strict=True))}/{len(greedy.token_ids)}"
    )
    assert b.graphs is not None and b.graphs.enabled
