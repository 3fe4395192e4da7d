"""``ortspec serve``: an OpenAI-compatible HTTP server on FastAPI + uvicorn, on one ``Engine``: every request is a
request of the Engine's one scheduler (``Engine.submit``), so requests share its passes and slots.

    from ortspec.adapters.serve.app import create_app
    from ortspec.adapters.serve.run import load_serving, serve_in_thread
    from ortspec.adapters.serve.settings import ServerSettings

    engine = load_serving(path, max_batch=16)          # Engine.from_dir(path, batch_slots=16, prefix_reuse=True)
    app = create_app(engine, ServerSettings(model_name="smollm2"))
    uvicorn.run(app)                                     # or: ortspec serve --model DIR --max-batch 16
    engine.close()

The command line (``adapters/cli/serve.py``) imports this package only when ``ortspec serve`` runs (it needs the
``serve`` extra). The package re-exports nothing: import from the module that owns a name.

Rooms, each knowing only the ones below it (and nothing of ``adapters/cli`` or ``adapters/batch``):

- ``run.py``: ``load_serving`` (the Engine the server runs: ``Engine.from_dir`` with the server's defaults) and
  ``serve_in_thread``.
- ``app.py``: ``create_app`` (``make_pool``: the pool on the Engine; ``app_for``: the app around any pool, a
  ``jobs.ServePool``), the routes, streaming (server-sent events), error handlers, the body-size guard.
- ``batch_pool.py``: ``BatchPool``: every request on the Engine's one scheduler (made ready by ``Engine.request``,
  submitted with ``Engine.submit``); it owns no backend and no scheduler.
- ``models.py``: the pydantic request models (the sampling fields built from their declarations),
  ``argument_fields`` (the Engine's ``ArgumentError.argument`` -> request field), ``prepare_options``.
- ``responses.py``: a ``GenerateResult`` in the OpenAI response and stream-chunk shapes (usage, logprobs, the
  ``ortspec`` extension field). Nothing here decides what is committed: finish reasons come from
  ``FinishReason.openai``, text and token counts from the result.
- ``jobs.py``: what the pools share: a request's job (``RequestGeneration``) and its events, its outcomes and their
  metrics, the queue limit, ``Retry-After`` and the busy/waiting gauges (``SubmittedJobs``); what the app needs of
  a pool (``ServePool``) and of the model's text (``Texts``).
- ``openapi.py``: the OpenAPI document: every status each route returns and every body (``RESPONSES``).
- ``errors.py``: ``APIError`` and ``ErrorBody`` (the OpenAI error object) and the mapping from a failure to its
  response.
- ``metrics.py``: the Prometheus metrics. ``settings.py``: ``ServerSettings``.
- ``ray/``: ``ortspec serve --ray``: the Engine as Ray Serve replicas behind this same app (its own package
  docstring; needs the ``ray`` extra). What it shares with ``ortspec batch --ray`` is ``adapters/ray_support.py``.

The Engine (``ortspec.adapters.engine``) does the rest: its scheduler's slots keep the sequences apart, and each
request's output is what it gives alone, whatever shares its passes.

Errors: a client's mistake (bad JSON, wrong types, unknown fields or model, an empty or too long prompt,
``max_tokens <= 0``, sampling values the Engine refuses, ``n != 1``) is a 400, 404 or 413 with an OpenAI error
object ``{"error": {"message", "type", "param", "code"}}`` naming the field; a ``ValueError`` from the Engine's
options or prompt checks is such a mistake (an ``ArgumentError`` names the argument, which ``argument_fields``
maps to the field). A ``GenerationError`` once generation started is a 500 (or, in a stream, an error event
followed by ``[DONE]``); the pool stays usable.
"""
