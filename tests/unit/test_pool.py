"""The model pool without Ray or MLX: which models load at start, which one makes room
(least recently used, never pinned, never busy), why a request is refused, idle unloads,
and the gate that carries it out (one load shared, a loaded model never waits)."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest

from serve_app.config.profile import parse_profile
from serve_app.deploy.pool import (
    Admission,
    ModelPool,
    PoolCapacityError,
    PoolGate,
    PoolLimits,
    PoolLoadError,
    PoolModel,
    Status,
    loaded_at_start,
    pool_for,
)
from serve_app.memory.plan import MemoryPlan, ModelFootprint
from serve_app.memory.shapes import CacheShape


def pool(*models: PoolModel, max_loaded: int | None = None, room: int | None = None,
         t: list[float] | None = None) -> ModelPool:
    """A pool on a fake clock ``t[0]`` (0.0 unless given)."""
    clock = t if t is not None else [0.0]
    return ModelPool(models, PoolLimits(max_loaded, room), clock=lambda: clock[0])


def idle_everywhere(name: str) -> int:
    return 0


def busy_with(**counts: int):
    return lambda name: counts.get(name, 0)


# ---- at start ------------------------------------------------------------------------


def test_initial_is_pinned_first_then_profile_order_under_the_cap():
    p = pool(PoolModel("a"), PoolModel("b", pinned=True), PoolModel("c"), PoolModel("d"),
             max_loaded=3)
    assert p.initial() == ("b", "a", "c")


def test_initial_under_the_memory_room_sums_footprints():
    """``b`` does not fit beside ``a``, ``c`` does: the order is the profile's, not a
    first-fit that stops at the first model too large."""
    p = pool(PoolModel("a", footprint_bytes=60), PoolModel("b", footprint_bytes=50),
             PoolModel("c", footprint_bytes=30), room=100)
    assert p.initial() == ("a", "c")
    pinned = pool(PoolModel("a", footprint_bytes=20), PoolModel("p", pinned=True,
                                                                 footprint_bytes=90), room=100)
    assert pinned.initial() == ("p",)  # the pinned one first, then nothing fits beside it


def test_one_model_alone_always_fits():
    p = pool(PoolModel("big", footprint_bytes=500), PoolModel("small", footprint_bytes=1),
             room=100)
    assert p.initial() == ("big",)
    p.start(())
    assert p.admit("big", idle_everywhere) == Admission(load=True)


def test_start_sets_loaded_and_unloaded():
    p = pool(PoolModel("a"), PoolModel("b"))
    p.start(["b"])
    assert (p.status("a"), p.status("b")) == (Status.UNLOADED, Status.LOADED)
    assert p.loaded() == ["b"]


# ---- admission -----------------------------------------------------------------------


@pytest.mark.parametrize("status", [Status.LOADED, Status.LOADING, Status.UNLOADING])
def test_admit_of_a_model_in_memory_needs_nothing(status):
    p = pool(PoolModel("a"), PoolModel("b"), max_loaded=1)
    p.start(["b"])
    p.set("a", status)
    assert p.admit("a", idle_everywhere) == Admission()


def test_admit_with_room_loads_without_unloading():
    p = pool(PoolModel("a"), PoolModel("b"), PoolModel("c"), max_loaded=2)
    p.start(["a"])
    assert p.admit("b", idle_everywhere) == Admission(load=True)


def test_a_full_pool_unloads_the_least_recently_used_idle_unpinned_model():
    t = [0.0]
    p = pool(PoolModel("p", pinned=True), PoolModel("a"), PoolModel("b"), PoolModel("c"),
             max_loaded=3, t=t)
    p.start(["p", "a", "b"])  # p is the least recently used of all, but pinned
    t[0] = 5.0
    p.used("b")
    t[0] = 7.0
    p.used("a")
    assert p.admit("c", idle_everywhere) == Admission(load=True, unload=("b",))
    t[0] = 9.0
    p.used("b")  # now a is the older one
    assert p.admit("c", idle_everywhere) == Admission(load=True, unload=("a",))
    assert p.admit("c", busy_with(a=1)) == Admission(load=True, unload=("b",))
    assert p.admit("c", busy_with(a=1, b=3)).refused is not None


def test_only_loaded_models_are_unloaded():
    """A model being unloaded or loaded is no victim (it is counted as in memory)."""
    p = pool(PoolModel("a"), PoolModel("b"), PoolModel("c"), max_loaded=2)
    p.start(["a", "b"])
    p.set("a", Status.UNLOADING)
    assert p.admit("c", idle_everywhere) == Admission(load=True, unload=("b",))
    p.set("b", Status.LOADING)
    assert p.admit("c", idle_everywhere).refused is not None


def test_memory_may_take_several_victims_and_stops_once_it_fits():
    t = [0.0]
    models = (PoolModel("a", footprint_bytes=40), PoolModel("b", footprint_bytes=40),
              PoolModel("c", footprint_bytes=10), PoolModel("big", footprint_bytes=90),
              PoolModel("mid", footprint_bytes=50))
    p = pool(*models, room=100, t=t)
    p.start(["a", "b", "c"])
    for name in ("a", "b", "c"):  # least recently used first: a, b, c
        t[0] += 1.0
        p.used(name)
    assert p.admit("big", idle_everywhere) == Admission(load=True, unload=("a", "b"))
    assert p.admit("mid", idle_everywhere) == Admission(load=True, unload=("a",))
    assert p.admit("mid", busy_with(a=1)) == Admission(load=True, unload=("b",))


def test_refusal_under_the_cap_names_the_model_the_key_and_why_each_is_held():
    p = pool(PoolModel("p", pinned=True), PoolModel("a"), PoolModel("c"), max_loaded=2)
    p.start(["p", "a"])
    refused = p.admit("c", busy_with(a=2)).refused
    assert refused is not None
    assert "'c'" in refused and "max_loaded_models 2" in refused
    assert "p (pinned)" in refused and "a (2 requests in flight)" in refused
    assert "memory budget" not in refused


def test_refusal_under_memory_names_the_memory_budget():
    p = pool(PoolModel("p", pinned=True, footprint_bytes=60),
             PoolModel("a", footprint_bytes=30), PoolModel("c", footprint_bytes=50), room=100)
    p.start(["p", "a"])
    refused = p.admit("c", busy_with(a=1)).refused
    assert refused is not None
    assert "'c'" in refused and "the memory budget" in refused
    assert "max_loaded_models" not in refused
    assert "p (pinned)" in refused and "a (1 request in flight)" in refused


# ---- idle ----------------------------------------------------------------------------


def test_idle_respects_the_timeout_busy_pinned_and_status():
    t = [0.0]
    p = pool(PoolModel("a", idle_unload_s=10), PoolModel("busy", idle_unload_s=10),
             PoolModel("pinned", pinned=True, idle_unload_s=10), PoolModel("never"),
             PoolModel("gone", idle_unload_s=10), PoolModel("going", idle_unload_s=10),
             PoolModel("recent", idle_unload_s=10), t=t)
    p.start(["a", "busy", "pinned", "never", "going", "recent"])
    p.set("going", Status.UNLOADING)
    t[0] = 5.0
    p.used("recent")
    t[0] = 9.9
    assert p.idle(busy_with(busy=1)) == []
    t[0] = 10.0
    assert p.idle(busy_with(busy=1)) == ["a"]
    t[0] = 15.0
    assert p.idle(busy_with(busy=1)) == ["a", "recent"]
    assert p.idle(idle_everywhere) == ["a", "busy", "recent"]


def test_unloading_is_reported_as_loaded():
    assert Status.UNLOADING.reported == "loaded"
    assert [s.reported for s in (Status.LOADED, Status.LOADING, Status.UNLOADED)] == [
        "loaded", "loading", "unloaded"]
    assert Status.UNLOADING.in_memory and not Status.UNLOADED.in_memory


def test_report_says_each_models_state():
    t = [0.0]
    p = pool(PoolModel("a", footprint_bytes=7), PoolModel("b", pinned=True), max_loaded=2,
             room=100, t=t)
    p.start(["a", "b"])
    p.set("a", Status.UNLOADING)
    t[0] = 2.5
    report = p.report(busy_with(b=3))
    assert report["max_loaded_models"] == 2 and report["room_bytes"] == 100
    assert report["loaded"] == ["a", "b"]
    a, b = report["models"]["a"], report["models"]["b"]
    assert (a["status"], a["state"], a["footprint_bytes"]) == ("loaded", "unloading", 7)
    assert (b["pinned"], b["in_flight"], b["idle_s"]) == (True, 3, 2.5)


# ---- the gate ------------------------------------------------------------------------


class Replicas:
    """Fake replicas: ``load`` waits on ``release`` (set by default), ``unload`` answers
    ``accept``; every call is recorded."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.accept = True
        self.fail: Exception | None = None
        self.release: asyncio.Event | None = None
        self.unload_release: asyncio.Event | None = None
        self.in_flight: dict[str, int] = {}

    async def load(self, name: str) -> None:
        self.loads.append(name)
        if self.release is not None:
            await self.release.wait()
        if self.fail is not None:
            raise self.fail

    async def unload(self, name: str, reason: str) -> bool:
        self.unloads.append(name)
        if self.unload_release is not None:
            await self.unload_release.wait()
        return self.accept

    def busy(self, name: str) -> int:
        return self.in_flight.get(name, 0)

    def gate(self, p: ModelPool) -> PoolGate:
        return PoolGate(p, self.load, self.unload, self.busy)


async def until(predicate, steps: int = 100) -> None:
    """Let the loop run until ``predicate()`` holds (a few steps; no wall-clock waits)."""
    for _ in range(steps):
        if predicate():
            return
        await asyncio.sleep(0)
    raise AssertionError("never happened")


def test_concurrent_ready_calls_share_one_load():
    async def main():
        r = Replicas()
        r.release = asyncio.Event()
        p = pool(PoolModel("a"), PoolModel("b"))
        p.start(["a"])
        g = r.gate(p)
        waiting = [asyncio.ensure_future(g.ready("b")) for _ in range(3)]
        await until(lambda: r.loads)
        assert p.status("b") is Status.LOADING and not any(w.done() for w in waiting)
        r.release.set()
        await asyncio.gather(*waiting)
        assert r.loads == ["b"] and r.unloads == []
        assert p.status("b") is Status.LOADED and p.states["b"].loads == 1
        await g.ready("b")  # loaded now: no second load
        assert r.loads == ["b"]

    asyncio.run(main())


def test_a_loaded_model_never_waits_for_another_models_load():
    async def main():
        r = Replicas()
        r.release = asyncio.Event()
        p = pool(PoolModel("a"), PoolModel("b"))
        p.start(["a"])
        g = r.gate(p)
        loading = asyncio.ensure_future(g.ready("b"))
        await until(lambda: r.loads)
        assert g.lock.locked()
        await asyncio.wait_for(g.ready("a"), timeout=1.0)  # returns while b's load holds
        assert not loading.done() and p.status("b") is Status.LOADING
        r.release.set()
        await loading

    asyncio.run(main())


def test_a_full_pool_unloads_then_loads_and_counts_both():
    async def main():
        r = Replicas()
        p = pool(PoolModel("a"), PoolModel("b"), max_loaded=1)
        p.start(["a"])
        await r.gate(p).ready("b")
        assert r.unloads == ["a"] and r.loads == ["b"]
        assert (p.status("a"), p.status("b")) == (Status.UNLOADED, Status.LOADED)
        assert p.states["a"].unloads == {"capacity": 1, "idle": 0, "admin": 0}
        assert p.states["b"].loads == 1 and p.states["b"].load_seconds >= 0.0
        assert p.states["a"].loads == 0 and p.states["b"].unloads == {"capacity": 0, "idle": 0,
                                                                      "admin": 0}

    asyncio.run(main())


def test_nothing_to_unload_is_a_capacity_error():
    async def main():
        r = Replicas()
        r.in_flight = {"a": 1}
        p = pool(PoolModel("a"), PoolModel("b"), max_loaded=1)
        p.start(["a"])
        with pytest.raises(PoolCapacityError, match="'b'"):
            await r.gate(p).ready("b")
        assert r.unloads == [] and r.loads == []
        assert p.status("b") is Status.UNLOADED

    asyncio.run(main())


def test_an_unload_the_replica_refuses_is_a_capacity_error_and_the_victim_stays():
    async def main():
        r = Replicas()
        r.accept = False  # a request reached the replica meanwhile
        p = pool(PoolModel("a"), PoolModel("b"), max_loaded=1)
        p.start(["a"])
        g = r.gate(p)
        with pytest.raises(PoolCapacityError, match="'a'"):
            await g.ready("b")
        assert r.unloads == ["a"] and r.loads == []
        assert (p.status("a"), p.status("b")) == (Status.LOADED, Status.UNLOADED)
        assert p.states["a"].unloads == {"capacity": 0, "idle": 0, "admin": 0}
        r.accept = True  # a retry succeeds
        await g.ready("b")
        assert p.status("b") is Status.LOADED

    asyncio.run(main())


def test_an_unload_that_raises_keeps_the_victim_loaded():
    async def main():
        r = Replicas()

        async def broken(name: str, reason: str) -> bool:
            raise RuntimeError("replica gone")

        p = pool(PoolModel("a"), PoolModel("b"), max_loaded=1)
        p.start(["a"])
        g = PoolGate(p, r.load, broken, r.busy)
        with pytest.raises(PoolCapacityError):
            await g.ready("b")
        assert p.status("a") is Status.LOADED and "replica gone" in p.states["a"].last_error

    asyncio.run(main())


def test_a_failed_load_is_unloaded_with_its_error_and_a_later_ready_tries_again():
    async def main():
        r = Replicas()
        r.fail = RuntimeError("weights missing")
        p = pool(PoolModel("a"), PoolModel("b"))
        p.start(["a"])
        g = r.gate(p)
        with pytest.raises(PoolLoadError, match="weights missing"):
            await g.ready("b")
        state = p.states["b"]
        assert p.status("b") is Status.UNLOADED and state.loads == 0
        assert state.last_error is not None and "weights missing" in state.last_error
        r.fail = None
        await g.ready("b")
        assert r.loads == ["b", "b"] and p.status("b") is Status.LOADED
        assert state.loads == 1 and state.last_error is None

    asyncio.run(main())


def test_every_waiter_of_a_failed_load_gets_the_error():
    async def main():
        r = Replicas()
        r.release = asyncio.Event()
        r.fail = RuntimeError("boom")
        p = pool(PoolModel("a"))
        p.start(())
        g = r.gate(p)
        waiting = [asyncio.ensure_future(g.ready("a")) for _ in range(2)]
        await until(lambda: r.loads)
        r.release.set()
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert [type(x) for x in results] == [PoolLoadError, PoolLoadError]
        assert r.loads == ["a"]

    asyncio.run(main())


def test_unload_idle_unloads_an_idle_model_and_counts_it():
    async def main():
        t = [0.0]
        r = Replicas()
        p = pool(PoolModel("a", idle_unload_s=5), PoolModel("b", idle_unload_s=5),
                 PoolModel("c"), t=t)
        p.start(["a", "b", "c"])
        g = r.gate(p)
        t[0] = 4.0
        assert await g.unload_idle() == []
        t[0] = 5.0
        r.in_flight = {"b": 1}
        assert await g.unload_idle() == ["a"]
        assert r.unloads == ["a"] and p.status("a") is Status.UNLOADED
        assert p.states["a"].unloads == {"capacity": 0, "idle": 1, "admin": 0}
        assert p.status("b") is Status.LOADED and p.status("c") is Status.LOADED

    asyncio.run(main())


def test_an_idle_unload_the_replica_refuses_keeps_the_model():
    async def main():
        t = [0.0]
        r = Replicas()
        r.accept = False
        p = pool(PoolModel("a", idle_unload_s=5), t=t)
        p.start(["a"])
        t[0] = 6.0
        assert await r.gate(p).unload_idle() == []
        assert p.status("a") is Status.LOADED and p.states["a"].unloads["idle"] == 0

    asyncio.run(main())


def test_a_request_for_a_victim_waits_for_the_transition_and_loads_it_again():
    """Every victim is marked at once: a request for the second victim, arriving while
    the first is being unloaded, is never sent to a replica the gate then unloads; it
    waits, and its model loads again after (making room in turn)."""
    async def main():
        t = [0.0]
        r = Replicas()
        r.unload_release = asyncio.Event()
        p = pool(PoolModel("a", footprint_bytes=40), PoolModel("b", footprint_bytes=40),
                 PoolModel("big", footprint_bytes=90), room=100, t=t)
        p.start(["a", "b"])
        t[0] = 1.0
        p.used("b")  # victims in order: a, then b
        g = r.gate(p)
        bringing = asyncio.ensure_future(g.ready("big"))
        await until(lambda: r.unloads)
        assert r.unloads == ["a"] and p.status("b") is Status.UNLOADING
        r.in_flight["b"] = 1  # the ingress counts a request for b, then asks the gate
        waiting = asyncio.ensure_future(g.ready("b"))
        for _ in range(10):
            await asyncio.sleep(0)
        assert not waiting.done()  # not sent: b is on its way out
        r.unload_release.set()
        await bringing
        await waiting
        assert r.unloads == ["a", "b", "big"] and r.loads == ["big", "b"]
        assert p.status("b") is Status.LOADED and p.status("big") is Status.UNLOADED

    asyncio.run(main())


def test_reconcile_takes_each_replicas_word_and_leaves_the_silent_ones():
    """A replica Serve restarted holds what its deployment was built to hold, an ingress
    that restarted starts from the start-time view: the replicas' answers win; a replica
    that does not answer (or answers something else) leaves the pool's view as it was."""
    async def main():
        r = Replicas()
        answers = {"a": "unloaded", "b": "loaded", "c": "what?"}

        async def status(name: str) -> str:
            if name == "d":
                await asyncio.Event().wait()  # never answers
            return answers[name]

        p = pool(PoolModel("a"), PoolModel("b"), PoolModel("c"), PoolModel("d"),
                 max_loaded=2)
        p.start(["a", "c"])
        g = PoolGate(p, r.load, r.unload, r.busy, status=status)
        with mock.patch("serve_app.deploy.pool.STATUS_TIMEOUT_S", 0.05):
            changed = await g.reconcile()
        assert changed == {"a": "unloaded", "b": "loaded"}
        assert [p.status(n) for n in "abcd"] == [Status.UNLOADED, Status.LOADED,
                                                 Status.LOADED, Status.UNLOADED]
        # At the cap now (b and c): the next model to load makes room for itself.
        r.in_flight["c"] = 1
        p.used("b")
        await g.ready("a")
        assert r.unloads == ["b"] and sorted(p.loaded()) == ["a", "c"]

    asyncio.run(main())


# ---- from a profile and a plan ---------------------------------------------------------


def model(name: str, **kw) -> dict:
    return {"name": name, "source": "embedded:tiny-dense", **kw}


def footprint(name: str, nbytes: int) -> ModelFootprint:
    return ModelFootprint(name, nbytes, 0, 1, 1, CacheShape(0))


def test_pool_for_pins_a_model_with_several_replicas_and_reads_the_plan():
    profile = parse_profile({"models": [model("a", num_replicas=2), model("b"),
                                        model("c", pinned=True),
                                        model("d", idle_unload_s=30)],
                             "memory": {"max_loaded_models": 3}})
    p = pool_for(profile, None)
    assert {n: s.pinned for n, s in p.states.items()} == {
        "a": True, "b": False, "c": True, "d": False}
    assert p.models["a"].locked is not None and p.models["c"].locked is None
    assert p.models["d"].idle_unload_s == 30 and p.models["b"].idle_unload_s is None
    assert p.limits == PoolLimits(3, None) and p.models["b"].footprint_bytes == 0
    plan = MemoryPlan(total_memory_bytes=1000, budget_bytes=900, budget_origin="test",
                      models=(footprint("a", 100), footprint("b", 200)), hot_bytes=150,
                      hot_origin="test", staging_bytes=50, loaded=("a", "b"))
    p = pool_for(profile, plan)
    assert p.limits == PoolLimits(3, 700)  # the budget less the hot tier and the staging
    assert [p.models[n].footprint_bytes for n in "abcd"] == [100, 200, 0, 0]
    assert p.initial() == ("a", "c", "b")


def test_loaded_at_start_is_every_model_with_several_ingresses():
    profile = parse_profile({"models": [model("a"), model("b"), model("c")],
                             "ingress": {"num_replicas": 2}})
    plan = MemoryPlan(total_memory_bytes=1000, budget_bytes=100, budget_origin="test",
                      models=tuple(footprint(n, 90) for n in "abc"), hot_bytes=0,
                      hot_origin="test", staging_bytes=0, loaded=("a", "b", "c"))
    assert loaded_at_start(profile, plan) == ("a", "b", "c")
    single = parse_profile({"models": [model("a"), model("b"), model("c")]})
    assert loaded_at_start(single, plan) == ("a",)  # one ingress: the pool's initial set


def test_loaded_at_start_of_a_pool_puts_pinned_first_under_the_cap():
    profile = parse_profile({"models": [model("a"), model("b", pinned=True), model("c")],
                             "memory": {"max_loaded_models": 2}})
    assert loaded_at_start(profile, None) == ("b", "a")
