"""``ortspec serve --ray`` on one local Ray instance (2 CPUs) with the tiny model: two engine replicas of one slot
each (one more request may queue) behind the same app as ``ortspec serve``.

Checked here: what each request is served equals ``Engine.generate`` alone (greedy, seeded sampling, chat,
streamed or not); the second turn of a conversation goes to the replica that served the first (and reuses its
KV); a full ingress is a 429 with ``Retry-After``; a client that goes away cancels its generation in the replica;
a replica killed mid-stream gives its client an error event while the other replica keeps serving, and Ray Serve
brings a replacement up; a node without the model folder is a clear error. Passes go through a gate actor the test
holds (``tests.support.ray_gate``); every wait is on the gate, the pool or a poll with a deadline.
"""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import pytest
import ray
from ray import serve

import tests.support.ray_gate as ray_gate
from ortspec.adapters.engine import Engine
from ortspec.adapters.serve.ray.replica import ReplicaSettings
from ortspec.adapters.serve.ray.router import prefix_ranks
from ortspec.adapters.serve.ray.run import APP_NAME, DEPLOYMENT, RayOptions, RayServeError, ray_app
from ortspec.adapters.serve.run import serve_in_thread
from ortspec.adapters.serve.settings import ServerSettings
from ortspec.backends.onnx import BackendConfig
from tests.support.gates import GATE_S

pytestmark = pytest.mark.ray

MODEL = "tiny"
GATE = "ortspec-test-pass-gate"
LONG = {"model": MODEL, "max_tokens": 1000, "stream": True, "ortspec": {"speculative": False}}


class Served:
    def __init__(self, url: str, pool, gate) -> None:
        self.url, self.pool, self.gate = url, pool, gate


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """Two replicas of one slot (max_queue 1), their passes behind the gate (open unless a test holds it)."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    ray.cloudpickle.register_pickle_by_value(ray_gate)
    gate = ray_gate.PassGate.options(name=GATE).remote()
    settings = ReplicaSettings(
        backend=BackendConfig(threads=1),
        server=ServerSettings(model_name=MODEL, max_queue=1),
        max_batch=1,
        wrap_batch=functools.partial(ray_gate.GatedReplicaBackend, gate=GATE),
    )
    try:
        with ray_app(tiny_model_dir, settings, RayOptions(replicas=2, threads=1)) as app, serve_in_thread(app) as url:
            yield Served(url, app.state.pool, gate)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))


def test_prefix_ranks_send_a_prompt_to_the_replicas_holding_most_of_it():
    held = {"a": [[1, 2, 3, 4, 5, 6]], "b": [[1, 2, 9], [7, 7]], "c": []}
    assert prefix_ranks(held, [1, 2, 3, 4, 5, 6, 7, 8], 0.5) == [["a"], ["a", "b", "c"]]  # 6 of 8 tokens
    assert prefix_ranks(held, [7, 7, 7], 0.5) == [["b"], ["a", "b", "c"]]
    assert prefix_ranks(held, [1, 2, 8, 8, 8], 0.5) == [["a", "b", "c"]]  # 2 of 5: the least loaded
    assert prefix_ranks({"a": [[1, 2]], "b": [[1, 2, 5]]}, [1, 2, 3], 0.5) == [["a", "b"], ["a", "b"]]  # a tie
    assert prefix_ranks({}, [1], 0.5) == [[]]


def _stream_text(lines) -> tuple[str, list[dict]]:
    """The text and the events of a stream's lines (``response.iter_lines()``, or what is left of them)."""
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    return "".join(e["choices"][0].get("text", "") for e in events if e.get("choices")), events


def test_served_text_is_the_librarys(served, reference):
    requests = [
        ({"prompt": "the quick brown fox jumps over the lazy dog. the quick", "max_tokens": 20}, {}),
        ({"prompt": "one two three four one two", "max_tokens": 16, "temperature": 0.8, "seed": 3}, {}),
        ({"prompt": "abc abc abc abc", "max_tokens": 24, "stream": True}, {}),
    ]
    with httpx.Client(base_url=served.url, timeout=GATE_S) as client:
        for body, _ in requests:
            body = {"model": MODEL, **body}
            kwargs = {k: v for k, v in body.items() if k in ("max_tokens", "temperature", "seed")}
            want = reference.generate(body["prompt"], **kwargs)
            if body.get("stream"):
                with client.stream("POST", "/v1/completions", json=body) as response:
                    text, events = _stream_text(response.iter_lines())
                assert events[-1]["choices"][0]["finish_reason"] == want.finish_reason.openai
                assert events[-1]["ortspec"]["worker"] in (0, 1)
            else:
                answer = client.post("/v1/completions", json=body).json()
                assert "choices" in answer, answer
                text = answer["choices"][0]["text"]
                assert answer["choices"][0]["finish_reason"] == want.finish_reason.openai
            assert text == want.text, body
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12}
        answer = client.post("/v1/chat/completions", json=chat).json()
        assert (
            answer["choices"][0]["message"]["content"]
            == reference.generate("hello there", chat=True, max_tokens=12).text
        )
        assert client.get("/health").json()["replicas"] == 2
        assert 'ortspec_generations_total{outcome="finished"}' in client.get("/metrics").text


def test_the_second_turn_goes_to_the_replica_that_served_the_first(served):
    """Four conversations, each first turn then second turn (a replica's one slot keeps the last conversation's KV):
    both replicas idle at each first turn, so only prefix affinity sends every second turn back (1/16 by chance),
    where its prompt's KV is reused."""
    with httpx.Client(base_url=served.url, timeout=GATE_S) as client:
        workers = set()
        for n in range(4):
            messages = [{"role": "user", "content": f"conversation {n}: " + "tell me about foxes and dogs " * 6}]
            first = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8})
            first = first.json()
            turn = messages + [
                {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                {"role": "user", "content": "and then?"},
            ]
            second = client.post("/v1/chat/completions", json={"model": MODEL, "messages": turn, "max_tokens": 4})
            second = second.json()
            assert second["ortspec"]["worker"] == first["ortspec"]["worker"]
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
            workers.add(first["ortspec"]["worker"])


def _first_chunk(lines) -> None:
    """Read ``lines`` (a stream's ``iter_lines()``) up to the first chunk with text."""
    for line in lines:
        if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
            return


def test_a_full_ingress_is_a_429_and_a_gone_client_cancels_its_generation(served):
    pool, gate = served.pool, served.gate
    ray.get(gate.hold.remote())
    with httpx.Client(base_url=served.url, timeout=GATE_S) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "prompt": "zz top zz top"}) as other:
            assert other.status_code == 200
            assert pool.wait_until(lambda p: len(p.jobs) == 1 and p.replica_of(p.jobs[0]), GATE_S)
            other_replica = pool.replica_of(pool.jobs[0])
            with client.stream("POST", "/v1/completions", json={**LONG, "prompt": "hello hello"}) as running:
                assert pool.wait_until(lambda p: len(p.jobs) == 2 and p.replica_of(p.jobs[1]), GATE_S)
                replica = pool.replica_of(pool.jobs[1])
                assert replica != other_replica  # the least loaded
                queued: list[httpx.Response] = []
                waiter = threading.Thread(
                    target=lambda: queued.append(
                        httpx.post(
                            served.url + "/v1/completions",
                            json={**LONG, "prompt": "x y", "max_tokens": 2, "stream": False},
                            timeout=GATE_S,
                        )
                    )
                )
                waiter.start()
                assert pool.wait_until(lambda p: len(p.jobs) == 3, GATE_S)
                refused = client.post("/v1/completions", json={**LONG, "prompt": "hi", "stream": False})
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["Retry-After"]) >= 1
                assert refused.json()["error"]["code"] == "queue_full"
                start = ray.get(gate.passes.remote()).get(replica, 0)
                ray.get(gate.allow.remote(6))
                _first_chunk(running.iter_lines())
            # the client went away: its job ends here, and in the replica it is in no pass after the current one
            assert pool.wait_until(lambda p: len(p.jobs) == 2, GATE_S)
            ray.get(gate.open.remote())
            waiter.join(GATE_S)
            assert queued[0].status_code == 200
            again = client.post(
                "/v1/completions", json={**LONG, "prompt": "hello hello", "max_tokens": 4, "stream": False}
            )
            assert again.status_code == 200
        # the cancelled request would have run up to 1000 passes on its replica before the next one there ended
        counts = ray.get(gate.passes.remote())
        assert counts.get(replica, 0) - start < 100, (counts, replica, start)
    assert 'ortspec_generations_total{outcome="cancelled"}' in httpx.get(served.url + "/metrics").text


def test_a_replica_killed_mid_stream(served, reference):
    pool = served.pool
    with httpx.Client(base_url=served.url, timeout=GATE_S) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "prompt": "kill me softly"}) as doomed:
            assert pool.wait_until(lambda p: len(p.jobs) == 1 and p.replica_of(p.jobs[0]), GATE_S)
            victim = pool.replica_of(pool.jobs[0])
            lines = doomed.iter_lines()
            _first_chunk(lines)
            ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
            _, events = _stream_text(lines)
        assert events[-1]["error"]["code"] == "replica_failed", events[-1]
        # the other replica keeps serving
        body = {"model": MODEL, "prompt": "the lazy dog", "max_tokens": 10}
        assert (
            client.post("/v1/completions", json=body).json()["choices"][0]["text"]
            == reference.generate("the lazy dog", max_tokens=10).text
        )
    # and Ray Serve brings a replacement up
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        replicas = serve.status().applications[APP_NAME].deployments[DEPLOYMENT].replica_states
        if replicas.get("RUNNING", 0) == 2:
            break
        time.sleep(0.5)
    assert replicas.get("RUNNING", 0) == 2, replicas


def test_a_node_without_the_model_folder_is_a_clear_error(served, tmp_path):
    settings = ReplicaSettings(backend=BackendConfig(threads=1), server=ServerSettings(model_name=MODEL))
    with pytest.raises(RayServeError, match="is not on node"):
        with ray_app(tmp_path / "nowhere", settings, RayOptions(replicas=1, threads=1)):
            pass
