"""Tools (``tools``, ``tool_choice``, ``parallel_tool_calls``): the values they take and refuse, the trained call
format (written, read whole and read as a stream), the prompt (the trained format, or a template that takes
``tools``), the constraint on a tiny model with a real BPE tokenizer (every choice: calls obey the schemas,
speculative == plain, batched == alone), the server through the official ``openai`` client (non-stream and stream,
a follow-up turn with the tool's result, bad tools a 400 naming the field), and the real model (marked real_model).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ortspec.adapters.engine import Engine, GenerationOptions
from ortspec.adapters.engine import tool_format as fmt
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.engine.tools import Named, ToolUse, parse_tool_choice, parse_tools
from ortspec.backends.onnx import BackendConfig
from ortspec.core import FinishReason

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
CALLS_TEXT = '{"city":"Paris","days":3}'


def _valid(name: str, arguments: str) -> bool:
    """Whether ``arguments`` (JSON text) obey the schema of ``name`` (the two schemas above, checked by hand)."""
    args = json.loads(arguments)
    if name == "get_time":
        return set(args) == {"zone"} and args["zone"] in ("utc", "cet")
    days = args.get("days")
    return (
        name == "get_weather"
        and set(args) == {"city", "days"}
        and isinstance(args["city"], str)
        and len(args["city"]) <= 12
        and isinstance(days, int)
        and 1 <= days <= 7
    )


def _called(name: str, arguments: str) -> dict:
    """An assistant turn that called ``name``."""
    call = {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


FOLLOW_UP = [*ASK, _called("get_weather", CALLS_TEXT), {"role": "tool", "tool_call_id": "c", "content": "sunny"}]


# -- the values -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "argument", "match"),
    [
        ({"tools": []}, "tools", "non-empty list"),
        ({"tools": "[nope"}, "tools", "not valid JSON"),
        ({"tools": [{"type": "function"}]}, "tools", r"tools\[0\]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", r"tools\[0\].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools",
            "object",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]},
            "tools",
            "unrecognized field 'extra'",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "expected one of"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "'nope'"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "tools"),
    ],
)
def test_bad_tools_name_the_field(options, argument, match):
    with pytest.raises(ValueError, match=match) as info:
        GenerationOptions(**options).tool_use()
    assert info.value.argument == argument  # type: ignore[attr-defined]


def test_tool_values():
    functions = parse_tools(json.dumps(TOOLS))
    assert functions is not None and [f.name for f in functions] == ["get_weather", "get_time"]
    assert parse_tool_choice({"type": "function", "function": {"name": "get_time"}}) == Named("get_time")
    assert ToolUse.of(functions, None, True) == ToolUse(functions, "auto", None, True)
    named = ToolUse.of(functions, Named("get_time"), True)
    assert named is not None and named.choice == "function" and not named.several  # one call of that function
    none = ToolUse.of(functions, "none", True)
    assert none is not None and not none.calls and none.definitions() is None
    assert none.read("<tool_call>[") == fmt.Reply("<tool_call>[", (), False)  # "none": text, whatever it says
    assert GenerationOptions(tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}).tools


# -- the format -----------------------------------------------------------------------------------------------------


CALLS = [("get_weather", CALLS_TEXT), ("get_time", '{"zone": "utc"}')]


def test_calls_are_written_in_the_trained_format_and_read_back_whole_or_piece_by_piece():
    text = fmt.calls_text(CALLS)
    assert text == (
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}},\n'
        '{"name": "get_time", "arguments": {"zone": "utc"}}\n]</tool_call>'
    )
    reply = fmt.read_reply(text)
    assert reply.content is None and reply.complete
    assert [(c.name, json.loads(c.arguments)) for c in reply.calls] == [(n, json.loads(a)) for n, a in CALLS]
    assert all(c.id.startswith("call_") for c in reply.calls) and reply.calls[0].id != reply.calls[1].id
    # A stream, one character at a time: the same calls; each call starts once with its name, then arguments.
    reader = fmt.CallReader()
    pieces = [p for ch in text for p in reader.feed(ch)] + reader.finish()
    starts = [p for p in pieces if isinstance(p, fmt.CallPiece) and p.name is not None]
    assert [p.name for p in starts] == ["get_weather", "get_time"] and reader.complete
    for index, call in enumerate(reply.calls):
        args = "".join(p.arguments for p in pieces if isinstance(p, fmt.CallPiece) and p.index == index)
        assert args == call.arguments
    # Text (even text that starts like a call), and a call cut short.
    assert fmt.read_reply("<tool") == fmt.Reply("<tool", (), False)
    assert fmt.read_reply('a "quoted" {brace}') == fmt.Reply('a "quoted" {brace}', (), False)
    cut = fmt.read_reply(text[:70])
    assert cut.content is None and not cut.complete and cut.calls[0].arguments == '{"city": "Paris", "d'


def test_a_string_holding_braces_and_quotes_does_not_end_the_arguments():
    text = fmt.calls_text([("get_weather", json.dumps({"city": 'a"}]\\', "days": 1}))])
    (call,) = fmt.read_reply(text).calls
    assert json.loads(call.arguments) == {"city": 'a"}]\\', "days": 1}


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-999, 999) | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=60, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.from_regex(r"[a-zA-Z0-9_-]{1,8}", fullmatch=True), st.dictionaries(st.text(max_size=4), _JSON)),
        min_size=1,
        max_size=3,
    ),
    cuts=st.lists(st.integers(0, 400), max_size=8),
)
def test_any_calls_read_back_the_same_whole_or_in_any_pieces(calls, cuts):
    text = fmt.calls_text([(name, json.dumps(args)) for name, args in calls])
    whole = fmt.read_reply(text)
    assert whole.complete and [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    reader, pieces, start = fmt.CallReader(), [], 0
    for cut in sorted(cuts) + [len(text)]:
        pieces += reader.feed(text[start:cut])
        start = max(start, cut)
    pieces += reader.finish()
    assert reader.complete and [(c.name, c.arguments) for c in reader.calls] == [
        (c.name, c.arguments) for c in whole.calls
    ]
    assert [p.name for p in pieces if isinstance(p, fmt.CallPiece) and p.name is not None] == [n for n, _ in calls]


def test_the_prompt_shows_tools_calls_and_results_in_the_trained_format_or_to_a_template_that_takes_them():
    history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALLS[0][1]}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    definitions = [{"name": "get_weather", "parameters": WEATHER}]
    turns = fmt.in_format(history, definitions)
    assert turns[0]["role"] == "system" and turns[0]["content"].endswith("\n\nBe brief.")
    assert "<tools>" + json.dumps(definitions) + "</tools>" in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": fmt.calls_text([CALLS[0]])}
    assert turns[3] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}
    # A template that reads `tools` gets them, and the messages as they are.
    template = (
        "{{ tools | tojson }}|{% for m in messages %}{{ m.role }}{{ m.tool_calls | length if m.tool_calls }};"
        "{% endfor %}"
    )
    rendered = Tokenizer(None, template).apply_chat_template(history, tools=definitions)  # type: ignore[arg-type]
    wrapped = json.dumps([{"type": "function", "function": definitions[0]}], sort_keys=True)
    assert rendered == wrapped + "|system;user;assistant1;tool;"
    assert Tokenizer(None, template).takes_tools and not Tokenizer(None, None).takes_tools  # type: ignore[arg-type]


# -- the constraint on a tiny model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory):
    """The tiny random model with a context that holds the tools' system turn (its small BPE takes ~640 tokens)."""
    from tests.conftest import _builder_available

    if not _builder_available():
        pytest.skip("building the tiny model needs the convert extra: pip install 'ortspec[convert]'")
    from tests.support.models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tools") / "tiny-fp32", context=1024)


@pytest.fixture(scope="module")
def engine(tools_model_dir):
    return Engine.from_dir(tools_model_dir, BackendConfig(threads=1))


CHOICES = [
    ("required", False),
    ("required", True),
    ({"type": "function", "function": {"name": "get_time"}}, True),
    ("auto", True),
]


@pytest.mark.parametrize(("choice", "parallel"), CHOICES)
def test_calls_obey_the_schemas_and_speculation_changes_nothing(engine, choice, parallel):
    kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 100}
    plain = engine.generate(ASK, speculative=None, **kw)
    spec = engine.generate(ASK, speculative="prompt-lookup", **kw)
    assert spec.token_ids == plain.token_ids and spec.finish_reason == plain.finish_reason
    assert spec.stats.steps <= plain.stats.steps
    reply = GenerationOptions(**kw).tool_use().read(plain.text)  # type: ignore[union-attr]
    if choice == "auto" and reply.content is not None:
        assert not plain.text.startswith(fmt.TAG)  # text is never a broken call
        return
    assert reply.content is None and plain.text.startswith(fmt.TAG)
    if plain.finish_reason is FinishReason.GRAMMAR_COMPLETE:
        assert reply.complete and all(_valid(c.name, c.arguments) for c in reply.calls)
        assert len(reply.calls) == 1 or parallel and choice != CHOICES[2][0]
        if isinstance(choice, dict):
            assert [c.name for c in reply.calls] == ["get_time"]
    sampled = engine.generate(ASK, temperature=0.8, seed=4, **kw)
    assert (
        sampled.token_ids == engine.generate(ASK, temperature=0.8, seed=4, speculative="prompt-lookup", **kw).token_ids
    )


def test_batched_tool_calls_equal_each_alone_and_none_is_plain_chat(engine):
    kw = {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 100}
    other = [{"role": "user", "content": "And the time?"}]
    many = engine.generate_many([ASK, other], **kw)
    assert [r.token_ids for r in many] == [engine.generate(p, **kw).token_ids for p in (ASK, other)]
    none = engine.generate(ASK, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.token_ids == engine.generate(ASK, max_tokens=8).token_ids  # not shown, not called
    # A model that wants to stop at once may, with auto (an empty answer), and may not with required.
    eos = min(engine.eos_token_ids)
    stop_now = {"tools": TOOLS, "max_tokens": 30, "logit_bias": {eos: 100.0}}
    assert engine.generate(ASK, **stop_now).finish_reason is FinishReason.EOS_TOKEN
    assert engine.generate(ASK, tool_choice="required", **stop_now).text.startswith("<tool_call>[")
    with pytest.raises(ValueError, match="chat") as info:
        engine.generate("hi", tools=TOOLS)
    assert info.value.argument == "tools"  # type: ignore[attr-defined]


def test_a_schema_llguidance_refuses_names_the_tool_before_anything_runs(engine):
    passes = engine.generate("hi", max_tokens=2).stats.steps
    bad = [
        TOOLS[0],
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": "strin"}}}}},
    ]
    with pytest.raises(ValueError, match=r"tools\[1\].function.parameters: .*strin") as info:
        engine.generate(ASK, tools=bad, max_tokens=5)
    assert info.value.argument == "tools"  # type: ignore[attr-defined]
    assert engine.generate("hi", max_tokens=2).stats.steps == passes  # the engine stays usable


@pytest.mark.parametrize("max_batch", [1, 2])
def test_batch_records_with_tools_get_their_calls(tools_model_dir, engine, tmp_path, max_batch):
    """``ortspec batch``: a chat record's ``tools`` and ``tool_choice`` keys, one at a time or batched: its line has
    the Engine's calls in the OpenAI shape."""
    from ortspec.adapters.batch.job import BatchJob
    from ortspec.adapters.batch.run import run_batch

    named = {"type": "function", "function": {"name": "get_time"}}
    records = [
        {"id": 1, "messages": ASK, "tools": TOOLS, "tool_choice": named},
        {"id": 2, "prompt": "And the time?", "chat": True, "tools": TOOLS, "tool_choice": "none"},
        {
            "id": 3,
            "messages": [*ASK, _called("get_weather", "{nope"), {"role": "tool", "tool_call_id": "c", "content": "x"}],
        },
        {"id": 4, "messages": FOLLOW_UP, "tools": TOOLS, "tool_choice": "none"},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    job = BatchJob(
        src, out, model=tools_model_dir, workers=1, threads=1, max_batch=max_batch, options={"max_tokens": 150}
    )
    run_batch(job, progress=False)
    lines = {line["id"]: line for line in map(json.loads, out.read_text().splitlines())}
    want = engine.generate(ASK, tools=TOOLS, tool_choice=named, max_tokens=150)
    assert lines[1]["text"] == want.text and lines[1]["finish_reason_openai"] == "tool_calls"
    (call,) = lines[1]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_time"
    assert _valid("get_time", call["function"]["arguments"])
    assert "tool_calls" not in lines[3] and "arguments: not JSON" in lines[3]["error"]
    assert lines[4]["text"] == engine.generate(fmt.in_format(FOLLOW_UP, None), max_tokens=150).text
    assert (
        "tool_calls" not in lines[2]
        and lines[2]["text"] == engine.generate("And the time?", chat=True, max_tokens=150).text
    )


# -- the server, through the official openai client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(tools_model_dir, engine):
    pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")
    import openai

    from ortspec.adapters.serve.app import create_app
    from ortspec.adapters.serve.run import serve_in_thread
    from ortspec.adapters.serve.settings import ServerSettings

    served_engine = Engine.from_dir(tools_model_dir, BackendConfig(threads=1), batch_slots=2)
    with served_engine, serve_in_thread(create_app(served_engine, ServerSettings(model_name="tiny"))) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _streamed(client, **kw):
    """Content, tool calls (index -> [id, name, arguments]) and the finish reason of a streamed chat answer."""
    content, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, [None, None, ""])
                entry[0] = call.id or entry[0]
                entry[1] = call.function.name or entry[1]
                entry[2] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return "".join(content), calls, finish


@pytest.mark.parametrize(
    ("choice", "parallel"),
    [
        ("required", False),
        ({"type": "function", "function": {"name": "get_time"}}, True),
        ("auto", True),
        ("none", True),
    ],
)
def test_served_tool_calls_are_the_engines_streamed_or_not(served, engine, choice, parallel):
    url, client = served
    kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 100}
    want = GenerationOptions(**kw).tool_use().read(engine.generate(ASK, **kw).text)  # type: ignore[union-attr]
    for speculative in (False, True):
        answer = client.chat.completions.create(
            model="tiny", messages=ASK, extra_body={"ortspec": {"speculative": speculative}}, **kw
        )
        message = answer.choices[0].message
        if want.content is not None:
            assert message.content == want.content and not message.tool_calls
            continue
        assert message.content is None
        got = [(c.function.name, c.function.arguments) for c in message.tool_calls]
        assert got == [(c.name, c.arguments) for c in want.calls]
        assert all(c.type == "function" and c.id.startswith("call_") for c in message.tool_calls)
        assert answer.choices[0].finish_reason == ("tool_calls" if want.complete else "length")
        if want.complete:
            assert all(_valid(name, args) for name, args in got)
    content, calls, finish = _streamed(client, model="tiny", messages=ASK, **kw)
    if want.content is not None:
        assert content == want.content and not calls and finish in ("stop", "length")
        return
    assert content == "" and [(name, args) for _, name, args in calls.values()] == [
        (c.name, c.arguments) for c in want.calls
    ]
    assert all(i.startswith("call_") for i, _, _ in calls.values())
    assert finish == ("tool_calls" if want.complete else "length")


def test_the_openai_stream_helper_accumulates_the_calls(served):
    _, client = served
    kw = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 150}
    with client.chat.completions.stream(model="tiny", messages=ASK, **kw) as stream:
        final = stream.get_final_completion()
    (call,) = final.choices[0].message.tool_calls
    assert call.function.name == "get_time" and _valid("get_time", call.function.arguments)
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_follow_up_turn_renders_the_call_and_its_result(served, engine):
    _, client = served
    kw = {"tools": TOOLS, "tool_choice": "none", "max_tokens": 6}
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": CALLS[0][1]}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]  # fmt: skip
    answer = client.chat.completions.create(model="tiny", messages=turn, **kw)
    rendered = fmt.in_format(turn, None)
    assert answer.choices[0].message.content == engine.generate(rendered, max_tokens=6).text
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(engine.prompt_ids(rendered))


BAD = [
    (
        {"messages": [*ASK, _called("get_weather", "{nope"), {"role": "tool", "tool_call_id": "c", "content": "x"}]},
        "messages",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
        "tools[0].function.parameters",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer"}}}]},
        "tools[0].function.parameters",
    ),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_bad_tools_are_a_400_naming_the_field_and_the_server_stays_usable(served, extra, param):
    import httpx

    url, _ = served
    body = {"model": "tiny", "messages": ASK, "max_tokens": 3} | extra
    answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param, answer.json()
    good = httpx.post(
        url + "/v1/chat/completions", json={"model": "tiny", "messages": ASK, "max_tokens": 3}, timeout=60
    )
    assert good.status_code == 200


# -- the real model --------------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_model_calls_the_weather_tool_exactly_under_speculation(real_engine):
    """SmolLM2, shown the tools in its trained format and asked about the weather: required to call, it calls
    get_weather with arguments that obey the schema; speculative (forced tokens, then the lookup) == plain, with
    ``required`` and with ``auto`` (where the 135M model answers in text)."""
    for choice in ("required", "auto"):
        kw = {"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}
        kw["max_tokens"] = 60 if choice == "required" else 24
        plain = real_engine.generate(ASK, **kw)
        spec = real_engine.generate(ASK, speculative="auto", **kw)
        assert spec.token_ids == plain.token_ids and spec.stats.steps <= plain.stats.steps
        if choice == "required":
            reply = GenerationOptions(**kw).tool_use().read(plain.text)  # type: ignore[union-attr]
            assert plain.finish_reason is FinishReason.GRAMMAR_COMPLETE and reply.complete, plain.text
            assert [c.name for c in reply.calls] == ["get_weather"] and _valid("get_weather", reply.calls[0].arguments)
            assert spec.stats.steps < plain.stats.steps  # the call's fixed text is forced: free drafts
