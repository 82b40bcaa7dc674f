"""The tiered store without Ray: pending reads, tier order, leases across tiers."""

from __future__ import annotations

import threading
import time

import numpy as np

from serve_app.cache.hot import HotEntry
from serve_app.cache.ssd import SSDStore
from serve_app.cache.tiers import DiskInfo, TieredStore
from tests.test_ssd import LAYOUT, MODEL, bid

DISK = DiskInfo(MODEL, LAYOUT, 16, "ssd_sidecar", "fp32", {"k0": "float32"})


def entry(i: int, nbytes: int = 4096) -> HotEntry:
    payload = {"k0": np.full(nbytes // 4, i, dtype=np.float32)}
    return HotEntry(bid(i), bid(i - 1), nbytes, False, handle=(payload, {"k0": "float32"}),
                    model="m")


def wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_pending_blocks_are_readable_before_their_file_exists(tmp_path):
    ssd = SSDStore(tmp_path, 1 << 30)
    gate = threading.Event()
    real_write = ssd.write
    ssd.write = lambda *a, **k: gate.wait(10) and real_write(*a, **k)
    store = TieredStore(hot_budget=1000, ssd=ssd, pending_max_bytes=1 << 20)  # too small for hot
    store.put(entry(0), DISK)
    found = store.lookup([bid(0)], need_checkpoint=False, layout=LAYOUT)
    assert [s.tier for s in found["sources"]] == ["pending"]
    assert not ssd.block_path(bid(0)).exists()
    store.release(found["lease"])
    gate.set()
    wait(lambda: store.snapshot()["staging"]["pending_bytes"] == 0)
    found = store.lookup([bid(0)], need_checkpoint=False, layout=LAYOUT)
    assert [s.tier for s in found["sources"]] == ["ssd"]
    assert ssd.block_path(bid(0)).exists()
    store.release(found["lease"])
    assert not ssd._pins


def test_chain_spans_tiers_in_order(tmp_path):
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    for i in range(3):
        store.put(entry(i), DISK)
    wait(lambda: store.snapshot()["staging"]["pending_bytes"] == 0)
    store.hot.remove(bid(1))  # only on disk now
    found = store.lookup([bid(0), bid(1), bid(2), bid(3)], need_checkpoint=False, layout=LAYOUT)
    assert found["present"] == 3
    assert [s.tier for s in found["sources"]] == ["hot", "ssd", "hot"]
    assert store.hot.pinned_ids() == {bid(0), bid(2)} and set(ssd._pins) == {bid(1)}
    store.release(found["lease"])
    assert store.hot.pinned_ids() == set() and not ssd._pins
