"""``ortspec serve`` routes each request to the idle worker whose KV serves it best (tiny model, two workers).

The rule (``WorkerPool`` in the server): the worker whose resident tokens share the longest prefix with the
prompt, net of the resident KV the request would drop there; the least recently used on ties. What a client sees
is the ``ortspec.worker`` field of the response and ``usage.prompt_tokens_details.cached_tokens``. Prompts are
token ids and EOS is off, so every generation is exactly ``max_tokens`` long and the residents' lengths are known.
"""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the server needs the serve extra: pip install 'ortspec[serve]'")

import httpx  # noqa: E402

from ortspec.adapters.engine import Engine  # noqa: E402
from ortspec.adapters.serve.app import create_app  # noqa: E402
from ortspec.adapters.serve.run import serve_in_thread  # noqa: E402
from ortspec.adapters.serve.settings import ServerSettings  # noqa: E402
from ortspec.backends.onnx import BackendConfig  # noqa: E402

MODEL = "tiny"
MAX_TOKENS = 4


@pytest.fixture
def server(tiny_model_dir):
    """A fresh two-worker server with prefix reuse, plain decoding, EOS off: (url, its worker pool)."""

    def worker() -> Engine:
        base = Engine.from_dir(tiny_model_dir, BackendConfig(threads=1))
        return Engine(base.backend, base.tokenizer, eos_token_ids=(), folder=base.folder, prefix_reuse=True)

    settings = ServerSettings(model_name=MODEL, speculative=None, measure_at_startup=False)
    app = create_app([worker(), worker()], settings)
    with serve_in_thread(app) as url:
        yield url, app.state.pool


def complete(server, prompt: list[int]) -> tuple[int, int]:
    """One completion; returns (the worker that served it, the cached prompt tokens). Waits (on the pool's event)
    until the worker is back in the pool, so the next request finds every worker idle."""
    url, pool = server
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()
    assert pool.wait_until(lambda p: p.busy == 0, timeout_s=60), "the worker was not released"
    assert data["usage"]["completion_tokens"] == MAX_TOKENS
    return data["ortspec"]["worker"], data["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_request_goes_to_the_worker_that_loses_least_and_reuses_most(server):
    long_a = list(range(10, 40))  # 30 tokens: its worker then holds 30 + 3
    short_b = list(range(50, 60))  # 10 tokens: 10 + 3
    wa, _ = complete(server, long_a)
    wb, _ = complete(server, short_b)
    assert wb != wa  # the empty worker, not the one holding the first prompt's KV

    # A new prompt that shares nothing: the worker with less resident KV to lose (the short one), although the
    # other one is the least recently used.
    wc, cached = complete(server, list(range(70, 80)))
    assert (wc, cached) == (wb, 0)

    # A prompt that continues the first one shares most of its worker's resident KV: it goes there and reuses it.
    wa2, cached = complete(server, long_a + [90, 91])
    assert wa2 == wa and cached >= len(long_a)


def test_ties_go_to_the_least_recently_used_worker(server):
    first, _ = complete(server, list(range(10, 30)))
    second, _ = complete(server, list(range(40, 60)))  # as long as the first: both workers hold 20 + 3 tokens
    assert second != first
    # Two new prompts that share nothing with either worker: equal losses, so the least recently used serves.
    third, _ = complete(server, list(range(70, 90)))
    assert third == first
    fourth, _ = complete(server, list(range(100, 120)))
    assert fourth == second
