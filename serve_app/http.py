"""The OpenAI-compatible HTTP API (FastAPI).

Routes are methods of ``OpenAIIngress`` so Ray Serve can host the class; how a
request reaches a model (``stream_events``) is left to the subclass. Every
error leaves as OpenAI's ``{"error": {...}}`` body with the right status.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.metrics import Recorder
from serve_app.openai_api import (
    API_KEY_DIGEST_FIELD,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    full_response,
    new_id,
    now,
    stream_chunk,
    usage_chunk,
)
from serve_app.validation import clean_loc

api = FastAPI(title="serve_app", docs_url=None, redoc_url=None)


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = ApiError(exc.status_code, str(exc.detail), type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code)


def _validation_error(exc: ValidationError) -> ApiError:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in clean_loc(first["loc"])) or None
    return ApiError(400, f"{param or 'body'}: {first['msg']}", param=param)


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _parse(request: Request, cls):
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        parsed = cls.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None
    parsed.check_supported()
    return body, parsed


class OpenAIIngress:
    """Routes; subclasses say how to reach models (``stream_events``)."""

    profile: Any
    recorder: Recorder = Recorder()

    def stream_events(self, name: str, kind: str, body: dict) -> Any:
        raise NotImplementedError

    async def model_stats(self) -> dict:
        raise NotImplementedError

    async def metrics_text(self) -> str:
        raise NotImplementedError

    def has_model(self, name: str) -> bool:
        return self.profile.model(name) is not None

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": m.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "serve_app",
                    "context_length": m.context_length,
                }
                for m in self.profile.models
            ],
        }

    @api.get("/v1/models/{name:path}")
    async def model(self, name: str) -> dict:
        m = self.profile.model(name)
        if m is None:
            raise ApiError(404, f"model {name!r} does not exist", type="not_found_error",
                           param="model", code="model_not_found")
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "serve_app",
                "context_length": m.context_length}

    @api.get("/v1/stats")
    async def stats(self) -> dict:
        return {"models": await self.model_stats()}

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(await self.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, "chat", ChatCompletionRequest)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, "completion", CompletionRequest)

    async def _complete(self, request: Request, kind: str, cls):
        """One completion request, counted by model and HTTP status."""
        labels = {"model": "unknown", "status": "500"}
        try:
            response = await self._answer(request, kind, cls, labels)
            labels["status"] = "200"
            return response
        except ApiError as exc:
            labels["status"] = str(exc.status)
            raise
        finally:
            self.recorder.inc("serve_app_requests", 1, labels)

    async def _answer(self, request: Request, kind: str, cls, labels: dict[str, str]):
        body, parsed = await _parse(request, cls)
        if self.has_model(parsed.model):
            labels["model"] = parsed.model
        else:
            known = ", ".join(m.name for m in self.profile.models)
            raise ApiError(404, f"model {parsed.model!r} does not exist; served: {known}",
                           type="not_found_error", param="model", code="model_not_found")
        body.pop(API_KEY_DIGEST_FIELD, None)  # only the ingress may set it
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer ") and auth[7:].strip():
            body[API_KEY_DIGEST_FIELD] = hashlib.sha256(auth[7:].strip().encode()).hexdigest()
        events = self.stream_events(parsed.model, kind, body)
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "the model replica ended the request early",
                           type="server_error") from None
        start = first[0]
        if start["type"] == "error":
            raise ApiError.from_event(start)
        rid = new_id(kind)
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        if parsed.stream:
            return StreamingResponse(
                self._sse(events, kind, rid, parsed.model, first[1:], include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await self._collect(events, kind, rid, parsed.model, first[1:])

    async def _iter(self, events, pending: list[dict]) -> AsyncIterator[dict]:
        """Events one by one; consecutive deltas of one batch merge into one."""
        if pending:
            for e in _merge_deltas(pending):
                yield e
        async for batch in events:
            for e in _merge_deltas(batch):
                yield e

    async def _collect(self, events, kind: str, rid: str, model: str, pending: list[dict]):
        parts: list[str] = []
        try:
            async for e in self._iter(events, pending):
                if e["type"] == "delta":
                    parts.append(e["text"])
                elif e["type"] == "error":
                    raise ApiError.from_event(e)
                elif e["type"] == "finish":
                    usage = Usage(e["prompt_tokens"], e["completion_tokens"], e["cached_tokens"])
                    return full_response(kind, rid, model, "".join(parts), e["finish_reason"],
                                         usage)
        finally:
            _cancel(events)
        raise ApiError(500, "the model replica ended the request early", type="server_error")

    async def _sse(self, events, kind, rid, model, pending, include_usage):
        created = now()
        try:
            if kind == "chat":
                yield sse(stream_chunk(kind, rid, model, created, text="", role=True))
            async for e in self._iter(events, pending):
                if e["type"] == "delta":
                    yield sse(stream_chunk(kind, rid, model, created, text=e["text"]))
                elif e["type"] == "error":
                    yield sse({"error": e["error"]})
                    break
                elif e["type"] == "finish":
                    yield sse(stream_chunk(kind, rid, model, created,
                                           finish_reason=e["finish_reason"]))
                    if include_usage:
                        usage = Usage(e["prompt_tokens"], e["completion_tokens"],
                                      e["cached_tokens"])
                        yield sse(usage_chunk(kind, rid, model, created, usage))
                    break
            yield b"data: [DONE]\n\n"
        finally:
            _cancel(events)


def _merge_deltas(batch: list[dict]) -> list[dict]:
    out: list[dict] = []
    for e in batch:
        if e["type"] == "delta" and out and out[-1]["type"] == "delta":
            out[-1] = {"type": "delta", "text": out[-1]["text"] + e["text"]}
        else:
            out.append(e)
    return out


def _cancel(events: Any) -> None:
    """Tell the replica we stopped listening, so it frees the batch slot."""
    cancel = getattr(events, "cancel", None)
    if cancel is not None:
        cancel()
