"""The server answers only what its OpenAPI document declares: Schemathesis fuzzes every route from the app's own
``/openapi.json``, in process (the ASGI app, no sockets), on the tiny random model (one worker, speculation on by
default as ``ortspec serve``), and checks each answer: never a 5xx, every status declared for its route, every body
(JSON, or each server-sent event's data) valid against the declared schema, every content type declared.

Half the cases are positive (valid by the schema), half negative (wrong types, missing or unknown fields, not JSON);
3 in 4 bodies are made to name the served model (``_serving``), so they reach the Engine; the rest keep whatever
Schemathesis wrote (404). Bounded for the suite: ``EXAMPLES`` (500) examples per route, derandomized (the same
requests on every run): about 10 s of CPU here for the two generation routes, 20 s for the file with the tiny
model's build. A larger run: ``ORTSPEC_FUZZ_EXAMPLES=6000 python -m pytest tests/test_openapi_fuzz.py`` (examples per
route; about 130 requests per CPU second on the tiny model, so about 50 s per generation route, plus Hypothesis's
shrinking of whatever it finds).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from ortspec.adapters.engine import Engine  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig  # noqa: E402

MODEL = "tiny"
EXAMPLES = int(os.environ.get("ORTSPEC_FUZZ_EXAMPLES", "500"))
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance, content_type_conformance]


OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]


def _serving(case_and_draw: tuple[schemathesis.Case, int]) -> schemathesis.Case:
    """The generated case, its body naming the served model unless the draw is 0 (or the body has no string
    ``model``: a negative case's wrong type stays)."""
    case, draw = case_and_draw
    if draw and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body = case.body | {"model": MODEL}
    return case


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """The default server's Engine: one batched Engine (``ortspec serve``'s ``load_serving``), 2 slots."""
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), prefix_reuse=True, batch_slots=2)


@pytest.fixture
def api(engine):
    """A fresh app's schema, read from its ``/openapi.json``; requests go to the app in process (the batched pool,
    as ``ortspec serve`` runs by default). One app per test: Schemathesis ends the app's lifespan (which closes its
    pool) when the test that started it ends."""
    settings = ServerSettings(model_name=MODEL, measure_at_startup=False, default_max_tokens=16)
    app = create_app([engine], settings, batch=engine.batch_backend())
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_the_document_declares_every_route(api):
    assert sorted((op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_answer_is_declared_in_the_openapi_document(api, method, path):
    operation = api[path][method]
    cases = st.one_of(operation.as_strategy(mode) for mode in GenerationMode)

    @given(st.tuples(cases, st.integers(0, 3)).map(_serving))
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    def fuzz(case: schemathesis.Case) -> None:
        case.call_and_validate(checks=CHECKS)

    fuzz()


# What the fuzzing found, kept as requests: each was a 500 ("generation failed": a non-finite logits row, or an
# empty window) before the sampling processors saturated within float32's range (core/sampling.py).
FOUND = [
    ({"prompt": "busy", "temperature": 600.0, "seed": 413, "repetition_penalty": 5e-324}, 400),  # 0 in float32
    ({"prompt": "\xad", "temperature": 2.605966020037836e-125}, 400),  # 0 in float32
    ({"prompt": "\u00c5#", "repetition_penalty": 1.5694863358611497e-171}, 400),  # below float32's smallest normal
    ({"prompt": "hello hello", "repetition_penalty": 1.2e-38}, 200),
    ({"prompt": "hello", "presence_penalty": -1.7e308, "frequency_penalty": 1.7e308, "max_tokens": 8}, 200),
    ({"prompt": "hello", "logit_bias": {"7": 1.7e308}, "temperature": 1.0, "max_tokens": 4}, 200),
]


@pytest.mark.parametrize(("body", "status"), FOUND)
def test_what_the_fuzzing_found_is_answered_as_declared(api, body, status):
    case = api["/v1/completions"]["POST"].Case(body={"model": MODEL} | body, media_type="application/json")
    response = case.call_and_validate(checks=CHECKS)
    assert response.status_code == status, response.text
    if status == 400:
        assert response.json()["error"]["param"] in body
