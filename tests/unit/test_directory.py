"""The cluster-wide block directory: ordered batches per node, restarts, followers."""

from __future__ import annotations

import pytest

from serve_app.cache.match import BlockEvent
from serve_app.cluster.directory import BlockDirectory, EventBatch


def batch(node: str, seq: int, *events: tuple[str, str | None], epoch: str = "e1",
          full: bool = False) -> EventBatch:
    return EventBatch(node, epoch, seq, tuple(BlockEvent(b, t) for b, t in events), full)


def state(d: BlockDirectory) -> dict[str, dict[str, str]]:
    return {b: d.holders(b) for b in ("b0", "b1", "b2", "b3", "x")}


def test_batches_build_holders_and_prefix_runs_by_node():
    d = BlockDirectory()
    assert d.apply(batch("A", 1, ("b0", "hot"), ("b1", "hot"), ("b2", "ssd"), full=True))
    assert d.apply(batch("B", 1, ("b0", "ssd"), ("b2", "hot"), full=True))
    assert d.holders("b0") == {"A": "hot", "B": "ssd"}
    # A holds the first three blocks; B only the first (it lacks b1, so b2 does not count)
    assert d.prefix_by_node(["b0", "b1", "b2", "b3"]) == {"A": ["hot", "hot", "ssd"],
                                                          "B": ["ssd"]}
    assert d.prefix_by_node(["b1", "b0"]) == {"A": ["hot", "hot"]}
    assert d.prefix_by_node(["x"]) == {}
    # a tier change and an eviction
    assert d.apply(batch("A", 2, ("b0", "ssd"), ("b1", None)))
    assert d.prefix_by_node(["b0", "b1"]) == {"A": ["ssd"], "B": ["ssd"]}
    assert d.nodes() == {"A": 2, "B": 2}


def test_out_of_order_batches_are_refused_until_a_full_snapshot():
    d = BlockDirectory()
    assert not d.apply(batch("A", 1, ("b0", "hot")))  # never seen, not a snapshot
    assert d.apply(batch("A", 1, ("b0", "hot"), full=True))
    assert not d.apply(batch("A", 3, ("b1", "hot")))  # seq 2 is missing
    assert not d.apply(batch("A", 2, ("b1", "hot"), epoch="e2"))  # another incarnation
    assert d.holders("b1") == {}
    assert d.apply(batch("A", 2, ("b1", "hot")))
    assert d.holders("b1") == {"A": "hot"}


def test_a_restarted_store_replaces_everything_known_about_its_node():
    d = BlockDirectory()
    d.apply(batch("A", 1, ("b0", "hot"), ("b1", "hot"), full=True))
    d.apply(batch("B", 1, ("b0", "hot"), full=True))
    # A restarted: its SSD still has b0; its RAM is empty
    assert d.apply(batch("A", 1, ("b0", "ssd"), epoch="e2", full=True))
    assert d.holders("b0") == {"A": "ssd", "B": "hot"}
    assert d.holders("b1") == {}
    assert not d.apply(batch("A", 2, ("b2", "hot")))  # the old epoch's sequence is gone
    assert d.apply(batch("A", 2, ("b2", "hot"), epoch="e2"))


def test_a_lost_node_is_forgotten():
    d = BlockDirectory()
    d.apply(batch("A", 1, ("b0", "hot"), ("b1", "ssd"), full=True))
    d.apply(batch("B", 1, ("b0", "hot"), full=True))
    d.forget("A")
    assert d.holders("b0") == {"B": "hot"} and d.holders("b1") == {}
    assert d.prefix_by_node(["b0", "b1"]) == {"B": ["hot"]}
    assert d.nodes() == {"B": 1}
    assert not d.apply(batch("A", 2, ("b2", "hot")))  # it must start over with a snapshot


def test_followers_replay_deltas_and_reset_when_too_far_behind():
    leader = BlockDirectory(log_limit=4)
    near, far = BlockDirectory(), BlockDirectory()
    leader.apply(batch("A", 1, ("b0", "hot"), ("b1", "hot"), full=True))
    near.follow(leader.changes_since(near.version))
    assert state(near) == state(leader) and near.version == leader.version
    leader.apply(batch("A", 2, ("b1", "ssd"), ("b2", "hot")))
    leader.apply(batch("B", 1, ("b0", "ssd"), full=True))
    delta = leader.changes_since(near.version)
    assert not delta.reset and len(delta.changes) == 3
    near.follow(delta)
    assert state(near) == state(leader)
    leader.forget("A")  # three removals: the 4-entry log no longer reaches version 0
    behind = leader.changes_since(far.version)
    assert behind.reset
    far.follow(behind)
    near.follow(leader.changes_since(near.version))
    assert state(far) == state(near) == state(leader) == {
        "b0": {"B": "ssd"}, "b1": {}, "b2": {}, "b3": {}, "x": {}}
    assert leader.changes_since(leader.version).changes == ()


def test_a_follower_of_a_replaced_directory_resyncs_instead_of_grafting():
    """A new directory (restarted or replaced actor) has a new incarnation. Its log has
    passed the version a follower of the old one reached: a bare version would get a
    delta of the new log applied onto the old copy (b0 would stay, wrongly). Naming its
    incarnation, the follower gets everything and matches the new directory."""
    from serve_app.cluster.directory import StaleCopy

    old = BlockDirectory()
    copy = BlockDirectory(log_limit=1, incarnation="")
    old.apply(batch("A", 1, ("b0", "hot"), full=True))
    copy.follow(old.changes_since(copy.version, copy.incarnation))
    assert copy.incarnation == old.incarnation and state(copy) == state(old)

    new = BlockDirectory()
    assert new.incarnation != old.incarnation
    new.apply(batch("B", 1, ("b1", "hot"), ("b2", "ssd"), full=True))
    new.apply(batch("B", 2, ("b3", "hot")))
    assert new.version > copy.version  # the grafting case: a plausible delta
    grafted = new.changes_since(copy.version)  # what a follower got before
    assert not grafted.reset
    with pytest.raises(StaleCopy):  # a delta of another incarnation is refused
        copy.follow(grafted)
    answer = new.changes_since(copy.version, copy.incarnation)
    assert answer.reset and answer.incarnation == new.incarnation
    copy.follow(answer)
    assert state(copy) == state(new) and copy.holders("b0") == {}
    assert copy.incarnation == new.incarnation and copy.version == new.version
    assert not new.changes_since(copy.version, copy.incarnation).reset  # in step now


# ---- the feed: a node's tiers as directory events ------------------------------------


def test_tiers_report_each_blocks_best_tier_as_it_changes(tmp_path):
    from serve_app.cache.ssd import SSDStore
    from serve_app.cache.tiers import TieredStore
    from tests.support.blocks import DISK, bid, entry
    from tests.support.servers import wait_for

    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=3 * 4096, ssd=ssd)
    for i in range(5):  # the two oldest fall out of RAM; all five reach the SSD
        store.put(entry(i), DISK)
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0
                 and len(ssd.block_ids()) == 5, "five blocks on SSD", interval=0.01)
    tiers = {e.block_id: e.tier for e in store.directory_events()}
    assert tiers == {bid(0): "ssd", bid(1): "ssd", bid(2): "hot", bid(3): "hot",
                     bid(4): "hot"}
    assert store.directory_events() == []  # nothing changed since
    ssd.remove(ssd.block_entry(bid(0)))
    assert [(e.block_id, e.tier) for e in store.directory_events()] == [(bid(0), None)]
    full = {e.block_id: e.tier for e in store.directory_events(full=True)}
    assert full == {bid(1): "ssd", bid(2): "hot", bid(3): "hot", bid(4): "hot"}
