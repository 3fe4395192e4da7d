"""``ortspec serve`` on one batched Engine (the default), on the tiny random model; what both pools share is in
test_server.py, run against each.

Checked here: concurrent requests (greedy, seeded sampling, stops, streamed or not) share passes and each is served
what ``Engine.generate`` gives it alone; ``/metrics`` has the batch-size histograms; ``speculative="shared-kv"``
without a drafter is refused with a 400 naming the field; a server on ``speculative="suffix"`` records each
finished output in its Engine's suffix cache; the ``--max-batch`` / ``--workers`` rule; a folder that cannot run
batched is served by workers, with one log line saying why. Passes go through a gate the test holds: every wait is
on an event or a pass count.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import httpx  # noqa: E402

from ortspec.adapters.cli.main import main  # noqa: E402
from ortspec.adapters.engine import Engine, GenerationOptions  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.errors import job_error  # noqa: E402
from ortspec.adapters.serve.jobs import Failed  # noqa: E402
from ortspec.adapters.serve.models import CompletionRequest, Prepared, argument_fields  # noqa: E402
from ortspec.adapters.serve.run import (  # noqa: E402
    DEFAULT_MAX_BATCH,
    batch_slots,
    default_threads,
    load_serving,
    serve_in_thread,
)
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig, OrtBatchBackend  # noqa: E402
from tests.support.gates import GATE_S, GatedBackend  # noqa: E402

MODEL = "tiny"
SLOTS = 4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


@pytest.fixture(scope="module")
def batched(tiny_model_dir):
    """One batched Engine with ``SLOTS`` slots behind a gate (open unless a test holds it): (url, gate, pool)."""
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    gate = GatedBackend(OrtBatchBackend.from_folder(engine.folder, BackendConfig(threads=1), slots=SLOTS))
    app = create_app([engine], ServerSettings(model_name=MODEL), batch=gate)
    with serve_in_thread(app) as url:
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
    rows_before = sum(pool.scheduler.rows_per_pass.values())
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
    assert pool.scheduler.decode_costs is not None and len(pool.scheduler.decode_costs) == SLOTS + 1  # measured
    assert max(pool.scheduler.rows_per_pass) > 1 and sum(pool.scheduler.rows_per_pass.values()) > rows_before
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


@pytest.mark.parametrize(
    ("workers", "max_batch", "slots"),
    [(1, None, DEFAULT_MAX_BATCH), (1, 8, 8), (1, 1, None), (3, None, None), (3, 1, None)],
)
def test_the_max_batch_and_workers_rule(workers, max_batch, slots):
    assert batch_slots(workers, max_batch) == slots


def test_workers_with_a_max_batch_above_one_is_refused(tiny_model_dir, capsys):
    with pytest.raises(ValueError, match="--workers 2 and --max-batch 8 do not combine"):
        batch_slots(2, 8)
    code = main(["serve", "--model", str(tiny_model_dir), "--workers", "2", "--max-batch", "8"])
    assert code == 2 and "do not combine" in capsys.readouterr().err


def test_load_serving_is_one_batched_engine_on_every_core(tiny_model_dir):
    serving = load_serving(tiny_model_dir, max_batch=3)
    assert len(serving.engines) == 1 and serving.batch is not None and serving.batch.slots == 3
    assert serving.engines[0].backend_config.threads == default_threads(1)
    # one session: the Engine's own backend is the batch backend's lone slot (the weights are loaded once)
    assert serving.engines[0].backend is serving.batch.lone()
    assert serving.engines[0].prefill_budget == 512
    # --prefill-budget reaches the pool's scheduler through the Engine
    serving = load_serving(tiny_model_dir, BackendConfig(threads=1), max_batch=2, prefill_budget=7)
    pool = create_app(serving.engines, ServerSettings(model_name=MODEL), batch=serving.batch).state.pool
    try:
        assert pool.scheduler._driver.prefill_budget == 7
    finally:
        pool.close()


def test_a_folder_that_cannot_batch_is_served_by_workers_saying_why(tiny_model_dir, caplog):
    config = BackendConfig(threads=1, share_buffer=False)  # the grow/copy KV path: OrtBatchBackend refuses it
    with caplog.at_level(logging.WARNING, logger="ortspec.serve"):
        serving = load_serving(tiny_model_dir, config)
    assert serving.batch is None and len(serving.engines) == 1 and serving.engines[0].prefix_reuse
    (record,) = [r for r in caplog.records if r.name == "ortspec.serve"]
    assert "cannot run batched" in record.getMessage() and "buffer sharing is off" in record.getMessage()
    assert "serving with one worker" in record.getMessage()


def test_suffix_requests_record_their_outputs_in_the_engines_cache_and_get_their_text_alone(tiny_model_dir, reference):
    engine = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
    batch = OrtBatchBackend.from_folder(engine.folder, BackendConfig(threads=1), slots=2)
    app = create_app([engine], ServerSettings(model_name=MODEL, speculative="suffix"), batch=batch)
    prompt = "the quick brown fox jumps over the lazy dog. the quick brown fox"
    want = reference.generate(prompt, max_tokens=20).text
    with serve_in_thread(app) as url:
        for _ in range(2):  # the second drafts from the first one's output
            response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20})
            assert response.json()["choices"][0]["text"] == want
            assert engine.suffix_cache.tokens > 20  # recorded at the end of the pass that finished it
