"""The server's errors: ``APIError`` (the OpenAI error object with an HTTP status), the pool's refusals
(``QueueFull``, ``RequestTimeout``, ``Cancelled``) and the mapping from a failure to its response.

A client's mistake is a 4xx naming the request field: an ``ArgumentError`` from the Engine (or the core under it)
carries the argument's name, which the request's table (``models.argument_fields``) turns into the field. Any
other ``ValueError`` from the Engine's checks is a 400 without a field; a ``RequestTimeout`` a 504; a
``GenerationError`` (the generation failed after it started) a 500; anything else a 500 ``internal_error``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from ortspec.core.checks import ArgumentError
from ortspec.driver import GenerateResult, GenerationError


class ErrorDetail(BaseModel):
    """What went wrong. ``type``: ``invalid_request_error`` (the client's mistake), ``rate_limit_error`` (the queue
    is full), ``timeout_error`` or ``server_error``; ``param``: the request field at fault, if one is;
    ``code``: a machine-readable word (``model_not_found``, ``context_length_exceeded``, ``queue_full``, ...)."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """The body of every error response, and of a stream's error event: the OpenAI error object."""

    error: ErrorDetail


class APIError(Exception):
    """An error response: an ``ErrorBody`` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        detail = ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorBody(error=detail).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled whole (a replica of ``ortspec serve --ray`` sends its failures to the ingress as these)."""
        return (_api_error, (self.status, self.message, self.type, self.param, self.code, self.headers))


def _api_error(
    status: int, message: str, type: str, param: str | None, code: str | None, headers: Mapping[str, str]
) -> APIError:
    return APIError(status, message, type=type, param=param, code=code, headers=headers)


class QueueFull(Exception):
    """Every worker is busy and ``max_queue`` requests are already waiting."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the server is busy: every worker is busy and the queue is full; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class RequestTimeout(Exception):
    """The request ran past its deadline, waiting for a worker or generating (``partial``: what was generated
    by then, for the message)."""

    def __init__(self, timeout_s: float, partial: GenerateResult | None = None) -> None:
        done = f" after {len(partial.token_ids)} generated tokens" if partial is not None else " waiting for a worker"
        super().__init__(f"the request timed out ({timeout_s:g} s){done}")


class Cancelled(Exception):
    """The client went away; the generation was stopped."""


def named(param: str | None, message: str) -> str:
    """``message`` led by ``param`` (``"messages[0].role: ..."``) unless it already starts with the field's name."""
    return f"{param}: {message}" if param and not message.startswith(param.split(".")[-1]) else message


def client_error(exc: ValueError, fields: Mapping[str, str]) -> APIError:
    """The 400 for a value the Engine refused, naming the request field (``fields``: the request's table from the
    Engine's argument names to its fields) when the error is an ``ArgumentError``."""
    param = fields.get(exc.argument) if isinstance(exc, ArgumentError) else None
    return APIError(400, named(param, str(exc)), param=param)


def queue_full_error(exc: QueueFull) -> APIError:
    """The 429 for a full queue, with ``Retry-After``."""
    headers = {"Retry-After": str(exc.retry_after_s)}
    return APIError(429, str(exc), type="rate_limit_error", code="queue_full", headers=headers)


def job_error(exc: BaseException, fields: Mapping[str, str]) -> APIError:
    """The response for a job that failed (``fields`` as for ``client_error``; an ``APIError``, a remote replica's
    answer, is its own response)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return client_error(exc, fields)
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), type="timeout_error", code="timeout")
    if isinstance(exc, GenerationError):
        return APIError(500, str(exc), type="server_error", code="generation_failed")
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal_error")
