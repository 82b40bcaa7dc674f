"""Rank 0's engine commands, replayed by the other ranks in the same order.

A sharded model runs every forward on every rank at once (its collectives pair them
up), so every rank's engine must insert, cancel and step the same requests in the same
order. Rank 0 decides (admission, queueing, cancels: ``serve_app.serving.engine``) and,
before each step, sends what it did since the last one; the others apply it, then step.
Sampled tokens are shared inside the step itself (``compat.sync_sampled_tokens``), so
the other ranks need neither the requests' samplers nor their grammars.

The commands travel over the model's own group, like mlx_lm.server's: one collective per
step carries their size (0 for a bare step, the common case while decoding), a second
one the pickled commands when there are any. A rank waiting in a collective spins a core
(MLX's ring backend polls its sockets): when rank 0 runs out of work it says so
(``Idle``) and the others sleep until it wakes them by a call outside the group.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Insert:
    """A request joins the batch: its prompt cut as rank 0 cut it (the same forwards),
    ``restored`` tokens of it from the prefix cache."""

    rid: int
    prompt: list[int]
    max_tokens: int
    segments: list[list[int]]
    restored: int
    plan_key: str | None = None  # the cache plans every rank made for it (None: none)


@dataclass(frozen=True)
class Cancel:
    rid: int


@dataclass(frozen=True)
class Forget:
    """A request every rank planned a restore for never reaches the batch (cancelled
    while it waited, or refused): the others let their plans go."""

    plan_key: str


@dataclass(frozen=True)
class Stop:
    """Rank 0's engine stopped: the others stop too."""


@dataclass(frozen=True)
class Idle:
    """Rank 0 has nothing to run: wait until it wakes you with ``wake`` (a call outside
    the group), not inside a collective, where MLX's ring backend spins a core."""

    wake: int


@dataclass
class Channel:
    """The commands' way from rank 0 to the others (``group``: the model's)."""

    group: Any
    seconds: float = 0.0  # spent in the channel's collectives (waiting on other ranks)
    messages: int = 0  # steps that carried commands
    message_bytes: int = 0
    steps: int = 0

    @property
    def rank(self) -> int:
        return self.group.rank()

    def send(self, commands: list) -> None:
        """Rank 0: the commands before a step (an empty list: a bare step), or ``Stop``."""
        tic = time.perf_counter()
        data = pickle.dumps(commands) if commands else b""
        mx.eval(mx.distributed.all_sum(mx.array([len(data)], dtype=mx.int32),
                                       group=self.group))
        if data:
            mx.eval(mx.distributed.all_sum(mx.array(np.frombuffer(data, dtype=np.uint8)),
                                           group=self.group))
            self.messages += 1
            self.message_bytes += len(data)
        self.steps += 1
        self.seconds += time.perf_counter() - tic

    def receive(self) -> list:
        """The other ranks: rank 0's commands before its next step (blocks until sent)."""
        tic = time.perf_counter()
        size = mx.distributed.all_sum(mx.zeros((1,), dtype=mx.int32), group=self.group)
        n = int(size.item())  # type: ignore[arg-type]
        commands: list = []
        if n:
            data = mx.distributed.all_sum(mx.zeros((n,), dtype=mx.uint8), group=self.group)
            mx.eval(data)
            commands = pickle.loads(np.array(data).tobytes())  # from rank 0 only
            self.messages += 1
            self.message_bytes += n
        self.steps += 1
        self.seconds += time.perf_counter() - tic
        return commands


class ShardPlanner(Protocol):
    """Rank 0's way to the other ranks' prefix caches: each plans a request's restore
    (at most ``limit`` tokens) under ``key`` and answers how many tokens it can restore;
    the request then restores what every rank can. ``drop`` forgets a key's plans (the
    request never reached the engine); a round that takes over ``timeout_s`` fails."""

    timeout_s: float

    async def plan(self, key: str, prompt: list[int], limit: int, *, salt: str | None,
                   api_key_digest: str | None, branch_points: tuple[int, ...]
                   ) -> list[int]: ...

    def drop(self, key: str) -> None: ...
