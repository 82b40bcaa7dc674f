"""A node lost mid-run, counted honestly (``bench.routers``' node-loss run): every session
streaming at once, a worker node killed, each turn's outcome (a cut stream or an answer
differing from an undisturbed run's fails it), the extra latency of the turns in flight at
the kill against the same turns undisturbed, and the ingress's resume and retry counters.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

import httpx
from ray.cluster_utils import Cluster

from bench.common import ServerProcess
from bench.traces import Arm, Scale, SessionPlan, percentile, send

RETRY_AFTER_S = 1.0
FAILED_MEANS = ("a request that raised (HTTP error status, broken connection) or a stream "
                "cut: ended by an SSE error event (replica_lost) or without a finish_reason")
HANG_S = 120.0


# The ingress's counters of a node loss (``/metrics``, summed over label sets).
RESUMED_REQUESTS = "ray_serve_app_resumed_requests_total"
RESUMED_PREFILL_TOKENS = "ray_serve_app_resumed_prefill_tokens_total"
REQUEST_RETRIES = "ray_serve_app_request_retries_total"
LOSS_COUNTERS = (RESUMED_REQUESTS, RESUMED_PREFILL_TOKENS, REQUEST_RETRIES)
LOSS_METRICS_INTERVAL_MS = 1000


def metric_sum(text: str, name: str) -> float:
    """The sum of ``name``'s samples over every label set of a Prometheus text export
    (0 when it has none: a counter never incremented is not exported)."""
    pattern = rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+(\S+)"
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def server_counters(server: ServerProcess, names: tuple[str, ...] = LOSS_COUNTERS,
                    settle_s: float = 5.0, timeout_s: float = 40.0) -> dict[str, float]:
    """``names`` summed from the server's ``/metrics`` once they have not moved for
    ``settle_s`` (processes export every ``LOSS_METRICS_INTERVAL_MS``), or at
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: dict[str, float] | None = None
    since = time.monotonic()
    while True:
        try:
            text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
            got = {n: metric_sum(text, n) for n in names}
        except httpx.HTTPError:
            got = last or {}
        if got != last:
            last, since = got, time.monotonic()
        if time.monotonic() - since >= settle_s or time.monotonic() > deadline:
            return got
        time.sleep(1.0)


@dataclass(frozen=True)
class TurnOutcome:
    """How one sent turn ended: ``error`` None for a whole answer; ``cut`` when the answer
    had started streaming and then ended in an error event or without a finish."""

    error: str | None = None
    cut: bool = False


def turn_outcome(result: dict | None, exc: BaseException | None) -> TurnOutcome:
    """A turn's outcome from ``send``'s result (``stream_chat``'s fields) or what it
    raised. An HTTP error status (a non-streamed error answer among them) raises; a stream
    already started ends with an ``{"error": ...}`` event instead, which ``stream_chat``
    reports as ``error``: a failure too, never a success with truncated text."""
    if exc is not None:
        return TurnOutcome(f"{type(exc).__name__}: {exc}"[:300])
    if result is None:
        return TurnOutcome("no answer")
    if result.get("error") is not None:
        return TurnOutcome(f"stream cut by an error event: {result['error']}"[:300], cut=True)
    if result.get("finish_reason") is None:
        return TurnOutcome("stream ended without a finish_reason", cut=True)
    return TurnOutcome()


def turn_walls(rows: list[dict]) -> dict[tuple[int, int], dict]:
    """Each turn's attempts (``run_sessions``' rows) as one: from its first attempt's start
    to its last's end (a failed attempt, the wait and the retry included), by (session,
    turn index); ``failed`` when any attempt failed (``error``: a cut stream, an answer
    other than the undisturbed run's, a request that raised)."""
    out: dict[tuple[int, int], dict] = {}
    for r in rows:
        t = out.setdefault((r["session"], r["turn"]), {
            "start_s": r["start_s"], "end_s": r["end_s"], "attempts": 0, "failed": False})
        t["start_s"], t["end_s"] = min(t["start_s"], r["start_s"]), max(t["end_s"], r["end_s"])
        t["attempts"] += 1
        t["failed"] = t["failed"] or bool(r["error"])
    for t in out.values():
        t["wall_s"] = t["end_s"] - t["start_s"]
    return out


def in_flight_turns(rows: list[dict], kill_at_s: float) -> set[tuple[int, int]]:
    """The turns (session, turn index) with an attempt in flight at the kill: started
    before it, ended at or after it."""
    return {(r["session"], r["turn"]) for r in rows if r["start_s"] < kill_at_s <= r["end_s"]}


def extra_latency(rows: list[dict], reference_rows: list[dict], kill_at_s: float) -> dict:
    """What the kill cost the turns in flight at it: each one's wall time in the loss run
    (``turn_walls``: retries included) less the same turn's (session, turn index) in the
    undisturbed run of the same sessions, p50 and max in seconds. The same difference for
    the turns that ended before the kill and those sent after it says how far two runs of
    the same sessions differ undisturbed (before) and on the nodes left (after)."""
    loss, ref = turn_walls(rows), turn_walls(reference_rows)
    flying = in_flight_turns(rows, kill_at_s)

    def extras(keys: list[tuple[int, int]]) -> list[float]:
        return [loss[k]["wall_s"] - ref[k]["wall_s"] for k in keys if k in ref]

    def figures(keys: list[tuple[int, int]]) -> dict:
        got = extras(keys)
        return {"turns": len(keys), "matched": len(got),
                "extra_latency_p50_s": percentile(got, 50),
                "extra_latency_max_s": max(got, default=None)}

    keys = sorted(flying)
    return {
        "in_flight": {**figures(keys),
                      "failed": sum(1 for k in keys if loss[k]["failed"]),
                      "per_turn": [{"session": k[0], "turn": k[1],
                                    "loss_wall_s": loss[k]["wall_s"],
                                    "reference_wall_s": ref[k]["wall_s"] if k in ref else None,
                                    "extra_s": (loss[k]["wall_s"] - ref[k]["wall_s"]
                                                if k in ref else None),
                                    "attempts": loss[k]["attempts"],
                                    "failed": loss[k]["failed"]} for k in keys]},
        "ended_before_kill": figures(sorted(k for k, t in loss.items()
                                            if t["end_s"] < kill_at_s)),
        "sent_after_kill": figures(sorted(k for k, t in loss.items()
                                          if t["start_s"] >= kill_at_s)),
    }


def loss_report(rows: list[dict], kill_at_s: float, wall_s: float,
                reference: dict[str, str] | None = None,
                reference_rows: list[dict] | None = None) -> dict:
    """The node-loss figures from every attempt's row (``error``, ``cut``, times, usage).
    ``reference``: each turn's text in an undisturbed run of the same sessions: an answer
    that differs from it counts as failed too. ``reference_rows``: that run's rows (their
    texts are ``reference`` when it is not given), for the turns' extra latency
    (``extra_latency``)."""
    if reference is None and reference_rows is not None:
        reference = {r["request"]: r["text"] for r in reference_rows if not r["error"]}
    reference = reference or {}
    for r in rows:  # a whole answer other than the undisturbed run's is no success either
        want = reference.get(r.get("request", ""))
        if not r["error"] and want is not None and r.get("text") != want:
            r["error"], r["differs"] = "differs from the undisturbed run's answer", True
    failed = [r for r in rows if r["error"] and r["end_s"] >= kill_at_s]
    ok = [r for r in rows if not r["error"]]

    def fraction(part: list[dict]) -> float | None:
        prompt = sum(r["prompt_tokens"] or 0 for r in part)
        return sum(r["cached_tokens"] or 0 for r in part) / prompt if prompt else None

    last_third = [r for r in ok if r["start_s"] >= wall_s * 2 / 3]
    flying = in_flight_turns(rows, kill_at_s) if all("session" in r for r in rows) else set()
    report = {
        "kill_at_s": kill_at_s, "wall_s": wall_s, "failed_means": FAILED_MEANS,
        "turns": len(ok),
        "failed_turns_after_kill": len(failed),
        "cut_streams_after_kill": sum(1 for r in failed if r.get("cut")),
        "differing_answers": sum(1 for r in rows if r.get("differs")),
        "compared_with_reference": sum(1 for r in rows if r.get("request") in reference),
        # the turns in flight when the victim was killed (started before, ended after)
        "in_flight_at_kill": sum(1 for r in rows if r["start_s"] < kill_at_s <= r["end_s"]),
        # of the turns in flight at the kill: those with an attempt that failed
        "failed_in_flight_turns": len({(r["session"], r["turn"]) for r in rows
                                       if r["error"] and (r.get("session"), r.get("turn"))
                                       in flying}),
        "failed_turns_before_kill": sum(1 for r in rows
                                        if r["error"] and r["end_s"] < kill_at_s),
        # From the kill until the last failed turn sent after it (0: none failed): a
        # stream cut by the kill started before it.
        "recovery_s": max((r["start_s"] - kill_at_s for r in failed
                           if r["start_s"] >= kill_at_s), default=0.0),
        "hangs": sum(1 for r in rows if r["end_s"] - r["start_s"] > HANG_S),
        "cached_fraction_before_kill": fraction([r for r in ok if r["end_s"] < kill_at_s]),
        "cached_fraction_last_third": fraction(last_third),
        "ttft_p50_s": percentile([r["ttft"] for r in ok], 50),
        "errors": [r["error"] for r in rows if r["error"]][:5]}
    if reference_rows is not None:
        report["extra_latency"] = extra_latency(rows, reference_rows, kill_at_s)
    return report


def run_sessions(server: ServerProcess, model: str, system: str, plans: list[SessionPlan],
                 scale: Scale, kill=None) -> tuple[list[dict], float]:
    """Every session at once, one thread each, each turn after its (scaled) think time,
    streamed; a failed turn (``turn_outcome``: a cut stream too) is counted and sent again
    after ``RETRY_AFTER_S``. ``kill``: (seconds, fn(t0)) calls ``fn`` that far into the
    run. Each attempt's row and the run's wall time."""
    rows: list[dict] = []
    lock = threading.Lock()
    t0 = time.perf_counter()
    arm = Arm("ours", "openai", server.base_url, model)

    def session(plan: SessionPlan) -> None:
        import random

        history: list[tuple[str, str]] = []
        rng = random.Random(plan.session)
        for turn in plan.turns:
            time.sleep(turn.think_s)
            while True:
                start = time.perf_counter() - t0
                r: dict | None = None
                try:
                    r = send(arm, system, history, turn.user, rng, scale.max_output)
                    outcome = turn_outcome(r, None)
                except Exception as e:  # noqa: BLE001 (counted)
                    outcome = turn_outcome(None, e)
                end = time.perf_counter() - t0
                with lock:
                    rows.append({"session": plan.session, "turn": turn.index,
                                 "request": f"s{plan.session}t{turn.index + 1}",
                                 "text": r.get("text") if r else None, "start_s": start,
                                 "end_s": end, "error": outcome.error, "cut": outcome.cut,
                                 "ttft": r["ttft"] if r else None,
                                 "prompt_tokens": r["prompt_tokens"] if r else None,
                                 "cached_tokens": r["cached_tokens"] if r else None})
                if r is not None and outcome.error is None:
                    history.append((turn.user, r["text"]))
                    break
                time.sleep(RETRY_AFTER_S)

    threads = [threading.Thread(target=session, args=(p,)) for p in plans]
    for t in threads:
        t.start()
    killer = threading.Timer(kill[0], kill[1], args=(t0,)) if kill else None
    if killer:
        killer.start()
    for t in threads:
        t.join()
    if killer:
        killer.join()
    return rows, time.perf_counter() - t0


def run_with_loss(server: ServerProcess, cluster: Cluster, workers: list, model: str,
                  system: str, plans: list[SessionPlan], scale: Scale, kill_at_s: float,
                  reference_rows: list[dict] | None = None) -> dict:
    """``run_sessions`` with a worker node killed ``kill_at_s`` into the run (raylet and
    everything on it): the one whose replica has the most requests in flight then
    (``/v1/stats``, a report a second old at most; the last worker on a tie), so that the
    kill lands on streams. The ingress's resumed-request counters are read from
    ``/metrics`` before the server stops."""
    killed: dict = {}

    def kill(t0: float) -> None:
        try:
            busy = per_node(server, model, "in_flight", timeout=10)
        except Exception as e:  # noqa: BLE001 (the last worker then)
            busy, killed["stats_error"] = {}, repr(e)[:200]
        victim = max(reversed(workers), key=lambda w: busy.get(w.node_id, 0))
        killed.update(victim=victim.node_id, in_flight_by_node=busy,
                      victim_in_flight=busy.get(victim.node_id))
        killed["at_s"] = time.perf_counter() - t0
        cluster.remove_node(victim, allow_graceful=False)

    rows, wall = run_sessions(server, model, system, plans, scale, (kill_at_s, kill))
    counters = server_counters(server)
    report = loss_report(rows, killed.get("at_s", kill_at_s), wall,
                         reference_rows=reference_rows)
    report.update(kill_planned_s=kill_at_s, victim_node=killed.get("victim"),
                  victim_in_flight_by_stats=killed.get("victim_in_flight"),
                  in_flight_by_node_at_kill=killed.get("in_flight_by_node"),
                  resumed_requests=counters.get(RESUMED_REQUESTS),
                  resumed_prefill_tokens=counters.get(RESUMED_PREFILL_TOKENS),
                  request_retries=counters.get(REQUEST_RETRIES),
                  reference_errors=(sum(1 for r in reference_rows if r["error"])
                                    if reference_rows is not None else None),
                  rows=rows)
    if "stats_error" in killed:
        report["victim_stats_error"] = killed["stats_error"]
    return report


def fmt(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def loss_table(loss: dict) -> str:
    """The node-loss run's figures, a row each."""
    extra = loss.get("extra_latency") or {}
    flying = extra.get("in_flight") or {}
    before, after = extra.get("ended_before_kill") or {}, extra.get("sent_after_kill") or {}
    compared = loss.get("compared_with_reference", 0)
    rows = [
        ("victim node", f"{loss.get('victim_node')} (killed {fmt(loss.get('kill_at_s'), 1)} s "
                        f"in; its replica had {loss.get('victim_in_flight_by_stats')} "
                        f"requests in flight by /v1/stats)"),
        ("turns in flight at the kill (every node)", loss.get("in_flight_at_kill")),
        ("failed turns after the kill (in flight included)",
         loss.get("failed_turns_after_kill")),
        ("of which in flight at the kill", loss.get("failed_in_flight_turns")),
        ("of which cut streams", loss.get("cut_streams_after_kill")),
        ("answers identical to the undisturbed run",
         f"{compared - loss.get('differing_answers', 0)} of {compared}"),
        ("resumed requests (/metrics)", fmt(loss.get("resumed_requests"), 0)),
        ("resumed prefill tokens (/metrics)", fmt(loss.get("resumed_prefill_tokens"), 0)),
        ("requests retried before answering (/metrics)",
         fmt(loss.get("request_retries"), 0)),
        ("extra latency of the turns in flight, p50 / max",
         f"{fmt(flying.get('extra_latency_p50_s'))} s / "
         f"{fmt(flying.get('extra_latency_max_s'))} s ({flying.get('matched')} turns)"),
        ("same difference, turns ended before the kill, p50 / max",
         f"{fmt(before.get('extra_latency_p50_s'))} s / "
         f"{fmt(before.get('extra_latency_max_s'))} s ({before.get('matched')} turns)"),
        ("same difference, turns sent after the kill, p50 / max",
         f"{fmt(after.get('extra_latency_p50_s'))} s / "
         f"{fmt(after.get('extra_latency_max_s'))} s ({after.get('matched')} turns)"),
        ("hangs (> 120 s)", loss.get("hangs")),
        ("run wall time, loss / undisturbed",
         f"{fmt(loss.get('wall_s'), 1)} s / {fmt(loss.get('reference_wall_s'), 1)} s"),
    ]
    return "\n".join(["| node loss | |", "|---|---|",
                      *(f"| {k} | {v} |" for k, v in rows)])


def per_node(server: ServerProcess, model: str, counter: str = "finished",
             timeout: float = 60) -> dict[str, int]:
    """Requests finished (or ``counter``: ``in_flight``) by the replica on each node
    (``/v1/stats``' replicas)."""
    stats = httpx.get(f"{server.base_url}/v1/stats",
                      timeout=timeout).json()["models"][model]
    return {r["node_id"]: (r["stats"].get("engine") or {}).get(counter, 0)
            for r in stats.get("replicas", [])}
