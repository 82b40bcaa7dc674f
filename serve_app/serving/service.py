"""One model behind the API: prompts to tokens, tokens to text events.

``ModelService`` turns a validated OpenAI request into prompt tokens (chat
template, context checks, sampling defaults), submits it to the ``Engine`` and
turns the engine's tokens into text events, applying stop strings. It is
plain asyncio with no Ray, so it can be tested in-process; the Ray replica is
a thin wrapper around it.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from serve_app.cache.client import CacheClient
from serve_app.cache.manager import CacheManager
from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.request_plan import RequestPlan
from serve_app.config.catalog import EMBEDDED_PREFIX
from serve_app.config.normalize_rules import RULE_NAMES
from serve_app.config.paths import default_home
from serve_app.config.profile import ModelProfile, source_kind
from serve_app.kvquant.format import quant_of
from serve_app.memory.shapes import CacheShape, cache_shape_from_layout
from serve_app.metrics.samples import replica_samples
from serve_app.metrics.table import Recorder
from serve_app.models.compat import download_model, token_bytes_table
from serve_app.models.embedded import materialize
from serve_app.multimodal.runtime import vision_for
from serve_app.parallel.lockstep import Channel, ShardPlanner
from serve_app.reasoning.ahead import HistoryAhead, ThinkingStats
from serve_app.reasoning.budget import ThoughtGate
from serve_app.serving.admission import QueueFullError, RankLostError, refusal
from serve_app.serving.engine import Engine
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.engine_ranks import RankEngine
from serve_app.serving.errors import queue_full_error, rank_lost_error
from serve_app.serving.events import Event, Finish, TokenLogprob
from serve_app.serving.prepare import PreparedRequest, Preparer, resumed
from serve_app.serving.recent import RecentWindow
from serve_app.serving.replica_stats import (
    CacheView,
    ImageStats,
    NormalizationStats,
    PhaseTimes,
    ReplicaStats,
)
from serve_app.serving.request import ApiError, Caller, ChatCompletionRequest, CompletionRequest
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.speculative import speculator_for
from serve_app.serving.stream import EventChannel, Lease, Pacer, RequestClock, RequestStream

AGREE_ROUNDS = 3  # a sharded model's ranks agreeing on a restore: then none is restored


def source_path(source: str, home: Path | None = None, progress=None) -> str:
    """The path (or hub id) that ``mlx_lm.load`` gets for a model source (``progress``
    hears an embedded real model's download and materialization)."""
    kind = source_kind(source)
    if kind == "embedded":
        return str(materialize(source[len(EMBEDDED_PREFIX) :], home or default_home(),
                               progress))
    if kind == "path":
        return str(Path(source).expanduser())
    return source


def draft_tokenizer_problem(profile: ModelProfile, home: Path | None = None) -> str | None:
    """Why ``speculative.draft_model`` cannot draft for ``profile``'s model (another
    tokenizer), read from local files only; None when it can, or when a hub model is not
    here to read (then ``load_draft_model`` refuses it when the model loads)."""
    spec = profile.speculative
    if spec is None or spec.draft_model is None:
        return None
    from mlx_lm.utils import load_tokenizer

    vocabs = []
    for source in (profile.source, spec.draft_model):
        if source_kind(source) == "hub":
            return None
        vocabs.append(load_tokenizer(Path(source_path(source, home))).get_vocab())
    return None if vocabs[0] == vocabs[1] else _another_tokenizer(spec.draft_model,
                                                                 repr(profile.source))


def _another_tokenizer(draft: str, target: str) -> str:
    return f"{draft!r} has another tokenizer than {target}: its tokens would mean other text"


def mtp_head_problem(profile: ModelProfile, home: Path | None = None) -> str | None:
    """Why ``speculative.method: mtp`` cannot draft for ``profile``'s model (no MTP head
    in its checkpoint), read from local files only; None when it can, or when a hub model
    is not here to read (then loading it refuses)."""
    spec = profile.speculative
    if spec is None or spec.method != "mtp" or source_kind(profile.source) == "hub":
        return None
    from serve_app.models.mtp import mtp_problem

    return mtp_problem(Path(source_path(profile.source, home)))


def _checkpoint_dir(model_dir: Path | None) -> Path:
    if model_dir is None:
        raise ValueError("speculative.method: mtp needs the model's checkpoint directory")
    return Path(model_dir)


def load_mtp_head(model, model_dir: Path):
    """The model's own MTP head (``serve_app.models.mtp``), refused with the reason."""
    from serve_app.models.mtp import MTPUnavailable
    from serve_app.models.mtp import load_mtp_head as load

    try:
        return load(model, model_dir)
    except MTPUnavailable as e:
        raise ValueError(f"speculative.method: mtp: {e}") from e


def load_draft_model(source: str, tokenizer, home: Path | None = None):
    """A draft model for speculative decoding, refused unless its tokenizer is the
    target's (its tokens would mean other text)."""
    import mlx_lm

    path = download_model(source_path(source, home))
    model, draft_tokenizer = mlx_lm.load(str(path))  # type: ignore[misc]
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError("speculative.draft_model: "
                         + _another_tokenizer(source, "the model it drafts for"))
    return model


def load_model(profile: ModelProfile, home: Path | None = None, progress=None):
    """Load through ``mlx_lm.load``; returns (model, tokenizer, model directory).
    ``progress`` hears each phase before loading (``downloading``, ``materializing``)."""
    import mlx_lm

    from serve_app.models.smollm2 import Progress

    path = source_path(profile.source, home, progress)
    if progress is not None and source_kind(profile.source) == "hub":
        progress(Progress("downloading"))  # from the hub, or at once from its local cache
    model_dir = download_model(path, profile.revision)
    # typed as a 2- or 3-tuple (return_config has no overloads): two without it;
    # the profile's chat template and tool-call format, if any, replace the checkpoint's
    model, tokenizer = mlx_lm.load(str(model_dir),  # type: ignore[misc]
                                   tokenizer_config=profile.tokenizer_config())
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
        lockstep: Channel | None = None,
        shard: str | None = None,
        wake_others: Callable[[int], None] | None = None,
    ) -> None:
        # Rank 0 of a sharded model: the other ranks' cache plans (set by the replica).
        self.shards: ShardPlanner | None = None
        self.profile = profile
        self.metrics = metrics or Recorder()
        self._labels = {"model": profile.name}
        self.tokenizer = tokenizer
        self.eos_ids = set(tokenizer.eos_token_ids)
        kwargs: dict[str, Any] = {
            "stop_tokens": self.eos_ids, "max_batch_size": profile.max_batch_size,
            "max_queued_requests": profile.max_queued_requests,
            "prefill_step_size": profile.prefill_step_size, "name": profile.name,
            "kv_quant": quant_of(profile.kv_cache)}
        vision, images = vision_for(profile, model, model_dir) if lockstep is None \
            else (None, None)  # the ranks of a sharded model place no images
        if lockstep is None:
            self.engine: Engine = Engine(model, vision=vision, speculator=speculator_for(
                profile.speculative, self.eos_ids,
                lambda source: load_draft_model(source, tokenizer),
                lambda: load_mtp_head(model, _checkpoint_dir(model_dir))), **kwargs)
        else:  # rank 0 of a model sharded over ranks (no speculation: the profile refuses)
            engine = RankEngine(model, channel=lockstep, **kwargs)
            engine.ranks.wake_others = wake_others  # before its first idle (it checks)
            self.engine = engine
        try:
            # The engine thread probes the layout: every cached array's shape and dtype.
            self.layout = self.engine.wait_ready()
            # What a sequence's cache weighs, from the layout (fixed for the model's life).
            self.kv_shape: CacheShape | None = (cache_shape_from_layout(self.layout)
                                                if self.layout.supported else None)
            self.cache = CacheManager.for_model(profile, self.layout, cache_client, model_dir,
                                                tokenizer.chat_template, shard)
        except BaseException:  # its thread would hold the weights on (a pool loads again)
            self.engine.shutdown()
            raise
        self.phases = PhaseTimes()
        self.recent = RecentWindow()  # the requests that ended in the last minute
        # Requests whose prompt a normalization rule changed, by rule (serve_app/normalize).
        self.normalized = dict.fromkeys(RULE_NAMES, 0)
        self.preparer = Preparer(profile, tokenizer, branch_points=self.cache.enabled,
                                 images=images)
        self.thinking = ThinkingStats()
        self.ahead = HistoryAhead(self.thinking)  # the next turns' prefixes, prefilled
        # Token id -> (its text, its raw bytes), for logprobs; the byte table on first use.
        self._token_texts: dict[int, tuple[str, tuple[int, ...]]] = {}
        self._token_bytes: Callable[[int], bytes] | None = None
        self._token_bytes_built = False

    @property
    def cache_stats(self) -> CacheStats:
        return self.cache.stats

    def shutdown(self) -> None:
        self.ahead.close()
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
        (``serve_app.serving.events``), then one ``Finish`` with usage (or a ``Failure``). Closing
        the iterator early cancels the request in the engine, which frees its batch slot
        at once. ``processors``:
        the request's ``constraints``, built off the event loop by the caller (a new
        schema compiles here otherwise).

        The steps: admission (429 before any cache work, 400 for a grammar), the cache
        plan and its lease (``Lease``), submission (429 when the engine's queue is full),
        then engine events to typed events (``RequestStream``), coalesced by
        ``Pacer``, with the phases and latencies accounted by ``RequestClock``.
        """
        arrived = time.perf_counter()
        for rule in prepared.normalized:
            self.normalized[rule] += 1
        refused, processors = self._admit(prepared, processors)
        if refused is not None:
            yield [refused.to_failure()]
            return
        run = prepared  # what the engine runs: a resumed request's prompt + tokens so far
        if prepared.resume:
            run = await asyncio.to_thread(resumed, prepared, self.preparer.images)
        try:
            plan, key = await self._plan(run)
        except RankLostError as exc:
            yield [rank_lost_error(str(exc)).to_failure()]
            return
        clock = RequestClock(self, arrived, prepared.prepare_seconds)
        lease = Lease(self.cache, plan.lease if plan is not None else None)
        events = EventChannel(asyncio.get_running_loop())
        try:
            rid = self._submit(run, processors, plan, events.put, key)
        except (QueueFullError, RankLostError) as exc:
            self.cache.settle(plan)
            if key is not None and self.shards is not None:
                self.shards.drop(key)
            await lease.release()
            refused = (rank_lost_error if isinstance(exc, RankLostError)
                       else queue_full_error)(str(exc))
            yield [refused.to_failure()]
            return
        except BaseException:
            self.cache.settle(plan)
            if key is not None and self.shards is not None:
                self.shards.drop(key)
            raise
        request = RequestStream(self, prepared, rid,
                                 plan.restore_tokens if plan is not None else 0, clock)
        pacer = Pacer(self.stream_interval)
        try:
            try:  # what the client has: its state, not its events
                request.replay(prepared.resume)
            except ApiError as exc:  # submitted already: the finally below cancels it
                yield [exc.to_failure()]
                return
            yield [request.start()]
            while not request.done:
                await pacer.wait(events)
                batch = await events.take()
                lease.release_beside()  # the engine has copied the restored blocks by now
                out = request.convert(batch)
                if request.done:  # before the last yield: a caller may stop at the Finish
                    self._after(prepared, request)
                if out:
                    pacer.sent()
                    yield out
        finally:
            if not request.done:
                self.engine.cancel(rid)
            self.cache.settle(plan)
            await lease.close()
            clock.finished()

    def _after(self, prepared: PreparedRequest, request: RequestStream) -> None:
        """A turn that ended: its thought counted; where it had a thought (generated, or
        rendered by the template in its generation prompt), the next turn's prefix
        prefilled ahead (``serve_app.reasoning.ahead``) once it answered (a stop string,
        the end of the answer or its token limit: the client sends back what it got)."""
        finish, history = request.finish, prepared.history
        if finish is None:
            return
        self.thinking.thought_tokens += finish.reasoning_tokens
        plan = prepared.thinking
        if history is None or plan is None:
            return
        if not (finish.reasoning_tokens or plan.prompt_thought):
            return  # no thought in this turn: the next one renders it as it was generated
        answer, calls = "".join(request.answer), tuple(request.calls)
        images = [s.image for s in prepared.vision.spans] if prepared.vision else []
        self.ahead.schedule(
            lambda: self.preparer.next_turn_prefix(history, answer, calls, images),
            [*prepared.prompt, *request.tokens],
            lambda tokens: self._prefill_ahead(prepared, tokens), self._free_slot)

    def _free_slot(self) -> bool:
        """A batch slot that no admitted request waits for (work ahead never queues, so
        it never takes a place a client's request could have had)."""
        return self.engine.snapshot().in_flight < self.profile.max_batch_size

    async def _prefill_ahead(self, turn: PreparedRequest, tokens: list[int]) -> int | None:
        """Prefill ``tokens`` (the next turn's prefix of ``turn``'s conversation) through
        the cache, under the turn's salt and key; the tokens restored, or None when the
        engine has no free slot (real requests come first) or the prefix is too long."""
        if len(tokens) >= self.profile.context_length or not self._free_slot():
            return None
        ahead = PreparedRequest(prompt=tokens, params=SamplingParams(max_tokens=1),
                                stops=[], salt=turn.salt, api_key_digest=turn.api_key_digest)
        if turn.vision is not None and self.preparer.images is not None:
            ahead.vision = await asyncio.to_thread(  # mrope positions: off the event loop
                self.preparer.images.from_keys, tokens, [s.image for s in turn.vision.spans])
        restored: int | None = None
        async for events in self.stream(ahead, ()):
            for e in events:
                if isinstance(e, Finish):
                    restored = e.cached_tokens
        return restored

    def _admit(self, prepared: PreparedRequest,
               processors: tuple | None) -> tuple[ApiError | None, tuple]:
        """The request's refusal, if any, and its logits processors: 429 when the engine
        is at capacity (checked before any cache work), 400 when its grammar does not
        compile (``constraints``, unless the caller built ``processors`` already)."""
        refused = refusal(self.engine)
        if refused is not None:
            return refused, ()
        if processors is None:
            try:
                processors = self.constraints(prepared)
            except ApiError as exc:
                return exc, ()
        return None, processors

    def _submit(self, prepared: PreparedRequest, processors: tuple,
                plan: RequestPlan | None, sink: Callable[[EngineEvent], None],
                key: str | None = None) -> int:
        """Into the engine with its plan; its events go to ``sink`` (on the engine's
        thread). Raises ``QueueFullError`` when the engine's queue is full."""
        params = replace(prepared.params, logprobs=prepared.logprobs,
                         logits_processors=processors)
        return self.engine.submit(prepared.prompt, params, sink, plan, key,
                                  vision=prepared.vision)

    async def _plan(self, prepared: PreparedRequest) -> tuple[RequestPlan | None, str | None]:
        """The request's cache plan. On a model sharded over ranks every rank plans its
        own share (under the key returned) and the request restores what all of them
        hold: rank 0 plans again, with that as its limit, until they agree (a few rounds
        at most; past them, nothing is restored, which every rank can do)."""
        kw = {"salt": prepared.salt, "api_key_digest": prepared.api_key_digest,
              "branch_points": prepared.branch_points}
        plan = await self.cache.plan(prepared.prompt, **kw)  # type: ignore[arg-type]
        shards = self.shards
        if shards is None or plan is None:
            return plan, None
        key = uuid.uuid4().hex
        try:
            for round_ in range(AGREE_ROUNDS + 1):
                want = plan.restore_tokens if round_ < AGREE_ROUNDS else 0
                got = await asyncio.wait_for(
                    shards.plan(key, prepared.prompt, want, **kw),  # type: ignore[arg-type]
                    shards.timeout_s)
                if min(got, default=want) >= plan.restore_tokens:
                    return plan, key
                self.cache.settle(plan)
                await self.cache.release(plan.lease)
                plan = await self.cache.plan(prepared.prompt, limit=min([want, *got]),
                                             **kw)  # type: ignore[arg-type]
                assert plan is not None
            return plan, key
        except BaseException as exc:  # cancelled, or a rank failed: nothing is kept
            self.cache.settle(plan)
            if plan is not None:
                await asyncio.shield(self.cache.release(plan.lease))
            shards.drop(key)
            if isinstance(exc, Exception) and not isinstance(exc, asyncio.CancelledError):
                raise RankLostError(f"model {self.profile.name!r}: the other ranks did not "
                                    f"plan the request's cache ({type(exc).__name__}: "
                                    f"{exc})") from exc
            raise

    def constraints(self, prepared: PreparedRequest) -> tuple:
        """The request's own logits processors: a fresh matcher of its grammar, if any
        (``Preparer.grammar``; 400 as ``ApiError``), behind a thinking request's
        ``ThoughtGate`` when it has a budget or a grammar."""
        grammar = self.preparer.grammar(prepared)

        def answer() -> tuple:
            return (grammar.processor(),) if grammar is not None else ()

        plan = prepared.thinking
        if plan is not None and (plan.budget is not None or grammar is not None):
            # The thought is free (up to its budget); the grammar starts after it. Where the
            # template did not open a thought, an unbudgeted one could take every token the
            # answer had: under a grammar the output opens one only with a budget.
            processors: tuple = (ThoughtGate(plan.markers, plan.in_thought, plan.budget,
                                             answer, may_open=plan.budget is not None),)
        else:
            processors = answer()
        if prepared.resume:  # they follow the tokens generated before from the start
            for processor in processors:
                processor.begin_at(len(prepared.prompt))
        return processors

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
        vision = self.engine.vision
        return replica_samples(self.profile.name, self.engine.snapshot(), self.cache_stats,
                               self.normalized, self.thinking,
                               replace(vision.stats) if vision is not None else None,
                               self.kv_shape)

    async def stats(self) -> dict:
        """``full_stats`` as ``/v1/stats`` shows them."""
        return (await self.full_stats()).to_json()

    async def full_stats(self) -> ReplicaStats:
        """``local_stats`` with the cache store's section (a store call)."""
        stats = self.local_stats()
        client = self.cache.client
        return stats if client is None else replace(stats, cache_store=await client.stats())

    def local_stats(self) -> ReplicaStats:
        """This replica's stats but the cache store's section: nothing remote, so any
        thread (the replica's report to its store, ``serve_app.cluster.replicas``) may
        call it."""
        remote = self.cache.remote
        view = CacheView(self.cache.settings.checkpoint_every or None, {
            "bandwidth_bytes_per_s": round(remote.bandwidth),
            "prefill_tokens_per_s": round(remote.prefill_rate) if remote.prefill_rate else None,
            "nodes": remote.snapshot()})  # per node: bandwidth, fetches, failures, breaker
        return ReplicaStats(
            self.profile.name, self.engine.snapshot(), copy.deepcopy(self.cache_stats), view,
            copy.deepcopy(self.phases),
            NormalizationStats(list(self.profile.normalize), dict(self.normalized)),
            recent=self.recent.activity(), images=self._image_stats(),
            kv_cache=self.kv_shape)

    def _image_stats(self) -> ImageStats | None:
        vision = self.engine.vision
        if vision is None:
            return None
        s = vision.stats
        return ImageStats(s.images, s.cache_hits, s.prefix_hits, s.encoder_seconds,
                          s.cached_bytes)

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
        while self.engine.snapshot().generated_tokens < len(tokens):
            if time.monotonic() > settle:
                break
            time.sleep(0.001)
        self.engine.reset_stats()
        return time.perf_counter() - tic


