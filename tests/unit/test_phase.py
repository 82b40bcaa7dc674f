"""A model's phase from its replicas' (serve_app.models.phase), without Ray."""

from __future__ import annotations

from serve_app.models.phase import ModelPhase, model_phase


def test_no_replica_wrote_yet():
    assert model_phase([], answered=False).phase == "starting"
    assert model_phase([], answered=True).phase == "ready"


def test_a_download_in_progress_shows_its_bytes():
    p = ModelPhase("downloading", 40, 100)
    assert model_phase([p], answered=False).public() == {
        "phase": "downloading", "progress": {"done_bytes": 40, "total_bytes": 100}}


def test_any_replica_serving_makes_the_model_serve():
    phases = [ModelPhase("loading"), ModelPhase("ready"), ModelPhase("failed", reason="x")]
    assert model_phase(phases, answered=True).phase == "ready"
    # "ready" written by a replica the ingress has not heard answer yet: still starting
    assert model_phase([ModelPhase("ready")], answered=False).phase == "warming"


def test_the_furthest_load_in_progress_wins_over_an_old_failure():
    phases = [ModelPhase("failed", reason="old", since=1), ModelPhase("downloading"),
              ModelPhase("warming")]
    assert model_phase(phases, answered=False).phase == "warming"


def test_every_replica_failed_gives_the_newest_reason():
    phases = [ModelPhase("failed", reason="old", since=1),
              ModelPhase("failed", reason="new", since=2)]
    assert model_phase(phases, answered=True).public() == {"phase": "failed", "reason": "new"}


def test_unloaded_by_the_pool_serves():
    assert model_phase([ModelPhase("unloaded")], answered=True).phase == "unloaded"


def test_encode_round_trips():
    p = ModelPhase("failed", None, None, "disk full", 3.5)
    assert ModelPhase.decode(p.encode()) == p
