"""The server answers only what its OpenAPI document declares, and accepts exactly what it declares: Schemathesis
fuzzes every route from the app's own ``/openapi.json``, in process (the ASGI app, no sockets), on the tiny random
model (the Engine ``ortspec serve`` opens, speculation on by default as there), and checks each answer:

- never a 5xx; every status declared for its route; every body (JSON, or each server-sent event's data) valid
  against the declared schema; every content type declared;
- a request valid by the schema (a positive case) is answered 200, or refused for one of the reasons the document
  lists as beyond any schema (``openapi.BEYOND_SCHEMA``: ``REFUSALS`` below tells each by its ``param`` and
  message), or 404 when it names another model;
- a request the schema refuses (a negative case: a wrong type, a missing or unknown field, a value out of range, a
  broken rule between fields, not JSON) is refused with a 4xx (Schemathesis's ``negative_data_rejection``).

15 in 16 bodies are made to name the served model (``_serving``), so they reach the Engine; the rest keep whatever
Schemathesis wrote (404). The model has a 1024-token context, so a request with tools (their system turn alone is
over 300 tokens) reaches the constraint compiler too.

A positive case the document itself refuses (the generator's rounding at a bound: ``seed`` 2**64 against
``exclusiveMaximum`` 2**64) is held to a 4xx instead: the document, read by ``jsonschema``, decides.

Bounded for the suite: ``EXAMPLES`` (120) examples per route, about half positive, derandomized (the same requests
on every run): about 40 s for the file on 2 cores, the model's build (10 s) included. A larger run:
``ORTSPEC_FUZZ_EXAMPLES=4000 python -m pytest tests/test_openapi_fuzz.py`` (examples per route: about 3.5 min for
completions and 5 min for chat, plus Hypothesis's shrinking of whatever it finds).
"""

from __future__ import annotations

import importlib.util
import os
import re

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import jsonschema  # noqa: E402
import schemathesis  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.openapi import BEYOND_SCHEMA  # noqa: E402
from ortspec.adapters.serve.run import load_serving  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig  # noqa: E402

MODEL = "tiny"
EXAMPLES = int(os.environ.get("ORTSPEC_FUZZ_EXAMPLES", "120"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    response_schema_conformance,
    content_type_conformance,
    negative_data_rejection,
]

OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("GET", "/v1/models"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
]

# Each refusal of ``BEYOND_SCHEMA`` as its 400 says it: the ``param`` it names and its message.
REFUSALS: dict[str, tuple[str, str]] = {
    "context": (r"prompt|messages", r".*: the prompt has \d+ tokens but the model's context is \d+"),
    "vocabulary": (r"prompt|logit_bias", r".* outside the vocabulary .*"),
    "empty_prompt": (r"prompt|messages", r".*the prompt is empty: it must encode to at least one token"),
    # llguidance's verdict, not the Engine's own shape check of a response_format (ResponseFormat.parse: the schema
    # states that shape, so none of its messages may come back)
    "constraint": (
        r"response_format",
        r"response_format: (?!type must be one of|unrecognized field|type '\w+' needs the field"
        r"|\w+ must be a non-empty string|json_schema must be|json_schema: unrecognized field"
        r"|json_schema\.(name|strict|schema) (must|is not)).*",
    ),
    "tools": (r"tools", r"(tools: )?tools\[\d+\]\.function\.(parameters: .*|name: .* is given twice)"),
    "tool_choice": (r"tool_choice", r"tool_choice: function .* is not one of the tools"),
    "call_arguments": (r"messages", r"messages\[\d+\]\.tool_calls\[\d+\]\.function\.arguments: not JSON .*"),
    "unicode": (r".*", r".*: holds an unpaired surrogate .*"),
}


def _beyond_schema(error: dict) -> str | None:
    """Which documented refusal beyond the schema a 400's error object is, if it is one."""
    for name, (param, message) in REFUSALS.items():
        if re.fullmatch(param, error.get("param") or "") and re.fullmatch(message, error["message"], re.DOTALL):
            return name
    return None


def _accepted_as_declared(case: schemathesis.Case, response) -> None:
    """A positive case's answer: 200, a 404 for another model, or a refusal the document lists as beyond the
    schema; anything else is a request the schema allows and the server refuses."""
    if response.status_code == 200:
        return
    body = case.body if isinstance(case.body, dict) else {}
    if response.status_code == 404 and body.get("model") != MODEL:
        return
    error = response.json().get("error", {}) if response.status_code == 400 else {}
    assert response.status_code == 400 and _beyond_schema(error) is not None, (
        f"a request valid by the schema was refused: {response.status_code} {response.text}\nrequest: {case.body!r}"
    )


def _body_schema(document: dict, path: str) -> jsonschema.Draft202012Validator:
    """The request body's schema of ``path`` in the document: what decides whether a case is valid (a generated
    positive case is, but for the generator's rounding at a bound)."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": document["components"]})


def _serving(case_and_draw: tuple[schemathesis.Case, int]) -> schemathesis.Case:
    """The generated case, its body naming the served model unless the draw is 7 (1 in 16 by the draw's range; not
    0, which Hypothesis draws far more often), or the body has no string ``model`` (a negative case's wrong type
    stays)."""
    case, draw = case_and_draw
    if draw != 7 and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body = case.body | {"model": MODEL}
    return case


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The Engine ``ortspec serve`` opens (``load_serving``), 2 slots, on a tiny model with a 1024-token context
    (room for the tools' system turn)."""
    if not all(importlib.util.find_spec(m) for m in ("torch", "transformers", "onnx", "onnxruntime_genai")):
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    from tests.support.models import make_tiny_model

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-1k") / "tiny-fp32", context=1024)
    with load_serving(folder, BackendConfig(threads=1), max_batch=2) as engine:
        yield engine


@pytest.fixture
def api(engine):
    """A fresh app's schema, read from its ``/openapi.json``; requests go to the app in process. One app per test:
    Schemathesis ends the app's lifespan when the test that started it ends (the Engine stays open)."""
    settings = ServerSettings(model_name=MODEL, measure_at_startup=False, default_max_tokens=16)
    return schemathesis.openapi.from_asgi("/openapi.json", create_app(engine, settings))


def test_the_document_declares_every_route(api):
    assert sorted((op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()) == sorted(OPERATIONS)


def test_the_refusals_told_apart_here_are_the_documented_ones():
    assert set(REFUSALS) == set(BEYOND_SCHEMA)


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_every_answer_is_declared_in_the_openapi_document(api, method, path):
    operation = api[path][method]
    cases = st.one_of(operation.as_strategy(mode) for mode in GenerationMode)
    body = _body_schema(api.raw_schema, path) if method == "POST" else None

    @given(st.tuples(cases, st.integers(0, 15)).map(_serving))
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call_and_validate(checks=CHECKS)
        if case.meta is not None and case.meta.generation.mode.is_positive:
            if body is None or body.is_valid(case.body):
                _accepted_as_declared(case, response)
            else:  # the generator's slip (2**64 for seed's exclusiveMaximum 2**64): invalid, so refused
                assert 400 <= response.status_code < 500, response.text

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
