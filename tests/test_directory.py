"""The cluster-wide block directory: ordered batches per node, restarts, followers."""

from __future__ import annotations

from serve_app.cache.directory import BlockDirectory, BlockEvent, EventBatch


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
