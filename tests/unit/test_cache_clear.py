"""A model's cache clear (the status page's button, ``POST /admin/models/{name}/cache/clear``)
on a real SSD directory, without Ray: the model's blocks leave RAM (by its name) and disk
(by its identity), files and all; another model's stay; a block or file a restore holds
right now stays and is counted; the counts add up over nodes."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from serve_app.cache.hot import HotEntry
from serve_app.cache.match import MatchQuery
from serve_app.cache.payload import BlockPayload, Tensor
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import DiskInfo
from serve_app.cache.stats import Cleared, Usage
from serve_app.cache.tiers import TieredStore
from tests.support.blocks import LAYOUT
from tests.support.servers import wait_for

A, B = "org/model-a.v1", "org/model-b.v1"  # names: how the hot tier knows a block's model
IDENTITY = {A: hashlib.sha256(b"identity a").hexdigest(),  # what the SSD tier knows
            B: hashlib.sha256(b"identity b").hexdigest()}
HOT_BYTES = 4096


def bid(model: str, i: int) -> str:
    return hashlib.sha256(f"{model} block {i}".encode()).hexdigest()


def chain(model: str, n: int) -> list[str]:
    return [bid(model, i) for i in range(n)]


def entry(model: str, i: int) -> HotEntry:
    half = Tensor(np.full(HOT_BYTES // 8, i, dtype=np.float32), "float32")
    parent = bid(model, i - 1) if i else ""
    return HotEntry(bid(model, i), parent, HOT_BYTES, False,
                    handle=BlockPayload({0: (half, half)}), model=model)


def disk(model: str) -> DiskInfo:
    return DiskInfo(IDENTITY[model], LAYOUT, 16, "ssd_sidecar", "fp32")


def files_on_disk(root: Path) -> set[str]:
    return {p.stem for p in root.rglob("*.safetensors")}


def sidecar(ssd: SSDStore, model: str, block_id: str) -> None:
    """A sidecar file (a recurrent checkpoint) for ``block_id``, written straight to disk."""
    assert ssd.write("sidecar", block_id, {"s1.0": np.zeros(64, np.float32)},
                     {"model": IDENTITY[model], "layout": LAYOUT, "parent_id": "",
                      "block_size": "16", "tokens": "16", "codec": "fp32"})


@pytest.fixture
def stores(tmp_path):
    """A tiered store over a real SSD directory, holding four blocks of A and three of B in
    both tiers (written through the write-behind thread)."""
    ssd = SSDStore(tmp_path / "kv", 1 << 30)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    wait_for(ssd.ready.is_set, "the SSD index", interval=0.01)
    for model, n in ((A, 4), (B, 3)):
        for i in range(n):
            assert store.put(entry(model, i), disk(model))
    wait_for(lambda: store.snapshot()["staging"]["pending_bytes"] == 0,
             "the staged blocks to reach SSD", interval=0.01)
    assert all(ssd.has_block(b) for b in chain(A, 4) + chain(B, 3))
    return store, ssd


def lookup(store: TieredStore, model: str, n: int) -> tuple[int, list[str]]:
    """(full blocks found, their tiers), the lease released."""
    found = store.match(MatchQuery(chain(model, n), need_state=False, layout=LAYOUT))
    store.release(found.lease)
    return found.present, [s.tier for s in found.sources]


def test_clear_removes_the_models_blocks_from_ram_and_disk_and_leaves_the_others(stores,
                                                                                   tmp_path):
    store, ssd = stores
    a_files = {b: ssd.block_entry(b).nbytes for b in chain(A, 4)}
    b_disk = {b: ssd.block_entry(b).path for b in chain(B, 3)}
    root = tmp_path / "kv"
    assert set(chain(A, 4)) <= files_on_disk(root)
    evictions = store.hot.stats.evictions

    cleared = store.clear(A, frozenset({IDENTITY[A]}), wait_s=5.0)

    assert cleared == Cleared(hot_blocks=4, hot_bytes=4 * HOT_BYTES, ssd_files=4,
                              ssd_bytes=sum(a_files.values()), kept_in_use=0)
    # RAM: A's gone (not as evictions), B's all there.
    assert not any(b in store.hot for b in chain(A, 4))
    assert all(b in store.hot for b in chain(B, 3))
    assert store.hot.stats.evictions == evictions
    hot = store.stats().hot_by_model
    assert (hot[A].blocks, hot[A].block_bytes, hot[A].evictions) == (0, 0, 0)
    assert (hot[B].blocks, hot[B].block_bytes) == (3, 3 * HOT_BYTES)
    # Disk: A's files gone from the directory and the index, B's untouched.
    assert files_on_disk(root) == set(chain(B, 3))
    assert not any(ssd.has_block(b) for b in chain(A, 4))
    assert all(p.exists() for p in b_disk.values())
    usage = ssd.usage()
    assert usage[IDENTITY[A][:16]] == Usage()
    assert (usage[IDENTITY[B][:16]].blocks, usage[IDENTITY[B][:16]].sidecars) == (3, 0)
    assert ssd.bytes_used() == sum(ssd.block_entry(b).nbytes for b in chain(B, 3))
    # A lookup of A's chain finds nothing in any tier; B's still matches in full.
    assert lookup(store, A, 4) == (0, [])
    assert lookup(store, B, 3) == (3, ["hot", "hot", "hot"])
    # Cleared again: nothing left to take.
    assert store.clear(A, frozenset({IDENTITY[A]}), wait_s=1.0) == Cleared()


def test_clear_by_name_in_ram_and_by_identity_on_disk(stores):
    """RAM knows blocks by the model's name, disk by its identity (every rank's for a
    sharded model): an identity not given leaves its files, a name not given its blocks."""
    store, ssd = stores
    cleared = store.clear(A, frozenset({IDENTITY[B]}), wait_s=1.0)
    assert (cleared.hot_blocks, cleared.ssd_files) == (4, 3)
    assert all(ssd.has_block(b) for b in chain(A, 4))
    assert not any(ssd.has_block(b) for b in chain(B, 3))
    assert all(b in store.hot for b in chain(B, 3))
    assert lookup(store, A, 4) == (4, ["ssd"] * 4)  # A's files remain: restorable
    assert lookup(store, B, 3) == (3, ["hot"] * 3)


def test_a_block_or_file_a_restore_holds_stays_and_is_counted(stores, tmp_path):
    """A restore under way (a lookup's lease on a hot block, an SSD pin on a file) is never
    pulled out from under it: those stay, counted in ``kept_in_use``; the rest goes."""
    store, ssd = stores
    a0, a1, a2, a3 = chain(A, 4)
    leased = store.match(MatchQuery([a0], need_state=False, layout=LAYOUT))
    assert [s.tier for s in leased.sources] == ["hot"] and store.hot.entry(a0).pins == 1
    ssd.pin([a2])
    sizes = {b: ssd.block_entry(b).nbytes for b in (a0, a1, a3)}

    cleared = store.clear(A, frozenset({IDENTITY[A]}), wait_s=1.0)

    # Hot: a1, a2, a3 out, a0 kept; disk: a0, a1, a3 out, a2 kept.
    assert cleared == Cleared(hot_blocks=3, hot_bytes=3 * HOT_BYTES, ssd_files=3,
                              ssd_bytes=sum(sizes.values()), kept_in_use=2)
    assert a0 in store.hot and not any(b in store.hot for b in (a1, a2, a3))
    assert ssd.has_block(a2) and ssd.block_path(a2).exists()
    assert files_on_disk(tmp_path / "kv") == {a2, *chain(B, 3)}
    # Once the restore ends, the next clear takes what it held.
    store.release(leased.lease)
    ssd.unpin([a2])
    assert store.hot.entry(a0).pins == 0
    again = store.clear(A, frozenset({IDENTITY[A]}), wait_s=1.0)
    assert (again.hot_blocks, again.ssd_files, again.kept_in_use) == (1, 1, 0)
    assert files_on_disk(tmp_path / "kv") == set(chain(B, 3))
    assert lookup(store, A, 4) == (0, [])


def test_clear_removes_sidecars_with_their_blocks_and_alone(stores, tmp_path):
    """A block's sidecar goes with it, a sidecar without its block (orphan) too: nothing of
    A's is left on disk and its usage is zero; B's sidecar stays."""
    store, ssd = stores
    a1 = bid(A, 1)
    sidecar(ssd, A, a1)
    sidecar(ssd, A, bid(A, 9))  # no block 9: a sidecar alone
    sidecar(ssd, B, bid(B, 0))
    paths = [ssd.sidecar_path(LAYOUT, a1), ssd.sidecar_path(LAYOUT, bid(A, 9))]
    assert all(p.exists() for p in paths)
    assert ssd.usage()[IDENTITY[A][:16]].sidecars == 2

    store.clear(A, frozenset({IDENTITY[A]}), wait_s=1.0)

    assert not any(p.exists() for p in paths)
    assert not ssd.has_sidecar(LAYOUT, a1) and not ssd.has_sidecar(LAYOUT, bid(A, 9))
    assert ssd.usage()[IDENTITY[A][:16]] == Usage()
    assert files_on_disk(tmp_path / "kv") == set(chain(B, 3))  # B's sidecar: same stem
    assert ssd.has_sidecar(LAYOUT, bid(B, 0))
    assert ssd.sidecar_path(LAYOUT, bid(B, 0)).exists()
    assert ssd.usage()[IDENTITY[B][:16]].sidecars == 1


def test_clear_counts_a_sidecar_deleted_with_its_block(tmp_path):
    """``Cleared.ssd_files`` counts blocks and sidecars: a block with its sidecar is two
    files, and their bytes are both counted."""
    ssd = SSDStore(tmp_path / "kv", 1 << 30)
    ssd.open()
    block = bid(A, 0)
    assert ssd.write("block", block, {"k0": np.arange(256, dtype=np.float32)},
                     {"model": IDENTITY[A], "layout": LAYOUT, "parent_id": "",
                      "block_size": "16", "tokens": "16"})
    sidecar(ssd, A, block)
    nbytes = ssd.block_entry(block).nbytes + ssd.sidecar_entry(LAYOUT, block).nbytes
    assert ssd.remove_model(frozenset({IDENTITY[A]})) == (2, nbytes, 0)


def test_remove_model_keeps_a_pinned_block_with_its_sidecar(tmp_path):
    """A pinned block's sidecar is pinned with it (pins are by block id): both stay, each
    counted as kept; the unpinned block of the same model goes."""
    ssd = SSDStore(tmp_path / "kv", 1 << 30)
    ssd.open()
    meta = {"model": IDENTITY[A], "layout": LAYOUT, "parent_id": "", "block_size": "16",
            "tokens": "16"}
    for i in range(2):
        assert ssd.write("block", bid(A, i), {"k0": np.arange(64, dtype=np.float32)}, meta)
    sidecar(ssd, A, bid(A, 0))
    ssd.pin([bid(A, 0)])
    gone = ssd.block_entry(bid(A, 1)).nbytes
    assert ssd.remove_model(frozenset({IDENTITY[A]})) == (1, gone, 2)
    assert ssd.has_block(bid(A, 0)) and ssd.has_sidecar(LAYOUT, bid(A, 0))
    assert files_on_disk(tmp_path / "kv") == {bid(A, 0)}
    assert ssd.remove_model(frozenset({IDENTITY[B]})) == (0, 0, 0)


def test_clear_waits_for_the_models_staged_writes(tmp_path):
    """A block still on its way to disk when the clear comes lands first, then goes: no
    file of the model appears after the clear."""
    ssd = SSDStore(tmp_path / "kv", 1 << 30)
    gate = threading.Event()
    real_write = ssd.write
    ssd.write = lambda *a, **k: gate.wait(10) and real_write(*a, **k)
    store = TieredStore(hot_budget=1 << 20, ssd=ssd, pending_max_bytes=1 << 20)
    wait_for(ssd.ready.is_set, "the SSD index", interval=0.01)
    store.put(entry(A, 0), disk(A))
    waiting = threading.Event()
    real_wait_staged = store._wait_staged

    def wait_staged(model: str, wait_s: float) -> None:
        waiting.set()
        real_wait_staged(model, wait_s)

    store._wait_staged = wait_staged
    out: list[Cleared] = []
    clearing = threading.Thread(target=lambda: out.append(
        store.clear(A, frozenset({IDENTITY[A]}), wait_s=60.0)))
    clearing.start()
    assert waiting.wait(10), "clear never waited for the staged write"
    assert not out and not ssd.block_path(bid(A, 0)).exists()
    gate.set()
    clearing.join(10)
    assert not clearing.is_alive()
    (cleared,) = out
    assert (cleared.hot_blocks, cleared.ssd_files, cleared.kept_in_use) == (1, 1, 0)
    assert not ssd.block_path(bid(A, 0)).exists() and not ssd.has_block(bid(A, 0))


def test_cleared_adds_up_field_by_field():
    """The ingress sums every node's ``Cleared``."""
    one = Cleared(hot_blocks=1, hot_bytes=10, ssd_files=2, ssd_bytes=200, kept_in_use=3)
    two = Cleared(hot_blocks=4, hot_bytes=40, ssd_files=5, ssd_bytes=500, kept_in_use=6)
    assert one + two == Cleared(5, 50, 7, 700, 9)
    assert one + Cleared() == one
    assert sum([one, two], Cleared()) == Cleared(5, 50, 7, 700, 9)
