"""The ingress's side of a stream that survives a lost replica (``api/resume.py``): the
token ids behind what was forwarded are kept, a loss reopens the request with them, and a
stream that cannot be continued honestly (output without its ids, too many losses, another
error) raises as before. The replica's side runs for real in tests/engine/test_resume.py;
the loss itself, here, is a stand-in exception (a node cannot die in a unit test)."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.api.resume import MAX_RESUMES, ResumableEvents, with_resume
from serve_app.serving.events import Delta, Event, Finish, Start, Tokens
from serve_app.serving.request import ChatCompletionRequest


class Lost(Exception):
    """The stand-in for Ray's error when the replica's node died."""


class Replica:
    """A replica's event batches for one request; raises ``Lost`` after ``lose_after``."""

    def __init__(self, batches: list[list[Event]], lose_after: int | None = None) -> None:
        self.batches, self.lose_after, self.cancelled = list(batches), lose_after, False

    def __aiter__(self) -> Replica:
        return self

    async def __anext__(self) -> list[Event]:
        if self.lose_after is not None and self.lose_after <= 0:
            raise Lost()
        if self.lose_after is not None:
            self.lose_after -= 1
        if not self.batches:
            raise StopAsyncIteration
        return self.batches.pop(0)

    def cancel(self) -> None:
        self.cancelled = True


def read(events: ResumableEvents) -> list[Event]:
    async def go() -> list[Event]:
        return [e async for batch in events for e in batch]

    return asyncio.run(go())


def resumable(first: Replica, then: list[Replica]):
    reopened: list[tuple[int, ...]] = []
    heard: list[tuple[int, Start]] = []

    async def reopen(tokens: tuple[int, ...]):
        reopened.append(tokens)
        return then.pop(0), Start(5, 3)

    events = ResumableEvents(first, reopen, lambda exc: isinstance(exc, Lost),
                             lambda n, start: heard.append((n, start)))
    return events, reopened, heard


FINISH = Finish("stop", 5, 4)


def test_a_loss_reopens_after_the_tokens_forwarded_and_strips_them():
    first = Replica([[Delta("ab"), Tokens((1, 2))], [Delta("c"), Tokens((3,))]], lose_after=2)
    second = Replica([[Delta("d"), Tokens((4,)), FINISH]])
    events, reopened, heard = resumable(first, [second])
    assert read(events) == [Delta("ab"), Delta("c"), Delta("d"), FINISH]
    assert reopened == [(1, 2, 3)] and heard == [(3, Start(5, 3))]
    assert first.cancelled and events.tokens == [1, 2, 3, 4] and events.resumes == 1


def test_text_held_back_has_no_tokens_yet_and_they_go_with_the_next_output():
    first = Replica([[Delta("ab"), Tokens((1, 2, 3))]], lose_after=1)
    second = Replica([[FINISH]])
    events, reopened, _ = resumable(first, [second])
    assert read(events) == [Delta("ab"), FINISH] and reopened == [(1, 2, 3)]


def test_output_without_its_tokens_cannot_be_continued():
    first = Replica([[Delta("ab")]], lose_after=1)
    events, reopened, _ = resumable(first, [Replica([])])
    with pytest.raises(Lost):
        read(events)
    assert reopened == []


def test_losses_past_the_limit_raise():
    replicas = [Replica([[Delta("x"), Tokens((9,))]], lose_after=1)
                for _ in range(MAX_RESUMES + 1)]
    events, reopened, _ = resumable(replicas[0], replicas[1:])
    with pytest.raises(Lost):
        read(events)
    assert reopened == [(9,), (9, 9)][:MAX_RESUMES]


def test_another_error_is_not_a_loss():
    class Broken(Replica):
        async def __anext__(self) -> list[Event]:
            raise ValueError("a bug")

    events, reopened, _ = resumable(Broken([]), [])
    with pytest.raises(ValueError):
        read(events)
    assert reopened == []


def test_the_request_sent_again_carries_the_tokens_and_nothing_else_changes():
    request = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=9, seed=4)
    again = with_resume(request, (1, 2))
    assert again._resume_tokens == (1, 2) and request._resume_tokens == ()
    assert again.model_dump() == request.model_dump()
