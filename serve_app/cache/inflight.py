"""Blocks that a request is prefilling now, so that no other request prefills them too.

Requests that arrive together often share a prefix nobody has cached yet: the system
prompt of an agent's parallel sessions, the same document asked four questions at once.
Batched together, each of them would prefill that prefix (four times the work, measured:
the first turns of 4 agent sessions on SmolLM2-135M waited 67 s each instead of 23 s
behind ``mlx_lm.server``, which serves them one after the other). Instead, a request's
plan claims the blocks it will compute, and a request whose prompt runs into blocks
another has claimed waits until they are published (or the claim ends: the other
request failed, was cancelled, or restored them after all), then looks them up and
restores them. A waiting request holds no claims, and a claim's owner never waits, so
waits cannot form a cycle.

Claims are made on the event loop; publishes arrive on the engine's thread: a lock keeps
the table, and waiters are woken through their loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence


class InflightBlocks:
    """Block id -> the plan computing it; waiters wake when the block is published."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, int] = {}
        self._owned: dict[int, set[str]] = {}
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._claims = itertools.count(1)

    def claim(self, block_ids: Sequence[str]) -> int:
        """Claim the blocks of ``block_ids`` nobody claims yet; the claim's id."""
        claim = next(self._claims)
        with self._lock:
            mine = {b for b in block_ids if b not in self._owner}
            for b in mine:
                self._owner[b] = claim
            self._owned[claim] = mine
        return claim

    def unclaim(self, claim: int, block_ids: Sequence[str] | None = None) -> None:
        """Give up ``block_ids`` of ``claim`` (all of them when None): it will not compute
        them (they were cached after all, or its request ended)."""
        with self._lock:
            owned = self._owned.get(claim)
            if owned is None:
                return
            drop = set(owned) if block_ids is None else owned.intersection(block_ids)
            owned -= drop
            if block_ids is None:
                del self._owned[claim]
            woken = [self._free(b) for b in drop if self._owner.get(b) == claim]
        _wake(woken)

    def published(self, block_id: str) -> None:
        """A block reached the store (any thread): whoever waits for it looks again."""
        with self._lock:
            claim = self._owner.get(block_id)
            if claim is None:
                return
            self._owned.get(claim, set()).discard(block_id)
            woken = [self._free(block_id)]
        _wake(woken)

    def awaited(self, block_ids: Sequence[str]) -> str | None:
        """The block to wait for before a lookup of ``block_ids``: the last of the run of
        claimed blocks that starts at the first claimed one (None: nothing claimed)."""
        last = None
        with self._lock:
            for b in block_ids:
                if b in self._owner:
                    last = b
                elif last is not None:
                    break
        return last

    async def wait(self, block_id: str, timeout: float) -> bool:
        """Until ``block_id`` is published or unclaimed (True), or ``timeout`` (False)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._lock:
            if block_id not in self._owner:
                return True
            self._waiters.setdefault(block_id, []).append((loop, future))
        try:
            await asyncio.wait_for(future, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            with self._lock:
                waiting = self._waiters.get(block_id)
                if waiting is not None:
                    waiting[:] = [w for w in waiting if w[1] is not future]
                    if not waiting:
                        del self._waiters[block_id]

    def claimed(self) -> int:
        """Blocks claimed now (a gauge)."""
        with self._lock:
            return len(self._owner)

    def _free(self, block_id: str) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]:
        self._owner.pop(block_id, None)
        return self._waiters.pop(block_id, [])


def _wake(groups: list[list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]]) -> None:
    for group in groups:
        for loop, future in group:
            try:
                loop.call_soon_threadsafe(_resolve, future)
            except RuntimeError:  # its loop closed: nobody waits any more
                pass


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)
