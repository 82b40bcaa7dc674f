"""An engine's part in a model sharded over ranks (``serve_app.parallel.lockstep``).

Rank 0's engine records what it does to its batch (inserts, cancels, and a request planned
on every rank that will never be inserted) and tells the other ranks before each step;
theirs replay it. While rank 0 has nothing to run it says so, and the others sleep
outside the group until it wakes them: a rank waiting inside a collective spins a core.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from serve_app.models.compat import sync_sampled_tokens
from serve_app.parallel.lockstep import Cancel, Channel, Forget, Idle, Insert, Stop
from serve_app.serving.engine import Engine
from serve_app.serving.engine_events import EngineEvent
from serve_app.serving.engine_request import EngineRequest, deliver
from serve_app.serving.sampling import SamplingParams

if TYPE_CHECKING:
    from serve_app.cache.request_plan import RequestPlan
    from serve_app.serving.engine_events import EventSink

logger = logging.getLogger(__name__)


class RankLink:
    """The channel to the other ranks, and what rank 0 has not told them yet."""

    def __init__(self, channel: Channel,
                 follower_plan: Callable[[Insert], tuple[RequestPlan | None, EventSink]]
                 | None = None) -> None:
        self.channel = channel
        # A rank other than 0: its own cache plan for a request rank 0 inserted.
        self.follower_plan = follower_plan
        self._unsent: list = []
        # Rank 0: names the lost rank when a collective fails (the replica's ranks).
        self.describe_loss: Callable[[BaseException], str] | None = None
        # Rank 0: wakes the others (a call outside the group) after it said it is idle;
        # None: they keep waiting inside the group's collectives.
        self.wake_others: Callable[[int], None] | None = None
        self._wakes = 0  # rank 0: Idle messages sent; the others: the last wake received
        self._idle = False  # rank 0: the others were told it is idle, not woken since
        self._woken = threading.Condition()
        # A rank other than 0: what its engine thread does now, since when (monotonic).
        self._doing: tuple[str, float] = ("commands", time.monotonic())

    def activity(self) -> dict:
        """``RankStatus``' ``activity`` and ``activity_s`` (any thread may ask)."""
        doing, since = self._doing
        return {"activity": doing, "activity_s": round(time.monotonic() - since, 3)}

    def _now_doing(self, what: str) -> None:
        self._doing = (what, time.monotonic())

    @property
    def leads(self) -> bool:
        return self.channel.rank == 0

    def record(self, command: Insert | Cancel | Forget) -> None:
        """Rank 0: something the others must do before its next step."""
        self._unsent.append(command)

    def tell(self, *commands: Idle | Stop) -> None:
        """Rank 0: what it did since the last step, then a step (or ``Idle``/``Stop``)."""
        if self._idle and not any(isinstance(c, Idle) for c in commands):
            assert self.wake_others is not None
            self.wake_others(self._wakes)  # out of their sleep, into the collective
            self._idle = False
        sent, self._unsent = [*self._unsent, *commands], []
        self.channel.send(sent)

    def go_idle(self) -> None:
        """Rank 0 has nothing to run: the others sleep until its next command."""
        if self.wake_others is not None and not self._idle:
            self._wakes += 1
            self.tell(Idle(self._wakes))
            self._idle = True

    def wake(self, number: int) -> None:
        """A rank other than 0: rank 0 has work again after its ``Idle(number)``."""
        with self._woken:
            self._wakes = max(self._wakes, number)
            self._woken.notify_all()

    def follow(self, insert: Callable[[Insert], None], cancel: Callable[[int], None],
               forget: Callable[[str], None], step: Callable[[], None],
               stopping: threading.Event) -> None:
        """A rank other than 0: replay rank 0's commands until it stops. Raises what
        fails (a lost rank 0, a restore that parts from rank 0's)."""
        while not stopping.is_set():
            self._now_doing("commands")
            commands = self.channel.receive()
            if any(isinstance(c, Stop) for c in commands):
                return
            idle = None
            for command in commands:
                if isinstance(command, Insert):
                    insert(command)
                elif isinstance(command, Cancel):
                    cancel(command.rid)
                elif isinstance(command, Forget):
                    forget(command.plan_key)
                elif isinstance(command, Idle):
                    idle = command
            if idle is None:
                self._now_doing("step")
                step()
                continue
            self._now_doing("asleep")
            with self._woken:
                while self._wakes < idle.wake and not stopping.is_set():
                    self._woken.wait(0.5)


# A fault the tests cannot cause for real: a rank's engine thread blocked while its
# process answers every ping. "RANK:STEPS": rank RANK's engine thread blocks for good
# before its step STEPS + 1. Read once, by ranks other than 0 only.
STALL_ENV = "SERVE_APP_TEST_STALL_RANK"


def _stalling(step: Callable[[], None], rank: int) -> Callable[[], None]:
    """``step``, or (``STALL_ENV`` names this rank) ``step`` until it blocks for good."""
    spec = os.environ.get(STALL_ENV, "")
    if not spec or int(spec.split(":")[0]) != rank:
        return step
    after = int(spec.split(":")[1])
    done = [0]

    def stalling() -> None:
        if done[0] >= after:
            logger.error("rank %d: %s set: its engine thread blocks for good", rank,
                         STALL_ENV)
            threading.Event().wait()
        done[0] += 1
        step()

    return stalling


def _ignore(event: EngineEvent) -> None:
    """The events of a request a follower rank replays: nobody waits for them."""


class RankEngine(Engine):
    """The engine of one rank of a model sharded over ranks: rank 0's (the channel's rank
    0) decides and tells the others before each step; the others' replay it. Any failure
    stops it for good (``broken``): the ranks cannot be put back in step."""

    def __init__(self, model, *, channel: Channel,
                 follower_plan: Callable[[Insert], tuple[RequestPlan | None, EventSink]]
                 | None = None, **kwargs) -> None:
        self.ranks = RankLink(channel, follower_plan)  # before the engine thread starts
        super().__init__(model, **kwargs)

    def _begin(self) -> None:
        sync_sampled_tokens(self.ranks.channel.group)

    def _serve(self) -> None:
        if self.ranks.leads:
            super()._serve()
            return
        try:
            self.ranks.follow(self._follow_insert, self._cancel, self._forget_plan,
                              _stalling(self._step, self.ranks.channel.rank), self._stopping)
        except Exception as exc:
            logger.exception("engine %s (rank %d) stopped", self.name,
                             self.ranks.channel.rank)
            self.broken = f"rank {self.ranks.channel.rank}: {exc}"
        self._stopping.set()

    def _idle(self) -> None:
        self.ranks.go_idle()  # the others sleep until the next command

    def _before_step(self) -> None:
        if self.ranks.leads:
            self.ranks.tell()

    def _record(self, command: Insert | Cancel | Forget) -> None:
        if self.ranks.leads:
            self.ranks.record(command)

    def _on_error(self, exc: Exception) -> bool:
        describe = self.ranks.describe_loss
        self.broken = self.broken or (describe(exc) if describe is not None
                                      else f"engine error on a sharded model: {exc}")
        self._stopping.set()
        return True

    def _on_stop(self) -> None:
        if self.ranks.leads and self.broken is None:
            try:
                self.ranks.tell(Stop())
            except Exception:  # a rank already gone: nothing to stop there
                logger.info("engine %s: the other ranks were gone at stop", self.name)

    def _follow_insert(self, command: Insert) -> None:
        follower_plan = self.ranks.follower_plan
        plan, sink = (follower_plan(command) if follower_plan is not None
                      else (None, _ignore))
        req = EngineRequest(command.rid, list(command.prompt),
                            SamplingParams(max_tokens=command.max_tokens), sink, plan)
        with self._lock:
            self.stats.in_flight += 1
            self.stats.submitted += 1
        self._insert(req, command.segments, command.restored)

    def _forget_plan(self, plan_key: str) -> None:
        """A rank other than 0: a request rank 0 planned never reaches the batch."""
        if self.ranks.follower_plan is None:
            return
        _, sink = self.ranks.follower_plan(Insert(-1, [], 0, [], 0, plan_key))
        sink(EngineEvent(restored=0))  # its pins go
        sink(EngineEvent(finish_reason="cancelled"))  # and its claims

    def abandon(self, message: str) -> None:
        """A rank was lost while this (rank 0's) engine may be waiting on it inside a
        collective: its requests end with ``message`` now, from the calling thread (the
        engine thread, if it ever wakes, ends none of them twice)."""
        self.broken = self.broken or message
        self._stopping.set()
        requests: list[EngineRequest] = []
        while True:  # the engine thread may be changing them: copy until a copy holds
            try:
                requests = [*self._requests.values(), *self._kv_waiting]
                break
            except RuntimeError:
                continue
        while True:  # submitted, not yet taken by the engine thread
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                requests.append(arg)
        for req in requests:
            if req.rid not in self._abandoned:
                self._abandoned.add(req.rid)
                deliver(req, EngineEvent(error=message, unavailable=True))
