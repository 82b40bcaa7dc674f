"""Demoting an unloaded model's blocks (no Ray): those the SSD tier holds, with what a
restore needs, leave RAM without counting as evictions; everything else stays hot, and
a lookup still finds the demoted blocks on SSD."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve_app.cache.hot import HotEntry
from serve_app.cache.match import MatchQuery, StateAt, Tier
from serve_app.cache.payload import BlockPayload, Tensor
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import DiskInfo
from serve_app.cache.tiers import TieredStore
from tests.support.blocks import LAYOUT, MODEL, bid
from tests.support.servers import wait_for

EXACT = DiskInfo(MODEL, LAYOUT, 16, "ssd_sidecar", "fp32")
NBYTES = 4096


def block(i: int, model: str = "x", checkpoint: bool = False) -> HotEntry:
    half = Tensor(np.full(NBYTES // 8, i, dtype=np.float32), "float32")
    state = {1: (Tensor(np.arange(8, dtype=np.float32), "float32"),)} if checkpoint else {}
    return HotEntry(bid(i), bid(i - 1), NBYTES, checkpoint,
                    handle=BlockPayload({0: (half, half)}, state), model=model)


def tiered(tmp_path) -> TieredStore:
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    wait_for(ssd.ready.is_set, "the SSD index", interval=0.01)
    return store


def written(store: TieredStore) -> None:
    """Wait until the SSD writer has taken every staged block."""
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0,
             "the staged blocks to reach SSD", interval=0.01)


def lookup(store: TieredStore, ids: list[str], need_state: bool = False):
    found = store.match(MatchQuery(ids, need_state=need_state, layout=LAYOUT))
    store.release(found.lease)
    return found


def test_a_models_blocks_on_ssd_leave_ram_and_another_models_stay(tmp_path):
    store = tiered(tmp_path)
    for i, model in enumerate(["x", "x", "y"]):
        assert store.put(block(i, model), EXACT)
    written(store)
    assert store.hot.bytes == 3 * NBYTES
    assert store.demote("x", LAYOUT, wait_s=5.0) == (2, 2 * NBYTES)
    assert store.hot.bytes == NBYTES and store.hot.ids() == [bid(2)]
    assert store.hot.stats.evictions == 0 and store.hot.stats.evicted_bytes == 0
    assert not store.hot.was_evicted(bid(0))  # a miss there is no eviction either
    assert store.hot.stats.by_model["x"] == {"blocks": 0, "bytes": 0, "evictions": 0}
    assert store.hot.stats.by_model["y"]["blocks"] == 1
    assert all(store.ssd.has_block(bid(i)) for i in range(3))
    staging = store.snapshot()["staging"]
    assert (staging["demoted_blocks"], staging["demoted_bytes"]) == (2, 2 * NBYTES)
    assert store.demote("x", LAYOUT, wait_s=5.0) == (0, 0)  # nothing left to take out
    assert store.stats().staging.demoted_blocks == 2


def test_a_demoted_block_is_still_found_on_the_ssd_tier(tmp_path):
    store = tiered(tmp_path)
    for i in range(2):
        store.put(block(i), EXACT)
    written(store)
    assert [s.tier for s in lookup(store, [bid(0), bid(1)]).sources] == [Tier.HOT, Tier.HOT]
    store.demote("x", LAYOUT, wait_s=5.0)
    found = lookup(store, [bid(0), bid(1)])
    assert found.ids == [bid(0), bid(1)] and found.present == 2
    assert [s.tier for s in found.sources] == [Tier.SSD, Tier.SSD]
    assert not store.ssd._pins  # the lease went back


def test_a_pinned_block_stays(tmp_path):
    """A block a restore is reading (pinned by its lookup's lease) is not taken out."""
    store = tiered(tmp_path)
    for i in range(2):
        store.put(block(i), EXACT)
    written(store)
    found = store.match(MatchQuery([bid(0)], layout=LAYOUT))
    assert store.hot.pinned_ids() == {bid(0)}
    assert store.demote("x", LAYOUT, wait_s=5.0) == (1, NBYTES)
    assert store.hot.ids() == [bid(0)]
    store.release(found.lease)
    assert store.demote("x", LAYOUT, wait_s=5.0) == (1, NBYTES)
    assert len(store.hot) == 0 and store.staging.demoted_blocks == 2


def test_a_block_the_ssd_tier_does_not_hold_stays(tmp_path):
    store = tiered(tmp_path)
    store.put(block(0), None)  # no disk info: never written
    assert store.demote("x", LAYOUT, wait_s=0.1) == (0, 0)
    assert store.hot.ids() == [bid(0)] and not store.ssd.has_block(bid(0))


def test_demote_waits_for_the_models_staged_writes(tmp_path):
    """A block still staged when the model unloads: demote waits (up to ``wait_s``) for
    its write, and keeps it hot when the write is slower than that."""
    store = tiered(tmp_path)
    ssd = store.ssd
    gate = threading.Event()
    real_write = ssd.write
    ssd.write = lambda *a, **k: gate.wait(10) and real_write(*a, **k)
    store.put(block(0), EXACT)
    assert store.demote("x", LAYOUT, wait_s=0.1) == (0, 0)  # staged, not on SSD yet
    assert store.hot.ids() == [bid(0)]
    opener = threading.Timer(0.2, gate.set)
    opener.start()
    try:
        assert store.demote("x", LAYOUT, wait_s=10.0) == (1, NBYTES)
    finally:
        opener.cancel()
        gate.set()
    assert len(store.hot) == 0 and ssd.has_block(bid(0))


@pytest.mark.parametrize("storage,codec,layout,leaves", [
    ("ssd_sidecar", "fp32", LAYOUT, True),  # an exact sidecar for this layout
    ("embedded", "fp32", "other" * 8, True),  # the state is in the block file itself
    ("ssd_sidecar", "bf16", LAYOUT, False),  # only a lossy sidecar
    ("ssd_sidecar", "fp32", "other" * 8, False),  # an exact one, but for another layout
], ids=["exact-sidecar", "embedded", "lossy-sidecar", "other-layout"])
def test_a_checkpoint_block_leaves_only_with_its_exact_state_on_ssd(tmp_path, storage, codec,
                                                                    layout, leaves):
    store = tiered(tmp_path)
    disk = DiskInfo(MODEL, LAYOUT, 16, storage, codec)
    store.put(block(0, checkpoint=True), disk)
    store.put(block(1), disk)  # no checkpoint: on SSD is enough
    written(store)
    assert store.ssd.has_block(bid(0))
    assert (store.ssd.sidecar_entry(LAYOUT, bid(0)) is not None) is (storage == "ssd_sidecar")
    blocks, _ = store.demote("x", layout, wait_s=5.0)
    assert blocks == (2 if leaves else 1)
    assert (bid(0) in store.hot) is not leaves and bid(1) not in store.hot
    if leaves:  # a hybrid lookup restores it from SSD
        (source,) = lookup(store, [bid(0)], need_state=True).sources
        assert source.tier == Tier.SSD
        assert source.state == (StateAt.SIDECAR if storage == "ssd_sidecar"
                                else StateAt.EMBEDDED)


def test_without_an_ssd_tier_demote_keeps_everything():
    store = TieredStore(hot_budget=1 << 20)
    for i in range(2):
        assert store.put(block(i), EXACT)
    assert store.demote("x", LAYOUT, wait_s=5.0) == (0, 0)
    assert store.hot.ids() == [bid(0), bid(1)] and store.hot.bytes == 2 * NBYTES
    assert store.staging.demoted_blocks == 0 and store.staging.demoted_bytes == 0
