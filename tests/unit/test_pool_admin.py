"""The model pool's admin controls without Ray or MLX: pinning at runtime (a model that
must stay loaded cannot be unpinned), a pinned model is never chosen to make room nor
unloaded when idle, and ``PoolGate.unload`` (the status page's unload button) refuses
what it must, naming why, and counts what it does."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.config.profile import parse_profile
from serve_app.deploy.pool import (
    UNLOAD_REASONS,
    Admission,
    ModelPool,
    PoolGate,
    PoolLimits,
    PoolModel,
    PoolRefused,
    Status,
    pool_for,
)


def pool(*models: PoolModel, max_loaded: int | None = None,
         t: list[float] | None = None) -> ModelPool:
    clock = t if t is not None else [0.0]
    return ModelPool(models, PoolLimits(max_loaded, None), clock=lambda: clock[0])


def idle(name: str) -> int:
    return 0


def counts(**unloads: int) -> dict[str, int]:
    return {**dict.fromkeys(UNLOAD_REASONS, 0), **unloads}


# ---- pins --------------------------------------------------------------------------------


def test_pin_and_unpin_at_runtime():
    p = pool(PoolModel("a"), PoolModel("b", pinned=True))
    assert (p.states["a"].pinned, p.states["b"].pinned) == (False, True)
    p.pin("a", True)
    p.pin("b", False)  # pinned by the profile, not locked: the pin may come off
    assert (p.states["a"].pinned, p.states["b"].pinned) == (True, False)
    p.pin("a", True)  # twice is once
    p.pin("a", False)
    assert p.states["a"].pinned is False
    report = p.report(idle)["models"]
    assert (report["a"]["pinned"], report["b"]["pinned"]) == (False, False)


def test_a_locked_model_refuses_unpin_and_stays_pinned():
    """A model with several replicas or sharded over ranks can never be unloaded by the
    pool (which unloads one replica): its pin cannot come off."""
    p = pool(PoolModel("a", locked="it has 2 replicas (models[].num_replicas)"))
    assert p.states["a"].pinned is True
    with pytest.raises(PoolRefused, match="'a' stays pinned: it has 2 replicas") as err:
        p.pin("a", False)
    assert err.value.code == "pin_locked"
    assert p.states["a"].pinned is True
    p.pin("a", True)  # pinning it again is no change, and no error
    assert p.states["a"].pinned is True
    assert p.report(idle)["models"]["a"]["pin_locked"] == ("it has 2 replicas "
                                                           "(models[].num_replicas)")


def test_a_runtime_pin_keeps_a_model_from_being_chosen_to_make_room():
    t = [0.0]
    p = pool(PoolModel("a"), PoolModel("b"), PoolModel("c"), max_loaded=2, t=t)
    p.start(["a", "b"])
    t[0] = 1.0
    p.used("b")  # a is the least recently used: the victim unless pinned
    assert p.admit("c", idle) == Admission(load=True, unload=("a",))
    p.pin("a", True)
    assert p.admit("c", idle) == Admission(load=True, unload=("b",))
    p.pin("b", True)
    refused = p.admit("c", idle).refused
    assert refused is not None and "a (pinned)" in refused and "b (pinned)" in refused
    p.pin("a", False)
    assert p.admit("c", idle) == Admission(load=True, unload=("a",))


def test_a_runtime_pin_keeps_an_idle_model_loaded():
    t = [0.0]
    p = pool(PoolModel("a", idle_unload_s=5), PoolModel("b", idle_unload_s=5), t=t)
    p.start(["a", "b"])
    t[0] = 10.0
    assert p.idle(idle) == ["a", "b"]
    p.pin("a", True)
    assert p.idle(idle) == ["b"]
    p.pin("a", False)
    assert p.idle(idle) == ["a", "b"]


# ---- PoolGate.unload -------------------------------------------------------------------------


class Replicas:
    """Fake replicas: ``unload`` answers ``accept`` (or raises ``fail``); calls recorded."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[tuple[str, str]] = []
        self.accept = True
        self.fail: Exception | None = None
        self.in_flight: dict[str, int] = {}

    async def load(self, name: str) -> None:
        self.loads.append(name)

    async def unload(self, name: str, reason: str) -> bool:
        self.unloads.append((name, reason))
        if self.fail is not None:
            raise self.fail
        return self.accept

    def busy(self, name: str) -> int:
        return self.in_flight.get(name, 0)

    def gate(self, p: ModelPool) -> PoolGate:
        return PoolGate(p, self.load, self.unload, self.busy)


def refusal(gate: PoolGate, name: str) -> PoolRefused:
    with pytest.raises(PoolRefused) as err:
        asyncio.run(gate.unload(name))
    return err.value


def test_unload_succeeds_and_counts_an_admin_unload():
    r = Replicas()
    p = pool(PoolModel("a"), PoolModel("b"))
    p.start(["a", "b"])
    asyncio.run(r.gate(p).unload("a"))
    assert r.unloads == [("a", "admin")]
    assert (p.status("a"), p.status("b")) == (Status.UNLOADED, Status.LOADED)
    assert p.states["a"].unloads == counts(admin=1)
    assert p.states["b"].unloads == counts()
    assert p.report(idle)["models"]["a"]["unloads"] == counts(admin=1)


def test_unload_refuses_a_pinned_model():
    r = Replicas()
    p = pool(PoolModel("a", pinned=True), PoolModel("b"))
    p.start(["a", "b"])
    g = r.gate(p)
    err = refusal(g, "a")
    assert err.code == "model_pinned" and "'a' is pinned" in str(err)
    p.pin("b", True)  # pinned at runtime: the same
    assert refusal(g, "b").code == "model_pinned"
    assert r.unloads == [] and p.loaded() == ["a", "b"]
    p.pin("b", False)
    asyncio.run(g.unload("b"))
    assert r.unloads == [("b", "admin")] and p.status("b") is Status.UNLOADED


@pytest.mark.parametrize("status", [Status.UNLOADED, Status.LOADING, Status.UNLOADING])
def test_unload_refuses_a_model_that_is_not_loaded(status):
    r = Replicas()
    p = pool(PoolModel("a"))
    p.start(["a"])
    p.set("a", status)
    err = refusal(r.gate(p), "a")
    assert err.code == "model_not_loaded"
    assert f"'a' is {status.value}, not loaded" in str(err)
    assert r.unloads == [] and p.status("a") is status
    assert p.states["a"].unloads == counts()


def test_unload_refuses_a_model_serving_a_request():
    r = Replicas()
    r.in_flight = {"a": 2}
    p = pool(PoolModel("a"))
    p.start(["a"])
    err = refusal(r.gate(p), "a")
    assert err.code == "model_busy" and "serving 2 request(s)" in str(err)
    assert r.unloads == [] and p.status("a") is Status.LOADED


def test_a_replica_that_refuses_keeps_the_model_loaded():
    """The replica took a request meanwhile (it refuses to unload while serving one): 409
    ``model_busy``, the model loaded as before, nothing counted."""
    r = Replicas()
    r.accept = False
    p = pool(PoolModel("a"))
    p.start(["a"])
    g = r.gate(p)
    err = refusal(g, "a")
    assert err.code == "model_busy" and "did not unload" in str(err)
    assert r.unloads == [("a", "admin")]
    assert p.status("a") is Status.LOADED and p.states["a"].unloads == counts()
    r.accept = True  # a retry once it is idle
    asyncio.run(g.unload("a"))
    assert p.status("a") is Status.UNLOADED and p.states["a"].unloads == counts(admin=1)


def test_a_replica_whose_unload_raises_keeps_the_model_with_its_error():
    r = Replicas()
    r.fail = RuntimeError("replica gone")
    p = pool(PoolModel("a"))
    p.start(["a"])
    assert refusal(r.gate(p), "a").code == "model_busy"
    assert p.status("a") is Status.LOADED and p.states["a"].unloads == counts()
    assert "replica gone" in p.states["a"].last_error


def test_an_unloaded_model_loads_again_on_request():
    r = Replicas()
    p = pool(PoolModel("a"))
    p.start(["a"])
    g = r.gate(p)

    async def main():
        await g.unload("a")
        await g.ready("a")  # as a request (or POST /admin/models/a/load) does

    asyncio.run(main())
    assert r.unloads == [("a", "admin")] and r.loads == ["a"]
    assert p.status("a") is Status.LOADED and p.states["a"].loads == 1


# ---- from a profile ------------------------------------------------------------------------


def model(name: str, **kw) -> dict:
    return {"name": name, "source": "embedded:tiny-dense", **kw}


def test_pool_for_locks_a_model_with_several_replicas_or_sharded():
    profile = parse_profile({"models": [
        model("replicated", num_replicas=2), model("sharded", parallel={"tensor": 2}),
        model("pinned", pinned=True), model("plain")]})
    p = pool_for(profile, None)
    assert {n: m.locked for n, m in p.models.items()} == {
        "replicated": "it has 2 replicas (models[].num_replicas)",
        "sharded": "it is sharded over ranks (models[].parallel)",
        "pinned": None, "plain": None}
    assert {n: s.pinned for n, s in p.states.items()} == {
        "replicated": True, "sharded": True, "pinned": True, "plain": False}
    for name in ("replicated", "sharded"):
        with pytest.raises(PoolRefused) as err:
            p.pin(name, False)
        assert err.value.code == "pin_locked"
        assert p.states[name].pinned is True
    p.pin("pinned", False)  # a profile's pin is not a lock
    assert p.states["pinned"].pinned is False
    assert p.initial()[:2] == ("replicated", "sharded")
