"""One request's way out of the engine: the channel its engine events cross from the
engine thread to the event loop, the text decoder and stop matching that turn tokens
into API events, its cache lease, pacing of streamed chunks, and its timings.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app.cache.manager import CacheManager
from serve_app.reasoning.text import ThoughtText
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.events import (
    Delta,
    Event,
    Failure,
    Finish,
    Reasoning,
    Start,
    TokenLogprob,
    Tokens,
    ToolCall,
)
from serve_app.serving.prepare import PreparedRequest
from serve_app.serving.request import ApiError
from serve_app.serving.stops import StopStringMatcher
from serve_app.serving.tools import ToolCallStream, function_name

if TYPE_CHECKING:
    from serve_app.serving.service import ModelService


class EventChannel:
    """Engine thread to asyncio: append under a lock, wake the loop only if it waits.

    One ``call_soon_threadsafe`` per token would wake the event loop (and take
    the GIL from the engine thread) at every decode step.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[EngineEvent] = []
        self._waiter: asyncio.Future | None = None
        self._ended = False  # the request's last event (its end or failure) is queued
        self._end_waiter: asyncio.Future | None = None

    def put(self, event: EngineEvent) -> None:
        last = event.finish_reason is not None or event.error is not None
        with self._lock:
            self._items.append(event)
            waiter, self._waiter = self._waiter, None
            end_waiter = None
            if last:
                self._ended = True
                end_waiter, self._end_waiter = self._end_waiter, None
        for w in (waiter, end_waiter):
            if w is not None:
                self._loop.call_soon_threadsafe(_wake, w)

    async def take(self) -> list[EngineEvent]:
        """Everything queued so far; waits for at least one event."""
        while True:
            with self._lock:
                if self._items:
                    items, self._items = self._items, []
                    return items
                self._waiter = self._loop.create_future()
                waiter = self._waiter
            await waiter

    async def wait_end(self, timeout: float) -> None:
        """Wait ``timeout`` seconds, or less: until the request's last event is queued
        (coalescing must never hold back the end of an answer)."""
        with self._lock:
            if self._ended:
                return
            waiter = self._end_waiter = self._loop.create_future()
        try:
            await asyncio.wait_for(waiter, timeout)
        except TimeoutError:
            with self._lock:
                if self._end_waiter is waiter:
                    self._end_waiter = None


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class TextDecoder:
    """Tokens to text for one request: streaming detokenizer plus stop strings."""

    def __init__(self, tokenizer, eos_ids: set[int], stops: list[str]) -> None:
        self._detok = tokenizer.detokenizer
        self._eos = eos_ids
        self._stops = StopStringMatcher(stops)
        self.tokens = 0

    def add(self, token: int) -> tuple[str, bool]:
        self.tokens += 1
        if token in self._eos:
            return "", False
        self._detok.add_token(token)
        return self._stops.feed(self._detok.last_segment)

    def finish(self) -> str:
        self._detok.finalize()
        text, stopped = self._stops.feed(self._detok.last_segment)
        return text if stopped else text + self._stops.flush()

    def stop_sequence(self) -> str | None:
        """The stop string that ended the text, if one did."""
        return self._stops.matched


def emit_text(out: list[Event], text: str, calls: ToolCallStream | None,
              logprobs: TokenLogprob | None, final: bool = False, cut: bool = False) -> int:
    """Text (with tool-call markup taken out as ``ToolCall`` events) and logprobs into
    ``out``; returns the tool calls emitted. ``final``: the output's end (``cut``: by the
    token limit, when a call left open is still a call, cut short)."""
    found: tuple[ToolCall, ...] = ()
    if calls is not None:
        update = calls.finish(text, cut) if final else calls.feed(text)
        text, found = update.text, update.calls
    if text or logprobs is not None:
        out.append(Delta(text, (logprobs,) if logprobs is not None else None))
    out.extend(found)
    return len(found)


class Lease:
    """A cache plan's pins on the blocks it restores: released once the engine has copied
    them (after its first event), beside the stream, so a slow store never holds up
    tokens; released at once when the request never reaches the engine."""

    def __init__(self, cache: CacheManager, lease: int | None) -> None:
        self._cache = cache
        self._lease = lease
        self._releasing: asyncio.Future | None = None

    async def release(self) -> None:
        lease, self._lease = self._lease, None
        await self._cache.release(lease)

    def release_beside(self) -> None:
        if self._lease is not None:
            self._releasing = asyncio.ensure_future(self._cache.release(self._lease))
            self._lease = None

    async def close(self) -> None:
        """At the stream's end: whatever is still held released, the release awaited."""
        if self._lease is not None:
            await self.release()
        if self._releasing is not None:
            await self._releasing


class Pacer:
    """Coalescing: at most one yield per stream interval after the first, except the
    last (the end of an answer goes out when it comes). Each yield costs a Ray streaming
    hop on the same cores that decode."""

    def __init__(self, interval: Callable[[], float]) -> None:
        self._interval = interval
        self._last = 0.0

    async def wait(self, events: EventChannel) -> None:
        wait = self._last + self._interval() - time.monotonic()
        if wait > 0:
            await events.wait_end(wait)

    def sent(self) -> None:
        self._last = time.monotonic()


class RequestClock:
    """One request's phases and latencies into the service's metrics: prepare and plan
    (at construction), queue (when the engine takes it), prefill (with the prefill rate
    it measured), time to first token, inter-token latency, and its whole duration."""

    def __init__(self, service: ModelService, arrived: float, prepare_seconds: float) -> None:
        self._service = service
        self.arrived = arrived
        self.planned = time.perf_counter()
        self.joined: float | None = None  # when the engine took the request into its batch
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.tokens = 0
        service._phase("prepare", prepare_seconds)
        service._phase("plan", self.planned - arrived)

    def join(self, at: float) -> None:
        self.joined = at
        self._service._phase("queue", at - self.planned)

    def token(self, at: float, prefilled_tokens: int) -> None:
        """A generated token at ``at``; ``prefilled_tokens``: the prompt tokens the engine
        computed (not restored)."""
        service = self._service
        if self.last_token_at is None and self.joined is not None:
            service._phase("prefill", at - self.joined)
            service._prefilled(prefilled_tokens, at - self.joined)
        service._observe_token(self.arrived, self.last_token_at, at)
        service.recent.token(at - self.arrived if self.first_token_at is None else None)
        if self.first_token_at is None:
            self.first_token_at = at
        self.last_token_at = at
        self.tokens += 1

    def finished(self) -> None:
        service = self._service
        service.metrics.observe("serve_app_request_duration_seconds",
                                time.perf_counter() - self.arrived, service._labels)
        first, last = self.first_token_at, self.last_token_at
        service.recent.finished(self.tokens,
                                0.0 if first is None or last is None else last - first)


class RequestStream:
    """One request's engine events to typed events: text through the detokenizer and
    stop strings (``TextDecoder``), tool-call markup out as ``ToolCall`` events,
    logprobs, restore failures accounted, and the ``Finish`` with its counters. A stop
    string cancels the request's work in the engine."""

    def __init__(self, service: ModelService, prepared: PreparedRequest, rid: int,
                 cached: int, clock: RequestClock) -> None:
        self._service = service
        self._rid = rid
        self._prompt_tokens = len(prepared.prompt)
        # What the engine prefills: a resumed request's prompt holds its tokens so far.
        self._run_tokens = len(prepared.prompt) + len(prepared.resume)
        self.cached = cached  # planned; lowered if the engine prefilled cold
        self._clock = clock
        self._started = time.monotonic()
        self._decoder = TextDecoder(service.tokenizer, service.eos_ids, prepared.stops)
        support = service.preparer.tool_support if prepared.tools is not None else None
        self._calls = (ToolCallStream(support, prepared.tools, forced_names(prepared))
                       if support is not None else None)
        self._logprobs = prepared.logprobs is not None
        self._called = 0  # tool calls emitted
        self._thought = (ThoughtText(service.tokenizer, service.eos_ids, prepared.thinking)
                         if prepared.thinking is not None else None)
        self._answer_started = False  # answer text has been emitted (after a thought)
        self._generated = 0  # tokens generated, thought and answer
        # Kept for the next turn's prefix (``ModelService`` prefills it ahead).
        self._history = prepared.history is not None
        self.tokens: list[int] = []  # generated
        self.answer: list[str] = []
        self.calls: list[ToolCall] = []
        self.finish: Finish | None = None
        self.done = False
        self._unsent: list[int] = []  # generated ids not yet in a ``Tokens`` event

    def start(self) -> Start:
        """Admitted; a resumed request's ``cached_tokens`` count over its prompt and the
        tokens replayed (what the ingress reports as re-prefilled is the rest)."""
        return Start(self._prompt_tokens, self.cached)

    def replay(self, tokens: tuple[int, ...]) -> None:
        """A resumed request: ``tokens`` (generated by a replica that was lost, already
        sent to the client) through the detokenizer, stop strings, thought split and
        tool-call parser, their events dropped, so what follows continues the client's
        answer exactly where it stopped."""
        dropped: list[Event] = []
        for token in tokens:
            if self._history:
                self.tokens.append(token)
            self._generated += 1
            if self._token(token, None, dropped):
                raise ApiError(400, "cannot resume: the tokens generated so far end the "
                                    "answer (a stop string)", code="invalid_resume")
        self._keep(dropped)

    def convert(self, batch: list[EngineEvent]) -> list[Event]:
        """The events of one batch of engine events (nothing after the request's end);
        a batch with output carries ``Tokens`` (the ids behind it) after it, before
        its end."""
        out: list[Event] = []
        for event in batch:
            if event.token is not None:
                self._unsent.append(event.token)
                if self._history:
                    self.tokens.append(event.token)
            if self._event(event, out):
                self.done = True
                break
        self._keep(out)
        if out and self._unsent:  # before the end (consumers stop at a Finish)
            at = len(out) - 1 if isinstance(out[-1], Finish | Failure) else len(out)
            out.insert(at, Tokens(tuple(self._unsent)))
            self._unsent = []
        return out

    def _keep(self, out: list[Event]) -> None:
        for e in out:
            if isinstance(e, Finish):
                self.finish = e
            elif self._history and isinstance(e, Delta):
                self.answer.append(e.text)
            elif self._history and isinstance(e, ToolCall):
                self.calls.append(e)

    def _event(self, event: EngineEvent, out: list[Event]) -> bool:
        """One engine event into ``out``; True when it ends the request."""
        if event.restored is not None:  # the engine took it out of the queue
            self._restored(event.restored, event.at)
        if event.error is not None and event.unavailable:
            from serve_app.serving.errors import rank_lost_error

            out.append(rank_lost_error(event.error).to_failure())
            return True
        if event.error is not None:
            from serve_app.models.compat import log_dir

            out.append(ApiError(500, f"{event.error} (the model replica's log under "
                                     f"{log_dir()}/serve has the traceback)",
                                type="server_error").to_failure())
            return True
        if event.token is not None:
            self._clock.token(event.at, self._run_tokens - self.cached)
            self._generated += 1
            if self._token(event.token, event, out):
                self._service.engine.cancel(self._rid)
                return True
        if event.finish_reason is not None:
            cut = event.finish_reason != "stop"
            if self._thought is not None:
                thought, answer = self._thought.finish()
                if thought:
                    out.append(Reasoning(thought))
                for token in answer:
                    self._emit(out, self._decoder.add(token)[0], None)
            self._emit(out, self._decoder.finish(), None, final=True, cut=cut)
            out.append(self._finish("length" if cut else "stop"))
            return True
        return False

    def _token(self, token: int, event: EngineEvent | None, out: list[Event]) -> bool:
        """A generated token through the thought split, detokenizer, stop strings and
        tool-call parser into ``out``; True when a stop string ended the answer there.
        ``event``: the engine's (its logprobs), None for a token replayed."""
        answer = [token]
        if self._thought is not None:
            thought, answer = self._thought.feed(token)
            if thought:
                out.append(Reasoning(thought))
        own = answer == [token]  # its logprobs belong to this token alone
        for t in answer:
            text, stopped = self._decoder.add(t)
            logprobs = (self._service._logprobs(event)
                        if event is not None and self._logprobs and own else None)
            self._emit(out, text, logprobs)
            if stopped:
                self._emit(out, "", None, final=True)
                out.append(self._finish("stop"))
                return True
        return False

    def _restored(self, restored: int, at: float) -> None:
        self._clock.join(at)
        if restored < self.cached:  # the engine prefilled it cold
            self._service.cache.restore_failed(self.cached)
            self.cached = restored

    def _emit(self, out: list[Event], text: str, logprobs: TokenLogprob | None,
              final: bool = False, cut: bool = False) -> None:
        if not self._answer_started and self._thought is not None:
            if self._thought.had_thought:  # the newlines after </think> are the template's
                text = text.lstrip("\n")
            self._answer_started = bool(text)
        self._called += emit_text(out, text, self._calls, logprobs, final, cut)

    def _finish(self, reason: str) -> Finish:
        return Finish(
            finish_reason="tool_calls" if self._called and reason == "stop" else reason,
            prompt_tokens=self._prompt_tokens,
            completion_tokens=max(self._generated, self._decoder.tokens),
            cached_tokens=min(self.cached, self._prompt_tokens),
            seconds=time.monotonic() - self._started,
            stop_sequence=self._decoder.stop_sequence(),
            reasoning_tokens=self._thought.splitter.thought_tokens if self._thought else 0,
        )


def forced_names(prepared: PreparedRequest) -> tuple[str, ...] | None:
    """The names a forced call of ``prepared`` may have (``tool_choice`` "required": any
    of its tools; a named function: that one); None when no call is forced."""
    if not prepared.forced_tool_choice:
        return None
    choice = prepared.tool_choice
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        return (name,) if isinstance(name, str) else ()
    return tuple(n for n in (function_name(t) for t in prepared.tools or ()) if n)
