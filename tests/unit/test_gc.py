"""``python -m serve_app gc --apply`` deletes through the store, under its lock, and
leaves its index matching the files on disk; no MLX needed."""

from __future__ import annotations

import numpy as np

from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_fs import TMP_MARK
from tests.unit.test_ssd import bid, meta, tensors


def populate(root) -> SSDStore:
    s = SSDStore(root, 1 << 30)
    s.open()
    for i in range(4):
        s.write("block", bid(i), tensors(), meta())
        s.write("sidecar", bid(i), {"s": np.zeros(8, np.float32)}, meta())
    s.write("sidecar", bid(99), {"s": np.zeros(8, np.float32)}, meta())  # orphan
    tmp = s.block_path(bid(7)).with_name(f"x.safetensors{TMP_MARK}1-1")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"partial")
    return s


def files(root) -> set[str]:
    return {p.name for p in root.rglob("*") if p.is_file() and p.name != "LOCK"}


def test_apply_deletes_under_the_store_lock_and_keeps_its_index(tmp_path):
    """``--apply`` deletes through the store (``SSDStore.remove_path``): each deletion
    waits for the store's lock (held here by another thread, as a writer would) and
    leaves the index and byte count matching the files on disk."""
    import threading
    import time

    from serve_app.cli import gc as gc_module

    populate(tmp_path)
    s = SSDStore(tmp_path, 10_000)
    s.open(clean=False)
    doomed = gc_module.plan(s, budget_given=True)
    assert {d.why for d in doomed} == {"temp_file", "orphan", "over_budget"}
    held = threading.Event()

    def writer() -> None:
        with s._lock:
            held.set()
            time.sleep(0.5)

    t = threading.Thread(target=writer)
    t.start()
    held.wait(5)
    tic = time.monotonic()
    out = gc_module.apply(s, doomed)
    assert time.monotonic() - tic >= 0.4  # it waited for the lock
    t.join()
    assert set(out["files"]) == {str(d.path) for d in doomed}
    assert s.orphans() == []
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert s.bytes_used() == on_disk == out["bytes_left"] <= 10_000
    assert all(s.block_entry(b) is None or s.block_entry(b).path.exists() for b in s.block_ids())
