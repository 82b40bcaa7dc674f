"""Driving the engine and a model service in this process (no Ray, no server): one request
run to its end, warm and cold services of one model, and a collector of engine events."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from pathlib import Path

import mlx.core as mx
import mlx_lm

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.events import Delta, Finish, Start
from serve_app.serving.request import ChatCompletionRequest
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.service import ModelService
from serve_app.serving.stream import EventChannel

BS = 16
"""The block size of the warm services here."""


def make_services(name: str, home: Path) -> tuple[ModelService, ModelService, LocalCacheClient]:
    """A warm (cached, block :data:`BS`) and a cold (no cache) service of one embedded
    model sharing its weights, and the warm one's cache client."""
    path = materialize(name, home)
    model, tokenizer = mlx_lm.load(str(path))
    client = LocalCacheClient(TieredStore(1 << 30))
    warm = ModelService(ModelProfile(name="warm", source=f"embedded:{name}",
                                     cache={"block_size": BS}), model, tokenizer, path, client)
    cold = ModelService(ModelProfile(name="cold", source=f"embedded:{name}",
                                     cache={"enabled": False}), model, tokenizer, path, None)
    return warm, cold, client


def run(service: ModelService, request) -> dict:
    """Serve ``request`` to its end: its text, what the plan meant to restore (``planned``),
    what the engine restored (``cached``), the prompt's tokens and the finish event's
    fields."""
    async def go():
        prepared = service.prepare(request)
        text, start, finish = [], None, None
        async for events in service.stream(prepared):
            for e in events:
                if isinstance(e, Start):
                    start = e
                elif isinstance(e, Delta):
                    text.append(e.text)
                elif isinstance(e, Finish):
                    finish = e
        # The finish event's count is what the engine really restored (usage).
        return {"text": "".join(text), "cached": finish.cached_tokens,
                "planned": start.cached_tokens,
                "prompt": prepared.prompt, **dataclasses.asdict(finish)}

    return asyncio.run(go())


def chat(messages: list[dict], n: int = 20) -> ChatCompletionRequest:
    """A greedy chat request of at most ``n`` tokens."""
    return ChatCompletionRequest(model="m", messages=messages, max_tokens=n, temperature=0)


def generated(service: ModelService, prompt: list[int], n: int) -> list[int]:
    """The token ids a greedy request produces (its text may not re-tokenize to them)."""
    tokens: list[int] = []

    async def go():
        channel = EventChannel(asyncio.get_running_loop())
        service.engine.submit(prompt, SamplingParams(max_tokens=n), channel.put)
        while True:
            for e in await channel.take():
                if e.token is not None:
                    tokens.append(e.token)
                if e.finish_reason or e.error:
                    return

    asyncio.run(go())
    return tokens


class Collector:
    """Every engine event of one request, and a flag once it ended (finished or failed)."""

    def __init__(self) -> None:
        self.events: list[EngineEvent] = []
        self.done = threading.Event()

    def __call__(self, event: EngineEvent) -> None:
        self.events.append(event)
        if event.finish_reason or event.error:
            self.done.set()

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def scored(self) -> list[EngineEvent]:
        """The events that carry a token (and its logprobs, when asked for)."""
        return [e for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        """The finish reason, once the request ended."""
        return self.events[-1].finish_reason if self.done.is_set() else None

    @property
    def error(self) -> str | None:
        """The error the request ended with, if it failed."""
        return self.events[-1].error if self.done.is_set() else None

    @property
    def restored(self) -> int:
        return next(e.restored for e in self.events if e.restored is not None)


class Script:
    """A logits processor that forces ``tokens`` and then EOS: a random-weight model made to
    say scripted text, token by token. ``begin_at`` as the service's own processors have it
    (a resumed request's prompt ends with the tokens generated before)."""

    def __init__(self, tokens: list[int], eos: int) -> None:
        self.tokens = [*tokens, eos]
        self.prompt: int | None = None

    def begin_at(self, start: int) -> None:
        self.prompt = start

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.prompt is None:
            self.prompt = tokens.size
        step = min(tokens.size - self.prompt, len(self.tokens) - 1)
        allowed = mx.arange(logits.shape[-1]) == self.tokens[step]
        return mx.where(allowed, logits, -mx.inf)
