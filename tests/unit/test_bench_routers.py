"""The node-loss bench's counting (``bench.routers``), without a server or Ray.

A stream cut by an SSE error event (``replica_lost``) or ended without a finish is a
failed turn, counted apart as a cut stream, never a success with truncated text; and
``stream_chat`` reports the error event it read.
"""

from __future__ import annotations

import json
from contextlib import contextmanager

import pytest

from bench import common
from bench.routers import loss_report, turn_outcome

WHOLE = {"text": "a whole answer", "finish_reason": "stop", "error": None, "ttft": 0.1,
         "prompt_tokens": 100, "cached_tokens": 50}
LOST = {"code": "replica_lost", "message": "the replica serving model 'm' went away"}


def test_a_whole_answer_succeeds():
    assert turn_outcome(WHOLE, None).error is None


def test_a_stream_ended_by_an_error_event_is_a_cut_failure():
    outcome = turn_outcome({**WHOLE, "text": "a wh", "finish_reason": None, "error": LOST},
                           None)
    assert outcome.cut and "replica_lost" in (outcome.error or "")


def test_a_stream_without_a_finish_is_a_cut_failure():
    outcome = turn_outcome({**WHOLE, "finish_reason": None}, None)
    assert outcome.cut and outcome.error


def test_a_raised_request_fails_but_is_not_a_cut_stream():
    outcome = turn_outcome(None, RuntimeError("503 Service Unavailable"))
    assert not outcome.cut and "503" in (outcome.error or "")


def row(start: float, end: float, error: str | None = None, cut: bool = False) -> dict:
    return {"start_s": start, "end_s": end, "error": error, "cut": cut, "ttft": 0.1,
            "prompt_tokens": 100, "cached_tokens": 50}


def test_the_report_counts_cut_streams_as_failed_turns():
    rows = [row(0, 1), row(1, 2, "boom"), row(5, 9, "cut by replica_lost", cut=True),
            row(8, 10, "ConnectError"), row(11, 12), row(20, 21)]
    report = loss_report(rows, kill_at_s=8.0, wall_s=30.0)
    assert report["failed_turns_after_kill"] == 2
    assert report["cut_streams_after_kill"] == 1
    assert report["failed_turns_before_kill"] == 1
    assert report["turns"] == 3
    assert report["recovery_s"] == pytest.approx(0.0)  # the last failure started at 8 s
    assert report["cached_fraction_last_third"] == pytest.approx(0.5)


def test_recovery_runs_from_the_kill_to_the_last_failed_turn_sent_after_it():
    cut_by_the_kill = row(7, 9, "cut", cut=True)
    assert loss_report([cut_by_the_kill, row(10, 11)], 8.0, 20.0)["recovery_s"] == 0.0
    report = loss_report([cut_by_the_kill, row(10, 11, "503"), row(12.5, 13, "503"),
                          row(14, 15)], 8.0, 20.0)
    assert report["recovery_s"] == pytest.approx(4.5)
    assert report["failed_turns_after_kill"] == 3 and report["cut_streams_after_kill"] == 1


def test_an_answer_other_than_the_undisturbed_runs_is_a_failed_turn():
    """Issue 45's honest counting: a whole answer that differs from the same turn of an
    undisturbed run (temperature 0) is no success either; one in flight at the kill too."""
    same = {**row(6, 9), "request": "s0t1", "text": "the answer"}
    other = {**row(9, 10), "request": "s1t1", "text": "another answer"}
    unknown = {**row(11, 12), "request": "s2t1", "text": "whatever"}
    report = loss_report([same, other, unknown], 8.0, 20.0,
                         reference={"s0t1": "the answer", "s1t1": "the real answer"})
    assert report["differing_answers"] == 1 and report["failed_turns_after_kill"] == 1
    assert report["compared_with_reference"] == 2 and report["in_flight_at_kill"] == 1
    assert report["turns"] == 2


def test_stream_chat_reports_the_error_event_that_ended_the_stream(monkeypatch):
    lines = ['data: {"choices": [{"delta": {"content": "a wh"}, "finish_reason": null}]}',
             "data: " + json.dumps({"error": LOST})]

    class Response:
        def raise_for_status(self) -> None:
            pass

        def iter_lines(self):
            return iter(lines)

    @contextmanager
    def fake_stream(*args, **kwargs):
        yield Response()

    monkeypatch.setattr(common.httpx, "stream", fake_stream)
    r = common.stream_chat("http://x", {"model": "m", "messages": []})
    assert r["text"] == "a wh" and r["error"] == LOST
    assert turn_outcome(r, None).cut
