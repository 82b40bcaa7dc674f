"""``python -m serve_app gc --apply`` deletes through the store, under its lock, and
leaves its index matching the files on disk; no MLX needed."""

from __future__ import annotations

import os
from unittest import mock

from serve_app.cache.ssd import SSDStore
from tests.support.ssd_dirs import populate


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
