"""OpenAI Responses API wire format (``POST /v1/responses``): requests, conversion, streams.

Pure translation, no model and no Ray, like ``anthropic_api``: a validated
Responses body becomes the ``ChatCompletionRequest`` every model replica takes
(so it is templated, cached and decoded exactly as the equivalent chat request),
and the replica's typed events (``serve_app.serving.events``: ``Start``, ``Delta``,
``ToolCall``, ``Finish``, ``Failure``) become the Responses API's SSE event sequence; the
non-streamed ``response`` object is accumulated from those same events. Shapes
are checked against the ``openai`` SDK's types in ``tests/test_responses_units.py``.

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
``function_call_output`` items are ``tool`` messages; ``reasoning`` items are
dropped (we never produce them, and dropping them always keeps every turn the same).

Accepted without effect: ``metadata``, ``user``, ``include``, ``reasoning``,
``prompt_cache_key``, ``prompt_cache_retention``, ``safety_identifier``,
``service_tier``, ``truncation`` (an over-long input is a 400, never truncated),
``max_tool_calls``, ``stream_options``, ``text.verbosity``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    Tag,
    ValidationError,
)

from serve_app.api.openai_api import Collector
from serve_app.config.validation import clean_loc
from serve_app.serving.events import Delta, Event, Failure, Finish, Start, ToolCall
from serve_app.serving.request import MAX_TOKENS, ApiError, ChatCompletionRequest, checked
from serve_app.serving.request import validation_error as request_validation_error
from serve_app.serving.tool_rules import TOOL_NAME_PATTERN, choice_problem

# Tool names as the chat API's FunctionDef takes them.
SUPPORTED_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
SUPPORTED_PARTS = ("input_text", "output_text", "refusal")


# ---- request schemas ----------------------------------------------------------------


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputText(_Open):
    type: Literal["input_text"]
    text: StrictStr


class OutputText(_Open):
    type: Literal["output_text"]
    text: StrictStr


class Refusal(_Open):
    type: Literal["refusal"]
    refusal: StrictStr


class UnsupportedPart(_Open):
    """Content the schema knows only so that the error can name it."""

    type: Literal["input_image", "input_file", "input_audio"]


ContentPart = Annotated[InputText | OutputText | Refusal | UnsupportedPart,
                        Field(discriminator="type")]


class MessageItem(_Open):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: StrictStr | list[ContentPart]


class FunctionCallItem(_Open):
    type: Literal["function_call"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    arguments: StrictStr


class FunctionCallOutputItem(_Open):
    type: Literal["function_call_output"]
    call_id: Annotated[StrictStr, Field(min_length=1)]
    output: StrictStr | list[ContentPart]


class ReasoningItem(_Open):
    """A reasoning item sent back in history: dropped (we never produce one)."""

    type: Literal["reasoning"]


def _item_tag(value: Any) -> str:
    """An item's type; a role/content item without one is a message, as the SDK allows."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", "message")


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_tag),
]


class FunctionToolParam(_Open):
    """A function tool, flat as the Responses API has it; other tool types are refused."""

    type: StrictStr
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)] | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    name: StrictStr


class FormatText(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]


class FormatJsonObject(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_object"]


class FormatJsonSchema(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["json_schema"]
    name: Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    description: StrictStr | None = None
    strict: StrictBool | None = None


TextFormat = Annotated[FormatText | FormatJsonObject | FormatJsonSchema,
                       Field(discriminator="type")]


class TextConfig(_Open):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(_Open):
    """POST /v1/responses."""

    model: StrictStr
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    tools: list[FunctionToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    stream: StrictBool = False
    store: StrictBool | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: StrictBool | None = None
    prompt: Any = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None

    def check_supported(self) -> None:
        """All 400s of the request, before any tokenizer time: the conversion itself."""
        to_chat_request(self)


def parse_request(body: Any) -> ResponsesRequest:
    """A /v1/responses body validated and checked; ``ApiError(400)`` naming the field."""
    return checked(ResponsesRequest, body, validation_error)


_ITEM_TAGS = frozenset(SUPPORTED_ITEMS) | frozenset(SUPPORTED_PARTS) | {
    "input_image", "input_file", "input_audio"}
_FORMAT_TAGS = frozenset({"text", "json_object", "json_schema"})


def param_of(loc: list | tuple) -> str | None:
    """A field path as OpenAI writes it: ``input[3].content[0].type``."""
    out = ""
    for p in loc:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _clean(loc: tuple) -> list:
    """``clean_loc``, also without a discriminator's tag after an index or a field."""
    out = clean_loc(loc)
    return [p for i, p in enumerate(out)
            if not (i > 0 and (p in _ITEM_TAGS and isinstance(out[i - 1], int)
                               or p in _FORMAT_TAGS and out[i - 1] == "format"))]


def validation_error(exc: ValidationError) -> ApiError:
    """The deepest pydantic error as a 400 (``serving.request.validation_error``), its path
    as OpenAI writes it (``input[3].content[0].type``) and its tag errors in words."""
    return request_validation_error(exc, _clean, _explain, param_of)


def _explain(worst: dict, loc: list) -> tuple[list, str, str | None] | None:
    if worst["type"] == "union_tag_invalid":
        tag = worst["ctx"]["tag"]
        message = worst["msg"]
        if len(loc) >= 2 and loc[-2] in ("content", "output"):
            message = (f"content part type {tag!r} is not supported (supported: "
                       f"{', '.join(SUPPORTED_PARTS)})")
        elif loc[:1] == ["input"]:
            message = (f"input item type {tag!r} is not supported by this server (supported: "
                       f"{', '.join(SUPPORTED_ITEMS)})")
        elif loc[-1:] == ["format"]:
            message = f"format type {tag!r} is not supported (text, json_object, json_schema)"
        return [*loc, "type"], message, "unsupported_value"
    if worst["type"] == "union_tag_not_found":
        return [*loc, "type"], "missing 'type'", None
    return None


# ---- conversion ---------------------------------------------------------------------------


def _refuse(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param, code=code)


def _check_stateless(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        raise _refuse("previous_response_id", "this server does not store responses; send the "
                      "whole conversation in input (and instructions) instead",
                      "unsupported_parameter")
    if request.conversation is not None:
        raise _refuse("conversation", "this server does not store conversations; send the "
                      "whole conversation in input instead", "unsupported_parameter")
    if request.background:
        raise _refuse("background", "background responses are not supported (nothing is "
                      "stored)", "unsupported_parameter")
    if request.prompt is not None:
        raise _refuse("prompt", "stored prompt templates are not supported; send "
                      "instructions and input", "unsupported_parameter")
    if request.top_logprobs:
        raise _refuse("top_logprobs", "logprobs are not supported on /v1/responses (use "
                      "/v1/chat/completions)", "unsupported_parameter")


def _text(parts: str | list, where: str, *, output: bool = False) -> str:
    """A message's (or a function output's) text: parts joined as chat joins them."""
    if isinstance(parts, str):
        return parts
    texts = []
    for j, part in enumerate(parts):
        if isinstance(part, UnsupportedPart):
            kind = "function_call_output" if output else "message"
            raise _refuse(f"{where}[{j}].type", f"{part.type} content is not supported by "
                          f"this server in a {kind} (text only)", "unsupported_content")
        texts.append(part.refusal if isinstance(part, Refusal) else part.text)
    return "".join(texts)


def _arguments(call: FunctionCallItem, where: str) -> str:
    try:
        value = json.loads(call.arguments) if call.arguments.strip() else {}
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise _refuse(f"{where}.arguments", "must be the JSON text of an object")
    return call.arguments


def _tools(request: ResponsesRequest) -> list[dict] | None:
    if not request.tools:
        return None
    out, names = [], set()
    for i, t in enumerate(request.tools):
        where = f"tools[{i}]"
        if t.type != "function":
            raise _refuse(f"{where}.type", f"{t.type!r} tools are not supported by this "
                          "server; only function tools", "unsupported_tool")
        if t.name is None:
            raise _refuse(f"{where}.name", "Field required")
        if t.name in names:
            raise _refuse(f"{where}.name", f"function name {t.name!r} is used twice")
        names.add(t.name)
        _check_schema(t.parameters, f"{where}.parameters")
        function: dict[str, Any] = {"name": t.name}
        if t.description is not None:
            function["description"] = t.description
        if t.parameters is not None:
            function["parameters"] = t.parameters
        if t.strict is not None:
            function["strict"] = t.strict
        out.append({"type": "function", "function": function})
    return out


def _check_schema(schema: dict | None, where: str) -> None:
    """A function's parameters: an object schema whose properties are schemas."""
    if schema is None:
        return
    if schema.get("type", "object") != "object":
        raise _refuse(where, "must be a JSON schema with type 'object'")
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(
            isinstance(v, (dict, bool)) for v in properties.values()):
        raise _refuse(f"{where}.properties", "must be an object mapping names to schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise _refuse(f"{where}.required", "must be a list of property names")


def _tool_choice(request: ResponsesRequest, tools: list[dict] | None) -> str | dict | None:
    choice = request.tool_choice
    names = {t["function"]["name"] for t in tools or ()}
    if choice is None or choice == "auto" or choice == "none":
        return choice
    named = None if choice == "required" else choice.name
    problem = choice_problem(True, named, names)
    if problem == "needs_tools":
        raise _refuse("tool_choice", f"{_choice_text(choice)} needs tools")
    if problem == "unknown_name":
        raise _refuse("tool_choice.name", f"no function named {named!r} in tools")
    if choice == "required":
        return choice
    return {"type": "function", "function": {"name": named}}


def _choice_text(choice: str | NamedFunction) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.name!r}"


def _response_format(request: ResponsesRequest) -> dict | None:
    fmt = request.text.format if request.text else None
    if fmt is None or isinstance(fmt, FormatText):
        return None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    schema: dict[str, Any] = {"name": fmt.name, "schema": fmt.schema_}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def to_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's conversation as chat messages (OpenAI's chat shape)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    if isinstance(request.input, str):
        messages.append({"role": "user", "content": request.input})
        return messages
    calls: set[str] = set()
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item, where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise _refuse(f"{where}.call_id", f"no function_call with call_id "
                              f"{item.call_id!r} earlier in input")
            text = _text(item.output, f"{where}.output", output=True)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    if len(messages) == (1 if request.instructions else 0):
        raise _refuse("input", "must hold at least one message")
    return messages


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The validated request as the chat request a model replica takes; ``ApiError(400)``
    naming the Responses field for what cannot be served."""
    _check_stateless(request)
    messages = to_messages(request)
    tools = _tools(request)
    choice = _tool_choice(request, tools)
    fmt = _response_format(request)
    forced = choice == "required" or isinstance(choice, dict)
    if fmt is not None and forced:
        raise _refuse("text.format", "a JSON format cannot be combined with a forced "
                      "tool_choice")
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": request.parallel_tool_calls if tools else None,
        "response_format": fmt,
    }
    try:
        return checked(ChatCompletionRequest, body, validation_error)
    except ApiError as exc:
        raise renamed(exc) from None


def renamed(exc: ApiError) -> ApiError:
    """An error about the chat request (from the checks, the Preparer or the replica)
    with its ``param`` named as the Responses request has it."""
    param = exc.param
    if not param:
        return exc
    new = param
    for old, to in (("messages", "input"), ("response_format.json_schema.schema",
                                             "text.format.schema"),
                    ("response_format", "text.format"), ("max_tokens", "max_output_tokens")):
        if param == old or param.startswith((old + ".", old + "[")):
            new = to + param[len(old):]
            break
    if new.startswith("tools[") and ".function." in new:
        new = new.replace(".function.", ".", 1)
    if new == param:
        return exc
    message = exc.message.replace(param, new, 1)
    return ApiError(exc.status, message, type=exc.type, param=new, code=exc.code,
                    headers=exc.headers)


# ---- responses ---------------------------------------------------------------------------


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """Responses usage: ``input_tokens`` counts all prompt tokens, the cached ones among them."""
    return {
        "input_tokens": prompt_tokens,
        # cache_write_tokens: the SDK requires it; what a request adds to the cache is not
        # counted per request here (blocks are stored after the fact), so it is 0.
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
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
        "reasoning": {"effort": None, "summary": None},
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
    ``response.output_item.added``, for text ``response.content_part.added``,
    ``response.output_text.delta``..., ``response.output_text.done``,
    ``response.content_part.done``, for a call ``response.function_call_arguments.delta``
    and ``.done``, then ``response.output_item.done``; finally ``response.completed``
    (``response.incomplete`` when cut by the token limit). An error after the start
    sends an ``error`` event and ``response.failed``. Every event has its
    ``sequence_number``; each method returns the events to send now.
    """

    def __init__(self, request: ResponsesRequest, response_id: str | None = None, *,
                 temperature: float | None = None, top_p: float | None = None,
                 created_at: float | None = None) -> None:
        self.response = response_object(
            request, response_id or new_response_id(),
            time.time() if created_at is None else created_at,
            temperature=temperature, top_p=top_p)
        self.started = False
        self.done = False
        self._sequence = 0
        self._message: dict | None = None  # the open message item
        self._output: list[dict] = []  # finished items

    @property
    def response_id(self) -> str:
        return self.response["id"]

    def feed(self, event: Event) -> list[dict[str, Any]]:
        """Dispatch one replica event (``serve_app.serving.events``)."""
        if isinstance(event, Start):
            return self.start()
        if isinstance(event, Delta):
            return self.text(event.text)
        if isinstance(event, ToolCall):
            return self.tool_call(event.id, event.name, event.arguments, event.complete)
        if isinstance(event, Finish):
            return self.finish(event.finish_reason, prompt_tokens=event.prompt_tokens,
                               completion_tokens=event.completion_tokens,
                               cached_tokens=event.cached_tokens)
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

    def text(self, text: str) -> list[dict[str, Any]]:
        self._check(started=True)
        if not text:
            return []
        out = []
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
        """Where the open ``message``'s text part is, for its events."""
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
        out = self._close_message()
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
               cached_tokens: int = 0) -> list[dict[str, Any]]:
        """Close the open item and the response; cut by the token limit, it is incomplete."""
        self._check(started=True)
        cut = finish_reason == "length"
        out = self._close_message("incomplete" if cut else "completed")
        self.response.update(
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            output=self._output,
            usage=usage(prompt_tokens, completion_tokens, cached_tokens),
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
            if self._message is not None:
                self._message["status"] = "incomplete"
                self._output.append(self._message)
                self._message = None
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
