"""Shared fixtures: a tiny random-weight model folder (same layout as the real one) and the real SmolLM2 folder."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

# The repository root, for the tests' support code (tests.support) under a bare `pytest` too (`python -m pytest`
# from the root has it already). Appended, not prepended: the root's ortspec/ must not shadow the installed package.
sys.path.append(str(Path(__file__).resolve().parent.parent))


def _builder_available() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("torch", "transformers", "onnx", "onnxruntime_genai"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with GQA, built by the onnxruntime-genai builder, with a small BPE tokenizer."""
    if not _builder_available():
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    from tests.support.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-shared") / "tiny-fp32")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """SmolLM2-135M-Instruct fp32, converted on first use into the ortspec cache (about a minute), then reused."""
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir("fp32")
    if not is_complete(folder):
        if not _builder_available():
            pytest.skip("converting the real model needs the convert extra: pip install 'ortspec[convert]'")
        convert_smollm2(folder, "fp32")
    return folder


@pytest.fixture(scope="session")
def real_engine(real_model_dir):
    from ortspec.adapters.engine import Engine
    from ortspec.backends.onnx import BackendConfig

    return Engine.from_dir(real_model_dir, BackendConfig(threads=2))
