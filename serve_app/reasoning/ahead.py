"""The next turn's prefix, prefilled ahead: a thinking model's template renders an earlier
assistant turn without its thought (Qwen3's drops the thoughts of turns before the last
user message), so the next request differs from what this turn prefilled and generated
right where its answer began. Once a turn ends, the server renders the conversation as the
next turn will send it, up to the next message's first token, and prefills that from the
cached prefix while the client reads the answer: the block tree keeps both branches, and
the next turn restores all of its history.

Nothing here knows the engine: the service passes how to render and how to prefill."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Two different next messages: what their renderings share is the history as the next
# turn renders it, up to that message's own text.
_PROBES = ("a", "b")


# done: prefilled; not_needed: the template renders the turn as it was generated;
# busy: the engine had no free slot (real requests first); failed: rendering or serving.
OUTCOMES = ("done", "not_needed", "busy", "failed")


@dataclass(frozen=True)
class History:
    """A chat turn's conversation as its template took it (after normalization), kept to
    render the next turn's prefix once the answer is known."""

    messages: tuple[dict[str, Any], ...]
    tools: list[dict] | None
    template_kwargs: dict[str, Any]


@dataclass
class ThinkingStats:
    """A replica's thinking counters (``serve_app_reasoning_tokens``,
    ``serve_app_history_ahead_*``)."""

    thought_tokens: int = 0  # generated inside thoughts, their markers included
    ahead: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    ahead_tokens: int = 0  # prefix tokens of the histories prefilled ahead
    ahead_prefilled_tokens: int = 0  # of those, prefilled (the cache did not hold them)


def next_turn_prefix(render: Callable[[list[dict[str, Any]]], list[int]],
                     history: History, assistant: dict[str, Any]) -> list[int]:
    """The tokens the next request of this conversation starts with: ``history``, then
    ``assistant`` (the answer as a client sends it back), rendered as an earlier turn,
    up to the first token of whatever message comes next: a tool's result after tool
    calls, else the user's. ``render(messages)`` renders without a generation prompt."""
    base = [*history.messages, assistant]
    calls = assistant.get("tool_calls") or []

    def following(text: str) -> dict[str, Any]:
        if calls:
            return {"role": "tool", "tool_call_id": calls[0].get("id"), "content": text}
        return {"role": "user", "content": text}

    a, b = (render([*base, following(probe)]) for probe in _PROBES)
    return a[:shared(a, b)]


def shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def covered(prefix: Sequence[int], seen: Sequence[int]) -> bool:
    """Whether the prefix departs from what the turn prefilled and generated (``seen``)
    only past it (its last token, an end of turn, aside): the template renders the turn
    as it was generated, and the cache holds it already."""
    return shared(prefix, seen) >= min(len(seen) - 1, len(prefix))


class HistoryAhead:
    """Runs the prefills ahead as tasks of the replica's event loop, one per ended turn
    (at most ``max_running`` at once: past that a turn's is skipped as ``busy``), and
    counts them; ``close`` cancels what still runs."""

    def __init__(self, stats: ThinkingStats, max_running: int = 2) -> None:
        self.stats = stats
        self.max_running = max_running
        self._tasks: set[asyncio.Task] = set()

    def schedule(self, prefix: Callable[[], list[int]], seen: Sequence[int],
                 prefill: Callable[[list[int]], Awaitable[int | None]],
                 free: Callable[[], bool] = lambda: True) -> None:
        """After a turn: ``prefix()`` renders the next turn's prefix (on a worker thread);
        ``prefill(tokens)`` serves it and returns the tokens it restored (None: refused,
        the engine is busy). ``free()``: whether the engine has a batch slot no request
        waits for; without one (or with ``max_running`` under way) nothing is rendered."""
        if len(self._tasks) >= self.max_running or not free():
            self.stats.ahead["busy"] += 1
            return
        task = asyncio.get_running_loop().create_task(self._run(prefix, list(seen), prefill))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, prefix: Callable[[], list[int]], seen: list[int],
                   prefill: Callable[[list[int]], Awaitable[int | None]]) -> None:
        stats = self.stats
        try:
            tokens = await asyncio.to_thread(prefix)
            if not tokens or covered(tokens, seen):
                stats.ahead["not_needed"] += 1
                return
            restored = await prefill(tokens)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("prefilling the next turn's history ahead failed")
            stats.ahead["failed"] += 1
            return
        if restored is None:
            stats.ahead["busy"] += 1
            return
        stats.ahead["done"] += 1
        stats.ahead_tokens += len(tokens)
        stats.ahead_prefilled_tokens += len(tokens) - restored

    async def idle(self) -> None:
        """Until every prefill ahead scheduled so far has ended (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
