"""The prefix-affinity router's ranking (plain: no Ray Serve running).

The router itself runs on a real multi-node cluster in ``tests/cluster/test_cluster.py``.
"""

from __future__ import annotations

import pytest

from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.match import BlockEvent
from serve_app.cluster.directory import BlockDirectory, EventBatch
from serve_app.cluster.routing import Candidate, ReplicaInfo, prefill_cost, rank
from serve_app.config.profile import ModelProfile

BS = 16


def candidates(*loads: int, capacity: int = 4) -> list[Candidate]:
    return [Candidate(f"r{i}", f"n{i}", ongoing, capacity) for i, ongoing in enumerate(loads)]


def test_the_replica_whose_node_holds_the_prefix_wins():
    runs = {"n1": ["hot"] * 4}
    ranking = rank(candidates(0, 0, 0), runs, prompt_tokens=4 * BS + 5, block_size=BS,
                   queue_cost_tokens=512)
    assert ranking.order[0] == "r1" and ranking.reason("r1") == "prefix"
    assert ranking.prefill["r1"] == 5  # only the tokens past the cached blocks
    # The others would fetch the four blocks from n1: cheaper than prefilling them.
    assert 5 < ranking.prefill["r0"] < 4 * BS + 5


def test_tiers_are_credited_hot_over_ssd_over_remote():
    hot = prefill_cost("a", {"a": ["hot"] * 4}, 64, BS)
    ssd = prefill_cost("a", {"a": ["ssd"] * 4}, 64, BS)
    remote = prefill_cost("a", {"b": ["hot"] * 4}, 64, BS)
    none = prefill_cost("a", {}, 64, BS)
    assert hot < ssd < remote < none == 64


def test_a_longer_run_elsewhere_counts_as_a_fetch_past_the_local_one():
    runs = {"a": ["hot"] * 2, "b": ["hot"] * 6}
    assert prefill_cost("a", runs, 6 * BS, BS) == pytest.approx(4 * 0.3 * BS)


def test_a_replica_with_free_slots_keeps_its_prefix_however_busy():
    """Load costs about nothing while a batch has free slots: the replica holding the
    session's blocks gets its next turn though it runs three requests and the other none
    (the cause of issue 45: a request cost as much as the prefix saved)."""
    runs = {"n0": ["hot"] * 20}  # 320 tokens cached on n0 (r1 would fetch them)
    ranking = rank(candidates(3, 0), runs, 328, BS, queue_cost_tokens=512)
    assert ranking.order[0] == "r0" and ranking.reason("r0") == "prefix"


def test_queueing_outweighs_the_prefix_once_every_batch_is_full():
    runs = {"n0": ["hot"] * 2}
    ranking = rank(candidates(6, 4), runs, 40, BS, queue_cost_tokens=512)  # both full
    assert ranking.order[0] == "r1" and ranking.reason("r1") == "load_fallback"
    ranking = rank(candidates(6, 4), runs, 40, BS, queue_cost_tokens=1)
    assert ranking.order[0] == "r0"


def test_costs_are_seconds_at_each_replicas_prefill_rate():
    """A replica ten times as fast at prefill may prefill more and still be first; one
    that has not measured its rate yet, or whose rate is within a factor of two of the
    median, is costed at the median (noise must not pin cold sessions to one replica)."""
    runs = {"n0": ["hot"] * 2}  # r0 prefills 8 tokens, r1 fetches 32 (0.3 each) and 8
    slow, fast, alike = (Candidate("r0", "n0", 0, 4, prefill_rate=100.0),
                         Candidate("r1", "n1", 0, 4, prefill_rate=1000.0),
                         Candidate("r2", "n2", 0, 4, prefill_rate=450.0))
    ranking = rank([slow, fast, alike], runs, 40, BS, queue_cost_tokens=512)
    assert ranking.order[0] == "r1" and ranking.order[-1] == "r0"
    assert ranking.seconds["r1"] == pytest.approx((0.3 * 32 + 8) / 1000) and \
        ranking.seconds["r0"] == pytest.approx(8 / 100)
    unknown = Candidate("r3", "n3", 0, 4)
    ranking = rank([slow, fast, alike, unknown], {}, 40, BS, queue_cost_tokens=512)
    assert ranking.seconds["r3"] == ranking.seconds["r2"] == pytest.approx(40 / 450)


def test_cold_sessions_spread_over_alike_replicas_whatever_their_measured_rates():
    """Two idle replicas of alike machines whose measured rates differ a little: a prompt
    no node holds goes to either (random), never always to the faster-measured one."""
    a, b = (Candidate("r0", "n0", 0, 4, prefill_rate=1000.0),
            Candidate("r1", "n1", 0, 4, prefill_rate=900.0))
    firsts = {rank([a, b], {}, 400, BS, 512).order[0] for _ in range(50)}
    assert firsts == {"r0", "r1"}


def test_a_full_replica_is_ranked_last_however_good_its_prefix():
    runs = {"n0": ["hot"] * 100}
    ranking = rank(candidates(4, 3, capacity=4), runs, 100 * BS, BS, queue_cost_tokens=0)
    assert ranking.order == ["r1", "r0"] and ranking.reason("r1") == "load_fallback"


def test_a_replica_ray_found_unreachable_is_ranked_after_a_full_one():
    """A dead node's replica holds the prefix until Serve removes it: asked first, Ray
    would probe it again and again while the request waits (seen with a node killed)."""
    runs = {"n0": ["hot"] * 100}
    suspect, full, free = (Candidate("r0", "n0", 0, 4, suspect=True),
                           Candidate("r1", "n1", 4, 4), Candidate("r2", "n2", 0, 4))
    ranking = rank([suspect, full, free], runs, 100 * BS, BS, queue_cost_tokens=0)
    assert ranking.order == ["r2", "r1", "r0"]


def test_no_prefix_anywhere_goes_to_the_least_loaded():
    ranking = rank(candidates(2, 0, 1), {}, 100, BS, queue_cost_tokens=512)
    assert ranking.order == ["r1", "r2", "r0"] and ranking.reason("r1") == "no_prefix"


def test_equal_replicas_share_the_work():
    firsts = {rank(candidates(0, 0), {}, 100, BS, 512).order[0] for _ in range(50)}
    assert firsts == {"r0", "r1"}


def test_routing_reads_the_same_block_ids_the_cache_stores():
    """Runs come from a directory fed with the chain a replica would store."""
    root = salted_root("root", None)
    prompt = list(range(5 * BS + 3))
    ids = chain(root, prompt, BS)
    directory = BlockDirectory()
    directory.apply(EventBatch("n0", "e", 1, tuple(BlockEvent(b, "hot") for b in ids[:3]),
                               full=True))
    directory.apply(EventBatch("n1", "e", 1, tuple(BlockEvent(b, "ssd") for b in ids),
                               full=True))
    runs = directory.prefix_by_node(ids)
    ranking = rank(candidates(0, 0), runs, len(prompt), BS, 512)
    # n1 has all five blocks on SSD (0.1 each); n0 three in RAM plus two fetched (0.3 each).
    assert ranking.prefill["r1"] == pytest.approx(5 * 0.1 * BS + 3)
    assert ranking.prefill["r0"] == pytest.approx(2 * 0.3 * BS + 3)
    assert ranking.order[0] == "r1"
    # A salted request has other ids: nothing is held for it.
    salted = chain(salted_root("root", "tenant"), prompt, BS)
    assert directory.prefix_by_node(salted) == {}


def test_replica_info_round_trips_and_ignores_strangers():
    info = ReplicaInfo("n", "root", 16, 8, running=2, queued=1)
    assert ReplicaInfo.from_stats(info.to_stats()) == info
    assert ReplicaInfo.from_stats({}) is None and ReplicaInfo.from_stats(None) is None
    assert ReplicaInfo.from_stats({"root": "r", "unknown": 1}) is None


def test_prefix_routing_is_on_by_default_only_with_several_replicas():
    one = ModelProfile(name="m", source="embedded:tiny-dense")
    two = ModelProfile(name="m", source="embedded:tiny-dense", num_replicas=2)
    assert not one.prefix_routing and two.prefix_routing
    assert ModelProfile(name="m", source="embedded:tiny-dense",
                        routing={"mode": "prefix"}).prefix_routing
    assert not ModelProfile(name="m", source="embedded:tiny-dense", num_replicas=2,
                            routing={"mode": "default"}).prefix_routing


def test_rays_imbalanced_threshold_is_read_with_rays_router_only():
    from serve_app.config.profile import ProfileError, parse_profile

    def profile(routing: dict) -> None:
        parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                                   "num_replicas": 2, "routing": routing}]}, where="p.yaml")

    profile({"mode": "ray_prefix", "ray_imbalanced_threshold": 4.0})
    with pytest.raises(ProfileError, match="routing.ray_imbalanced_threshold: Ray's router"):
        profile({"mode": "prefix", "ray_imbalanced_threshold": 4.0})
