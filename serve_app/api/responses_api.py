"""OpenAI Responses API wire format (``POST /v1/responses``): requests, conversion, streams.

Pure translation, no model and no Ray, like ``anthropic_api``: a validated
Responses body becomes the ``ChatCompletionRequest`` every model replica takes
(so it is templated, cached and decoded exactly as the equivalent chat request),
and the replica's typed events (``serve_app.serving.events``: ``Start``, ``Delta``,
``ToolCall``, ``Finish``, ``Failure``) become the Responses API's SSE event sequence; the
non-streamed ``response`` object is accumulated from those same events. Shapes
are checked against the ``openai`` SDK's types in ``tests/unit/test_responses_units.py``.

Stateless: nothing is stored. ``store: true`` is accepted and answered as not
stored (``"store": false`` in the response), since clients send it by default;
``previous_response_id``, ``conversation``, ``item_reference`` items and
``background`` need stored state and are refused with a 400 naming the field.

Conversion (the same tokens as the equivalent chat conversation, so every turn
of an agent reuses the prefix cache): ``instructions`` is the first system
message; ``developer`` messages are system messages; a message's text parts are
joined as chat joins them; an assistant message directly followed by
``function_call`` items, and consecutive ``function_call`` items, are one
assistant message with ``tool_calls`` (what the model's own chat turn was);
``function_call_output`` items are ``tool`` messages; a ``reasoning`` item's thought
is the next assistant message's ``reasoning_content`` (the template decides whether to
render it). A thinking model's thought goes out as a ``reasoning`` item before the
message (``encrypted_content``, signed, when ``include`` asks for it), ``reasoning.effort``
picks its budget.

Accepted without effect: ``metadata``, ``user``, ``include`` (but
``reasoning.encrypted_content``), ``reasoning.summary``,
``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``,
``service_tier``, ``truncation`` (an over-long input is a 400, never truncated),
``max_tool_calls``, ``stream_options``, ``text.verbosity``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from serve_app.api.openai_api import Collector
from serve_app.api.responses_request import ResponsesRequest
from serve_app.api.thinking_signature import ThoughtSigner
from serve_app.serving.events import Delta, Event, Failure, Finish, Reasoning, Start, ToolCall
from serve_app.serving.request import ApiError

# ---- request schemas ----------------------------------------------------------------


# ---- conversion ---------------------------------------------------------------------------


# ---- responses ---------------------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          reasoning_tokens: int = 0) -> dict:
    """Responses usage: ``input_tokens`` counts all prompt tokens, the cached ones among them."""
    return {
        "input_tokens": prompt_tokens,
        # cache_write_tokens: the SDK requires it; what a request adds to the cache is not
        # counted per request here (blocks are stored after the fact), so it is 0.
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _echo_tools(request: ResponsesRequest) -> list[dict]:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": t.parameters, "strict": t.strict} for t in request.tools or ()]


def _echo_text(request: ResponsesRequest) -> dict:
    fmt = request.text.format if request.text else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def response_object(request: ResponsesRequest, response_id: str, created_at: float, *,
                    temperature: float | None = None, top_p: float | None = None) -> dict:
    """The ``response`` object as it starts: in progress, no output, the request echoed.
    ``temperature``/``top_p``: what sampling uses when the request sets none."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "model": request.model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None,
                      "summary": request.reasoning.summary if request.reasoning else None},
        "store": False,
        "temperature": request.temperature if request.temperature is not None else temperature,
        "text": _echo_text(request),
        "tool_choice": _echo_choice(request),
        "tools": _echo_tools(request),
        "top_p": request.top_p if request.top_p is not None else top_p,
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
        "metadata": dict(request.metadata or {}),
    }


def _echo_choice(request: ResponsesRequest) -> str | dict:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _failed_code(status: int) -> str:
    """An HTTP status as a ``response.error.code`` the SDK knows."""
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if status < 500 else "server_error"


class ResponseStream:
    """Internal events in, Responses stream events out, in the order OpenAI sends them.

    ``response.created``, ``response.in_progress``; per output item
    ``response.output_item.added``, for a thought ``response.reasoning_text.delta``...
    and ``.done``, for text ``response.content_part.added``,
    ``response.output_text.delta``..., ``response.output_text.done``,
    ``response.content_part.done``, for a call ``response.function_call_arguments.delta``
    and ``.done``, then ``response.output_item.done``; finally ``response.completed``
    (``response.incomplete`` when cut by the token limit). An error after the start
    sends an ``error`` event and ``response.failed``. Every event has its
    ``sequence_number``; each method returns the events to send now.
    """

    def __init__(self, request: ResponsesRequest, response_id: str | None = None, *,
                 temperature: float | None = None, top_p: float | None = None,
                 created_at: float | None = None, signer: ThoughtSigner | None = None) -> None:
        self.response = response_object(
            request, response_id or new_response_id(),
            time.time() if created_at is None else created_at,
            temperature=temperature, top_p=top_p)
        self.started = False
        self.done = False
        self._sequence = 0
        self._message: dict | None = None  # the open message item
        self._reasoning: dict | None = None  # the open reasoning item
        # encrypted_content on reasoning items, when the request includes it
        self._sealer = signer if request.wants_encrypted_reasoning() else None
        self._model = request.model
        self._output: list[dict] = []  # finished items

    @property
    def response_id(self) -> str:
        return self.response["id"]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Dispatch one replica event (``serve_app.serving.events``)."""
        if isinstance(event, Start):
            return self.start()
        if isinstance(event, Reasoning):
            return self.reasoning(event.text)
        if isinstance(event, Delta):
            return self.text(event.text)
        if isinstance(event, ToolCall):
            return self.tool_call(event.id, event.name, event.arguments, event.complete)
        if isinstance(event, Finish):
            return self.finish(event.finish_reason, prompt_tokens=event.prompt_tokens,
                               completion_tokens=event.completion_tokens,
                               cached_tokens=event.cached_tokens,
                               reasoning_tokens=event.reasoning_tokens)
        if isinstance(event, Failure):
            return self.error(ApiError.from_failure(event))
        raise ValueError(f"unknown event {event!r}")

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self, **changes: Any) -> dict[str, Any]:
        return json.loads(json.dumps({**self.response, **changes}))

    def start(self) -> list[dict[str, Any]]:
        self._check(started=False)
        self.started = True
        return [self._event("response.created", response=self._snapshot()),
                self._event("response.in_progress", response=self._snapshot())]

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        """Thought text: the reasoning item (opened before the message), one
        ``reasoning_text`` part."""
        self._check(started=True)
        if not text:
            return []
        out = []
        if self._reasoning is None:
            self._reasoning = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                               "summary": [], "content": [], "status": "in_progress"}
            out.append(self._event("response.output_item.added",
                                   output_index=len(self._output),
                                   item=json.loads(json.dumps(self._reasoning))))
            self._reasoning["content"].append({"type": "reasoning_text", "text": ""})
        self._reasoning["content"][0]["text"] += text
        out.append(self._event("response.reasoning_text.delta", **self._where(self._reasoning),
                               delta=text))
        return out

    def _close_reasoning(self, status: str = "completed") -> list[dict[str, Any]]:
        item = self._reasoning
        if item is None:
            return []
        text = item["content"][0]["text"]
        out = [self._event("response.reasoning_text.done", **self._where(item), text=text)]
        item["status"] = status
        if self._sealer is not None:
            item["encrypted_content"] = self._sealer.encrypted_content(self._model, text)
        out.append(self._event("response.output_item.done", output_index=len(self._output),
                               item=json.loads(json.dumps(item))))
        self._output.append(item)
        self._reasoning = None
        return out

    def text(self, text: str) -> list[dict[str, Any]]:
        self._check(started=True)
        if not text:
            return []
        out = self._close_reasoning()
        if self._message is None:
            self._message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                             "status": "in_progress", "role": "assistant", "content": []}
            out.append(self._event("response.output_item.added",
                                   output_index=len(self._output),
                                   item=json.loads(json.dumps(self._message))))
            self._message["content"].append({"type": "output_text", "text": "",
                                             "annotations": [], "logprobs": []})
            out.append(self._event("response.content_part.added", **self._where(self._message),
                                   part={"type": "output_text", "text": "",
                                         "annotations": [], "logprobs": []}))
        self._message["content"][0]["text"] += text
        out.append(self._event("response.output_text.delta", **self._where(self._message),
                               delta=text, logprobs=[]))
        return out

    def _where(self, message: dict[str, Any]) -> dict[str, Any]:
        """Where the open item's (``message``'s) text part is, for its events."""
        return {"item_id": message["id"], "output_index": len(self._output),
                "content_index": 0}

    def _close_message(self, status: str = "completed") -> list[dict[str, Any]]:
        if self._message is None:
            return []
        message = self._message
        part = message["content"][0]
        out = [self._event("response.output_text.done", **self._where(message),
                           text=part["text"], logprobs=[]),
               self._event("response.content_part.done", **self._where(message), part=dict(part))]
        self._message["status"] = status
        out.append(self._event("response.output_item.done", output_index=len(self._output),
                               item=json.loads(json.dumps(self._message))))
        self._output.append(self._message)
        self._message = None
        return out

    def tool_call(self, call_id: str, name: str, arguments: str,
                  complete: bool = True) -> list[dict[str, Any]]:
        """A function_call item; one the token limit cut off (``complete`` false) is
        ``incomplete``, its arguments as far as they got."""
        self._check(started=True)
        out = self._close_reasoning() + self._close_message()
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "arguments": "", "call_id": call_id, "name": name}
        index = len(self._output)
        out.append(self._event("response.output_item.added", output_index=index,
                               item=dict(item)))
        out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                               output_index=index, delta=arguments))
        out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                               output_index=index, arguments=arguments, name=name))
        item.update(arguments=arguments, status="completed" if complete else "incomplete")
        out.append(self._event("response.output_item.done", output_index=index,
                               item=dict(item)))
        self._output.append(item)
        return out

    def finish(self, finish_reason: str, *, prompt_tokens: int, completion_tokens: int,
               cached_tokens: int = 0, reasoning_tokens: int = 0) -> list[dict[str, Any]]:
        """Close the open item and the response; cut by the token limit, it is incomplete."""
        self._check(started=True)
        cut = finish_reason == "length"
        status = "incomplete" if cut else "completed"
        out = self._close_reasoning(status) + self._close_message(status)
        self.response.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            output=self._output,
            usage=usage(prompt_tokens, completion_tokens, cached_tokens, reasoning_tokens),
            completed_at=None if cut else time.time(),
        )
        kind = "response.incomplete" if cut else "response.completed"
        out.append(self._event(kind, response=self._snapshot()))
        self.done = True
        return out

    def error(self, exc: ApiError) -> list[dict[str, Any]]:
        """The stream's end after a failure: an ``error`` event, then ``response.failed``
        with what was produced so far (the open message as it stood, incomplete)."""
        self.done = True
        out = [self._event("error", code=exc.code or exc.type, message=exc.message,
                           param=exc.param)]
        if self.started:
            for open_item in (self._reasoning, self._message):
                if open_item is not None:
                    open_item["status"] = "incomplete"
                    self._output.append(open_item)
            self._reasoning = self._message = None
            self.response.update(status="failed", output=self._output, error={
                "code": _failed_code(exc.status), "message": exc.message})
            out.append(self._event("response.failed", response=self._snapshot()))
        return out

    def _check(self, *, started: bool) -> None:
        if self.done:
            raise RuntimeError("the response stream has already ended")
        if self.started != started:
            raise RuntimeError("response already started" if self.started
                               else "the first event must be start")


def response_collector(request: ResponsesRequest, response_id: str | None = None,
                       **defaults: Any) -> Collector:
    """The non-streamed ``response`` object, accumulated from ``ResponseStream``'s events,
    so both answers to one generation are the same."""
    return Collector(ResponseStream(request, response_id, **defaults), accumulate)


def accumulate(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished stream's events as the final ``response`` object, as a client rebuilds
    it: the items from their added/delta/done events, the rest from the last lifecycle
    event (``response.completed``, ``.incomplete`` or ``.failed``)."""
    response: dict[str, Any] | None = None
    items: dict[int, dict[str, Any]] = {}
    final = False
    for e in events:
        kind = e["type"]
        if kind in ("response.created", "response.in_progress"):
            response = json.loads(json.dumps(e["response"]))
        elif response is None:
            raise ValueError(f"{kind} before response.created")
        elif kind == "response.output_item.added":
            items[e["output_index"]] = json.loads(json.dumps(e["item"]))
        elif kind == "response.content_part.added":
            items[e["output_index"]]["content"].append(dict(e["part"]))
        elif kind == "response.output_text.delta":
            items[e["output_index"]]["content"][e["content_index"]]["text"] += e["delta"]
        elif kind == "response.reasoning_text.delta":
            parts = items[e["output_index"]]["content"]
            if len(parts) <= e["content_index"]:
                parts.append({"type": "reasoning_text", "text": ""})
            parts[e["content_index"]]["text"] += e["delta"]
        elif kind == "response.function_call_arguments.delta":
            items[e["output_index"]]["arguments"] += e["delta"]
        elif kind == "response.output_item.done":
            items[e["output_index"]] = json.loads(json.dumps(e["item"]))
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            last = e["response"]
            response = {**json.loads(json.dumps(last)),
                        "output": [items[i] for i in sorted(items)]}
            final = True
        elif kind == "error":
            continue  # response.failed follows it once the response had started
    if response is None or not final:
        raise ValueError("the stream did not finish")
    return response
