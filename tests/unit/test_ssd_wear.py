"""The SSD write budget (wear) on real files, without Ray: writes over the hourly budget
are dropped whole, counted, and never evict or corrupt what is there."""

from __future__ import annotations

import shutil

import pytest

from serve_app.cache.ssd import SSDStore, WriteResult
from serve_app.cache.tiers import TieredStore
from serve_app.cache.wear import AUTO_FRACTION_PER_HOUR, RollingByteBudget, auto_write_budget
from serve_app.metrics.samples import store_samples
from serve_app.metrics.table import DROP_REASONS
from tests.support.blocks import DISK, LAYOUT, MODEL, bid, entry, meta, tensors
from tests.support.servers import wait_for


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def file_size(tmp_path) -> int:
    """Bytes of one test block file (what the budget is charged)."""
    probe = SSDStore(tmp_path / "probe", 1 << 30)
    probe.open()
    probe.write("block", bid(999), tensors(), meta())
    return probe.block_entry(bid(999)).nbytes


def test_writes_over_the_hourly_budget_are_dropped_and_counted(tmp_path):
    size = file_size(tmp_path)
    clock = Clock()
    s = SSDStore(tmp_path / "kv", 1 << 30, write_budget_per_hour=2 * size + size // 2,
                 clock=clock)
    s.open()
    assert s.write("block", bid(0), tensors(), meta())
    clock.now += 1800
    assert s.write("block", bid(1), tensors(), meta())
    clock.now += 1000
    assert s.write("block", bid(2), tensors(), meta()) is WriteResult.SKIPPED
    assert s.write("sidecar", bid(1), tensors(), meta()) is WriteResult.SKIPPED
    assert not s.has_block(bid(2)) and not s.block_path(bid(2)).exists()
    assert not s.has_sidecar(LAYOUT, bid(1))
    assert s.stats.writes_skipped_write_budget == 2
    assert s.stats.bytes_written == 2 * size
    files = sorted(p.name for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert files == sorted([f"{bid(0)}.safetensors", f"{bid(1)}.safetensors"])  # no temp file
    snap = s.snapshot()
    assert snap["write_budget_per_hour"] == 2 * size + size // 2
    assert snap["written_last_hour"] == 2 * size
    clock.now += 801  # the first write is now more than an hour old: room for one more
    assert s.write("block", bid(2), tensors(), meta())
    assert s.write("block", bid(3), tensors(), meta()) is WriteResult.SKIPPED
    clock.now += 1800  # and the second
    assert s.write("block", bid(3), tensors(), meta())
    again = SSDStore(tmp_path / "kv", 1 << 30)  # a restart: every indexed file is whole
    again.open()
    assert sorted(again.block_ids()) == sorted(bid(i) for i in range(4))
    for i in range(4):
        got, _ = again.read(again.block_entry(bid(i)), {"model": MODEL})
        assert (got["k0"] == tensors()["k0"]).all()


def test_a_dropped_write_evicts_nothing(tmp_path):
    size = file_size(tmp_path)
    clock = Clock()
    s = SSDStore(tmp_path / "kv", 2 * size, write_budget_per_hour=2 * size, clock=clock)
    s.open()
    assert s.write("block", bid(0), tensors(), meta())
    assert s.write("block", bid(1), tensors(), meta())  # the SSD budget is full now
    assert s.write("block", bid(2), tensors(), meta()) is WriteResult.SKIPPED
    assert s.has_block(bid(0)) and s.has_block(bid(1)) and s.stats.evictions == 0


def test_bytes_of_a_write_that_failed_are_given_back(tmp_path):
    size = file_size(tmp_path)
    s = SSDStore(tmp_path / "kv", 1 << 30, min_free_bytes=1 << 62,
                 write_budget_per_hour=size)
    s.open()
    assert s.write("block", bid(0), tensors(), meta()) is WriteResult.SKIPPED  # free-space
    assert s.stats.writes_skipped_low_space == 1
    assert s.stats.writes_skipped_write_budget == 0
    assert s.write_budget is not None and s.write_budget.used() == 0


def test_no_budget_means_no_limit(tmp_path):
    s = SSDStore(tmp_path / "kv", 1 << 30)
    s.open()
    for i in range(5):
        assert s.write("block", bid(i), tensors(), meta())
    assert s.write_budget is None and s.snapshot()["written_last_hour"] is None


def test_tiered_store_counts_the_drops_and_exports_them(tmp_path):
    """Staged blocks that meet a spent budget are dropped by reason ``ssd_write_budget``
    (``/v1/stats`` and the dropped-blocks metric), and the written bytes are exported."""
    ssd = SSDStore(tmp_path / "kv", 1 << 30, write_budget_per_hour=6000)
    # The store opens (indexes) its SSD tier itself; opened here too, the store's second
    # open could run while the first write was under way and remove its temporary file
    # (crash leftovers go at open): that write failed and the next one fit the budget.
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    for i in range(4):  # files of ~4.2 KB: one fits the budget
        store.put(entry(i), DISK)
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0,
                 "the staged blocks to reach SSD", interval=0.01)
    stats = store.stats()
    assert stats.dropped_ssd_write_budget == 3 and stats.writes_dropped == 3
    assert stats.ssd_written_bytes == ssd.stats.bytes_written > 0
    snap = store.snapshot()
    assert snap["dropped"]["ssd_write_budget"] == 3
    assert snap["staging"]["writes_dropped"] == 3 and snap["staging"]["writes_done"] == 1
    assert all(bid(i) in store.hot for i in range(4))  # still served from RAM
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for s in store_samples(stats, {MODEL[:16]: "m"})}
    assert "ssd_write_budget" in DROP_REASONS
    assert samples[("serve_app_cache_dropped_blocks", (("reason", "ssd_write_budget"),))] == 3
    assert samples[("serve_app_cache_ssd_written_bytes", ())] == stats.ssd_written_bytes
    assert samples[("serve_app_cache_ssd_write_budget_bytes", ())] == 6000


def test_rolling_budget_slides_and_gives_back():
    clock = Clock()
    budget = RollingByteBudget(100, window_s=60, clock=clock)
    assert budget.try_take(60)
    clock.now += 0.5  # the same second: one entry
    assert budget.try_take(40) and not budget.try_take(1)
    budget.give_back(30)
    assert budget.used() == 70 and budget.try_take(30)
    clock.now += 61
    assert budget.used() == 0 and budget.try_take(100)
    assert not RollingByteBudget(100).try_take(101)  # more than the whole budget never fits


def test_auto_write_budget_is_two_percent_of_the_volume_an_hour(tmp_path):
    total = shutil.disk_usage(tmp_path).total
    got = auto_write_budget(tmp_path / "not" / "made" / "yet")
    assert got == max(int(total * AUTO_FRACTION_PER_HOUR), 1 << 30)
    assert AUTO_FRACTION_PER_HOUR == pytest.approx(0.0205, abs=0.0005)
