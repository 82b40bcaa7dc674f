"""The engine: one thread that owns all MLX work for one model.

It drives mlx-lm's ``BatchGenerator``, so requests join and leave the running
batch between decode steps (continuous batching). Other threads talk to it only
through a command queue; results go back through per-request callbacks. It
knows nothing about HTTP, Ray or text: tokens in, tokens out.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from serve_app.cache.layout import Layout, probe_layout
from serve_app.cache.request_plan import Published, RequestPlan
from serve_app.kvquant.format import KVQuant
from serve_app.memory.plan import MemoryLimits
from serve_app.memory.shapes import cache_shape_from_layout
from serve_app.models.compat import batch_row_caches, install_decode_step
from serve_app.multimodal.prompt import VisionPrompt
from serve_app.multimodal.runtime import VisionRuntime
from serve_app.parallel.lockstep import Cancel, Forget, Insert
from serve_app.serving import engine_cache, engine_exit
from serve_app.serving.admission import (
    KVBudget,
    KVBudgetError,
    QueueFullError,
    RankLostError,
    capacity_message,
)
from serve_app.serving.engine_events import EngineEvent, EngineStats, EventSink, StepOutcome
from serve_app.serving.engine_request import EngineRequest, deliver
from serve_app.serving.samplers import make_request_sampler, score_logprobs
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.speculative import Speculator

logger = logging.getLogger(__name__)


class Engine:
    """Continuous batching over one model on one dedicated thread.

    ``max_batch_size`` sequences decode together; up to ``max_queued_requests``
    more wait for a slot. Beyond that ``submit`` raises ``QueueFullError`` so
    callers get back-pressure instead of unbounded memory.
    """

    def __init__(
        self,
        model,
        *,
        stop_tokens: set[int],
        max_batch_size: int = 8,
        max_queued_requests: int = 32,
        prefill_step_size: int = 512,
        prefill_batch_size: int | None = None,
        name: str = "model",
        speculator: Speculator | None = None,
        vision: VisionRuntime | None = None,
        kv_quant: KVQuant | None = None,
    ) -> None:
        self.model = model
        self.kv_quant = kv_quant  # the attention layers' K/V quantized (None: float)
        self.vision = vision  # a vision-language model's image splice
        self.broken: str | None = None  # why a sharded engine stopped (a rank was lost)
        self._abandoned: set[int] = set()  # requests ``RankEngine.abandon`` already ended
        # Speculative decode steps (None: plain ones); it reports each step to the counters.
        self.speculator = speculator
        if speculator is not None:
            speculator.record = self._record_step
        self.layout: Layout | None = None  # probed on the engine thread (wait_ready)
        self.name = name
        self.stop_tokens = set(stop_tokens)
        self.max_batch_size = max_batch_size
        self.max_queued_requests = max_queued_requests
        self.prefill_step_size = prefill_step_size
        self.prefill_batch_size = prefill_batch_size or min(max_batch_size, 8)
        self.stats = EngineStats(speculative_method=self._method)
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count(1)
        self._requests: dict[int, EngineRequest] = {}
        self._by_uid: dict[int, EngineRequest] = {}
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._generator: BatchGenerator | None = None
        # KV admission (set_kv_budget): the budget, and requests waiting for KV (engine
        # thread only: admitted in order, so a large request is never passed over).
        self.kv = KVBudget()
        self._kv_waiting: deque[EngineRequest] = deque()
        # MLX's memory limits (set_memory_limits), and what the engine thread applied.
        self._limits: MemoryLimits | None = None
        self.applied_limits: MemoryLimits | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{name}", daemon=True)
        self._thread.start()
        engine_exit.register(self)

    # ---- called from any thread -------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        sink: EventSink,
        cache: RequestPlan | None = None,
        plan_key: str | None = None,
        vision: VisionPrompt | None = None,
    ) -> int:
        """Queue a request; events for it arrive through ``sink`` on the engine thread.
        ``plan_key``: a sharded model's other ranks planned its cache under it."""
        if not prompt:
            raise ValueError("prompt must contain at least one token")
        if cache is not None and (self.layout is None or not self.layout.supported):
            raise ValueError("this engine has no supported cache layout")
        if self.broken is not None:
            raise RankLostError(self.broken)
        if self._stopping.is_set():
            raise QueueFullError(f"model {self.name!r} is shutting down")
        self.check_kv(len(prompt), params.max_tokens)
        with self._lock:
            if self._queue_full():
                self.stats.rejected += 1
                raise QueueFullError(self.capacity_message())
            self.stats.in_flight += 1
            self.stats.submitted += 1
            rid = next(self._ids)
        self._commands.put(("submit", EngineRequest(rid, list(prompt), params, sink, cache,
                                                    plan_key=plan_key, vision=vision)))
        return rid

    def set_kv_budget(self, budget_bytes: int | None) -> None:
        """Admit requests by KV bytes (``admission.KVBudget``): one that would take the
        reserved KV past ``budget_bytes`` waits until running ones free enough; one over
        the budget alone is refused at ``submit`` (``KVBudgetError``). None: no limit."""
        shape = cache_shape_from_layout(self._probed_layout) \
            if self._probed_layout.supported else None
        self.kv = KVBudget(shape, budget_bytes if shape is not None else None)
        self._commands.put(("wake", None))  # a larger budget may admit waiting requests

    def check_kv(self, prompt_tokens: int, max_tokens: int) -> None:
        """``KVBudgetError`` (counted in ``kv_rejected``) for a request that could never be
        admitted; callers that know the request's size early refuse it before any work."""
        refusal = self.kv.refusal(self.name, prompt_tokens, max_tokens)
        if refusal is not None:
            with self._lock:
                self.stats.kv_rejected += 1
            raise KVBudgetError(refusal)

    def set_memory_limits(self, limits: MemoryLimits | None) -> None:
        """MLX's wired and cache limits, applied on the engine thread now and after every
        ``BatchGenerator`` it makes (which sets its own); off Metal none (advisory)."""
        self._commands.put(("limits", limits))

    def at_capacity(self) -> bool:
        """True when ``submit`` would raise ``QueueFullError`` (counted as a rejection)."""
        with self._lock:
            full = self._queue_full()
            self.stats.rejected += int(full)
            return full

    @property
    def _method(self) -> str:
        return self.speculator.method if self.speculator is not None else ""

    def _queue_full(self) -> bool:
        """The queue bound (``max_batch_size + max_queued_requests``); under ``_lock``."""
        return self.stats.in_flight >= self.max_batch_size + self.max_queued_requests

    def capacity_message(self) -> str:
        return capacity_message(self.name, self.stats.in_flight, self.max_batch_size,
                                self.max_queued_requests)

    def reset_stats(self) -> None:
        """Start every counter from zero (after a warm-up users must not see)."""
        with self._lock:
            self.stats = EngineStats(speculative_method=self._method)

    def wait_ready(self, timeout: float | None = None) -> Layout:
        """Block until the engine thread has probed the model's cache layout."""
        if not self._ready.wait(timeout):
            raise TimeoutError(f"engine {self.name!r} did not start in {timeout} s")
        if self._start_error is not None:
            raise RuntimeError(f"engine {self.name!r} failed to start") from self._start_error
        return self._probed_layout

    def cancel(self, rid: int) -> None:
        """Stop a request and free its batch slot before the next decode step."""
        self._commands.put(("cancel", rid))

    def snapshot(self) -> EngineStats:
        """A copy of the counters, consistent (taken under the engine's lock)."""
        with self._lock:
            return replace(self.stats)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._commands.put(("wake", None))
        self._stopped.wait(timeout)

    # ---- engine thread ------------------------------------------------------------

    @property
    def _probed_layout(self) -> Layout:
        """The cache layout, probed on the engine thread before it serves anything."""
        if self.layout is None:
            raise RuntimeError(f"engine {self.name!r} has not probed its model")
        return self.layout

    @property
    def _batch(self) -> BatchGenerator:
        """The running batch (made on the engine thread before it serves anything)."""
        if self._generator is None:
            raise RuntimeError(f"engine {self.name!r} is not running")
        return self._generator

    def _new_generator(self) -> BatchGenerator:
        old, self._generator = self._generator, None
        if old is not None:  # it puts back the wired limit it found: before ours is set
            old.close()
        generator = BatchGenerator(
            self.model,
            stop_tokens=[[t] for t in sorted(self.stop_tokens)],
            completion_batch_size=self.max_batch_size,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_step_size,
            # The engine thread's own default stream: a stream made on another
            # thread is not usable here, and a new one aborts the process at exit.
            stream=mx.default_stream(mx.default_device()),
        )
        self._apply_limits()  # after mlx-lm set the recommended wired limit
        if self.speculator is not None:
            install_decode_step(generator, self.speculator.step)
        elif self.vision is not None:
            self.vision.install(generator)
        return generator

    def _apply_limits(self) -> None:
        """The plan's limits into MLX, on Metal only (engine thread)."""
        self.applied_limits = self._limits.apply() if self._limits is not None else None

    def _run(self) -> None:
        try:
            self._begin()
            self.layout = probe_layout(self.model, self.kv_quant)
            if self.speculator is not None:
                self.speculator.calibrate(self.model, self.max_batch_size)
            self._generator = self._new_generator()
        except BaseException as exc:  # reported by wait_ready
            self._start_error = exc
            self._stopping.set()
        self._ready.set()
        self._serve()
        self._on_stop()
        self._fail_all(self.broken or "engine shut down")
        self._fail_queued("engine shut down")
        for req in [*self._kv_waiting, *(self.vision.drop_all() if self.vision else [])]:
            self._fail(req, "engine shut down")
        self._kv_waiting.clear()
        self._count_waiting()
        # Free MLX state on the thread that made it: arrays of this thread's
        # stream destroyed at interpreter exit abort the process.
        self._generator = None
        # The model's weights go with the engine (a model pool unloads it): this thread
        # stays parked below, holding the engine, so it must not hold the weights too.
        self.model = None
        self.speculator = None  # and a draft model's with it
        mx.synchronize()
        self._stopped.set()
        # Park instead of returning: when a thread that used MLX exits, its
        # thread-local streams are torn down in a way that can abort the whole
        # process (std::terminate). A parked daemon thread dies with the process.
        threading.Event().wait()

    def _serve(self) -> None:
        while not self._stopping.is_set():
            try:
                if not self._requests:
                    if self.stats.running_batch_size:  # the last step's, not now's
                        with self._lock:
                            self.stats.running_batch_size = 0
                    self._idle()
                busy = self.vision is not None and self.vision.busy
                self._drain_commands(block=not self._requests and not busy)
                if busy and self.vision is not None:  # a prefill chunk's worth of tower work
                    for req in self.vision.encode_step(self.prefill_step_size):
                        self._join(req)  # the requests whose images are all encoded
                if self._requests:
                    self._step()
                self._admit_waiting()
            except Exception as exc:  # the engine must outlive any one bad batch
                logger.exception("engine %s step failed", self.name)
                if self._on_error(exc):
                    return
                self._fail_all(f"engine error: {exc}")
                self._generator = self._new_generator()

    # ---- what a model sharded over ranks adds (``engine_ranks.RankEngine``): no-ops here

    def _begin(self) -> None:  # on the engine thread, before it probes the model
        pass

    def _idle(self) -> None:  # nothing runs: the engine is about to wait for commands
        pass

    def _before_step(self) -> None:
        pass

    def _record(self, command: Insert | Cancel | Forget) -> None:  # done to the batch
        pass

    def _on_error(self, exc: Exception) -> bool:  # a step failed; True: stop for good
        return False

    def _on_stop(self) -> None:
        pass

    def _drain_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = command
            if kind == "submit":
                self._admit(arg)
            elif kind == "cancel":
                self._cancel(arg)
            elif kind == "limits":
                self._limits = arg
                self._apply_limits()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _admit(self, req: EngineRequest) -> None:
        """Into the batch if its KV fits beside the running requests' (or nothing runs),
        else to the back of the KV queue (behind any request already waiting)."""
        req.kv_bytes = self.kv.bytes_for(len(req.prompt), req.params.max_tokens)
        if self._kv_waiting or not self._kv_fits(req):
            self._kv_waiting.append(req)
            with self._lock:
                self.stats.kv_waited += 1
            self._count_waiting()
            return
        self._start(req)

    def _kv_fits(self, req: EngineRequest) -> bool:  # requests held for the tower run too
        held = self.vision.held if self.vision is not None else 0
        return self.kv.fits(self.stats.kv_in_use_bytes, req.kv_bytes, len(self._requests) + held)

    def _admit_waiting(self) -> None:
        """Requests waiting for KV, in order, while the first of them fits."""
        while self._kv_waiting and self._kv_fits(self._kv_waiting[0]):
            self._start(self._kv_waiting.popleft())
            self._count_waiting()

    def _count_waiting(self) -> None:
        with self._lock:
            self.stats.kv_waiting = len(self._kv_waiting)

    def _start(self, req: EngineRequest) -> None:
        with self._lock:  # reserved from now (a request waiting for the tower holds it too)
            self.stats.kv_in_use_bytes += req.kv_bytes
        if req.vision is not None and self.vision is not None and self.vision.hold(req):
            return  # its images first, a prefill chunk's worth a step (``_serve``)
        self._join(req)

    def _join(self, req: EngineRequest) -> None:
        try:
            self._insert(req)
        except Exception as exc:  # e.g. a restore that does not fit the model
            logger.exception("engine %s: inserting request %d failed", self.name, req.rid)
            self._release_kv(req)
            self._fail(req, f"could not start the request: {exc}")

    def _release_kv(self, req: EngineRequest) -> None:
        """A request ended (or never joins): its KV reservation is free."""
        if not req.kv_bytes:  # no KV budget: nothing reserved
            return
        with self._lock:
            self.stats.kv_in_use_bytes = max(0, self.stats.kv_in_use_bytes - req.kv_bytes)
        req.kv_bytes = 0

    def _insert(self, req: EngineRequest, segments: list[list[int]] | None = None,
                restored: int | None = None) -> None:
        """Into the batch. A follower rank passes rank 0's ``segments`` and what rank 0
        ``restored`` (its own restore must give as many tokens, or the ranks part)."""
        caches, all_tokens = None, None
        cache = engine_cache.restore(self.model, self._probed_layout, req, self.stats,
                                     self._lock, self.name, restoring=restored != 0)
        if restored is not None and req.restored != restored:
            raise RuntimeError(f"request {req.rid}: this rank restored {req.restored} "
                               f"tokens where rank 0 restored {restored}")
        if cache is not None:
            caches, all_tokens = [cache], [req.prompt[: req.restored]]
        if req.cache is not None:
            req.cache.start(req.restored)
        # Every request learns when it left the queue and what it really restored.
        deliver(req, EngineEvent(restored=req.restored))
        if segments is None:
            segments = engine_cache.segments(req)
        processors = list(req.params.logits_processors)
        if req.vision is not None and self.vision is not None:
            segments, processors, all_tokens = self.vision.begin(req, segments, processors)
        (uid,) = self._batch.insert_segments(
            [segments],
            max_tokens=[req.params.max_tokens],
            caches=caches,
            all_tokens=all_tokens,
            samplers=[make_request_sampler(req.params)],
            # The processors see prompt + generated tokens even after a restore: mlx-lm
            # starts the request's token history from ``all_tokens`` (the restored part)
            # and appends every prefilled chunk to it.
            logits_processors=[processors],
        )
        req.uid = uid
        if req.vision is not None and self.vision is not None:
            self.vision.joined(req.rid, uid)
        self._record(Insert(req.rid, req.prompt, req.params.max_tokens, segments,
                            req.restored, req.plan_key))
        if self.speculator is not None:
            self.speculator.add(uid, req.params, len(req.prompt))
        self._requests[req.rid] = req
        self._by_uid[uid] = req
        with self._lock:
            self.stats.prompt_tokens += len(req.prompt)

    def _cancel(self, rid: int) -> None:
        req = self._requests.pop(rid, None)
        if req is None:
            self._cancel_waiting(rid)
            return
        assert req.uid is not None  # set by _insert before the request is in _requests
        self._by_uid.pop(req.uid, None)
        self._forget(req)
        if req.cache is not None and req.generated:
            # Still in the batch: the cache and the state are at the last token returned.
            self._capture(req, len(req.prompt) + req.generated, None, state_valid=True,
                          decoding=True, ended=True)
        self._batch.remove([req.uid])
        self._record(Cancel(rid))
        self._publish_held(req)
        self._release_kv(req)
        with self._lock:
            self.stats.cancelled += 1
            self.stats.in_flight -= 1
        deliver(req, EngineEvent(finish_reason="cancelled"))

    def _cancel_waiting(self, rid: int) -> None:
        """Cancel a request waiting for KV or for the tower (it never joined the batch)."""
        req = next((r for r in self._kv_waiting if r.rid == rid), None)
        if req is not None:
            self._kv_waiting.remove(req)
            self._count_waiting()
        elif self.vision is not None and (req := self.vision.drop(rid)) is not None:
            self._release_kv(req)
        if req is None:
            return
        with self._lock:
            self.stats.cancelled += 1
            self.stats.in_flight -= 1
        self._forget_unstarted(req)
        deliver(req, EngineEvent(finish_reason="cancelled"))

    def _step(self) -> None:
        tic = time.perf_counter()
        self._before_step()
        prompt_responses, responses = self._batch.next()
        toc = time.perf_counter()
        # A speculative step returns several tokens of a row, in order.
        batch = len({r.uid for r in responses})
        last = {r.uid: n for n, r in enumerate(responses)}
        # Counted before any event goes out: whoever sees a request's end sees its tokens.
        with self._lock:
            if batch:
                self.stats.decode_steps += 1
                self.stats.generated_tokens += len(responses)
            self.stats.step_seconds += toc - tic
            self.stats.steps += 1
            self.stats.longest_step_seconds = max(self.stats.longest_step_seconds, toc - tic)
            self.stats.running_batch_size = batch
            self.stats.peak_batch_size = max(self.stats.peak_batch_size, batch)
        for p in prompt_responses:
            req = self._by_uid.get(p.uid)
            if req is not None and p.end_of_prompt and self.vision is not None:
                self.vision.prefilled(req.rid)
            if req is None or req.cache is None:
                continue
            if p.end_of_prompt:  # the last prompt token is fed with the first decode step
                self._capture(req, len(req.prompt) - 1, None, state_valid=False)
            else:  # the recurrent state is at ``covered`` only where a segment ended
                self._capture(req, req.restored + p.progress[0], None,
                              state_valid=p.end_of_segment)
        wanted = [n for n, r in enumerate(responses) if r.uid in self._by_uid
                  and self._by_uid[r.uid].params.logprobs is not None]
        scored = dict(zip(wanted, score_logprobs(
            [responses[n] for n in wanted],
            [self._by_uid[responses[n].uid].params.logprobs or 0 for n in wanted]),
            strict=True))
        for n, r in enumerate(responses):
            req = self._by_uid.get(r.uid)
            if req is None:
                continue
            req.generated += 1
            req.output.append(r.token)
            if req.cache is not None:
                # The cache now holds the prompt and every token returned so far; the
                # recurrent state is at the row's last token of the step.
                self._capture(req, len(req.prompt) + req.generated, r.prompt_cache,
                              state_valid=last[r.uid] == n, decoding=True,
                              ended=r.finish_reason is not None)
            logprob, top = scored.get(n, (None, ()))
            deliver(req, EngineEvent(token=r.token, logprob=logprob, top_logprobs=top))
            if r.finish_reason is not None:
                self._finish(req, r.finish_reason)

    def _capture(self, req: EngineRequest, covered: int, finished_cache: list | None, *,
                 state_valid: bool, decoding: bool = False, ended: bool = False) -> None:
        """What the request's plan says is due, now that its cache covers ``covered``
        tokens (``engine_cache.capture``)."""
        seconds = engine_cache.capture(req, covered, finished_cache, self._probed_layout,
                                       lambda uid: batch_row_caches(self._batch, uid),
                                       self._count, self.name,
                                       state_valid=state_valid, decoding=decoding,
                                       ended=ended)
        if seconds:
            with self._lock:
                self.stats.capture_seconds += seconds

    def _count(self, published: list[Published]) -> None:
        with self._lock:
            self.stats.count_published(published)

    def _publish_held(self, req: EngineRequest) -> None:
        """A request that ends publishes its newest decode-time checkpoint."""
        if req.cache is not None:
            self._count(req.cache.publish_held())

    def _finish(self, req: EngineRequest, reason: str) -> None:
        self._requests.pop(req.rid, None)
        if req.uid is not None:
            self._by_uid.pop(req.uid, None)
        self._forget(req)
        self._publish_held(req)
        self._release_kv(req)
        with self._lock:
            self.stats.finished += 1
            self.stats.in_flight -= 1
        deliver(req, EngineEvent(finish_reason=reason))

    def _forget(self, req: EngineRequest) -> None:
        if self.vision is not None:
            self.vision.ended(req.rid)
        if self.speculator is not None and req.uid is not None:
            self.speculator.forget(req.uid)

    def _record_step(self, outcome: StepOutcome) -> None:
        with self._lock:
            self.stats.count_step(outcome)

    def _fail(self, req: EngineRequest, message: str) -> None:
        self._forget(req)
        if self._requests.pop(req.rid, None) is not None:
            self._release_kv(req)
        with self._lock:
            self.stats.failed += 1
            self.stats.in_flight -= 1
        self._forget_unstarted(req)
        if req.rid not in self._abandoned:
            deliver(req, EngineEvent(error=message, unavailable=self.broken is not None))

    def _forget_unstarted(self, req: EngineRequest) -> None:
        """A request that never joined the batch: the plans made for it elsewhere go."""
        if req.uid is None and req.plan_key is not None:
            self._record(Forget(req.plan_key))

    def _fail_all(self, message: str) -> None:
        for req in list(self._requests.values()):
            self._fail(req, message)
        self._by_uid.clear()

    def _fail_queued(self, message: str) -> None:
        while True:
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self._fail(arg, message)
