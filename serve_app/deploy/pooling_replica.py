"""One embedding or rerank model's replica (``models[].task: embed | rerank``).

Ray Serve's own ``@serve.batch`` gathers the requests that arrive together into one model
call; the call runs all their inputs, sorted by length, on the replica's one MLX thread
(``serve_app.pooling.model``). Tokenizing runs on worker threads first, so a long input
never holds the model. It loads and unloads as the model pool asks, and reports its phase,
stats and metrics as a generation replica does."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray import serve

from serve_app.config.profile import ModelProfile
from serve_app.deploy.pool import UNLOAD_REASONS
from serve_app.metrics.samples import pool_samples, pooling_samples
from serve_app.metrics.table import MetricsPump, RayRecorder
from serve_app.models.compat import download_model
from serve_app.models.phase import (
    ModelLoadError,
    PhaseBoard,
    load_failure_reason,
    replica_identity,
)
from serve_app.pooling.calls import PoolingAnswer, PoolingCall, ScoreCall
from serve_app.serving.errors import model_load_failed_error
from serve_app.serving.events import Failure
from serve_app.serving.replica_stats import PoolingStats, ReplicaProcess, ReplicaStats
from serve_app.serving.request import ApiError

if TYPE_CHECKING:
    from serve_app.pooling.model import Encoded, PoolingModel, Task

logger = logging.getLogger("ray.serve")


class PoolingReplica:
    def __init__(self, profile: ModelProfile, model_home: str | None,
                 load_at_start: bool = True) -> None:
        self.profile = profile
        self.task: Task = "rerank" if profile.task == "rerank" else "embed"
        self.model_home = Path(model_home).expanduser() if model_home else None
        self.node_id = ray.get_runtime_context().get_node_id()
        self.recorder = RayRecorder("replica", serve=True)
        self.board = PhaseBoard(*replica_identity(profile.name))
        # MLX's one thread: loading, every batch, and freeing the model run there.
        self.mlx = ThreadPoolExecutor(1, thread_name_prefix=f"mlx-{profile.name}")
        self.model: PoolingModel | None = None
        self.counts = PoolingStats(task=self.task)
        self.loads, self.load_seconds = 0, 0.0
        self.unloads = dict.fromkeys(UNLOAD_REASONS, 0)
        self.active = 0  # requests here now (an unload waits for none)
        self._transition: asyncio.Lock | None = None
        self.loop_thread: str | None = None
        settings = profile.pooling
        self._run.set_max_batch_size(settings.max_batch_size)  # type: ignore[attr-defined]
        self._run.set_batch_wait_timeout_s(settings.batch_wait_timeout_s)  # type: ignore[attr-defined]
        # Every second: the counters (from the totals below) and the model pool's.
        self.pump = MetricsPump(self.recorder, self.metric_samples).start()
        if load_at_start:
            try:
                self.mlx.submit(self._load, True).result()
            except ModelLoadError:
                pass  # the replica stays up, failed with its reason; a request tries again
        else:
            self.board.set("unloaded")

    # ---- loading and unloading (the model pool's calls) ------------------------------

    def _load(self, at_start: bool = False) -> PoolingModel:
        from serve_app.models.wheels import console_progress
        from serve_app.pooling.model import PoolingModel
        from serve_app.serving.service import source_path

        tic = time.perf_counter()
        console = console_progress(self.profile.name)

        def progress(p: Any) -> None:
            console(p)
            self.board.set(p.phase, p.done_bytes or None, p.total_bytes or None)

        try:
            path = download_model(source_path(self.profile.source, self.model_home, progress),
                                  self.profile.revision)
            self.board.set("loading")
            model = PoolingModel(Path(path), self.task, self.profile.pooling.max_batch_tokens)
            self.board.set("warming")
            probe = model.encode_pair("warm", "up") if self.task == "rerank" else \
                model.encode("warm up")
            (model.scores if self.task == "rerank" else model.embed)([probe])
        except Exception as exc:
            reason = load_failure_reason(self.profile.source, exc)
            self.board.set("failed", reason=reason)
            logger.error("model %s failed to load: %s", self.profile.name, reason)
            raise ModelLoadError(reason) from exc
        self.model = model
        self.board.set("ready")
        if not at_start:
            self.loads += 1
            self.load_seconds += time.perf_counter() - tic
        logger.info("model %s ready (%s, %s pooling)", self.profile.name, self.task,
                    model.pooling.mode)
        return model

    @property
    def transition(self) -> asyncio.Lock:
        if self._transition is None:
            self._transition = asyncio.Lock()
        return self._transition

    async def _loaded(self) -> PoolingModel:
        model = self.model
        if model is not None:
            return model
        async with self.transition:
            if self.model is None:
                try:
                    await asyncio.wrap_future(self.mlx.submit(self._load))
                except ModelLoadError as exc:
                    raise model_load_failed_error(
                        f"model {self.profile.name!r} could not be loaded: {exc}") from None
            assert self.model is not None
            return self.model

    async def load(self) -> str:
        await self._loaded()
        return "loaded"

    async def unload(self, reason: str = "capacity") -> bool:
        async with self.transition:
            if self.model is None:
                return True
            deadline = time.monotonic() + 5.0
            while self.active:
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.02)
            self.model = None
            await asyncio.wrap_future(self.mlx.submit(_free_mlx))
            self.unloads[reason if reason in self.unloads else "capacity"] += 1
            self.board.set("unloaded")
            return True

    async def status(self) -> str:
        return "unloaded" if self.model is None else "loaded"

    async def ready(self) -> bool:
        self.loop_thread = threading.current_thread().name
        return True

    def cache_identities(self) -> frozenset[str]:
        return frozenset()  # no prefix cache

    async def self_benchmark(self, ssd_bytes: int) -> Any:
        raise ApiError(409, f"model {self.profile.name!r} is an {self.task} model: the "
                            "self-benchmark measures generation", code="not_generative")

    # ---- requests ------------------------------------------------------------------

    async def run(self, call: PoolingCall) -> PoolingAnswer | Failure:
        """One request's inputs through the model (with whatever requests arrive with
        it); a ``Failure`` (400 naming the input, 429 when full, 503) instead of raising."""
        self.active += 1
        try:
            model = await self._loaded()
            if not isinstance(call, ScoreCall) and call.dimensions is not None:
                self._check_dimensions(model, call.dimensions)
            encoded = await asyncio.to_thread(_encode, model, call, self._truncate(call),
                                              self.profile.pooling.instruction)
            values = await self._run(encoded)
            if isinstance(values, Exception):
                raise values
            tokens = sum(len(e.ids) for e in encoded)
            self.counts.requests += 1
            self.counts.inputs += len(encoded)
            self.counts.tokens += tokens
            if isinstance(call, ScoreCall):
                return PoolingAnswer("score", values, tokens)
            from serve_app.pooling.pooler import finish

            return PoolingAnswer("embed", finish(values, model.pooling, call.dimensions), tokens)
        except ApiError as exc:
            self.counts.failed += 1
            return exc.to_failure()
        except Exception as exc:  # a bug of ours: a 500 that says so, the replica goes on
            logger.exception("model %s: a request failed", self.profile.name)
            self.counts.failed += 1
            return ApiError(500, f"the model replica failed on this request: {exc}",
                            type="server_error").to_failure()
        finally:
            self.active -= 1

    def _check_dimensions(self, model: PoolingModel, dimensions: int) -> None:
        if dimensions > model.dimension:
            raise ApiError(400, f"dimensions: {dimensions} is over the model's "
                                f"{model.dimension}", param="dimensions")
        if dimensions != model.dimension and not self.profile.pooling.matryoshka:
            raise ApiError(400, f"dimensions: model {self.profile.name!r} was not trained to "
                                f"be cut (Matryoshka): ask for its {model.dimension} or none "
                                "(pooling.matryoshka in its profile says it was)",
                           param="dimensions", code="dimensions_not_supported")

    def _truncate(self, call: PoolingCall) -> bool:
        return self.profile.pooling.truncate if call.truncate is None else call.truncate

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.005)
    async def _run(self, batches: list[list[Encoded]]) -> list[np.ndarray | Exception]:
        """Every request's inputs that arrived together, in one model call on the MLX
        thread; each request gets its rows back (or the call's error)."""
        model = self.model
        if model is None:
            return [RuntimeError("the model was unloaded")] * len(batches)
        flat = [e for batch in batches for e in batch]
        run = model.scores if self.task == "rerank" else model.embed
        tic = time.perf_counter()
        try:
            values = await asyncio.wrap_future(self.mlx.submit(run, flat))
        except Exception as exc:
            logger.exception("model %s: a batch of %d inputs failed", self.profile.name,
                             len(flat))
            return [ApiError(500, f"the model failed on this batch: {exc}",
                             type="server_error")] * len(batches)
        seconds = time.perf_counter() - tic
        self.counts.batches += 1
        self.counts.batch_seconds += seconds
        self.recorder.observe("serve_app_pooling_batch_requests", len(batches),
                              {"model": self.profile.name})
        self.recorder.observe("serve_app_pooling_batch_seconds", seconds,
                              {"model": self.profile.name})
        out: list[np.ndarray | Exception] = []
        at = 0
        for batch in batches:
            out.append(values[at:at + len(batch)])
            at += len(batch)
        return out

    # ---- stats -----------------------------------------------------------------------

    def metric_samples(self) -> list:
        """The pump's samples (its thread): this model's counts and its pool state."""
        c = self.counts
        return [*pooling_samples(self.profile.name, self.task, c.inputs, c.tokens),
                *pool_samples(self.profile.name, self.model is not None, self.loads,
                              self.load_seconds, self.unloads)]

    async def stats(self) -> ReplicaStats:
        self.loop_thread = threading.current_thread().name
        return ReplicaStats(self.profile.name, pooling=replace(self.counts),
                            replica=ReplicaProcess(
                                pid=os.getpid(), node_id=self.node_id,
                                user_code_thread=self.loop_thread,
                                status="loaded" if self.model is not None else "unloaded",
                                loads=self.loads, load_seconds=round(self.load_seconds, 3),
                                unloads=dict(self.unloads)))

    def __del__(self) -> None:
        board = getattr(self, "board", None)
        if board is not None:
            board.clear()
        pump = getattr(self, "pump", None)
        if pump is not None:
            pump.stop()


def _encode(model: PoolingModel, call: PoolingCall, truncate: bool,
            instruction: str | None) -> list[Encoded]:
    """A call's inputs as token ids (a worker thread); a 400 naming the first input that
    cannot be used."""
    from serve_app.pooling.model import TooLong

    out = []
    if isinstance(call, ScoreCall):
        items: list[Any] = list(call.pairs)
    else:
        items = list(call.texts) or list(call.token_lists)
    for i, item in enumerate(items):
        try:
            if isinstance(call, ScoreCall):
                out.append(model.encode_pair(item[0], item[1], instruction, truncate))
            elif isinstance(item, str):
                out.append(model.encode(item, truncate))
            else:
                out.append(model.encode_ids(list(item), truncate))
        except TooLong as exc:
            hint = "" if truncate else " (set truncate: true to cut inputs to it)"
            raise ApiError(400, f"{call.param}[{i}] has {exc}{hint}", param=f"{call.param}[{i}]",
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise ApiError(400, f"{call.param}[{i}]: {exc}", param=f"{call.param}[{i}]") \
                from None
    return out


def _free_mlx() -> None:
    """MLX's buffers freed on the thread that used them (after the model is dropped)."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
