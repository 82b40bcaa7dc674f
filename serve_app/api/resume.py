"""Streams that survive a lost replica: the ingress keeps the token ids behind every event
it forwarded and, when the replica serving a request goes away mid-answer, sends the
request again with them; the next replica prefills prompt and tokens (restoring what its
tiers and the block directory hold), replays the tokens through its stream state without
sending their events again, and goes on. The client sees one answer: at temperature 0,
or with a seed, the very tokens an undisturbed run gives (``serving.prepare.resumed``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from serve_app.serving.events import Event, Failure, Finish, Start, Tokens
from serve_app.serving.request import OpenAIRequest

MAX_RESUMES = 2  # a request continued at most this often (each loss costs a prefill)


def with_resume(request: OpenAIRequest, tokens: tuple[int, ...]) -> OpenAIRequest:
    """``request`` to send again after ``tokens`` were generated and forwarded."""
    again = request.model_copy()
    again._resume_tokens = tokens
    return again


Reopen = Callable[[tuple[int, ...]], Awaitable[tuple[Any, Start]]]


class ResumableEvents:
    """A request's event batches (after its ``Start``), ``Tokens`` taken out and kept.

    ``lost(exc)`` says whether an error means the replica went away; then the request is
    reopened (``reopen(tokens)``: its new events and their ``Start``) with every token
    whose output was forwarded, at most ``MAX_RESUMES`` times. A batch whose output came
    with no ``Tokens`` (a replica that does not send them) makes the request one that
    cannot resume: the loss is raised as before. ``resumed(tokens, start)`` hears each
    continuation (its metrics)."""

    def __init__(self, events: Any, reopen: Reopen, lost: Callable[[Exception], bool],
                 resumed: Callable[[int, Start], None] = lambda n, start: None) -> None:
        self._events = events
        self._reopen = reopen
        self._lost = lost
        self._resumed = resumed
        self.tokens: list[int] = []
        self.resumes = 0
        self._resumable = True

    def __aiter__(self) -> ResumableEvents:
        return self

    async def __anext__(self) -> list[Event]:
        while True:
            try:
                batch = await self._events.__anext__()
            except StopAsyncIteration:
                raise
            except Exception as exc:
                if not (self._resumable and self.resumes < MAX_RESUMES and self._lost(exc)):
                    raise
                self.cancel()
                self.resumes += 1
                tokens = tuple(self.tokens)
                self._events, start = await self._reopen(tokens)
                self._resumed(len(tokens), start)
                continue
            out = self._keep(batch)
            if out:
                return out

    def _keep(self, batch: list[Event]) -> list[Event]:
        """The batch without its ``Tokens``, whose ids are kept."""
        out: list[Event] = []
        sent = False
        for e in batch:
            if isinstance(e, Tokens):
                self.tokens.extend(e.ids)
                sent = True
            else:
                out.append(e)
        if out and not sent and not isinstance(out[-1], Finish | Failure):
            # output without its ids (the end excepted: nothing follows it)
            self._resumable = False
        return out

    def cancel(self) -> None:
        """Tell the replica serving it that no one listens (it frees the batch slot)."""
        cancel = getattr(self._events, "cancel", None)
        if cancel is not None:
            cancel()
