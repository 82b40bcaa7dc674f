"""The Anthropic Messages request: its body's schema (pydantic, validated once), its
errors in Anthropic's words, and its translation into the chat input every replica
serves (``to_chat_input``): messages, tools, ``tool_choice``, ``cache_control``
checkpoints.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from serve_app.api.thinking_signature import SignedThought, signed_block
from serve_app.config.validation import clean_loc
from serve_app.serving.request import MAX_TOKENS, ApiError, checked
from serve_app.serving.request import validation_error as request_validation_error
from serve_app.serving.tool_rules import (
    ANTHROPIC_MAX_TOOL_NAME,
    anthropic_name_ok,
    choice_problem,
    first_duplicate,
)
from serve_app.serving.tools import ToolCall

# Text blocks of one turn (or of the system prompt) are joined with this: the
# same request must always render the same prompt, or prefix caching misses.
BLOCK_SEPARATOR = "\n"


class CacheControl(BaseModel):
    """A prompt-caching breakpoint; we keep only where it is (see ChatInput)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["ephemeral"]
    ttl: StrictStr | None = None


class _Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    cache_control: CacheControl | None = None


class TextBlock(_Block):
    type: Literal["text"]
    text: StrictStr


class ImageSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["base64", "url"]
    media_type: StrictStr | None = None  # base64
    data: StrictStr | None = None  # base64
    url: StrictStr | None = None  # url: refused (this server fetches nothing)

    def as_url(self, where: str) -> str:
        """The image as the chat API's data URL."""
        if self.type == "url":
            return self.url or ""  # the image decoder refuses a web address, saying why
        if not self.data or not self.media_type:
            raise ApiError(400, f"{where}.source: a base64 image needs media_type and data",
                           param=f"{where}.source")
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Block):
    type: Literal["image"]
    source: ImageSource


class UnsupportedBlock(_Block):
    """Block types the schema knows only so that the error can name them."""

    type: Literal[
        "document", "search_result", "container_upload", "server_tool_use",
        "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result",
        "mcp_tool_use", "mcp_tool_result",
    ]


class ThinkingBlock(_Block):
    """A thought sent back in history: its signature is verified (by the route) and its
    text becomes the assistant message's ``reasoning_content``."""

    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr


class RedactedThinkingBlock(_Block):
    """A redacted thought (Anthropic's own, encrypted): accepted and dropped."""

    type: Literal["redacted_thinking"]


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: Annotated[StrictStr, Field(min_length=1)]
    name: Annotated[StrictStr, Field(min_length=1)]
    input: dict[str, Any]


ToolResultPart = Annotated[TextBlock | ImageBlock | UnsupportedBlock,
                           Field(discriminator="type")]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: Annotated[StrictStr, Field(min_length=1)]
    content: StrictStr | list[ToolResultPart] | None = None
    is_error: StrictBool | None = None


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
    | RedactedThinkingBlock
    | UnsupportedBlock,
    Field(discriminator="type"),
]


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]


class Tool(BaseModel):
    """A client tool; server tools (a ``type`` such as ``web_search_20250305``) are refused."""

    model_config = ConfigDict(extra="allow")
    name: Annotated[StrictStr, Field(min_length=1, max_length=ANTHROPIC_MAX_TOOL_NAME)]
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    type: StrictStr | None = None
    cache_control: CacheControl | None = None


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: StrictStr | None = None
    disable_parallel_tool_use: StrictBool | None = None


class ThinkingParam(BaseModel):
    """``thinking``: ``enabled`` with a ``budget_tokens`` (the thought's budget),
    ``adaptive`` (the profile's budget) or ``disabled``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class _Conversation(BaseModel):
    """What both /v1/messages and /v1/messages/count_tokens take."""

    model_config = ConfigDict(extra="allow")
    model: StrictStr
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    cache_control: CacheControl | None = None  # automatic caching: a breakpoint at the end
    thinking: ThinkingParam | None = None

    def check_supported(self) -> None:
        """All 400s of the request, before any tokenizer time (the same checks as the
        conversion, which is cheap next to templating)."""
        to_chat_input(self)


class MessagesRequest(_Conversation):
    """POST /v1/messages."""

    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)]
    stop_sequences: list[StrictStr] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None  # accepted, not applied
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None

    def requested_max_tokens(self) -> int:
        return self.max_tokens

    def stop_list(self) -> list[str]:
        return list(self.stop_sequences or [])


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens (sampling fields, if sent, are ignored)."""


def parse_messages_request(body: Any) -> MessagesRequest:
    """A /v1/messages body validated and checked; ``ApiError(400)`` naming the field."""
    return checked(MessagesRequest, body, validation_error)


def parse_count_tokens_request(body: Any) -> CountTokensRequest:
    """A /v1/messages/count_tokens body validated and checked, like the above."""
    return checked(CountTokensRequest, body, validation_error)


def validation_error(exc: ValidationError) -> ApiError:
    """The deepest pydantic error as a 400 (``serving.request.validation_error``), with
    the content block's own tag left out of the path and its tag errors in words."""
    return request_validation_error(exc, _clean_loc, _explain)


def _explain(worst: dict, loc: list) -> tuple[list, str, str | None] | None:
    if worst["type"] == "union_tag_invalid":  # pydantic lists every tag, even refused ones
        return loc, (f"content block type {worst['ctx']['tag']!r} is not supported "
                     "(supported: text, tool_use, tool_result)"), None
    if worst["type"] == "union_tag_not_found":
        return loc, "content block has no 'type'", None
    return None


_BLOCK_TAGS = frozenset({"text", "image", "tool_use", "tool_result", "thinking",
                         "redacted_thinking"})


def _clean_loc(loc: tuple) -> list:
    """``clean_loc``, also without the discriminator's tag after a block's index."""
    out = clean_loc(loc)
    return [p for i, p in enumerate(out)
            if not (p in _BLOCK_TAGS and i > 0 and isinstance(out[i - 1], int))]


@dataclass(frozen=True)
class TemplateMessage:
    """One message as a chat template takes it (OpenAI chat shape)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # set on role "tool"
    # The system prompt's blocks, each with its separator: text parts whose join is
    # ``content``, so normalization rules can see (and drop) one block.
    parts: tuple[str, ...] = ()
    reasoning: str | None = None  # an assistant message's thought (its thinking blocks)
    # A user message with images: its text and images in order, as chat parts.
    media: tuple[dict[str, Any], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """OpenAI's chat shape (arguments as JSON text): it becomes a chat request, whose
        messages give templates the arguments as objects."""
        content: str | list[dict[str, Any]] = self.content
        if self.parts:
            content = [{"type": "text", "text": p} for p in self.parts]
        if self.media:
            content = list(self.media)
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name,
                              "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        return out


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: ``auto``, ``required`` (Anthropic ``any``), ``none``, or
    ``function`` with ``name`` (Anthropic ``tool``)."""

    mode: Literal["auto", "required", "none", "function"]
    name: str | None = None

    def to_openai(self) -> str | dict[str, Any]:
        if self.mode == "function":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


@dataclass(frozen=True)
class ChatInput:
    """A Messages request as plain data for templating and sampling.

    ``cache_control_points``: indexes into ``messages`` of the messages holding a
    block marked ``cache_control`` (the system message for a marked system block;
    the last message for a top-level marker), hints for where a checkpoint pays.
    ``tools_cache_control``: a tool was marked.
    ``continue_final``: the last message is the assistant's, to be continued
    (template it with ``continue_final_message=True``, no generation prompt).
    ``thinking``: the model thinks (rendered with thinking off otherwise), within
    ``thinking_budget`` tokens when set. ``thoughts``: the history's signed thinking
    blocks, for the route to verify before their text reaches the prompt.
    """

    messages: tuple[TemplateMessage, ...]
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    cache_control_points: tuple[int, ...] = ()
    tools_cache_control: bool = False
    continue_final: bool = False
    parallel_tool_calls: bool = True
    thinking: bool = False
    thinking_budget: int | None = None
    thoughts: tuple[SignedThought, ...] = ()

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.to_dict() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """OpenAI-style tools for ``apply_chat_template(tools=...)``; None without tools."""
        return [t.to_dict() for t in self.tools] or None


@dataclass
class _Builder:
    messages: list[TemplateMessage] = field(default_factory=list)
    points: set[int] = field(default_factory=set)
    thoughts: list[SignedThought] = field(default_factory=list)

    def add(self, message: TemplateMessage, marked: bool) -> None:
        self.messages.append(message)
        if marked:
            self.points.add(len(self.messages) - 1)


def to_chat_input(request: _Conversation) -> ChatInput:
    """Convert a validated request; ``ApiError(400)`` for what cannot be served.

    Tool results become ``tool`` messages in block order, splitting the user turn
    around them; a tool result must answer a ``tool_use`` of an earlier turn.
    """
    tools = _convert_tools(request.tools or [])
    choice, parallel = _convert_tool_choice(request.tool_choice, tools)
    budget = _thinking_budget(request)
    out = _Builder()
    if request.system is not None:
        parts: tuple[str, ...] = ()
        if isinstance(request.system, str):
            text, marked = request.system, False
        else:
            blocks = [b.text for b in request.system]
            text = BLOCK_SEPARATOR.join(blocks)
            parts = tuple(b + BLOCK_SEPARATOR for b in blocks[:-1]) + tuple(blocks[-1:])
            marked = any(b.cache_control is not None for b in request.system)
        if text or marked:
            out.add(TemplateMessage("system", text, parts=parts if len(parts) > 1 else ()),
                    marked)
    seen_tool_ids: set[str] = set()
    last = len(request.messages) - 1
    continue_final = False
    for i, m in enumerate(request.messages):
        where = f"messages.{i}"
        if m.role == "assistant":
            message, marked = _assistant_message(m.content, where, out.thoughts)
            if i == last and not message.content and not message.tool_calls:
                break  # an empty final assistant turn (or only thinking): just generate
            seen_tool_ids.update(c.id for c in message.tool_calls)
            out.add(message, marked)
            if i == last:
                if message.tool_calls:
                    raise ApiError(400, f"{where}: the final assistant message cannot contain "
                                   "tool_use blocks; send their tool_result blocks in a user "
                                   "message", param=where)
                continue_final = True
        else:
            if _is_empty(m.content):
                raise ApiError(400, f"{where}.content: user messages must not be empty",
                               param=f"{where}.content")
            _user_messages(m.content, where, seen_tool_ids, out)
    if request.cache_control is not None and out.messages:
        out.points.add(len(out.messages) - 1)
    stop = request.stop_list() if isinstance(request, MessagesRequest) else []
    sampling = request if isinstance(request, MessagesRequest) else None
    return ChatInput(
        messages=tuple(out.messages),
        tools=tools,
        tool_choice=choice,
        max_tokens=sampling.max_tokens if sampling else None,
        temperature=sampling.temperature if sampling else None,
        top_p=sampling.top_p if sampling else None,
        top_k=sampling.top_k if sampling else None,
        stop=tuple(stop),
        cache_control_points=tuple(sorted(out.points)),
        tools_cache_control=any(t.cache_control is not None for t in request.tools or ()),
        continue_final=continue_final,
        parallel_tool_calls=parallel,
        thinking=request.thinking is not None and request.thinking.on,
        thinking_budget=budget,
        thoughts=tuple(out.thoughts),
    )


def _thinking_budget(request: _Conversation) -> int | None:
    """``thinking.budget_tokens`` of an enabled request: required, and below
    ``max_tokens`` (which counts the thought and the answer), as Anthropic has it."""
    thinking = request.thinking
    if thinking is None or thinking.type != "enabled":
        return None
    budget = thinking.budget_tokens
    if budget is None:
        raise ApiError(400, "thinking.budget_tokens: Field required (with type 'enabled')",
                       param="thinking.budget_tokens")
    if isinstance(request, MessagesRequest) and budget >= request.max_tokens:
        raise ApiError(400, f"thinking.budget_tokens: must be less than max_tokens (got "
                            f"{budget} >= {request.max_tokens}): max_tokens counts the "
                            "thought and the answer", param="thinking.budget_tokens")
    return budget


def _is_empty(content: str | list) -> bool:
    return len(content) == 0


def _unsupported(block: UnsupportedBlock | ImageBlock, where: str) -> ApiError:
    return ApiError(400, f"{where}: {block.type} content blocks are not supported by this "
                    "server", param=where, code="unsupported_content")


def _assistant_message(content: str | list, where: str,
                       thoughts: list[SignedThought]) -> tuple[TemplateMessage, bool]:
    if isinstance(content, str):
        return TemplateMessage("assistant", content), False
    texts: list[str] = []
    thought: list[str] = []
    calls: list[ToolCall] = []
    marked = False
    for j, b in enumerate(content):
        at = f"{where}.content.{j}"
        marked = marked or b.cache_control is not None
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False)))
        elif isinstance(b, ToolResultBlock):
            raise ApiError(400, f"{at}: tool_result blocks belong in user messages", param=at)
        elif isinstance(b, ImageBlock):
            raise ApiError(400, f"{at}: image blocks belong in user messages", param=at)
        elif isinstance(b, UnsupportedBlock):
            raise _unsupported(b, at)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(signed_block(f"{at}.signature", b.thinking, b.signature))
            thought.append(b.thinking)
        # RedactedThinkingBlock: dropped
    reasoning = BLOCK_SEPARATOR.join(thought) if thought else None
    return TemplateMessage("assistant", BLOCK_SEPARATOR.join(texts), tuple(calls),
                           reasoning=reasoning), marked


def _user_message(parts: list[str | dict[str, Any]]) -> TemplateMessage:
    """Text blocks (joined) and images as one user message: chat parts, a run of text one."""
    if all(isinstance(p, str) for p in parts):
        return TemplateMessage("user", BLOCK_SEPARATOR.join(cast(list[str], parts)))
    media: list[dict[str, Any]] = []
    for is_text, run in itertools.groupby(parts, key=lambda p: isinstance(p, str)):
        items = list(run)
        media += [{"type": "text", "text": BLOCK_SEPARATOR.join(cast(list[str], items))}] \
            if is_text else cast(list[dict[str, Any]], items)
    return TemplateMessage("user", "".join(p.get("text", "") for p in media), media=tuple(media))


def _user_messages(content: str | list, where: str, seen_tool_ids: set[str],
                   out: _Builder) -> None:
    if isinstance(content, str):
        out.add(TemplateMessage("user", content), False)
        return
    parts: list[str | dict[str, Any]] = []  # texts and images (chat parts), in order
    marked = False

    def flush() -> None:
        nonlocal parts, marked
        if parts:
            out.add(_user_message(parts), marked)
        parts, marked = [], False

    for j, b in enumerate(content):
        at = f"{where}.content.{j}"
        if isinstance(b, TextBlock | ImageBlock):
            parts.append(b.text if isinstance(b, TextBlock) else
                         {"type": "image_url", "image_url": {"url": b.source.as_url(at)}})
            marked = marked or b.cache_control is not None
        elif isinstance(b, ToolResultBlock):
            if b.tool_use_id not in seen_tool_ids:
                raise ApiError(400, f"{at}.tool_use_id: no tool_use block with id "
                               f"{b.tool_use_id!r} in an earlier assistant message",
                               param=f"{at}.tool_use_id")
            flush()
            text = _tool_result_text(b, at)
            out.add(TemplateMessage("tool", text, tool_call_id=b.tool_use_id),
                    b.cache_control is not None)
        elif isinstance(b, ToolUseBlock):
            raise ApiError(400, f"{at}: tool_use blocks belong in assistant messages", param=at)
        elif isinstance(b, UnsupportedBlock):
            raise _unsupported(b, at)
        else:
            raise ApiError(400, f"{at}: {b.type} blocks belong in assistant messages", param=at)
    flush()


def _tool_result_text(block: ToolResultBlock, where: str, *, check: bool = True) -> str:
    """The result as text; an error result is marked so the model can tell (the chat
    shape has no is_error)."""
    content = block.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        parts = []
        for k, part in enumerate(content):
            if isinstance(part, UnsupportedBlock | ImageBlock):
                if check:  # a tool result's image: the chat shape has no place for it yet
                    raise _unsupported(part, f"{where}.content.{k}")
                continue
            parts.append(part.text)
        text = BLOCK_SEPARATOR.join(parts)
    return f"Error: {text}" if block.is_error else text


def _convert_tools(tools: list[Tool]) -> tuple[FunctionTool, ...]:
    out = []
    duplicate = first_duplicate(t.name for t in tools)
    for i, t in enumerate(tools):
        where = f"tools.{i}"
        if t.type not in (None, "custom"):
            raise ApiError(400, f"{where}.type: server tool {t.type!r} is not supported by this "
                           "server; only client tools (name, description, input_schema)",
                           param=f"{where}.type", code="unsupported_tool")
        if not anthropic_name_ok(t.name):
            raise ApiError(400, f"{where}.name: tool names may contain only letters, digits, "
                           f"'_' and '-' (got {t.name!r})", param=f"{where}.name")
        if duplicate is not None and duplicate[0] == i:
            raise ApiError(400, f"{where}.name: tool name {t.name!r} is used twice",
                           param=f"{where}.name")
        if t.input_schema is None:
            raise ApiError(400, f"{where}.input_schema: Field required",
                           param=f"{where}.input_schema")
        if t.input_schema.get("type") != "object":
            raise ApiError(400, f"{where}.input_schema: must be a JSON schema with type "
                           "'object'", param=f"{where}.input_schema")
        out.append(FunctionTool(t.name, t.description, t.input_schema))
    return tuple(out)


def _convert_tool_choice(
    choice: ToolChoiceParam | None, tools: tuple[FunctionTool, ...]
) -> tuple[ToolChoice | None, bool]:
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "none":
        return ToolChoice("none"), parallel
    names = {t.name for t in tools}
    if choice_problem(True, None, names) == "needs_tools":  # (auto too: Anthropic's rule)
        raise ApiError(400, f"tool_choice: type {choice.type!r} needs tools", param="tool_choice")
    if choice.type == "auto":
        return ToolChoice("auto"), parallel
    if choice.type == "any":
        return ToolChoice("required"), parallel
    if not choice.name:
        raise ApiError(400, "tool_choice.name: required when type is 'tool'",
                       param="tool_choice.name")
    if choice_problem(True, choice.name, names) == "unknown_name":
        raise ApiError(400, f"tool_choice.name: no tool named {choice.name!r} in tools",
                       param="tool_choice.name")
    return ToolChoice("function", choice.name), parallel
