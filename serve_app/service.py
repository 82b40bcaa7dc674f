"""One model behind the API: prompts to tokens, tokens to text events.

``ModelService`` turns a validated OpenAI request into prompt tokens (chat
template, context checks, sampling defaults), submits it to the ``Engine`` and
turns the engine's tokens into text events, applying stop strings. It is
plain asyncio with no Ray, so it can be tested in-process; the Ray replica is
a thin wrapper around it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from serve_app.cache.client import CacheClient
from serve_app.cache.manager import CacheManager, CacheStats
from serve_app.compat import download_model, token_bytes_table
from serve_app.embedded import EMBEDDED_PREFIX, default_home, materialize
from serve_app.engine import Engine, EngineEvent, QueueFullError
from serve_app.events import Delta, Event, Failure, Finish, Start, TokenLogprob, ToolCall
from serve_app.metrics import PHASES, Recorder, replica_samples
from serve_app.normalize import RULE_NAMES
from serve_app.openai_api import ApiError, Caller, ChatCompletionRequest, CompletionRequest
from serve_app.prepare import PreparedRequest, Preparer
from serve_app.profile import ModelProfile, source_kind
from serve_app.sampling import SamplingParams
from serve_app.stops import StopStringMatcher
from serve_app.tools import ToolCallStream

RETRY_AFTER_SECONDS = 1


@dataclass
class PhaseTimes:
    """Seconds spent in each phase before the first token, summed per phase, and how
    many requests reached each (a rejected or cancelled one stops early)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.counts[phase] += 1

    def summary(self) -> dict:
        return {"requests": self.counts[PHASES[0]],
                "mean_ms": {k: round(v * 1000 / max(self.counts[k], 1), 3)
                            for k, v in self.seconds.items()}}


def resolve_source(profile: ModelProfile, home: Path | None = None) -> str:
    """The path (or hub id) that ``mlx_lm.load`` gets for a model profile."""
    kind = source_kind(profile.source)
    if kind == "embedded":
        return str(materialize(profile.source[len(EMBEDDED_PREFIX) :], home or default_home()))
    if kind == "path":
        return str(Path(profile.source).expanduser())
    return profile.source


def load_model(profile: ModelProfile, home: Path | None = None):
    """Load through ``mlx_lm.load``; returns (model, tokenizer, model directory)."""
    import mlx_lm

    path = resolve_source(profile, home)
    model_dir = download_model(path, profile.revision)
    # typed as a 2- or 3-tuple (return_config has no overloads): two without it
    model, tokenizer = mlx_lm.load(str(model_dir))  # type: ignore[misc]
    return model, tokenizer, model_dir


class ModelService:
    """Validation, templating and streaming for one loaded model."""

    def __init__(
        self,
        profile: ModelProfile,
        model,
        tokenizer,
        model_dir: Path | None = None,
        cache_client: CacheClient | None = None,
        metrics: Recorder | None = None,
    ) -> None:
        self.profile = profile
        self.metrics = metrics or Recorder()
        self._labels = {"model": profile.name}
        self.tokenizer = tokenizer
        self.eos_ids = set(tokenizer.eos_token_ids)
        self.engine = Engine(
            model,
            stop_tokens=self.eos_ids,
            max_batch_size=profile.max_batch_size,
            max_queued_requests=profile.max_queued_requests,
            prefill_step_size=profile.prefill_step_size,
            name=profile.name,
        )
        # The engine thread probes the layout: every cached array's shape and dtype.
        self.layout = self.engine.wait_ready()
        self.phases = PhaseTimes()
        # Requests whose prompt a normalization rule changed, by rule (serve_app/normalize).
        self.normalized = dict.fromkeys(RULE_NAMES, 0)
        self.cache = CacheManager.for_model(profile, self.layout, cache_client, model_dir,
                                            tokenizer.chat_template)
        self.preparer = Preparer(profile, tokenizer, branch_points=self.cache.enabled)
        # Token id -> (its text, its raw bytes), for logprobs; the byte table on first use.
        self._token_texts: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._token_bytes: Callable[[int], bytes] | None = None
        self._token_bytes_built = False

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ---- request preparation ---------------------------------------------------

    def prompt_tokens(self, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
        return self.preparer.prompt_tokens(request)

    def prepare(self, request: ChatCompletionRequest | CompletionRequest,
                caller: Caller | None = None) -> PreparedRequest:
        """See ``Preparer.prepare``: runs on a replica worker thread."""
        return self.preparer.prepare(request, caller)

    def branch_points(self, request: ChatCompletionRequest | CompletionRequest,
                      prompt: list[int]) -> tuple[int, ...]:
        return self.preparer.branch_points(request, prompt)

    # ---- streaming ----------------------------------------------------------------

    async def stream(self, prepared: PreparedRequest,
                     processors: tuple | None = None) -> AsyncIterator[list[Event]]:
        """Events for one request, in batches of whatever is ready.

        First ``[Start]`` (or ``[Failure]``), then ``Delta`` and ``ToolCall`` events
        (``serve_app.events``), then one ``Finish`` with usage (or a ``Failure``). Closing
        the iterator early cancels the request in the engine, which frees its batch slot
        at once. ``processors``:
        the request's ``constraints``, built off the event loop by the caller (a new
        schema compiles here otherwise).
        """
        arrived = time.perf_counter()
        events = EventChannel(asyncio.get_running_loop())
        for rule in prepared.normalized:
            self.normalized[rule] += 1
        if self.engine.at_capacity():  # before any cache work
            yield [_queue_full(self.engine.capacity_message()).to_failure()]
            return
        if processors is None:
            try:
                processors = self.constraints(prepared)
            except ApiError as exc:
                yield [exc.to_failure()]
                return
        plan = await self.cache.plan(prepared.prompt, salt=prepared.salt,
                                     api_key_digest=prepared.api_key_digest,
                                     branch_points=prepared.branch_points)
        planned = time.perf_counter()
        self._phase("prepare", prepared.prepare_seconds)
        self._phase("plan", planned - arrived)
        joined: float | None = None  # when the engine took the request into its batch
        lease = plan.lease if plan is not None else None
        cached = plan.restore_tokens if plan is not None else 0
        try:
            params = replace(prepared.params, logprobs=prepared.logprobs,
                             logits_processors=processors)
            rid = self.engine.submit(prepared.prompt, params, events.put, plan)
        except QueueFullError as exc:
            await self.cache.release(lease)
            yield [_queue_full(str(exc)).to_failure()]
            return

        started = time.monotonic()
        decoder = _TextDecoder(self.tokenizer, self.eos_ids, prepared.stops)
        support = self.preparer.tool_support if prepared.tools is not None else None
        calls = ToolCallStream(support, prepared.tools) if support is not None else None
        called = 0
        done = False
        releasing: asyncio.Future | None = None
        last_token_at: float | None = None
        try:
            yield [Start(len(prepared.prompt), cached)]
            last_yield = 0.0
            while not done:
                # Coalesce: at most one yield per stream interval after the first.
                # Each yield costs a Ray streaming hop on the same cores that decode.
                wait = last_yield + self.stream_interval() - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                batch = await events.take()
                if lease is not None:  # the engine has copied the restored blocks by now
                    # Released beside the stream: a slow store never holds up tokens.
                    releasing = asyncio.ensure_future(self.cache.release(lease))
                    lease = None
                out: list[Event] = []
                for event in batch:
                    if event.restored is not None:  # the engine took it out of the queue
                        joined = event.at
                        self._phase("queue", joined - planned)
                        if event.restored < cached:  # the engine prefilled it cold
                            self.cache.restore_failed(cached)
                            cached = event.restored
                    if event.error is not None:
                        out.append(ApiError(500, event.error, type="server_error").to_failure())
                        done = True
                        break
                    if event.token is not None:
                        if last_token_at is None and joined is not None:
                            self._phase("prefill", event.at - joined)
                            self._prefilled(len(prepared.prompt) - cached, event.at - joined)
                        self._observe_token(arrived, last_token_at, event.at)
                        last_token_at = event.at
                        text, stopped = decoder.add(event.token)
                        logprobs = self._logprobs(event) if prepared.logprobs is not None else None
                        called += self._emit(out, text, calls, logprobs)
                        if stopped:
                            self.engine.cancel(rid)
                            called += self._emit(out, "", calls, None, final=True)
                            reason = "stop"
                            done = True
                            break
                    if event.finish_reason is not None:
                        called += self._emit(out, decoder.finish(), calls, None, final=True)
                        reason = "stop" if event.finish_reason == "stop" else "length"
                        done = True
                        break
                if done and not (out and isinstance(out[-1], Failure)):
                    out.append(Finish(
                        finish_reason="tool_calls" if called and reason == "stop" else reason,
                        prompt_tokens=len(prepared.prompt),
                        completion_tokens=decoder.tokens,
                        cached_tokens=cached,
                        seconds=time.monotonic() - started,
                        stop_sequence=decoder.stop_sequence(),
                    ))
                if out:
                    last_yield = time.monotonic()
                    yield out
        finally:
            if not done:
                self.engine.cancel(rid)
            if lease is not None:
                await self.cache.release(lease)
            if releasing is not None:
                await releasing
            self.metrics.observe("serve_app_request_duration_seconds",
                                 time.perf_counter() - arrived, self._labels)

    def constraints(self, prepared: PreparedRequest) -> tuple:
        """The request's own logits processors: a fresh matcher of its grammar, if any
        (``Preparer.grammar``; 400 as ``ApiError``)."""
        grammar = self.preparer.grammar(prepared)
        return (grammar.processor(),) if grammar is not None else ()

    def _logprobs(self, event: EngineEvent) -> TokenLogprob | None:
        """A generated token's logprob entry, with its alternatives (EOS has none)."""
        if event.token is None or event.logprob is None or event.token in self.eos_ids:
            return None
        entry = self._token_entry(event.token, event.logprob)
        return replace(entry, top=tuple(self._token_entry(t, lp)
                                        for t, lp in event.top_logprobs))

    def _token_entry(self, token: int, logprob: float) -> TokenLogprob:
        known = self._token_texts.get(token)
        if known is None:  # once per token id, not per generated token
            text = self.tokenizer.decode([token])
            if not self._token_bytes_built:
                self._token_bytes = token_bytes_table(self.tokenizer)
                self._token_bytes_built = True
            table = self._token_bytes
            raw = table(token) if table is not None else text.encode()
            known = self._token_texts[token] = (text, tuple(raw))
        return TokenLogprob(known[0], logprob, known[1])

    @staticmethod
    def _emit(out: list[Event], text: str, calls: ToolCallStream | None,
              logprobs: TokenLogprob | None, final: bool = False) -> int:
        """Text (with tool-call markup taken out as ``ToolCall`` events) and logprobs into
        ``out``; returns the tool calls emitted."""
        found: tuple[ToolCall, ...] = ()
        if calls is not None:
            update = calls.finish(text) if final else calls.feed(text)
            text, found = update.text, update.calls
        if text or logprobs is not None:
            out.append(Delta(text, (logprobs,) if logprobs is not None else None))
        out.extend(found)
        return len(found)

    def stream_interval(self) -> float:
        """Seconds between one stream's chunks: the profile's interval, stretched so that
        the running streams together stay within ``stream_chunks_per_second``."""
        running = self.engine.stats.running_batch_size
        return min(1.0, max(self.profile.stream_interval_ms / 1000.0,
                            running / self.profile.stream_chunks_per_second))

    def _phase(self, phase: str, seconds: float) -> None:
        self.phases.add(phase, seconds)
        self.metrics.observe("serve_app_request_phase_seconds", seconds,
                             {**self._labels, "phase": phase})

    def _prefilled(self, tokens: int, seconds: float) -> None:
        """A measured prefill rate, for deciding whether fetching from another node pays;
        only prefills of at least a block measure it (short ones are all overhead)."""
        if self.cache.enabled and tokens >= self.cache.settings.block_size:
            self.cache.remote.prefilled(tokens, seconds)

    def _observe_token(self, arrived: float, previous: float | None, at: float) -> None:
        if previous is None:
            self.metrics.observe("serve_app_time_to_first_token_seconds", at - arrived,
                                 self._labels)
        else:
            self.metrics.observe("serve_app_inter_token_latency_seconds", at - previous,
                                 self._labels)

    def metric_samples(self) -> list:
        """This replica's counters and gauges, for the metrics pump."""
        return replica_samples(self.profile.name, self.engine.snapshot(),
                               self.cache_stats.summary(), self.normalized)

    async def stats(self) -> dict:
        engine = self.engine.snapshot()
        cache = self.cache_stats.summary()
        tokens = engine["captured_tokens"]
        cache["checkpoint_interval"] = self.cache.settings.checkpoint_every or None
        remote = self.cache.remote
        cache["remote_fetch_policy"] = {
            "bandwidth_bytes_per_s": round(remote.bandwidth),
            "prefill_tokens_per_s": round(remote.prefill_rate) if remote.prefill_rate else None,
            "nodes": remote.snapshot()}  # per node: bandwidth, fetches, failures, breaker
        cache["checkpoint_bytes_per_1k_tokens"] = (
            round(engine["captured_checkpoint_bytes"] * 1000 / tokens) if tokens else None)
        out = {"model": self.profile.name, "engine": engine, "cache": cache,
               "phases": self.phases.summary(),
               "normalization": {"rules": list(self.profile.normalize),
                                 "requests_by_rule": dict(self.normalized)}}
        if self.cache.client is not None:
            out["cache_store"] = await self.cache.client.stats()
        return out

    def warm_up(self, timeout: float = 300.0) -> float:
        """One prefill and one decode through the engine; returns the seconds taken.

        MLX sets up its kernels and buffers on first use, so without this the
        first user request pays for it. No cache plan: nothing is cached, and
        the engine's counters are reset afterwards so users never see it.
        """
        done = threading.Event()
        tokens: list[int] = []
        errors: list[str] = []

        def sink(event: EngineEvent) -> None:
            if event.token is not None:
                tokens.append(event.token)
            if event.error is not None:
                errors.append(event.error)
            if event.error is not None or event.finish_reason is not None:
                done.set()

        text = "Warm up the engine with a short prompt, please."
        prompt = (list(self.tokenizer.encode(text, add_special_tokens=False)) * 8)[:8]
        tic = time.perf_counter()
        self.engine.submit(prompt, SamplingParams(max_tokens=2, temperature=0.0), sink)
        if not done.wait(timeout):
            raise RuntimeError(f"model {self.profile.name}: warm-up took over {timeout:.0f} s")
        if errors:
            raise RuntimeError(f"model {self.profile.name}: warm-up failed: {errors[0]}")
        # The engine counts a step's tokens just after delivering them: wait for
        # that, then start every counter from zero.
        settle = time.monotonic() + 5.0
        while self.engine.snapshot()["generated_tokens"] < len(tokens):
            if time.monotonic() > settle:
                break
            time.sleep(0.001)
        self.engine.reset_stats()
        return time.perf_counter() - tic


def _queue_full(message: str) -> ApiError:
    return ApiError(
        429,
        message,
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


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

    def put(self, event: EngineEvent) -> None:
        with self._lock:
            self._items.append(event)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._loop.call_soon_threadsafe(_wake, waiter)

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


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _TextDecoder:
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
