"""The request a model replica serves: OpenAI's chat and completions schemas, validated.

Every API's route turns its body into one of these (the Anthropic Messages and
Responses routes translate theirs), so the serving layer reads one shape. Only
shapes and checks live here; no model, no Ray. Requests are validated strictly
enough that a wrong type is a 400 naming the field, while fields that clients
commonly send and that do not change the result (``user``, ``metadata``...)
are accepted and ignored. ``ApiError`` is how any layer refuses a request.
"""


from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Protocol, Self, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
)

from serve_app.config.validation import clean_loc
from serve_app.serving.events import Failure
from serve_app.serving.sampling import MAX_TOP_LOGPROBS
from serve_app.serving.tool_rules import (
    TOOL_NAME_PATTERN,
    choice_problem,
    first_duplicate,
    forces_call,
)


@dataclass(frozen=True)
class Caller:
    """Who sent a request, as the ingress saw it: never read from the request body.

    It travels beside the request so no client can set it. ``api_key_digest``
    is a sha256 of the bearer token (never the key); the replica salts cache
    blocks with it when the profile isolates by API key.
    """

    api_key_digest: str | None = None


class ApiError(Exception):
    """An error that becomes an OpenAI-style JSON body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        """Picklable (it crosses Ray from a replica): rebuilt from its ``Failure``."""
        return (ApiError.from_failure, (self.to_failure(),))

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_failure(self) -> Failure:
        """The error as a replica's event, to cross from a replica to the ingress."""
        return Failure(self.status, self.message, self.type, self.param, self.code,
                       dict(self.headers))

    @classmethod
    def from_failure(cls, failure: Failure) -> ApiError:
        return cls(failure.status, failure.message, type=failure.type, param=failure.param,
                   code=failure.code, headers=dict(failure.headers))


MAX_STOPS = 16
MAX_CACHE_SALT_CHARS = 256
MAX_SEED = 2**64  # seeds are unsigned 64-bit (the engine's PRNG key)
MAX_TOKENS = 2**31 - 1  # beyond any context: a larger max_tokens is a mistake (400)
# What one message costs in the prompt bound beyond its text: the chat template's
# role markers and separators (about 5-10 tokens a message in common templates).
MESSAGE_OVERHEAD_CHARS = 16


class _Servable(Protocol):
    """A request model (any API's) that says what of it is not served (``ApiError``)."""

    @classmethod
    def model_validate(cls, obj: Any) -> Self: ...

    def check_supported(self) -> None: ...


R = TypeVar("R", bound=_Servable)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=MAX_SEED)] | None = None
    # OpenAI takes 4; Anthropic's stop_sequences, carried here, may be more.
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: StrictStr | None = None
    # Tokens another replica generated for this request before it was lost: the answer
    # continues after them (set by the ingress, ``api/resume.py``; never from a body).
    _resume_tokens: tuple[int, ...] = PrivateAttr(default=())

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        """Reject options that would change the result in ways we cannot honour."""
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        check_cache_salt(self.cache_salt)
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )


def check_cache_salt(salt: str | None) -> None:
    """400 for a salt that is too long or not encodable as UTF-8 (a lone surrogate,
    which JSON can carry): the cache and the router hash its UTF-8 bytes."""
    if salt is None:
        return
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise ApiError(400, f"cache_salt is {len(salt)} characters, over the limit of "
                            f"{MAX_CACHE_SALT_CHARS}", param="cache_salt", code="invalid_value")
    try:
        salt.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, "cache_salt must be valid Unicode text (it has a lone surrogate)",
                       param="cache_salt", code="invalid_value") from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: StrictStr  # a base64 data URL (web addresses are refused: never fetched)
    detail: Literal["auto", "low", "high"] = "auto"


class ImagePart(BaseModel):
    """An image in a user message (OpenAI's ``image_url`` part; Anthropic's ``image``
    blocks and Responses' ``input_image`` items arrive as these)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr  # a JSON object, as OpenAI sends it

    def as_object(self) -> dict[str, Any]:
        """The arguments as an object (``check_supported`` made sure they are one)."""
        value = json.loads(self.arguments) if self.arguments.strip() else {}
        if not isinstance(value, dict):
            raise ValueError("not an object")
        return value


class ToolCallIn(BaseModel):
    """A tool call an assistant message made (the conversation's history)."""

    model_config = ConfigDict(extra="allow")
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: Annotated[StrictStr, Field(pattern=TOOL_NAME_PATTERN)]
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef

    def to_template(self) -> dict[str, Any]:
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[Annotated[TextPart | ImagePart, Field(discriminator="type")]] \
        | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant messages
    tool_call_id: StrictStr | None = None  # tool messages
    # An assistant message's thought, sent back as the server sent it (the template
    # decides whether to render it: Qwen3's drops the thoughts of turns before the last
    # user message).
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None  # mlx_lm.server's and OpenRouter's name for it

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if isinstance(p, TextPart))

    def images(self) -> list[ImageURL]:
        if not isinstance(self.content, list):
            return []
        return [p.image_url for p in self.content if isinstance(p, ImagePart)]

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template takes it (OpenAI's chat shape; a message with
        images as parts, each image as ``{"type": "image"}``, as vision templates take)."""
        content: Any = self.text()
        if self.images():
            assert isinstance(self.content, list)
            content = [{"type": "text", "text": p.text} if isinstance(p, TextPart)
                       else {"type": "image"} for p in self.content]
        out: dict[str, Any] = {"role": self.role, "content": content}
        if self.tool_calls:
            # Objects, as mlx_lm.server passes them: Qwen3's template takes text or an
            # object, Qwen3-Coder's iterates the arguments' items.
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": c.function.as_object()}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thought = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thought is not None and self.role == "assistant":
            out["reasoning_content"] = thought
        return out



# What ``chat_template_kwargs`` may not set: the template call's own arguments, which the
# server sets, and the tokenizer's (padding to a length a client names would fill memory).
TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "tokenize", "add_generation_prompt",
    "continue_final_message", "chat_template", "return_dict", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "pad_to_multiple_of", "return_tensors",
    "return_attention_mask", "tokenizer_kwargs", "add_special_tokens", "split_special_tokens",
    "sanitize_control_tokens", "processor_kwargs",
})
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1000


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_TOKENS)] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    response_format: dict[str, Any] | None = None
    # Message counts after which a prefix is worth a cache checkpoint: Anthropic's
    # ``cache_control`` markers, set by the Messages API route only (never from a body).
    _cache_points: tuple[int, ...] = PrivateAttr(default=())
    # The last (assistant) message is continued, not answered (vLLM's name for it).
    continue_final_message: StrictBool = False
    # Extra arguments for the chat template (vLLM's name), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    # A thinking model's effort as a thought budget (the profile's ``reasoning``);
    # "none" renders the prompt with thinking off.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # Set by the Anthropic Messages route (``thinking.budget_tokens``), never from a body.
    _thinking_budget: int | None = PrivateAttr(default=None)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs to be true",
                           param="top_logprobs")
        names = [t.function.name for t in self.tools or ()]
        if first_duplicate(names) is not None:
            raise ApiError(400, "tools: function names must be unique", param="tools")
        choice = self.tool_choice
        named = choice.function.name if isinstance(choice, NamedToolChoice) else None
        problem = choice_problem(forces_call(choice), named, names)
        if problem == "unknown_name" or (problem == "needs_tools" and named is not None):
            raise ApiError(400, f"tool_choice names function {named!r}, which "
                                "is not among the request's tools", param="tool_choice")
        if problem == "needs_tools":
            raise ApiError(400, "tool_choice 'required' needs tools", param="tool_choice")
        if self.response_format is not None and self.wants_tools():
            if forces_call(choice) and self.response_format.get("type") not in (None, "text"):
                raise ApiError(400, "response_format cannot be combined with a forced "
                                    "tool_choice", param="response_format")
        self._check_template_kwargs()
        for i, m in enumerate(self.messages):
            if m.role != "user" and m.images():
                raise ApiError(400, f"messages[{i}]: only user messages carry images",
                               param=f"messages[{i}].content")
            if m.role == "tool" and not m.tool_call_id:
                raise ApiError(400, f"messages[{i}]: a tool message needs tool_call_id",
                               param=f"messages[{i}].tool_call_id")
            if m.tool_calls and m.role != "assistant":
                raise ApiError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                               param=f"messages[{i}].tool_calls")
            for j, c in enumerate(m.tool_calls or ()):
                try:
                    c.function.as_object()
                except ValueError:  # JSONDecodeError is one
                    param = f"messages[{i}].tool_calls[{j}].function.arguments"
                    raise ApiError(400, f"{param}: must be the JSON text of an object",
                                   param=param) from None

    def _check_template_kwargs(self) -> None:
        """A few template variables with plain values, none of the call's own arguments."""
        kwargs = self.chat_template_kwargs or {}
        p = "chat_template_kwargs"
        taken = sorted(TEMPLATE_ARGUMENTS & set(kwargs))
        if taken:
            raise ApiError(400, f"{p} may not set {', '.join(taken)}: the server passes the "
                                "template call's and the tokenizer's arguments itself", param=p)
        if len(kwargs) > MAX_TEMPLATE_KWARGS:
            raise ApiError(400, f"{p} takes at most {MAX_TEMPLATE_KWARGS} keys", param=p)
        for key, value in kwargs.items():
            plain = value is None or isinstance(value, (bool, int, float, str))
            if not plain or (isinstance(value, str) and len(value) > MAX_TEMPLATE_KWARG_CHARS):
                raise ApiError(400, f"{p}.{key} must be a string (at most "
                                    f"{MAX_TEMPLATE_KWARG_CHARS} characters), a number, a "
                                    "boolean or null", param=f"{p}.{key}")

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages and tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def wants_tools(self) -> bool:
        """Tools are offered and may be called (``tool_choice`` is not ``none``)."""
        return bool(self.tools) and self.tool_choice != "none"

    def top_logprobs_wanted(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_size(self) -> tuple[int, str]:
        """(size, unit) of the prompt before tokenizing: characters of message contents,
        tool calls and tool definitions (all of it is templated)."""
        size = sum(len(m.text()) + MESSAGE_OVERHEAD_CHARS for m in self.messages)
        size += sum(len(c.function.name) + len(c.function.arguments)
                    for m in self.messages for c in m.tool_calls or ())
        size += sum(len(json.dumps(t.to_template())) for t in self.tools or ())
        if self.response_format is not None:  # its schema is compiled, not templated
            size += len(json.dumps(self.response_format))
        return size + sum(map(len, self.stop_list())), "characters"


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        if isinstance(self.prompt, list) and len(self.prompt) == 0:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)):
            if len(self.prompt) != 1:
                raise ApiError(400, "only one prompt per request is supported", param="prompt")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_size(self) -> tuple[int, str]:
        """(size, unit) of the prompt before tokenizing: characters, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return len(prompt) + sum(map(len, self.stop_list())), "characters"
        return len(prompt), "token ids"


def check_prompt_size(
    request: ChatCompletionRequest | CompletionRequest, max_chars: int, context_length: int,
    max_messages: int | None = None,
) -> None:
    """Refuse an oversized prompt before any tokenizer time is spent on it.

    Characters are bounded by ``max_chars`` (each message counts
    ``MESSAGE_OVERHEAD_CHARS`` beyond its text; schemas and stop strings count too);
    token ids, which need no tokenizing, by the context length itself; a chat's
    messages by ``max_messages``.
    """
    if isinstance(request, ChatCompletionRequest) and max_messages is not None:
        check_message_count(len(request.messages), max_messages, "messages")
    size, unit = request.prompt_size()
    param = "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if unit == "token ids" and size >= context_length:
        message = (f"this model's maximum context length is {context_length} tokens, but the "
                   f"prompt has {size} tokens (at least one token must remain to generate)")
    elif unit == "characters" and size > max_chars:
        message = (f"the prompt has {size} characters, over this model's limit of {max_chars} "
                   f"characters (max_prompt_chars; context length {context_length} tokens)")
    else:
        return
    raise ApiError(400, message, param=param, code="context_length_exceeded")


def check_message_count(count: int, limit: int, param: str = "messages") -> None:
    """400 for a conversation of more than ``limit`` messages (the model's
    ``max_messages``): checked before the messages are validated one by one."""
    if count > limit:
        raise ApiError(400, f"{param} has {count} items, over this model's limit of {limit} "
                            "(max_messages)", param=param, code="too_many_messages")


# What an API says of a pydantic error it words itself: the field path, the message and
# the error code to use instead, or None for pydantic's own.
Explain = Callable[[dict, list], "tuple[list, str, str | None] | None"]


def dotted(loc: list | tuple) -> str | None:
    """A field path as ``messages.0.content``."""
    return ".".join(str(p) for p in loc) or None


def validation_error(exc: ValidationError, clean: Callable[[tuple], list] = clean_loc,
                     explain: Explain | None = None,
                     param_of: Callable[[list], str | None] = dotted) -> ApiError:
    """A request body's pydantic error as the API's 400, for every API: the deepest error
    is the one named (a bad content part, not "input should be a valid string"), its
    message starting with the field path (``clean``: as the API names fields, ``param_of``:
    as it writes paths); ``explain`` words the errors pydantic words poorly."""
    worst = max(exc.errors(), key=lambda e: len(clean(e["loc"])))
    loc, message, code = clean(worst["loc"]), worst["msg"], None
    said = explain(dict(worst), loc) if explain is not None else None
    if said is not None:
        loc, message, code = said
    param = param_of(loc)
    return ApiError(400, f"{param or 'body'}: {message}", param=param, code=code)


def checked(cls: type[R], body: Any, error: Callable[[ValidationError], ApiError]) -> R:
    """A request body validated (``error`` says which field is wrong, in the API's own
    words) and checked for what we serve; both APIs' routes take their bodies here."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        parsed = cls.model_validate(body)
    except ValidationError as exc:
        raise error(exc) from None
    parsed.check_supported()
    return parsed


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()

# What the ingress hands a model replica, validated (and ``check_supported``) once.
OpenAIRequest = ChatCompletionRequest | CompletionRequest


