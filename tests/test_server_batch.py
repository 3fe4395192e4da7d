"""``ortspec serve`` on its one Engine's scheduler, on the tiny random model: what is about sharing passes and slots
(the rest of the server's behaviour is in test_server.py).

Checked here: concurrent requests (greedy, seeded sampling, stops, streamed or not) share passes and each is served
what ``Engine.generate`` gives it alone; the server's requests and the Engine's in-process calls share the same
passes; ``/metrics`` has the batch-size histograms; ``speculative="shared-kv"`` without a drafter is refused with a
400 naming the field; a server on ``speculative="suffix"`` records each finished output in its Engine's suffix
cache; ``load_serving`` opens one Engine on every core with the server's settings; a folder that cannot run batched
is served one sequence at a time, with one log line saying why. Passes go through a gate the test holds: every wait
is on an event or a pass count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import httpx  # noqa: E402

from ortspec.adapters.engine import Engine, GenerationOptions  # noqa: E402
from ortspec.adapters.engine.scheduler import Scheduling  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.errors import job_error  # noqa: E402
from ortspec.adapters.serve.jobs import Failed  # noqa: E402
from ortspec.adapters.serve.models import CompletionRequest, Prepared, argument_fields  # noqa: E402
from ortspec.adapters.serve.run import default_threads, load_serving, serve_in_thread  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig, OrtBatchBackend  # noqa: E402
from tests.support.gates import GATE_S, GatedBackend  # noqa: E402

MODEL = "tiny"
SLOTS = 4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


@pytest.fixture(scope="module")
def batched(tiny_model_dir, reference):
    """One Engine with ``SLOTS`` slots, its batch backend behind a gate (open unless a test holds it), prefix reuse
    on as the server runs it: (url, gate, pool)."""
    gate = GatedBackend(OrtBatchBackend.from_folder(reference.folder, BackendConfig(threads=1), slots=SLOTS))
    engine = Engine(
        gate,
        reference.tokenizer,
        eos_token_ids=reference.eos_token_ids,
        folder=reference.folder,
        scheduling=Scheduling(prefix_reuse=True),
    )
    app = create_app(engine, ServerSettings(model_name=MODEL))
    with engine, serve_in_thread(app) as url:
        yield url, gate, app.state.pool
        gate.open()


REQUESTS = [
    {"prompt": "the quick brown fox jumps over the lazy dog. the quick brown fox", "max_tokens": 20},
    {"prompt": "one two three four one two three four", "max_tokens": 16, "temperature": 0.8, "seed": 3},
    {"prompt": "abc abc abc abc", "max_tokens": 24, "stop": ["c a", "zz"], "stream": True},
    {"prompt": "hello there", "max_tokens": 12, "top_p": 0.9, "temperature": 1.1, "seed": 9, "stream": True},
    {"prompt": "lazy dog lazy dog lazy", "max_tokens": 18, "ortspec": {"speculative": False}},
    {"prompt": "fox fox fox", "max_tokens": 10},  # waits for a slot: four slots, six requests
]


def _text(response: httpx.Response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["text"]
    data = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1] if json.loads(d)["choices"])


def test_concurrent_requests_share_passes_and_each_gets_its_text_alone(batched, reference):
    url, gate, pool = batched
    wants = [
        reference.generate(
            r["prompt"],
            **{k: v for k, v in r.items() if k in ("max_tokens", "temperature", "seed", "stop", "top_p")},
        ).text
        for r in REQUESTS
    ]
    scheduler = pool.engine.scheduler
    rows_before = sum(scheduler.rows_per_pass.values())
    gate.hold()  # the first pass waits until every request is in
    out: list[httpx.Response | None] = [None] * len(REQUESTS)

    def send(i: int) -> None:
        out[i] = httpx.post(url + "/v1/completions", json={"model": MODEL, **REQUESTS[i]}, timeout=GATE_S)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    assert pool.wait_until(lambda p: len(p.jobs) == len(REQUESTS), GATE_S)
    assert pool.busy == SLOTS and pool.waiting == len(REQUESTS) - SLOTS
    gate.open()
    for t in threads:
        t.join(GATE_S)
    got = [_text(r, bool(q.get("stream"))) for r, q in zip(out, REQUESTS, strict=True)]
    assert got == wants
    assert all(r.json()["ortspec"]["worker"] == 0 for r, q in zip(out, REQUESTS, strict=True) if not q.get("stream"))
    assert scheduler.decode_costs is not None and len(scheduler.decode_costs) == SLOTS + 1  # measured at startup
    assert max(scheduler.rows_per_pass) > 1 and sum(scheduler.rows_per_pass.values()) > rows_before
    metrics = httpx.get(url + "/metrics").text
    assert "ortspec_batch_rows_bucket" in metrics and "ortspec_batch_decoding_rows_bucket" in metrics
    assert "ortspec_batch_slots 4.0" in metrics and 'ortspec_generations_total{outcome="finished"}' in metrics
    health = httpx.get(url + "/health").json()
    assert health == {"status": "ok", "workers": 1, "max_batch": SLOTS, "busy": 0, "waiting": 0}


def test_the_shared_kv_drafter_is_refused_naming_the_field(batched, reference):
    """This server's Engine has no drafter; were ``shared-kv`` to reach its batched pool, it is the 400 of the
    Engine's rule, naming ``ortspec.speculative``."""
    _, _, pool = batched
    request = CompletionRequest(model=MODEL, prompt="hi")
    prepared = Prepared(
        reference.tokenize("hi"), GenerationOptions(speculative="shared-kv"), argument_fields(request), True
    )

    async def first_event() -> object:
        job = await pool.submit(prepared, stream=True, deadline=1e9)
        return await job.next()

    failed = asyncio.run(first_event())
    assert isinstance(failed, Failed)  # before any Started: an error response, not a stream
    error = job_error(failed.error, prepared.fields)
    assert error.status == 400 and error.param == "ortspec.speculative" and "shared-kv" in error.message


def test_the_servers_requests_and_in_process_calls_share_the_engines_passes(batched, reference):
    """A request to the server and an ``Engine.generate`` call on the same Engine, from another thread, are requests of
    one scheduler: they run in the same passes, and each gets what it gives alone."""
    url, gate, pool = batched
    engine, scheduler = pool.engine, pool.engine.scheduler
    served_prompt, local_prompt = "the quick brown fox jumps over", "one two three four one two"
    wants = [reference.generate(p, max_tokens=10).text for p in (served_prompt, local_prompt)]
    shared_before = sum(n for rows, n in scheduler.rows_per_pass.items() if rows >= 2)
    submitted = scheduler.submitted
    gate.hold()
    out: dict[str, str] = {}

    def serve() -> None:
        body = {"model": MODEL, "prompt": served_prompt, "max_tokens": 10}
        out["served"] = httpx.post(url + "/v1/completions", json=body, timeout=GATE_S).json()["choices"][0]["text"]

    def local() -> None:
        out["local"] = engine.generate(local_prompt, max_tokens=10).text

    threads = [threading.Thread(target=serve), threading.Thread(target=local)]
    for t in threads:
        t.start()
    assert scheduler.wait_until(lambda s: s.submitted == submitted + 2, GATE_S)
    gate.open()
    for t in threads:
        t.join(GATE_S)
    assert [out["served"], out["local"]] == wants
    assert sum(n for rows, n in scheduler.rows_per_pass.items() if rows >= 2) > shared_before


def test_load_serving_is_one_engine_on_every_core(tiny_model_dir):
    with load_serving(tiny_model_dir, max_batch=3) as engine:
        assert engine.batch.slots == 3 and engine.note is None
        assert engine.backend_config.threads == default_threads()
        # one session: the Engine's one-sequence backend is the batch backend's lone slot (the weights load once)
        assert engine.backend is engine.batch.lone()
        assert engine.prefill_budget == 512 and engine.prefix_reuse
    # --prefill-budget reaches the scheduler the server's requests run on
    with load_serving(tiny_model_dir, BackendConfig(threads=1), max_batch=2, prefill_budget=7) as engine:
        pool = create_app(engine, ServerSettings(model_name=MODEL)).state.pool
        assert pool.engine.scheduler._driver.prefill_budget == 7 and pool.parallel == 2


def test_a_folder_that_cannot_batch_is_served_one_sequence_at_a_time_saying_why(tiny_model_dir, reference, caplog):
    config = BackendConfig(threads=1, share_buffer=False)  # the grow/copy KV path: OrtBatchBackend refuses it
    with caplog.at_level(logging.WARNING, logger="ortspec.serve"):
        engine = load_serving(tiny_model_dir, config)
    (record,) = [r for r in caplog.records if r.name == "ortspec.serve"]
    assert "one sequence at a time" in record.getMessage() and "buffer sharing is off" in record.getMessage()
    prompt = "the quick brown fox jumps over the lazy dog"
    with engine, serve_in_thread(create_app(engine, ServerSettings(model_name=MODEL))) as url:
        assert engine.batch.slots == 1 and engine.prefix_reuse
        assert httpx.get(url + "/health").json()["max_batch"] == 1
        answer = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 12})
        assert answer.json()["choices"][0]["text"] == reference.generate(prompt, max_tokens=12).text


def test_suffix_requests_record_their_outputs_in_the_engines_cache_and_get_their_text_alone(tiny_model_dir, reference):
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1), batch_slots=2)
    app = create_app(engine, ServerSettings(model_name=MODEL, speculative="suffix"))
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    want = reference.generate(prompt, max_tokens=20).text
    with engine, serve_in_thread(app) as url:
        for _ in range(2):  # the second drafts from the first one's output
            response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20})
            assert response.json()["choices"][0]["text"] == want
            assert engine.suffix_cache.tokens > 20  # recorded at the end of the pass that finished it
