"""The payloads of the cross-node fetch tests fit the layout those fetches are checked
against (the fetches on a real multi-node Ray are tests/cluster/test_cluster_faults.py)."""

from __future__ import annotations

import numpy as np

from serve_app.cache.layout import KV, ArraySpec, Layout
from serve_app.cache.payload import BlockPayload, CapturedBlock, Tensor

BS = 4
LAYOUT = Layout((KV,), arrays=((ArraySpec((1, 2, None, 8), "float32"),) * 2,), epoch="t")


def payload(seed: int) -> BlockPayload:
    rng = np.random.default_rng(seed)
    arrays = tuple(Tensor(rng.standard_normal((1, 2, BS, 8)).astype(np.float32), "float32")
                   for _ in range(2))
    return BlockPayload({0: arrays})


def test_a_payload_put_by_this_process_is_a_block_payload():
    """The helper's payloads fit the layout the fetches are checked against."""
    assert LAYOUT.check(payload(0), BS, need_state=False) is None
    assert CapturedBlock("b", "root", payload(0)).nbytes == payload(0).nbytes
