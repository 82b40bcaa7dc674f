"""The payloads of the cross-node fetch tests fit the layout those fetches are checked
against (the fetches on a real multi-node Ray are tests/cluster/test_cluster_faults.py)."""

from __future__ import annotations

from serve_app.cache.payload import CapturedBlock
from tests.support.blocks import SMALL_BS, SMALL_LAYOUT, small_payload


def test_a_payload_put_by_this_process_is_a_block_payload():
    """The shared payloads fit the layout the fetches are checked against."""
    assert SMALL_LAYOUT.check(small_payload(0), SMALL_BS, need_state=False) is None
    assert CapturedBlock("b", "root", small_payload(0)).nbytes == small_payload(0).nbytes
