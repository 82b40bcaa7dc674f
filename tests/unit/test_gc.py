"""``python -m serve_app gc --apply`` deletes through the store, under its lock, and
leaves its index matching the files on disk; no MLX needed."""

from __future__ import annotations

import os
from unittest import mock

import numpy as np

from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_fs import TMP_MARK
from tests.support.blocks import bid, meta, tensors


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
    """``--apply`` deletes through the store (``SSDStore.remove_path``): every file goes
    while this thread holds the store's lock (as a writer would wait for it), and the
    index and byte count match the files on disk after."""
    from serve_app.cli import gc as gc_module

    populate(tmp_path)
    s = SSDStore(tmp_path, 10_000)
    s.open(clean=False)
    doomed = gc_module.plan(s, budget_given=True)
    assert {d.why for d in doomed} == {"temp_file", "orphan", "over_budget"}
    locked_at_unlink: list[bool] = []
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        locked_at_unlink.append(s._lock._is_owned())
        return real_unlink(path, *args, **kwargs)

    with mock.patch("os.unlink", unlink):
        out = gc_module.apply(s, doomed)
    assert len(locked_at_unlink) >= len(doomed) and all(locked_at_unlink), locked_at_unlink
    assert set(out["files"]) == {str(d.path) for d in doomed}
    assert s.orphans() == []
    on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
    assert s.bytes_used() == on_disk == out["bytes_left"] <= 10_000
    assert all(s.block_entry(b) is None or s.block_entry(b).path.exists() for b in s.block_ids())
