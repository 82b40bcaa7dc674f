"""The OpenAI Responses request: its body's schema (pydantic, validated once; stateless:
no ``previous_response_id``), its errors as OpenAI words them, and its translation into
the equivalent chat completions request (``to_chat_request``).
"""

from __future__ import annotations

import json
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

from serve_app.api.thinking_signature import SignedThought, opened
from serve_app.config.validation import clean_loc
from serve_app.serving.request import MAX_TOKENS, ApiError, ChatCompletionRequest, checked
from serve_app.serving.request import validation_error as request_validation_error
from serve_app.serving.tool_rules import TOOL_NAME_PATTERN, choice_problem, forces_call

# Tool names as the chat API's FunctionDef takes them.
SUPPORTED_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


SUPPORTED_PARTS = ("input_text", "input_image", "output_text", "refusal")


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


class InputImage(_Open):
    """An image in a user message: ``image_url`` a base64 data URL (``file_id`` names a
    stored file, and nothing is stored here: a 400)."""

    type: Literal["input_image"]
    image_url: StrictStr | None = None
    file_id: StrictStr | None = None
    detail: Literal["auto", "low", "high"] = "auto"


class UnsupportedPart(_Open):
    """Content the schema knows only so that the error can name it."""

    type: Literal["input_file", "input_audio"]


ContentPart = Annotated[InputText | InputImage | OutputText | Refusal | UnsupportedPart,
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


class ReasoningText(_Open):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(_Open):
    """A reasoning item sent back in history (Codex sends each one back): its thought
    becomes the next assistant message's ``reasoning_content``; ``encrypted_content``
    (ours, signed) wins over ``content``, and one that does not verify is a 400."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    encrypted_content: StrictStr | None = None

    def thought(self, where: str) -> str | None:
        if self.encrypted_content is not None:
            return opened(f"{where}.encrypted_content", self.encrypted_content).text
        if self.content:
            return "".join(p.text for p in self.content)
        return None


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


class ReasoningParam(_Open):
    """``reasoning``: the effort as the profile's thought budget (``none``: thinking
    off; ``xhigh`` is ``high``); ``summary`` is accepted, none is written."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


ENCRYPTED_REASONING = "reasoning.encrypted_content"


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
    reasoning: ReasoningParam | None = None
    include: list[StrictStr] | None = None

    def wants_encrypted_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or ())

    def check_supported(self) -> None:
        """All 400s of the request, before any tokenizer time: the conversion itself."""
        to_chat_request(self)


def parse_request(body: Any) -> ResponsesRequest:
    """A /v1/responses body validated and checked; ``ApiError(400)`` naming the field."""
    return checked(ResponsesRequest, body, validation_error)


_ITEM_TAGS = frozenset(SUPPORTED_ITEMS) | frozenset(SUPPORTED_PARTS) | {
    "input_file", "input_audio"}


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
        if isinstance(part, InputImage):
            raise _refuse(f"{where}[{j}].type", "input_image content belongs in a user "
                          "message", "unsupported_content")
        texts.append(part.refusal if isinstance(part, Refusal) else part.text)
    return "".join(texts)


def _user_content(parts: str | list, where: str) -> str | list[dict[str, Any]]:
    """A user message's content as chat takes it: text, or parts where it has images."""
    if isinstance(parts, str) or not any(isinstance(p, InputImage) for p in parts):
        return _text(parts, where)
    out: list[dict[str, Any]] = []
    for j, part in enumerate(parts):
        if isinstance(part, InputImage):
            if part.image_url is None:
                raise _refuse(f"{where}[{j}].image_url", "this server stores no files: send "
                              "the image as image_url, a base64 data URL", "unsupported_content")
            out.append({"type": "image_url",
                        "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            out.append({"type": "text", "text": _text([part], where)})
    return out


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
    if isinstance(choice, NamedFunction):
        named: str | None = choice.name
        text = f"function {choice.name!r}"
    elif forces_call(choice):
        named, text = None, repr(choice)
    else:
        return choice
    problem = choice_problem(True, named, names)
    if problem == "needs_tools":
        raise _refuse("tool_choice", f"{text} needs tools")
    if problem == "unknown_name":
        raise _refuse("tool_choice.name", f"no function named {named!r} in tools")
    if named is None:
        return "required"
    return {"type": "function", "function": {"name": named}}


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
    thought: list[str] = []  # reasoning items not yet followed by the assistant's turn
    for i, item in enumerate(request.input):
        where = f"input[{i}]"
        if isinstance(item, ReasoningItem):
            text = item.thought(where)
            if text is not None:
                thought.append(text)
            continue
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = _user_content(item.content, f"{where}.content") if role == "user" \
                else _text(item.content, f"{where}.content")
            messages.append({"role": role, "content": content})
            if role == "assistant" and thought:
                messages[-1]["reasoning_content"] = "\n".join(thought)
            thought = []
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item, where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and not thought:
                last.setdefault("tool_calls", []).append(call)  # the same turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    messages[-1]["reasoning_content"] = "\n".join(thought)
            thought = []
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise _refuse(f"{where}.call_id", f"no function_call with call_id "
                              f"{item.call_id!r} earlier in input")
            text = _text(item.output, f"{where}.output", output=True)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
            thought = []
    if len(messages) == (1 if request.instructions else 0):
        raise _refuse("input", "must hold at least one message")
    return messages


def _effort(request: ResponsesRequest) -> str | None:
    effort = request.reasoning.effort if request.reasoning else None
    return "high" if effort == "xhigh" else effort


def signed_thoughts(request: ResponsesRequest) -> list[SignedThought]:
    """The ``encrypted_content`` of the reasoning items in ``input``, for the route to
    verify before their text reaches the prompt."""
    if isinstance(request.input, str):
        return []
    return [opened(f"input[{i}].encrypted_content", item.encrypted_content)
            for i, item in enumerate(request.input)
            if isinstance(item, ReasoningItem) and item.encrypted_content is not None]


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The validated request as the chat request a model replica takes; ``ApiError(400)``
    naming the Responses field for what cannot be served."""
    _check_stateless(request)
    messages = to_messages(request)
    tools = _tools(request)
    choice = _tool_choice(request, tools)
    fmt = _response_format(request)
    if fmt is not None and forces_call(choice):
        raise _refuse("text.format", "a JSON format cannot be combined with a forced "
                      "tool_choice")
    body: dict[str, Any] = {
        "model": request.model, "messages": messages, "stream": request.stream,
        "max_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "tools": tools, "tool_choice": choice,
        "parallel_tool_calls": request.parallel_tool_calls if tools else None,
        "response_format": fmt,
        "reasoning_effort": _effort(request),
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
