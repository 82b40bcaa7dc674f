"""bench.pinning: simulated nodes get cores of their own only where there are enough."""

from __future__ import annotations

from bench.pinning import core_plan


def test_each_node_gets_an_equal_share_of_the_allowed_cores():
    assert core_plan(3, [0, 1, 2, 3, 4, 5, 6]).nodes == ((0, 1), (2, 3), (4, 5))
    assert core_plan(2, [4, 7]).nodes == ((4,), (7,))


def test_fewer_cores_than_nodes_pins_nothing_and_says_why():
    plan = core_plan(3, [0, 1])
    assert plan.nodes == () and "2 cores for 3 simulated nodes" in (plan.why_not or "")
    assert plan.to_json()["pinned"] is False
