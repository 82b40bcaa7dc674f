"""OpenAI wire format: request schemas, error bodies, response objects.

Only shapes live here; no model, no Ray. Requests are validated strictly
enough that a wrong type is a 400 naming the field, while fields that clients
commonly send and that do not change the result (``user``, ``metadata``...)
are accepted and ignored.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


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

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_event(self) -> dict:
        """A picklable form, to cross from a replica to the ingress."""
        return {
            "type": "error",
            "status": self.status,
            "error": self.body()["error"],
            "headers": self.headers,
        }

    @classmethod
    def from_event(cls, event: dict) -> ApiError:
        e = event["error"]
        return cls(
            event["status"],
            e["message"],
            type=e["type"],
            param=e["param"],
            code=e["code"],
            headers=event.get("headers"),
        )


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=4)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    cache_salt: StrictStr | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def check_supported(self) -> None:
        """Reject options that would change the result in ways we cannot honour."""
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_value")
        if self.logprobs not in (None, False, 0):
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise ApiError(
                400, "stream_options is only allowed when stream is true", param="stream_options"
            )


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ApiError(400, "tools are not supported yet", param="tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise ApiError(
                400, "only response_format type 'text' is supported", param="response_format"
            )

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_size(self) -> tuple[int, str]:
        """(size, unit) of the prompt before tokenizing: characters of message contents."""
        return sum(len(m.text()) for m in self.messages), "characters"


class CompletionRequest(_Request):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
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

    def prompt_size(self) -> tuple[int, str]:
        """(size, unit) of the prompt before tokenizing: characters, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return len(prompt), "characters"
        return len(prompt), "token ids"


def check_prompt_size(
    request: ChatCompletionRequest | CompletionRequest, max_chars: int, context_length: int
) -> None:
    """Refuse an oversized prompt before any tokenizer time is spent on it.

    Characters are bounded by ``max_chars``; token ids, which need no
    tokenizing, by the context length itself.
    """
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


_Request.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()

# What the ingress hands a model replica, validated (and ``check_supported``) once.
OpenAIRequest = ChatCompletionRequest | CompletionRequest


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    def to_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def new_id(kind: str) -> str:
    prefix = "chatcmpl" if kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def full_response(
    kind: str, rid: str, model: str, text: str, finish_reason: str, usage: Usage
) -> dict:
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": now(),
        "model": model,
        "choices": [choice],
        "usage": usage.to_dict(),
    }


def stream_chunk(
    kind: str,
    rid: str,
    model: str,
    created: int,
    *,
    text: str | None = None,
    role: bool = False,
    finish_reason: str | None = None,
) -> dict:
    if kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text or "",
            "finish_reason": finish_reason,
            "logprobs": None,
        }
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, model: str, created: int, usage: Usage) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.to_dict(),
    }
