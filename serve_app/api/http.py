"""The OpenAI-compatible HTTP API (FastAPI).

Routes are methods of ``OpenAIIngress`` so Ray Serve can host the class; how a
request reaches a model is its backend's (``serve_app.api.backend.ModelBackend``). Every
error leaves as OpenAI's ``{"error": {...}}`` body with the right status.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from serve_app.api import anthropic_api as anthropic
from serve_app.api import anthropic_request, auth, responses_api, responses_request
from serve_app.api.backend import ModelBackend
from serve_app.api.body import parsed_body
from serve_app.api.openai_api import (
    CHAT,
    COMPLETION,
    Collector,
    CompletionStream,
    Wire,
    completion_collector,
)
from serve_app.api.resume import ResumableEvents, with_resume
from serve_app.api.sse import DONE, data_event, sse_event
from serve_app.api.status import ErrorLog, ServerInfo
from serve_app.api.thinking_signature import server_signer
from serve_app.config import api_keys
from serve_app.metrics.table import Recorder
from serve_app.models.compat import log_dir
from serve_app.models.phase import SERVING
from serve_app.serving.events import Delta, Event, Failure, Reasoning, Start
from serve_app.serving.request import (
    ApiError,
    Caller,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    check_message_count,
    check_prompt_size,
    checked,
    validation_error,
)

logger = logging.getLogger("ray.serve")

api = FastAPI(title="serve_app", docs_url=None, redoc_url=None)
# API keys (serve_app/api/auth.py): checked before any route runs or any body is read.
api.add_middleware(auth.ApiKeyMiddleware)

NOT_READY_RETRY_AFTER_S = 2
LOST = "replica_lost"  # the code of a request whose replica went away
LOST_REPLICA_RETRIES = 2  # resends of a request lost (or not taken) before its start
# A request Serve's router has not given to a replica in this long is sent again: seen when
# a node died while the router was probing its replica (the request then waited for ever).
ROUTE_STALL_S = 20.0
MAX_CACHE_POINTS = 4  # Anthropic's own limit on cache_control markers
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
T = TypeVar("T")


@api.exception_handler(ApiError)
async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def internal_error() -> ApiError:
    """500 for a fault of ours: where its traceback is."""
    return ApiError(500, "internal error: the server's log has the traceback (the ingress's "
                         f"under {log_dir()}/serve)", type="server_error")


@api.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error: %r", exc)
    err = internal_error()
    return JSONResponse(err.body(), status_code=err.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    err = ApiError(exc.status_code, str(exc.detail), type=kind)
    return JSONResponse(err.body(), status_code=exc.status_code)




def release() -> str | None:
    """This package's version, as installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("serve_app")
    except PackageNotFoundError:
        return None


def caller_of(request: Request) -> Caller:
    """Who is asking, from the headers only (a body can never choose its cache salt):
    the key the auth middleware checked, when keys are configured."""
    key = auth.presented_key(request.headers)
    return Caller(api_key_digest=api_keys.digest(key) if key else None)


def _unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable", code=code,
                    headers={"Retry-After": str(NOT_READY_RETRY_AFTER_S)})


def not_ready_error(names: list[str]) -> ApiError:
    """503 for models whose replica is not up and warmed yet."""
    return _unavailable(f"not ready yet (loading or warming up): {', '.join(names)}; "
                        "retry shortly (GET /health shows each model's phase)",
                        "model_not_ready")


def timeout_error(name: str, seconds: float) -> ApiError:
    """504 for a request its model did not answer in time (ingress.request_timeout_s)."""
    return ApiError(504, f"model {name!r} did not answer within {seconds:g} s "
                         "(ingress.request_timeout_s); its work was cancelled",
                    type="timeout_error", code="request_timeout")


def replica_lost_error(name: str) -> ApiError:
    """503 for a request whose model replica went away while serving it."""
    return _unavailable(f"the replica serving model {name!r} went away; retry shortly",
                        LOST)


class OpenAIIngress:
    """The routes. Every way to a model goes through ``backend``, one typed interface
    (``serve_app.api.backend.ModelBackend``): the deployment passes the Ray one."""

    def __init__(self, backend: ModelBackend) -> None:
        self.backend = backend
        self.profile = backend.profile
        self.recorder: Recorder = backend.recorder
        self.errors = ErrorLog()  # the last error answers, for the status page
        self.signer = server_signer()  # signs the thoughts sent, verifies those sent back
        self.server = ServerInfo(release(), time.time(), auth.keys_enabled(),
                                 auth.admin_keys_enabled(), backend.pool_report() is not None)

    @api.get("/health")
    async def health(self) -> JSONResponse:
        """200 once every model serves (ready, or unloaded by the pool: it loads on demand);
        503 with each model's phase before (downloading with its bytes, loading, warming)
        and when one failed (with the reason)."""
        names = [m.name for m in self.profile.models]
        phases = await asyncio.gather(*(self.backend.model_phase(n) for n in names))
        models = {n: p.public() for n, p in zip(names, phases, strict=True)}
        failed = [n for n, p in zip(names, phases, strict=True) if p.phase == "failed"]
        waiting = [n for n, p in zip(names, phases, strict=True)
                   if p.phase not in SERVING and p.phase != "failed"]
        if not failed and not waiting:
            return JSONResponse({"status": "ok", "models": models})
        if failed:
            reasons = "; ".join(f"{n}: {models[n].get('reason', 'unknown')}" for n in failed)
            err = _unavailable(f"model failed to load: {reasons}", "model_load_failed")
        else:
            err = not_ready_error([f"{n} ({models[n]['phase']})" for n in waiting])
        body = {**err.body(), "status": "failed" if failed else "starting", "models": models}
        return JSONResponse(body, status_code=err.status, headers=err.headers)

    def _log_error(self, request: Request, labels: dict[str, str], err: ApiError) -> None:
        model = labels["model"]
        self.errors.add(request.url.path, None if model == "unknown" else model, err)

    async def _model_entry(self, m: Any) -> dict:
        """A model in ``/v1/models``: its ``status`` (``model_status``) and
        ``memory_bytes``, its planned footprint."""
        ready, phase = await asyncio.gather(self.backend.model_ready(m.name),
                                            self.backend.model_phase(m.name))
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "serve_app",
                "context_length": m.context_length, "task": m.task,
                "status": self.backend.model_status(m.name, ready),
                **phase.public(),
                "memory_bytes": self.backend.memory_bytes(m.name)}

    @api.get("/v1/models")
    async def models(self) -> dict:
        entries = await asyncio.gather(*(self._model_entry(m) for m in self.profile.models))
        return {"object": "list", "data": list(entries)}

    @api.get("/v1/models/{name:path}")
    async def model(self, name: str) -> dict:
        m = self.profile.model(name)
        if m is None:
            raise ApiError(404, f"model {name!r} does not exist", type="not_found_error",
                           param="model", code="model_not_found")
        return await self._model_entry(m)

    @api.get("/v1/stats")
    async def stats(self) -> dict:
        """Each model's totals over its replicas with its phase, the memory plan, the model
        pool, the cluster's nodes, the self-benchmarks, this ingress's last errors."""
        names = [m.name for m in self.profile.models]
        # The phases as written, no readiness probe: /v1/stats calls every replica already.
        stats, phases = await asyncio.gather(self.backend.stats(), asyncio.gather(
            *(self.backend.model_phase(n, probe=False) for n in names)))
        for name, phase in zip(names, phases, strict=True):
            stats["models"].setdefault(name, {"model": name})["phase"] = phase.public()
        return {"server": self.server.to_json(), **stats, "errors": self.errors.report()}

    @api.get("/metrics")
    async def metrics(self) -> PlainTextResponse:
        return PlainTextResponse(await self.backend.metrics_text(),
                                 media_type=CONTENT_TYPE_LATEST)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._complete(request, CHAT, ChatCompletionRequest)

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._complete(request, COMPLETION, CompletionRequest)

    async def _complete(self, request: Request, wire: Wire, cls):
        """One completion request, counted by model and HTTP status."""
        labels = {"model": "unknown", "status": "500"}
        try:
            response = await self._answer(request, wire, cls, labels)
            labels["status"] = "200"
            return response
        except ApiError as exc:
            labels["status"] = str(exc.status)
            self._log_error(request, labels, exc)
            raise
        except Exception:
            self._log_error(request, labels, internal_error())
            raise
        finally:
            self.recorder.inc("serve_app_requests", 1, labels)

    async def _answer(self, request: Request, wire: Wire, cls, labels: dict[str, str]):
        parsed = await self._body(request, lambda body: checked(cls, body, validation_error))
        deadline = self._deadline()
        events, start = await self._open(parsed, caller_of(request), labels, deadline)
        field = self.model_of(parsed.model).reasoning.response_field
        if parsed.stream:
            include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
            stream = CompletionStream(wire, parsed.model, include_usage=include_usage,
                                      reasoning_field=field)
            return StreamingResponse(
                self._stream(events, stream, start, parsed.model, data_event, end=DONE,
                             path=request.url.path),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        collector = completion_collector(wire, parsed.model, field)
        await self._collect(events, collector, start, parsed.model, deadline)
        return collector.response()

    def _deadline(self) -> float:
        """When a request arriving now times out (``asyncio``'s clock)."""
        return asyncio.get_running_loop().time() + self.profile.ingress.request_timeout_s

    async def _open(self, parsed: OpenAIRequest, caller: Caller, labels: dict[str, str],
                    deadline: float) -> tuple[Any, Start]:
        """Send a validated request to its model: its event stream and its ``Start``, once
        the replica has admitted it (an error before that is raised here, as the HTTP
        error; so is a timeout at ``deadline``: 504, the replica's work cancelled).

        A replica lost before the ``Start`` (its node died, say) has sent the client
        nothing: the request goes once more, to a replica Serve still has (a whole answer
        not streamed counts as not started until it all arrived); so does one no replica
        took within ``ROUTE_STALL_S``. A replica lost after it is one the request
        survives: it goes on elsewhere after the tokens forwarded (``api/resume.py``)."""
        m = self.model_of(parsed.model)
        labels["model"] = m.name
        check_prompt_size(parsed, m.prompt_char_limit(), m.context_length, m.max_messages)
        if not await self.backend.model_ready(m.name):
            raise not_ready_error([m.name])
        events, start = await self._send(m.name, parsed, caller, deadline)

        async def reopen(tokens: tuple[int, ...]) -> tuple[Any, Start]:
            logger.warning("model %s: its replica went away mid-answer; continuing the "
                           "request elsewhere after %d tokens", m.name, len(tokens))
            return await self._send(m.name, with_resume(parsed, tokens), caller,
                                    self._deadline())

        def resumed(n: int, again: Start) -> None:
            model = {"model": m.name}
            self.recorder.inc("serve_app_resumed_requests", 1, model)
            self.recorder.inc("serve_app_resumed_prefill_tokens",
                              max(0, again.prompt_tokens + n - again.cached_tokens), model)

        lost = lambda exc: self.backend.replica_lost(m.name, exc)  # noqa: E731
        return ResumableEvents(events, reopen, lost, resumed), start

    async def _send(self, name: str, parsed: OpenAIRequest, caller: Caller,
                    deadline: float) -> tuple[Any, Start]:
        """``_open``'s sending: to a replica until one admits it (see there)."""
        loop = asyncio.get_running_loop()
        for attempt in range(1 + LOST_REPLICA_RETRIES):
            events = None
            stall = min(deadline, loop.time() + ROUTE_STALL_S)
            try:
                async with asyncio.timeout_at(deadline):
                    events = await self.backend.stream_events(name, parsed, caller)
                    assigned = getattr(events, "assigned", None)
                    if assigned is not None:  # a replica took it (or the stall ends it)
                        async with asyncio.timeout_at(stall):
                            await assigned()
                    return events, await self._first(events, name)
            except TimeoutError:
                if events is not None:
                    _cancel(events)
                if loop.time() >= deadline:
                    raise timeout_error(name,
                                        self.profile.ingress.request_timeout_s) from None
                why = f"no replica took it in {ROUTE_STALL_S:g} s"
                if attempt == LOST_REPLICA_RETRIES:
                    raise _unavailable(f"model {name!r}: {why}; retry shortly",
                                       "not_routed") from None
            except ApiError as exc:
                if exc.code != LOST or attempt == LOST_REPLICA_RETRIES:
                    raise
                why = "its replica went away before answering"
            logger.warning("model %s: %s; sending the request again", name, why)
            self.recorder.inc("serve_app_request_retries", 1, {"model": name})
        raise AssertionError("unreachable")

    async def _first(self, events: Any, name: str) -> Start:
        """The replica's first event batch: ``[Start]`` (admitted) or ``[Failure]``."""
        try:
            first = await events.__anext__()
        except StopAsyncIteration:
            raise ApiError(500, "the model replica ended the request early (it may have "
                                "been restarted); retry, and if it repeats see the replica's "
                                f"log under {log_dir()}/serve", type="server_error") from None
        except Exception as exc:
            if not self.backend.replica_lost(name, exc):
                raise
            raise replica_lost_error(name) from None
        head = first[0] if len(first) == 1 else None
        if isinstance(head, Start):
            return head
        _cancel(events)
        if isinstance(head, Failure):
            raise ApiError.from_failure(head)
        raise ApiError(500, f"the model replica began the request with {first!r}, not a "
                            "start event", type="server_error")

    def model_of(self, name: str) -> Any:
        """A generation model's profile (404 for no model; 400 for an embedding one)."""
        m = self.profile.model(name)
        if m is None:
            known = ", ".join(p.name for p in self.profile.models)
            raise ApiError(404, f"model {name!r} does not exist; served: {known}",
                           type="not_found_error", param="model", code="model_not_found")
        if m.task != "generate":
            route = "/v1/embeddings" if m.task == "embed" else "/v1/rerank and /v1/score"
            raise ApiError(400, f"model {name!r} is a {m.task} model: it answers {route}, "
                                "not generation", param="model", code="wrong_model_task")
        return m

    # ---- OpenAI's Responses API ---------------------------------------------------------

    @api.post("/v1/responses")
    async def responses(self, request: Request):
        """OpenAI Responses, stateless: the equivalent chat request, Responses shapes."""
        labels = {"model": "unknown", "status": "500"}
        try:
            parsed = await self._body(request, responses_request.parse_request, "input")
            for thought in responses_request.signed_thoughts(parsed):
                self.signer.verify(thought)
            m = self.model_of(parsed.model)
            defaults = {"temperature": m.sampling.temperature, "top_p": m.sampling.top_p}
            deadline = self._deadline()
            try:
                events, start = await self._open(responses_request.to_chat_request(parsed),
                                                 caller_of(request), labels, deadline)
            except ApiError as exc:  # named as the Responses request has it
                raise responses_request.renamed(exc) from None
            labels["status"] = "200"
            if parsed.stream:
                stream = responses_api.ResponseStream(parsed, signer=self.signer, **defaults)
                return StreamingResponse(
                    self._stream(events, stream, start, parsed.model, sse_event,
                                 path=request.url.path),
                    media_type="text/event-stream", headers=SSE_HEADERS)
            collector = responses_api.response_collector(parsed, signer=self.signer,
                                                             **defaults)
            await self._collect(events, collector, start, parsed.model, deadline)
            return JSONResponse(collector.response())
        except ApiError as exc:
            labels["status"] = str(exc.status)
            self._log_error(request, labels, exc)
            raise
        except Exception:
            self._log_error(request, labels, internal_error())
            raise
        finally:
            self.recorder.inc("serve_app_requests", 1, labels)

    # ---- Anthropic's Messages API ------------------------------------------------------

    @api.post("/v1/messages")
    async def messages(self, request: Request):
        """Anthropic Messages: the same generation, Anthropic's shapes and errors."""
        labels = {"model": "unknown", "status": "500"}
        try:
            parsed = await self._body(request, anthropic_request.parse_messages_request)
            chat = anthropic_request.to_chat_input(parsed)
            for thought in chat.thoughts:
                self.signer.verify(thought)
            signer = self.signer if chat.thinking else None  # no thinking block otherwise
            deadline = self._deadline()
            events, start = await self._open(chat_request(chat, parsed.model, parsed.stream),
                                             caller_of(request), labels, deadline)
            labels["status"] = "200"
            if parsed.stream:
                stream = anthropic.MessageStream(parsed.model, signer=signer)
                return StreamingResponse(
                    self._stream(events, stream, start, parsed.model, sse_event,
                                 path=request.url.path),
                    media_type="text/event-stream", headers=SSE_HEADERS)
            collector = anthropic.message_collector(parsed.model, signer=signer)
            await self._collect(events, collector, start, parsed.model, deadline)
            return JSONResponse(collector.response())
        except ApiError as exc:
            labels["status"] = str(exc.status)
            self._log_error(request, labels, exc)
            return _anthropic_error(exc)
        except Exception as exc:  # still Anthropic's shape for a client of that API
            logger.exception("/v1/messages failed")
            err = (replica_lost_error(labels["model"])
                   if self.backend.replica_lost(labels["model"], exc) else internal_error())
            self._log_error(request, labels, err)
            return _anthropic_error(err)
        finally:
            self.recorder.inc("serve_app_requests", 1, labels)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(self, request: Request):
        """The prompt's tokens as the model would see them (its chat template and tools)."""
        try:
            parsed = await self._body(request, anthropic_request.parse_count_tokens_request)
            chat = chat_request(anthropic_request.to_chat_input(parsed), parsed.model, False)
            m = self.model_of(parsed.model)
            check_prompt_size(chat, m.prompt_char_limit(), m.context_length, m.max_messages)
            if not await self.backend.model_ready(m.name):
                raise not_ready_error([m.name])
            timeout = self.profile.ingress.request_timeout_s
            try:
                n = await asyncio.wait_for(
                    self.backend.count_prompt_tokens(m.name, chat, caller_of(request)), timeout)
            except TimeoutError:
                raise timeout_error(m.name, timeout) from None
            return JSONResponse(anthropic.count_tokens_response(n))
        except ApiError as exc:
            self.errors.add(request.url.path, None, exc)
            return _anthropic_error(exc)

    async def _body(self, request: Request, parse: Callable[[Any], T],
                    items: str = "messages") -> T:
        """The body, parsed; the number of ``items`` (a conversation's messages) is
        bounded before each one is validated."""
        def bounded(body: Any) -> None:
            if isinstance(body, dict) and isinstance(body.get(items), list):
                name = body.get("model")
                m = self.profile.model(name) if isinstance(name, str) else None
                limit = m.max_messages if m is not None else max(
                    p.max_messages for p in self.profile.models)
                check_message_count(len(body[items]), limit, items)

        return await parsed_body(request, int(self.profile.ingress.max_request_bytes), parse,
                                 bounded)

    async def _stream(self, events, stream: Any, start: Start, model: str,
                      encode: Callable[[dict], bytes], end: bytes = b"", path: str = ""):
        """An API's SSE body: ``stream`` (that API's consumer) fed ``start`` and then the
        replica's events until it is done, each of its outputs through ``encode``; then
        ``end``. A failure after the start is an error event (and in the error log)."""
        try:
            for out in stream.feed(start):
                yield encode(out)
            async for e in self._iter(events, model):
                if isinstance(e, Failure):
                    self.errors.add(path, model, ApiError.from_failure(e))
                for out in stream.feed(e):
                    yield encode(out)
                if stream.done:
                    break
            if end:
                yield end
        finally:
            _cancel(events)

    async def _collect(self, events, collector: Collector, start: Start, model: str,
                       deadline: float) -> None:
        """A non-streamed answer: ``collector`` (that API's consumer of the same events)
        fed ``start`` and then the replica's events until it is done; a ``Failure`` raises
        there, passing ``deadline`` raises 504."""
        try:
            collector.feed(start)
            async for e in self._iter(events, model, deadline):
                collector.feed(e)
                if collector.done:
                    break
        finally:
            _cancel(events)

    async def _iter(self, events, model: str,
                    deadline: float | None = None) -> AsyncIterator[Event]:
        """Events one by one, after the ``Start``; consecutive deltas of one batch merge
        into one.

        A replica lost mid-request ends the events with a 503 ``Failure``. With a
        ``deadline`` (a whole answer is collected), passing it raises 504.
        """
        try:
            while True:
                try:
                    if deadline is None:
                        batch = await events.__anext__()
                    else:
                        async with asyncio.timeout_at(deadline):
                            batch = await events.__anext__()
                except StopAsyncIteration:
                    return
                for e in _merge_deltas(batch):
                    yield e
        except TimeoutError:
            if deadline is None:
                raise
            raise timeout_error(model, self.profile.ingress.request_timeout_s) from None
        except ApiError as exc:  # a request lost mid-answer that could not go on
            yield exc.to_failure()
        except Exception as exc:
            if not self.backend.replica_lost(model, exc):
                raise
            yield replica_lost_error(model).to_failure()


def chat_request(chat: anthropic_request.ChatInput, model: str,
                 stream: bool) -> ChatCompletionRequest:
    """A Messages request as the chat request every model replica takes."""
    body: dict[str, Any] = {
        "model": model, "messages": chat.template_messages(), "stream": stream,
        "max_tokens": chat.max_tokens, "temperature": chat.temperature, "top_p": chat.top_p,
        "stop": list(chat.stop) or None, "tools": chat.template_tools(),
        "tool_choice": chat.tool_choice.to_openai() if chat.tool_choice else None,
        "parallel_tool_calls": chat.parallel_tool_calls if chat.tools else None,
        "continue_final_message": chat.continue_final,
        # Without ``thinking`` a thinking model answers straight away, as Anthropic's do.
        "chat_template_kwargs": None if chat.thinking else {"enable_thinking": False},
    }
    parsed = checked(ChatCompletionRequest, body, validation_error)
    parsed._thinking_budget = chat.thinking_budget
    # A cache_control marker on message i: the prefix through it deserves a checkpoint.
    # Anthropic allows four markers; each costs a rendering of the conversation.
    points = sorted({i + 1 for i in chat.cache_control_points})
    parsed._cache_points = tuple(points[-MAX_CACHE_POINTS:])
    return parsed


def _anthropic_error(exc: ApiError) -> JSONResponse:
    reply = anthropic.error_reply(exc)
    return JSONResponse(reply.body(), status_code=reply.status, headers=reply.headers)


def _merge_deltas(batch: list[Event]) -> list[Event]:
    out: list[Event] = []
    for e in batch:
        last = out[-1] if out else None
        if isinstance(e, Delta) and isinstance(last, Delta):
            out[-1] = last.merged(e)
        elif isinstance(e, Reasoning) and isinstance(last, Reasoning):
            out[-1] = Reasoning(last.text + e.text)
        else:
            out.append(e)
    return out


def _cancel(events: Any) -> None:
    """Tell the replica we stopped listening, so it frees the batch slot."""
    cancel = getattr(events, "cancel", None)
    if cancel is not None:
        cancel()
