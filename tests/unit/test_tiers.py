"""The tiered store without Ray: pending reads, tier order, leases across tiers, races."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve_app.cache.match import Drop, MatchQuery, StateAt
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import SSDError, digest_of, read_file
from serve_app.cache.tiers import GONE, TieredStore
from tests.support.blocks import DISK, LAYOUT, bid, entry, meta, tensors
from tests.support.servers import wait_for


def test_pending_blocks_are_readable_before_their_file_exists(tmp_path):
    ssd = SSDStore(tmp_path, 1 << 30)
    gate = threading.Event()
    real_write = ssd.write
    ssd.write = lambda *a, **k: gate.wait(10) and real_write(*a, **k)
    store = TieredStore(hot_budget=1000, ssd=ssd, pending_max_bytes=1 << 20)  # too small for hot
    store.put(entry(0), DISK)
    found = store.match(MatchQuery([bid(0)], need_state=False, layout=LAYOUT))
    assert [s.tier for s in found.sources] == ["pending"]
    assert not ssd.block_path(bid(0)).exists()
    store.release(found.lease)
    gate.set()
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0,
                 "the staged blocks to reach SSD", interval=0.01)
    found = store.match(MatchQuery([bid(0)], need_state=False, layout=LAYOUT))
    assert [s.tier for s in found.sources] == ["ssd"]
    assert ssd.block_path(bid(0)).exists()
    store.release(found.lease)
    assert not ssd._pins


def test_chain_spans_tiers_in_order(tmp_path):
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    for i in range(3):
        store.put(entry(i), DISK)
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0,
                 "the staged blocks to reach SSD", interval=0.01)
    store.hot.remove(bid(1))  # only on disk now
    found = store.match(MatchQuery([bid(i) for i in range(4)], layout=LAYOUT))
    assert found.present == 3
    assert [s.tier for s in found.sources] == ["hot", "ssd", "hot"]
    assert store.hot.pinned_ids() == {bid(0), bid(2)} and set(ssd._pins) == {bid(1)}
    store.release(found.lease)
    assert store.hot.pinned_ids() == set() and not ssd._pins


def embedded_on_disk(tmp_path) -> SSDStore:
    """A block file carrying its recurrent checkpoint (``embedded``), and nothing else."""
    ssd = SSDStore(tmp_path, 1 << 30)
    state = {"s1.0": np.zeros(4, np.float32)}
    assert ssd.write("block", bid(0), {**tensors(), **state},
                     {**meta(), "checkpoint": "embedded"})
    return ssd


class EvictingStore(TieredStore):
    """Injects the race: the SSD writer thread evicts the block right after every index
    check of its checkpoint (each check still sees it). For real this needs a thread
    switch at exactly that point, which a test cannot force."""

    victim = None

    def _embedded_state(self, bid: str) -> bool:
        if self.ssd.block_entry(bid) is None:
            with self.ssd._lock:
                self.ssd._index(self.victim)
        embedded = super()._embedded_state(bid)
        self.ssd.remove(self.ssd.block_entry(bid))  # file and index entry gone
        return embedded


@pytest.mark.parametrize("tier", ["ssd", "hot"])
def test_lookup_racing_an_eviction_is_a_clean_miss(tmp_path, tier):
    """The block file holding the checkpoint vanishes mid-lookup: the lookup hands out the
    file it saw (or, when it never saw one, a path and a token matching nothing); reading
    it misses cleanly. It used to raise AttributeError on the vanished entry's path."""
    ssd = embedded_on_disk(tmp_path)
    store = EvictingStore(hot_budget=1 << 20, ssd=ssd)
    wait_for(ssd.ready.is_set, "the SSD index", interval=0.01)
    store.victim = ssd.block_entry(bid(0))
    if tier == "hot":  # the block is hot too, without its checkpoint
        store.put(entry(0), None)
    found = store.match(MatchQuery([bid(0)], need_state=True, layout=LAYOUT))
    (source,) = found.sources
    assert (source.tier, source.state) == ("ssd", StateAt.EMBEDDED)
    assert source.file_digest == (digest_of(store.victim) if tier == "ssd" else GONE)
    with pytest.raises(SSDError):
        read_file(source.handle, {})
    store.drop(Drop.BLOCK, LAYOUT, bid(0), source.file_digest)  # what the replica does next
    store.release(found.lease)
    assert not ssd._pins


def test_drop_removes_only_the_file_the_reader_saw(tmp_path):
    """A replica drops a bad file by the digest its lookup saw; a file rewritten since under
    the same name stays (a stale drop used to delete the fresh file)."""
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd)
    wait_for(ssd.ready.is_set, "the SSD index", interval=0.01)
    ssd.write("block", bid(0), tensors(), meta())
    found = store.match(MatchQuery([bid(0)], need_state=False, layout=LAYOUT))
    old = found.sources[0].file_digest
    store.release(found.lease)
    ssd.write("block", bid(0), tensors(), meta())  # rewritten: a new file, a new digest
    new = digest_of(ssd.block_entry(bid(0)))
    assert new != old
    store.drop(Drop.BLOCK, LAYOUT, bid(0), old)
    assert ssd.has_block(bid(0)) and ssd.block_path(bid(0)).exists()
    assert digest_of(ssd.block_entry(bid(0))) == new
    store.drop(Drop.BLOCK, LAYOUT, bid(0), new)
    assert not ssd.has_block(bid(0)) and not ssd.block_path(bid(0)).exists()


def test_a_block_no_tier_keeps_is_counted_as_dropped(tmp_path):
    store = TieredStore(hot_budget=1000)  # no SSD tier, and too small for the block
    assert not store.put(entry(0), DISK)
    assert store.snapshot()["dropped"]["hot_full"] == 1
    assert store.put(entry(1, 512), DISK)
    low = TieredStore(hot_budget=1 << 20, ssd=SSDStore(tmp_path, 1 << 30, 1 << 62))
    assert low.put(entry(0), DISK)  # hot keeps it; the SSD write is skipped (no free space)
    wait_for(lambda: low.snapshot()["staging"]["pending_bytes"] == 0,
                 "the staged blocks to reach SSD", interval=0.01)
    snap = low.snapshot()
    assert snap["dropped"]["ssd_low_space"] == 1 == snap["staging"]["writes_dropped"]
