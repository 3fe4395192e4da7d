"""The request schemas of the server's OpenAPI document say exactly what its validation accepts: each request below
is checked against the document (``jsonschema``, as a client or a generator reads it) and sent to the app, in process
on the tiny random model, and the two must agree. Each case is a mismatch the schema fuzzing found (or its kind):
the schema allowed what the server refused, or the other way round.

The declared bounds are checked wholesale too: for every option a request field carries, values on and around its
bounds are valid by the document exactly when the server's validation (the request model, then the options'
declarations, ``core/declare.py``) takes them, with no model in the loop.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import jsonschema  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from ortspec.adapters.engine.surfaces import SAMPLING_OPTIONS, declared  # noqa: E402
from ortspec.adapters.serve import models  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.errors import APIError  # noqa: E402
from ortspec.adapters.serve.run import load_serving  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig  # noqa: E402
from ortspec.core.options import MAX_STOP_LENGTH, MAX_STOPS  # noqa: E402
from ortspec.core.sampling import F32_TINY  # noqa: E402

MODEL = "tiny"
SETTINGS = ServerSettings(model_name=MODEL, measure_at_startup=False, default_max_tokens=4)
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hello"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Paris"}'}}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    with load_serving(tiny_model_dir, BackendConfig(threads=1), max_batch=2) as engine:
        with TestClient(create_app(engine, SETTINGS)) as client:
            yield client


@pytest.fixture(scope="module")
def document(client) -> dict:
    return client.get("/openapi.json").json()


def _validator(document: dict, path: str) -> jsonschema.Draft202012Validator:
    """The request body's schema of ``path``, resolved against the whole document."""
    body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return jsonschema.Draft202012Validator({**body, "components": document["components"]})


def _agree(client, document: dict, path: str, body: dict, *, valid: bool, param: str | None = None) -> dict:
    """``body`` is valid by the document iff ``valid``, and the server answers 200 iff ``valid`` (else a 400 naming
    ``param``, when given). The answer's JSON."""
    full = {"model": MODEL, **body}
    assert _validator(document, path).is_valid(full) is valid, full
    response = client.post(path, json=full)
    assert response.status_code == (200 if valid else 400), response.text
    if not valid and param is not None:
        assert response.json()["error"]["param"] == param, response.text
    return response.json()


# ----------------------------------------------------------------------------------------------------------------
# JSON numbers: an integer is any number without a fraction; a number is a double
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"top_k": 1.5e10},  # the fuzzing's find: refused as "not a valid integer" before
        {"top_k": 5.0},
        {"max_tokens": 2.0},
        {"n": 1.0},
        {"seed": 7.0, "temperature": 0.5},
        {"logprobs": 2.0},
        {"prompt": [5.0, 6, 7.0]},
        {"prompt": [[5.0, 6]]},
    ],
)
def test_an_integral_number_is_an_integer(client, document, fields):
    _agree(client, document, COMPLETIONS, {"prompt": "hello", **fields}, valid=True)


@pytest.mark.parametrize("fields", [{"top_k": 2.5}, {"max_tokens": 2.5}, {"seed": 1.5}, {"prompt": [5.5]}])
def test_a_fraction_is_not_an_integer(client, document, fields):
    _agree(client, document, COMPLETIONS, {"prompt": "hello", **fields}, valid=False)


@pytest.mark.parametrize(
    "fields",
    [
        {"presence_penalty": 10**30},  # an integer past int64 for a number field: refused before
        {"temperature": 10**30, "top_p": 0.5},
        {"logit_bias": {"7": 10**20}},
        {"repetition_penalty": 3},
    ],
)
def test_an_integer_is_a_number(client, document, fields):
    _agree(client, document, COMPLETIONS, {"prompt": "hello", **fields}, valid=True)


def test_a_number_past_the_double_range_is_refused_as_the_document_says(client, document):
    schema = document["components"]["schemas"]["CompletionRequest"]["properties"]["presence_penalty"]
    assert {"type": "number", "format": "double"} in schema["anyOf"]
    body = b'{"model": "tiny", "prompt": "hello", "presence_penalty": 1' + b"0" * 400 + b"}"
    response = client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "presence_penalty"


# ----------------------------------------------------------------------------------------------------------------
# Bounds: the document states each option's declared bounds, and validation applies exactly those
# ----------------------------------------------------------------------------------------------------------------

PROBES = {
    "int": [-1, 0, 1, 2, 5.0, 2**63, 2**64 - 1, 2**64, 1.5e10, 2.5, 1e30],
    "number": [-1e308, -1, -F32_TINY, 0, 0.0, 5e-324, F32_TINY / 2, F32_TINY, 1e-30, 0.5, 1, 1.0000001, 2, 1e308],
}


def _validation_accepts(body: dict) -> bool:
    """Whether the server's validation takes a completion request (the request model on its JSON, then the
    options), short of the model (prompt and vocabulary)."""
    try:
        request = models.CompletionRequest.model_validate_json(json.dumps(body))
        models.prepare_options(request, SETTINGS, context_length=256)
    except (ValidationError, APIError):
        return False
    return True


BOUNDED = [field.name for field, spec in declared([*SAMPLING_OPTIONS, "max_tokens"]) if spec.bounds is not None]


@pytest.mark.parametrize("name", BOUNDED)
def test_the_document_states_exactly_the_declared_bounds(document, name):
    _, spec = declared([name])[0]
    assert spec.bounds is not None
    validator = _validator(document, COMPLETIONS)
    for value in PROBES[spec.bounds.kind]:
        body = {"model": MODEL, "prompt": "hello", name: value}
        assert validator.is_valid(body) is _validation_accepts(body), (name, value)


def test_temperature_is_0_or_at_least_float32s_smallest_normal(client, document):
    for tiny in (5e-324, 2.605966020037836e-125, F32_TINY / 2):
        _agree(client, document, COMPLETIONS, {"prompt": "hi", "temperature": tiny}, valid=False, param="temperature")
    for fine in (0, F32_TINY):
        _agree(client, document, COMPLETIONS, {"prompt": "hi", "temperature": fine}, valid=True)


@pytest.mark.parametrize("name", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_states_its_minimum(client, document, name):
    _agree(client, document, CHAT, {"messages": USER, name: 0}, valid=False, param=name)
    _agree(client, document, CHAT, {"messages": USER, name: 1}, valid=True)


def test_max_tokens_beside_max_completion_tokens_is_held_to_its_minimum_too(client, document):
    """The fuzzing's find: ``max_completion_tokens`` wins, and ``max_tokens: 0`` beside it went unchecked."""
    body = {"messages": USER, "max_completion_tokens": 2, "max_tokens": 0}
    _agree(client, document, CHAT, body, valid=False, param="max_tokens")
    _agree(client, document, CHAT, body | {"max_tokens": 5}, valid=True)


@pytest.mark.parametrize(
    ("stop", "valid", "param"),
    [
        ("", False, "stop"),
        ([""], False, "stop[0]"),
        (["x"] * MAX_STOPS, True, None),
        (["x"] * (MAX_STOPS + 1), False, "stop"),
        ("x" * MAX_STOP_LENGTH, True, None),
        (["x" * (MAX_STOP_LENGTH + 1)], False, "stop[0]"),
        ([], True, None),
    ],
)
def test_stop_states_its_limits(client, document, stop, valid, param):
    _agree(client, document, COMPLETIONS, {"prompt": "hello", "stop": stop}, valid=valid, param=param)


@pytest.mark.parametrize(
    ("key", "valid"), [("7", True), ("0", True), ("07", False), (" 7", False), ("-1", False), ("+7", False)]
)
def test_a_logit_bias_key_is_a_token_id_in_decimal(client, document, key, valid):
    _agree(client, document, COMPLETIONS, {"prompt": "hi", "logit_bias": {key: 1}}, valid=valid, param="logit_bias")


@pytest.mark.parametrize(
    ("prompt", "valid"),
    [("", False), ([], False), (["a", "b"], False), ([[1], [2]], False), ([[]], False), ([-1], False), (["a"], True)],
)
def test_the_prompt_shapes(client, document, prompt, valid):
    _agree(client, document, COMPLETIONS, {"prompt": prompt}, valid=valid)


# ----------------------------------------------------------------------------------------------------------------
# Chat messages: each role its own fields
# ----------------------------------------------------------------------------------------------------------------


def test_a_tool_turn_with_tool_calls_is_refused_by_the_document_too(client, document):
    """The fuzzing's find: a ``tool`` message carrying ``tool_calls`` was valid by the document (one message schema
    for every role) and refused by the server."""
    turn = {"role": "tool", "content": "sunny", "tool_call_id": "call_1", "tool_calls": [CALL]}
    answer = _agree(client, document, CHAT, {"messages": [*USER, turn]}, valid=False, param="messages[1].tool_calls")
    assert "tool message" in answer["error"]["message"]


@pytest.mark.parametrize(
    ("turn", "valid", "param"),
    [
        ({"role": "assistant", "tool_calls": [CALL]}, True, None),  # content left out with calls
        ({"role": "assistant", "content": None, "tool_calls": [CALL], "refusal": None}, True, None),  # a response's
        ({"role": "assistant", "content": "hi", "refusal": None, "tool_calls": None}, True, None),
        ({"role": "assistant"}, False, "messages[1]"),
        ({"role": "assistant", "content": None, "tool_calls": []}, False, "messages[1].tool_calls"),
        ({"role": "user", "content": "x", "tool_call_id": "call_1"}, False, "messages[1].tool_call_id"),
        ({"role": "system", "content": None}, False, "messages[1].content"),
        ({"role": "tool", "content": "sunny"}, False, "messages[1].tool_call_id"),
        ({"role": "wizard", "content": "hi"}, False, "messages[1].role"),
    ],
)
def test_each_role_has_its_own_fields(client, document, turn, valid, param):
    _agree(client, document, CHAT, {"messages": [*USER, turn]}, valid=valid, param=param)


def test_a_string_that_is_not_unicode_text_is_a_400_naming_it(client):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}'
    response = client.post(CHAT, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text  # was a 500 from the tokenizer
    assert response.json()["error"]["param"] == "messages[0].content"


# ----------------------------------------------------------------------------------------------------------------
# response_format and tools: their shapes, and the rules between fields
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response_format", "valid"),
    [
        ({"type": "text"}, True),
        ({"type": "json_object"}, True),
        ({"type": "regex", "regex": "(yes|no)"}, True),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": None}}, True),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": True}}, False),  # llguidance's refusal
        ({"type": "json_schema", "json_schema": {"name": "", "schema": {}}}, False),
        ({"type": "json_schema", "json_schema": {"name": "x"}}, False),
        ({"type": "regex"}, False),
        ({"type": "regex", "regex": ""}, False),
        ({"type": "text", "regex": "x"}, False),
        ({"type": "yaml"}, False),
    ],
)
def test_response_format_shapes(client, document, response_format, valid):
    answer = _agree(client, document, CHAT, {"messages": USER, "response_format": response_format}, valid=valid)
    assert valid or answer["error"]["param"].startswith("response_format")  # the field, or the part of it at fault


@pytest.mark.parametrize(
    ("fields", "valid", "param"),
    [
        ({"top_logprobs": 2}, False, "top_logprobs"),
        ({"top_logprobs": 2, "logprobs": True}, True, None),
        ({"top_logprobs": None}, True, None),
        ({"tool_choice": "none"}, False, "tool_choice"),
        ({"tool_choice": None}, True, None),
        ({"tools": [TOOL], "tool_choice": "none", "response_format": {"type": "json_object"}}, True, None),
        ({"tools": [TOOL], "tool_choice": "auto", "response_format": {"type": "json_object"}}, False, None),
        ({"tools": [TOOL], "response_format": {"type": "regex", "regex": "a"}}, False, "response_format"),
        ({"tools": [TOOL], "tool_choice": "none", "response_format": {"type": "text"}}, True, None),
        ({"tools": []}, False, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, False, "tools[0].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, False, None),
    ],
)
def test_the_rules_between_fields_are_in_the_document(client, document, fields, valid, param):
    _agree(client, document, CHAT, {"messages": USER, **fields}, valid=valid, param=param)
