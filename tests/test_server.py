"""``ortspec serve`` end to end: a real uvicorn server on a free port, on the tiny random model, driven by the
official ``openai`` client (sync, async, streamed and not) and by raw HTTP (httpx) for bad input.

What is checked: served text equals ``Engine.generate`` text for the same prompt (completions and chat), streamed
chunks concatenate to the non-streamed text, speculation on and off give the same text, prefix reuse changes
nothing but the cached-token count, and every bad request is a 4xx OpenAI error object naming the field, after
which the server still answers. A second server, whose backend's passes go through a gate the test holds and whose
clock the test moves, makes the rest deterministic, measured in target passes and waited for on events: a full
queue is a 429 with Retry-After, a client that disconnects stops its generation within one pass, a request past its
deadline is a 504 within one pass, and a backend failure is a clean 500.

The server runs every request on its one Engine's scheduler (``BatchPool``); what is about sharing passes and slots
(concurrent requests, the batch metrics, ``load_serving``) is in test_server_batch.py; the batch driver's choice of
slot by the longest cached prefix, in test_batch_driver.py.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import NamedTuple

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import httpx  # noqa: E402
import openai  # noqa: E402

from ortspec.adapters.engine import Engine  # noqa: E402
from ortspec.adapters.engine.scheduler import Scheduling  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.run import load_serving, serve_in_thread  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig, OrtBatchBackend  # noqa: E402
from tests.support.gates import GATE_S, GatedBackend, ManualClock  # noqa: E402

MODEL = "tiny"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox jumps over"}]


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """A plain Engine (no prefix reuse): what the server must reproduce."""
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """The server's defaults (speculative ``suffix``, prefix reuse) on the Engine ``ortspec serve`` opens, with 4
    slots."""
    with load_serving(tiny_model_dir, BackendConfig(threads=1), max_batch=4) as engine:
        with serve_in_thread(create_app(engine, ServerSettings(model_name=MODEL))) as url:
            yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[str, str | None, object, list]:
    """Concatenated content deltas, the finish reason, the usage chunk's usage, and every chunk."""
    parts, finish, usage, chunks = [], None, None, []
    for chunk in stream:
        chunks.append(chunk)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text = choice.delta.content if hasattr(choice, "delta") else choice.text
            parts.append(text or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, usage, chunks


# ----------------------------------------------------------------------------------------------------------------
# Shapes and identity with the Engine
# ----------------------------------------------------------------------------------------------------------------


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(server + "/health").json()
    assert health["status"] == "ok" and health["busy"] == health["waiting"] == 0
    assert health["workers"] == 1 and health["max_batch"] == 4
    metrics = httpx.get(server + "/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE ortspec_target_passes_total counter" in metrics.text


def test_completion_equals_engine_generate(client, reference):
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    want = reference.generate(prompt, max_tokens=24)
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24)
    assert got.object == "text_completion" and got.id.startswith("cmpl-") and got.created > 0
    choice = got.choices[0]
    assert choice.text == want.text and choice.finish_reason == want.finish_reason.openai
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == want.prompt_tokens + len(want.token_ids)
    stats = got.model_extra["ortspec"]
    assert stats["speculative"] is True and stats["passes"] >= 1
    assert {"proposed", "accepted", "acceptance", "worker"} <= set(stats)
    # The same prompt as token ids, and as a list of one string.
    ids = reference.tokenize(prompt)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=24).choices[0].text == want.text
    assert client.completions.create(model=MODEL, prompt=[prompt], max_tokens=24).choices[0].text == want.text


def test_chat_streamed_equals_not_streamed_equals_engine(client, reference):
    want = reference.generate(CHAT, max_tokens=32)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=32)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == want.text
    assert full.choices[0].finish_reason == want.finish_reason.openai
    stream = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=32, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage, chunks = _stream_text(stream)
    assert text == want.text and finish == want.finish_reason.openai
    assert chunks[0].choices[0].delta.role == "assistant"
    assert usage.completion_tokens == len(want.token_ids) and usage.prompt_tokens == want.prompt_tokens
    assert chunks[-1].choices == [] and all(c.object == "chat.completion.chunk" for c in chunks)
    assert any("ortspec" in (c.model_extra or {}) for c in chunks)


def test_response_format_is_obeyed_streamed_or_not_and_a_bad_one_is_a_400(server, client, reference):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    schema["additionalProperties"] = False
    rf = {"type": "json_schema", "json_schema": {"name": "flag", "schema": schema, "strict": True}}
    want = reference.generate(CHAT, max_tokens=40, response_format=rf)
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, response_format=rf)
    assert full.choices[0].message.content == want.text and json.loads(want.text)["ok"] in (True, False)
    assert full.choices[0].finish_reason == "stop"
    text, finish, _, _ = _stream_text(
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=40, response_format=rf, stream=True)
    )
    assert text == want.text and finish == "stop"
    # Alternatives the grammar forbids (-inf) are left out: JSON has no -inf.
    yes_no = {"type": "regex", "regex": "(yes|no)"}
    lp = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=8, response_format=yes_no, logprobs=True, top_logprobs=20
    )
    assert lp.choices[0].message.content in ("yes", "no")
    assert all(len(t.top_logprobs) <= 20 for t in lp.choices[0].logprobs.content)
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}
    body = {"model": MODEL, "messages": CHAT, "response_format": bad}
    answer = httpx.post(server + "/v1/chat/completions", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "response_format"


def test_streamed_completion_and_raw_sse_end_with_done(server, client, reference):
    prompt = "abc abc abc abc"
    want = reference.generate(prompt, max_tokens=20)
    text, finish, usage, _ = _stream_text(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, stream=True)
    )
    assert text == want.text and finish == want.finish_reason.openai and usage is None
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "stream": True}
    with httpx.stream("POST", server + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1]) == want.text


def test_speculation_on_and_off_give_the_same_text(client, reference):
    prompt = "one two three four one two three four one two three"
    want = reference.generate(prompt, max_tokens=40)
    for flag in (True, False):
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, extra_body={"ortspec": {"speculative": flag}}
        )
        assert got.choices[0].text == want.text
        stats = got.model_extra["ortspec"]
        assert stats["speculative"] is flag
        if not flag:
            assert stats["proposed"] == 0 and stats["passes"] == len(want.token_ids)


def test_seeded_sampling_is_the_engines_and_replays(client, reference):
    """Sampling fields pass through: the served tokens are the Engine's at the same seed, speculation on or off;
    a request without a seed gets one drawn and reported, and replays with it."""
    prompt = "one two three four one two three four one two three"
    sampling = dict(temperature=0.8, top_p=0.95, top_k=20, min_p=0.01, frequency_penalty=0.2, presence_penalty=0.1)
    want = reference.generate(prompt, max_tokens=30, seed=11, **sampling)
    for flag in (True, False):
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, seed=11,
            extra_body={**{k: v for k, v in sampling.items() if k in ("top_k", "min_p")},
                        "ortspec": {"speculative": flag}},
            **{k: v for k, v in sampling.items() if k not in ("top_k", "min_p")},
        )  # fmt: skip
        assert got.choices[0].text == want.text
        assert got.model_extra["ortspec"]["seed"] == 11
    drawn = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8)
    seed = drawn.model_extra["ortspec"]["seed"]
    assert isinstance(seed, int)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.8, seed=seed)
    assert again.choices[0].text == drawn.choices[0].text
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, logit_bias={"7": 100})
    assert biased.usage.completion_tokens == 5
    assert (
        reference.tokenize(biased.choices[0].text) == [7] * 5
        or biased.choices[0].text == reference.generate(prompt, max_tokens=5, logit_bias={7: 100.0}).text
    )


def test_stop_sequences_logprobs_and_seed(client, reference):
    prompt = "the quick brown fox jumps over the lazy dog"
    free = reference.generate(prompt, max_tokens=30)
    stop = free.text[5:8]  # a stop string that the greedy continuation contains
    want = reference.generate(prompt, max_tokens=30, stop=[stop, "zzzz"])
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=[stop, "zzzz"], seed=7)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    assert client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, stop=stop).choices[0].text == want.text

    lp = reference.generate(prompt, max_tokens=6, top_logprobs=3)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=6, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=3)
    assert completion.choices[0].logprobs.token_logprobs == pytest.approx([t.logprob for t in lp.logprobs])
    # a dict by token text: ids whose text is the same (e.g. partial UTF-8 bytes) share an entry
    assert all(1 <= len(top) <= 3 for top in completion.choices[0].logprobs.top_logprobs)
    # streamed logprobs are the same tokens' as the non-streamed ones
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, logprobs=0, stream=True)
    streamed = [x for c in stream for ch in c.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    assert streamed == pytest.approx([t.logprob for t in lp.logprobs])


def test_async_clients_in_parallel_get_the_engine_text(server, reference):
    prompts = [f"{w} {w} lazy dog {i}" for i, w in enumerate(["fox", "cat", "owl", "bee", "elk", "yak"])]
    wants = [reference.generate([{"role": "user", "content": p}], max_tokens=16).text for p in prompts]

    async def main() -> tuple[list[str], list[str]]:
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)

        async def streamed(p: str) -> str:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16, stream=True
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def whole(p: str) -> str:
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], max_tokens=16
            )
            return r.choices[0].message.content

        a = await asyncio.gather(*(streamed(p) for p in prompts))
        b = await asyncio.gather(*(whole(p) for p in prompts))
        await client.close()
        return list(a), list(b)

    streamed_texts, whole_texts = asyncio.run(main())
    assert streamed_texts == wants and whole_texts == wants


def test_prefix_reuse_takes_the_next_turns_slot_and_changes_nothing(tiny_model_dir, reference):
    """Two conversations on a fresh server of two slots, then each one's next turn: it takes the slot holding its
    KV, prefills only the new tokens, and the text is what a fresh Engine (no reuse) produces."""
    with load_serving(tiny_model_dir, BackendConfig(threads=1), max_batch=2) as engine:
        with serve_in_thread(create_app(engine, ServerSettings(model_name=MODEL))) as url:
            _two_conversations(openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0), reference)


def _two_conversations(client, reference) -> None:
    convs = [
        [{"role": "user", "content": "tell me about the quick brown fox and the lazy dog " * 3}],
        [{"role": "user", "content": "numbers: one two three four five six seven eight " * 3}],
    ]
    first = []
    for conv in convs:
        r = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=12)
        assert r.choices[0].message.content == reference.generate(conv, max_tokens=12).text
        first.append(r)
    for conv, r in zip(convs, first, strict=True):
        turn = conv + [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "and then?"},
        ]
        again = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=12)
        assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens
        assert again.choices[0].message.content == reference.generate(turn, max_tokens=12).text


# ----------------------------------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------------------------------

GOOD = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}

# (endpoint, body (a dict, or raw bytes), status, param)
BAD = [
    ("completions", b"{not json", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"prompt": "hello"}, 400, "model"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", dict(GOOD, model="gpt-4o"), 404, "model"),
    ("completions", dict(GOOD, prompt=""), 400, "prompt"),
    ("completions", dict(GOOD, prompt=[]), 400, "prompt"),
    ("completions", dict(GOOD, prompt=["a", "b"]), 400, "prompt"),
    ("completions", dict(GOOD, prompt=[10**9]), 400, "prompt"),
    ("completions", dict(GOOD, prompt=5), 400, "prompt"),
    ("completions", dict(GOOD, prompt="fox " * 400), 400, "prompt"),
    ("completions", dict(GOOD, max_tokens=0), 400, "max_tokens"),
    ("completions", dict(GOOD, max_tokens=-5), 400, "max_tokens"),
    ("completions", dict(GOOD, max_tokens="ten"), 400, "max_tokens"),
    ("completions", dict(GOOD, max_tokens=2.5), 400, "max_tokens"),
    ("completions", dict(GOOD, temperature=-0.7), 400, "temperature"),
    ("completions", dict(GOOD, temperature="hot"), 400, "temperature"),
    ("completions", dict(GOOD, temperature=0.7, top_p=0.0), 400, "top_p"),
    ("completions", dict(GOOD, top_k=-1), 400, "top_k"),
    ("completions", dict(GOOD, frequency_penalty="high"), 400, "frequency_penalty"),
    ("completions", dict(GOOD, logit_bias={"x": 3}), 400, "logit_bias"),
    ("completions", dict(GOOD, logit_bias={"999999": 3}), 400, "logit_bias"),
    ("completions", b'{"model": "tiny", "prompt": "hello", "logit_bias": {"7": Infinity}}', 400, "logit_bias"),
    ("completions", dict(GOOD, temperature=0.5, min_p=1.5), 400, "min_p"),
    (
        "chat/completions",
        dict(GOOD_CHAT, max_tokens=None, max_completion_tokens=0, top_k=-1),
        400,
        "max_completion_tokens",
    ),
    ("chat/completions", dict(GOOD_CHAT, stop=[""]), 400, "stop[0]"),
    ("completions", dict(GOOD, seed=-1), 400, "seed"),
    ("completions", dict(GOOD, n=2), 400, "n"),
    ("completions", dict(GOOD, seed="x"), 400, "seed"),
    ("completions", dict(GOOD, stop=3), 400, "stop"),
    ("completions", dict(GOOD, stop=[""]), 400, "stop[0]"),
    ("completions", dict(GOOD, stream="yes"), 400, "stream"),
    ("completions", dict(GOOD, logprobs=9), 400, "logprobs"),
    ("completions", dict(GOOD, ortspec={"speculative": "maybe"}), 400, "ortspec.speculative"),
    ("completions", dict(GOOD, best_of=3), 400, "best_of"),
    ("chat/completions", dict(GOOD_CHAT, messages=[]), 400, "messages"),
    ("chat/completions", dict(GOOD_CHAT, messages="hi"), 400, "messages"),
    ("chat/completions", dict(GOOD_CHAT, messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("chat/completions", dict(GOOD_CHAT, messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("chat/completions", dict(GOOD_CHAT, max_completion_tokens=0), 400, "max_completion_tokens"),
    ("chat/completions", dict(GOOD_CHAT, top_logprobs=2), 400, "top_logprobs"),
    ("chat/completions", dict(GOOD_CHAT, n=3, stream=True), 400, "n"),
    ("chat/completions", dict(GOOD_CHAT, temperature=-1.0, stream=True), 400, "temperature"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_a_client_error_naming_the_field(server, endpoint, body, status, param):
    with httpx.Client(base_url=server, timeout=30) as http:
        kwargs = {"content": body, "headers": {"content-type": "application/json"}}
        response = http.post(f"/v1/{endpoint}", **(kwargs if isinstance(body, bytes) else {"json": body}))
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert error["param"] == param, error
        assert error["type"] == "invalid_request_error"
        good = GOOD_CHAT if endpoint.startswith("chat") else GOOD
        assert http.post(f"/v1/{endpoint}", json=good).status_code == 200  # the next request works


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-0.8)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x " * 1000, max_tokens=2)
    assert info.value.code == "context_length_exceeded"


def test_unknown_paths_and_oversized_bodies(server):
    assert httpx.get(server + "/v1/nothing").json()["error"]["code"] == "not_found"
    assert httpx.get(server + "/v1/completions").status_code == 405
    big = httpx.post(server + "/v1/completions", content=b"x" * (17 << 20), headers={"content-type": "text/plain"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"


# ----------------------------------------------------------------------------------------------------------------
# Queue, cancellation, timeout, failure: a backend whose passes go through a gate the test holds, and a clock the
# test moves (EOS off so generations run to max_tokens). Everything is measured in target passes and waited for on
# events (a pass count, the job's cancel flag, the pool's state); GATE_S only bounds a wait that should never end.
# ----------------------------------------------------------------------------------------------------------------

TIMEOUT = 60.0  # the request timeout, on the test's clock


class Gated(NamedTuple):
    url: str
    backend: GatedBackend
    pool: object  # the app's pool
    clock: ManualClock


def _idle(pool) -> bool:
    return pool.busy == 0 and pool.waiting == 0


@pytest.fixture(scope="module")
def gated_server(tiny_model_dir):
    """An Engine of one slot, its batch backend gated, on a manual clock (the scheduler's deadlines are read on it),
    and one queue slot."""
    base = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))  # the folder and tokenizer, loaded
    clock = ManualClock()
    settings = ServerSettings(model_name=MODEL, max_queue=1, request_timeout_s=TIMEOUT, speculative=None)
    backend = GatedBackend(OrtBatchBackend.from_folder(base.folder, BackendConfig(threads=1), slots=1))
    with Engine(backend, base.tokenizer, folder=base.folder, scheduling=Scheduling(clock=clock)) as engine:
        app = create_app(engine, settings)
        with serve_in_thread(app) as url:
            yield Gated(url, backend, app.state.pool, clock)


@pytest.fixture
def gated(gated_server):
    """The gated server, its gate open again and its slot idle after the test."""
    yield gated_server
    gated_server.backend.open()
    assert gated_server.pool.wait_until(_idle, GATE_S)


def _post(url: str, body: dict, out: list) -> threading.Thread:
    """POST ``body`` to /v1/completions in a thread; the response lands in ``out``."""
    thread = threading.Thread(target=lambda: out.append(httpx.post(url + "/v1/completions", json=body, timeout=GATE_S)))
    thread.start()
    return thread


def test_full_queue_is_a_429_with_retry_after(gated):
    url, backend, pool, clock = gated
    long = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "stream": True}
    start = backend.hold()
    backend.allow(2)  # the prompt pass (the stream's headers follow it) and one step; the next pass waits
    with httpx.Client(base_url=url, timeout=GATE_S) as a, a.stream("POST", "/v1/completions", json=long) as running:
        assert running.status_code == 200
        backend.wait_blocked_at(start + 2)
        running_job = pool.jobs[0]
        queued: list[httpx.Response] = []
        thread = _post(url, dict(long, stream=False), queued)
        assert pool.wait_until(lambda p: p.waiting == 1, GATE_S)
        refused = httpx.post(url + "/v1/completions", json=dict(long, max_tokens=2))
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["Retry-After"]) >= 1
        assert refused.json()["error"]["code"] == "queue_full"
    # closing the running stream cancels its job and frees the slot for the queued request, which is past its
    # deadline by then and ends cleanly with a 504
    assert running_job.cancelled.wait(GATE_S)
    clock.advance(TIMEOUT + 1)
    backend.open()
    thread.join(GATE_S)
    assert [r.status_code for r in queued] == [504]
    assert pool.wait_until(_idle, GATE_S)
    assert httpx.post(url + "/v1/completions", json=dict(long, max_tokens=2, stream=False)).status_code == 200


def test_a_disconnected_stream_stops_within_one_pass(gated):
    url, backend, pool, _ = gated
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1000, "stream": True}
    start = backend.hold()
    backend.allow(4)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=GATE_S) as response:
        assert response.status_code == 200
        backend.wait_blocked_at(start + 4)
        job = pool.jobs[0]
    # the client is gone while the scheduler waits for its next pass: the job is cancelled, and once the gate
    # opens the scheduler runs at most the pass it was about to run
    assert job.cancelled.wait(GATE_S)
    backend.open()
    assert pool.wait_until(_idle, GATE_S)
    assert backend.passes <= start + 4 + 1
    assert 'ortspec_generations_total{outcome="cancelled"}' in httpx.get(url + "/metrics").text


def test_a_disconnected_plain_request_stops_too(gated):
    url, backend, pool, _ = gated
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 1000}).encode()
    host, port = httpx.URL(url).host, httpx.URL(url).port
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    start = backend.hold()
    backend.allow(3)
    with socket.create_connection((host, port)) as client:
        client.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
        backend.wait_blocked_at(start + 3)
        job = pool.jobs[0]
    assert job.cancelled.wait(GATE_S)
    backend.open()
    assert pool.wait_until(_idle, GATE_S)
    assert backend.passes <= start + 3 + 1  # far from the 1000 passes it would have run


def test_a_request_past_its_deadline_is_a_504_within_one_pass(gated):
    url, backend, pool, clock = gated
    start = backend.hold()
    backend.allow(3)
    out: list[httpx.Response] = []
    thread = _post(url, {"model": MODEL, "prompt": "hi", "max_tokens": 1000}, out)
    backend.wait_blocked_at(start + 3)
    clock.advance(TIMEOUT + 1)  # the deadline passes while the scheduler waits for its next pass
    backend.open()
    thread.join(GATE_S)
    assert out[0].status_code == 504 and out[0].json()["error"]["type"] == "timeout_error"
    assert "generated tokens" in out[0].json()["error"]["message"]
    assert pool.wait_until(_idle, GATE_S)
    assert backend.passes <= start + 3 + 1


def test_a_backend_failure_is_a_clean_500_and_the_server_stays_usable(gated):
    url, backend, _, _ = gated
    backend.fail_at = backend.passes + 5
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 20}, timeout=GATE_S)
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"
    assert "injected backend failure" in r.json()["error"]["message"]

    backend.fail_at = backend.passes + 5
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=GATE_S) as response:
        data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["code"] == "generation_failed"

    ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 20}, timeout=GATE_S)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 20


def test_cli_has_a_serve_command():
    from ortspec.adapters.cli.main import build_parser

    args = build_parser().parse_args(["serve", "--max-batch", "2", "--port", "0", "--no-prefix-reuse"])
    assert args.max_batch == 2 and args.port == 0 and args.prefix_reuse is False and args.speculative == "auto"
    with pytest.raises(SystemExit):  # the worker design is retired: one Engine serves every request
        build_parser().parse_args(["serve", "--workers", "2"])
    assert args.prefill_budget == 512
    assert build_parser().parse_args(["serve", "--prefill-budget", "none"]).prefill_budget is None
    assert build_parser().parse_args(["serve", "--prefill-budget", "64"]).prefill_budget == 64
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill-budget", "0"])


@pytest.mark.real_model
def test_real_model_served_text_equals_engine_and_reuse_changes_nothing(real_model_dir, real_engine):
    """SmolLM2: served chat text (streamed and not, speculative on and off) equals ``Engine.generate``; the second
    turn of a conversation reuses the first turn's KV and still equals a fresh Engine's text."""
    conv = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat, and the dog sat on the log."}]
    want = real_engine.generate(conv, max_tokens=40)
    engine = load_serving(real_model_dir, BackendConfig(threads=2), max_batch=2)
    with engine, serve_in_thread(create_app(engine, ServerSettings(model_name=MODEL))) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        for speculative in (True, False):
            extra = {"ortspec": {"speculative": speculative}}
            full = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=40, extra_body=extra)
            assert full.choices[0].message.content == want.text
            assert full.choices[0].finish_reason == want.finish_reason.openai
            if speculative:
                assert full.model_extra["ortspec"]["accepted"] > 0  # it did speculate
        stream = client.chat.completions.create(model=MODEL, messages=conv, max_tokens=40, stream=True)
        assert _stream_text(stream)[0] == want.text
        turn = conv + [{"role": "assistant", "content": want.text}, {"role": "user", "content": "Now say it twice."}]
        again = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=40)
        assert again.usage.prompt_tokens_details.cached_tokens >= want.prompt_tokens
        assert again.choices[0].message.content == real_engine.generate(turn, max_tokens=40).text
