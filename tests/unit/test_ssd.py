"""The SSD tier on real files: atomic writes, index rebuild, budget, safety, races."""

from __future__ import annotations

import hashlib
import os
import stat
import threading

import numpy as np
import pytest

import serve_app.cache.ssd as ssd_module
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import SSDError, digest_of, read_header
from serve_app.cache.ssd_fs import FORMAT_VERSION, TMP_MARK
from tests.support.blocks import LAYOUT, MODEL, bid, meta, tensors


def store(tmp_path, budget: int = 1 << 30, **kw) -> SSDStore:
    s = SSDStore(tmp_path / "kv", budget, **kw)
    s.open()
    return s


def test_write_read_and_rebuild_from_headers(tmp_path):
    s = store(tmp_path)
    assert s.write("block", bid(0), tensors(), meta())
    assert s.write("sidecar", bid(0), {"s1.0": np.zeros(4, np.float32)},
                   {**meta(), "codec": "fp32"})
    entry = s.block_entry(bid(0))
    got, m = s.read(entry, {"model": MODEL})
    np.testing.assert_array_equal(got["k0"], tensors()["k0"])
    assert m["format_version"] == FORMAT_VERSION and m["block_id"] == bid(0)
    again = store(tmp_path)  # a restart: index from headers only
    assert again.has_block(bid(0)) and again.has_sidecar(LAYOUT, bid(0))
    assert again.snapshot()["blocks"] == 1 and again.snapshot()["sidecars"] == 1


def test_restart_removes_temp_files_and_ignores_other_versions(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    path = s.block_path(bid(1))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + TMP_MARK + "123-1")
    partial.write_bytes(b"half a file")
    from safetensors.numpy import save_file
    s.block_path(bid(2)).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors(), str(s.block_path(bid(2))),
              metadata={**meta(), "format_version": "0", "kind": "block", "block_id": bid(2)})
    again = store(tmp_path)
    assert not partial.exists()
    assert again.stats.temp_files_removed == 1
    assert not again.has_block(bid(2)) and again.stats.foreign_files == 1
    assert again.has_block(bid(0))


def test_corrupt_file_is_rejected_and_removed(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    entry = s.block_entry(bid(0))
    data = bytearray(entry.path.read_bytes())
    data[20:40] = b"x" * 20  # breaks the JSON header
    entry.path.write_bytes(bytes(data))
    with pytest.raises(SSDError):
        s.read(entry, {"model": MODEL})
    assert not s.has_block(bid(0)) and not entry.path.exists()
    assert s.stats.read_failures == 1


def test_metadata_mismatch_is_rejected(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    with pytest.raises(SSDError, match="model"):
        s.read(s.block_entry(bid(0)), {"model": "another"})


def test_budget_evicts_lru_and_other_models_first(tmp_path):
    s = store(tmp_path, budget=4 * 2000)
    s.active = {(MODEL, LAYOUT)}
    s.write("block", bid(100), tensors(), meta(model="f" * 64))  # a model nobody serves
    for i in range(3):
        s.write("block", bid(i), tensors(), meta())
    size = s.block_entry(bid(0)).nbytes
    s.budget_bytes = 4 * size
    s.touch(s.block_entry(bid(0)))
    s.write("block", bid(3), tensors(), meta())
    assert not s.has_block(bid(100))  # the foreign model went first
    s.write("block", bid(4), tensors(), meta())
    assert not s.has_block(bid(1)) and s.has_block(bid(0))  # then least recently used
    assert s.bytes_used() <= s.budget_bytes
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").rglob("*.safetensors"))
    assert on_disk == s.bytes_used()


def test_pinned_files_survive_eviction(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    s.budget_bytes = s.block_entry(bid(0)).nbytes
    s.pin([bid(0)])
    s.write("block", bid(1), tensors(), meta())
    assert s.has_block(bid(0))
    s.unpin([bid(0)])
    s.enforce_budget()
    assert s.bytes_used() <= s.budget_bytes


def test_removing_a_block_removes_its_sidecar_and_orphans_are_found(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    s.write("sidecar", bid(0), {"s": np.zeros(2, np.float32)}, meta())
    s.write("sidecar", bid(9), {"s": np.zeros(2, np.float32)}, meta())
    assert [e.block_id for e in s.orphans()] == [bid(9)]
    s.remove(s.block_entry(bid(0)))
    assert not s.has_sidecar(LAYOUT, bid(0))
    assert not s.sidecar_path(LAYOUT, bid(0)).exists()


def test_low_free_space_skips_writes(tmp_path):
    s = store(tmp_path, min_free_bytes=1 << 62)
    assert not s.write("block", bid(0), tensors(), meta())
    assert s.stats.writes_skipped_low_space == 1 and not s.has_block(bid(0))


def test_only_hex_ids_make_paths_and_symlinks_are_never_followed(tmp_path):
    s = store(tmp_path)
    with pytest.raises(SSDError):
        s.block_path("../../etc/passwd")
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"precious")
    s.write("block", bid(0), tensors(), meta())
    link = s.block_path(bid(5))
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, link)
    again = store(tmp_path)
    assert not again.has_block(bid(5))
    again._unlink(outside)  # outside the cache directory: refused
    assert outside.read_bytes() == b"precious"


def test_directory_lock(tmp_path):
    a = SSDStore(tmp_path / "kv", 1 << 20)
    b = SSDStore(tmp_path / "kv", 1 << 20)
    assert not b.directory_in_use()
    assert a.lock_directory()
    assert not b.lock_directory()


def test_header_is_read_without_tensors(tmp_path):
    s = store(tmp_path)
    s.write("block", bid(0), tensors(1 << 16), meta())
    table, m = read_header(s.block_path(bid(0)))
    assert set(table) == {"k0", "v0"} and m["kind"] == "block"


def test_non_contiguous_arrays_are_written_in_logical_order(tmp_path):
    s = store(tmp_path)
    x = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4).transpose(0, 2, 1)
    assert not x.flags["C_CONTIGUOUS"]
    s.write("block", bid(0), {"k0": x}, meta())
    got, _ = s.read(s.block_entry(bid(0)), {})
    np.testing.assert_array_equal(got["k0"], x)


def test_running_totals_match_a_recount(tmp_path):
    """Budgets and stats use running totals; after any mix of writes, sidecar-only
    writes, removals, evictions and a restart they equal a full count of the index."""
    rng = np.random.default_rng(7)
    other = hashlib.sha256(b"other model").hexdigest()
    s = store(tmp_path, budget=30_000)  # a dozen files or so: evictions happen

    def recount(st: SSDStore) -> None:
        snap = st.snapshot()
        files = [*st._blocks.values(), *st._sidecars.values()]
        assert st.bytes_used() == sum(e.nbytes for e in files) <= st.budget_bytes
        assert snap["block_bytes"] == sum(e.nbytes for e in st._blocks.values())
        assert snap["sidecar_bytes"] == sum(e.nbytes for e in st._sidecars.values())
        assert snap["orphans"] == len(st.orphans())
        for model in (MODEL, other):
            mine = [e for e in files if e.model == model]
            got = snap["by_model"].get(model[:16], {})
            assert got.get("blocks", 0) == sum(e.kind == "block" for e in mine)
            assert got.get("sidecar_bytes", 0) == sum(e.nbytes for e in mine
                                                      if e.kind == "sidecar")

    for _ in range(300):
        i = int(rng.integers(0, 20))
        model = MODEL if i % 3 else other
        op = rng.random()
        if op < 0.45:
            s.write("block", bid(i), tensors(int(rng.integers(64, 512))), meta(model))
        elif op < 0.8:  # a sidecar, sometimes without (or before) its block: an orphan
            s.write("sidecar", bid(i), {"s1.0": np.zeros(int(rng.integers(4, 64)), np.float32)},
                    {**meta(model), "codec": "fp32"})
        elif op < 0.9 and s.block_entry(bid(i)) is not None:
            s.remove(s.block_entry(bid(i)))
        elif s.sidecar_entry(LAYOUT, bid(i)) is not None:
            s.remove(s.sidecar_entry(LAYOUT, bid(i)))
        recount(s)
    snap = s.snapshot()
    assert snap["evictions"] > 0
    assert sum(m["evictions"] for m in snap["by_model"].values()) == snap["evictions"]
    recount(store(tmp_path, budget=s.budget_bytes))  # a restart rebuilds the same totals


def test_remove_leaves_a_file_rewritten_since(tmp_path):
    """A stale entry (the file was rewritten under the same name) removes nothing."""
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    stale = s.block_entry(bid(0))
    s.write("block", bid(0), tensors(), meta())  # same content: a new write id, a new token
    fresh = s.block_entry(bid(0))
    assert digest_of(fresh) != digest_of(stale)
    assert not s.remove(stale) and not s.remove_file("block", LAYOUT, bid(0), digest_of(stale))
    assert s.block_entry(bid(0)) is fresh and fresh.path.exists()
    assert s.remove_file("block", LAYOUT, bid(0), digest_of(fresh))
    assert not s.has_block(bid(0)) and not fresh.path.exists()


def test_a_remover_cannot_slip_between_rename_and_index(tmp_path, monkeypatch):
    """A remover holding the old entry runs right after the new file is renamed into place:
    it must wait for the index update and then leave the new file alone (it used to see
    the old entry still indexed and delete the new file)."""
    s = store(tmp_path)
    s.write("block", bid(0), tensors(), meta())
    stale = s.block_entry(bid(0))
    real_replace = os.replace
    removers: list[threading.Thread] = []

    def replace_then_race(src, dst, **dir_fds):
        real_replace(src, dst, **dir_fds)
        t = threading.Thread(target=s.remove, args=(stale,))
        t.start()
        t.join(0.3)  # under the store lock it cannot finish yet
        removers.append(t)

    monkeypatch.setattr(ssd_module.os, "replace", replace_then_race)
    assert s.write("block", bid(0), tensors(), meta())
    removers[0].join(10)
    fresh = s.block_entry(bid(0))
    assert fresh is not None and digest_of(fresh) != digest_of(stale)
    assert fresh.path.exists()


def test_files_are_0600_and_directories_0700(tmp_path, monkeypatch):
    root = tmp_path / "new" / "kv"  # created by us, parents included
    s = SSDStore(root, 1 << 30)
    assert s.lock_directory()
    s.open()
    temp_modes = []
    real_replace = os.replace

    def replace(src, dst, src_dir_fd=None, dst_dir_fd=None):
        temp_modes.append(stat.S_IMODE(os.stat(src, dir_fd=src_dir_fd).st_mode))
        real_replace(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)

    monkeypatch.setattr(ssd_module.os, "replace", replace)
    s.write("block", bid(0), tensors(), meta())
    s.write("sidecar", bid(0), {"s1.0": np.zeros(4, np.float32)}, meta())
    assert temp_modes == [0o600, 0o600]
    files = [s.base / "LOCK", s.block_path(bid(0)), s.sidecar_path(LAYOUT, bid(0))]
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    dirs = {tmp_path / "new", root, s.base}
    for path in files[1:]:
        dirs |= {p for p in path.parents if s.base in p.parents}
    assert len(dirs) == 8  # new, kv, v1, blocks, blocks/xx, sidecars, sidecars/layout, /xx
    for d in dirs:
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_eviction_deletes_exactly_its_plan(tmp_path):
    """The plan (a block followed by its sidecars, each file once) is what eviction does."""
    s = store(tmp_path)
    for i in range(6):
        s.write("block", bid(i), tensors(), meta())
        if i % 2 == 0:
            s.write("sidecar", bid(i), {"s1.0": np.zeros(64, np.float32)}, meta())
    s.budget_bytes = s.bytes_used() // 2
    plan = s.eviction_plan()
    assert len({id(e) for e in plan}) == len(plan)
    assert [e.kind for e in plan[:2]] == ["block", "sidecar"]  # the oldest, with its sidecar
    assert plan[0].block_id == plan[1].block_id
    on_disk = {p for p in (tmp_path / "kv").rglob("*.safetensors")}
    s.enforce_budget()
    gone = on_disk - {p for p in (tmp_path / "kv").rglob("*.safetensors")}
    assert gone == {e.path for e in plan}
    assert s.bytes_used() <= s.budget_bytes


def test_two_stores_in_one_process_conflict(tmp_path):
    """flock belongs to an open file description: a second open in the same process is
    refused like another process would be, and the LOCK file names the holder."""
    a = SSDStore(tmp_path / "kv", 1 << 20)
    b = SSDStore(tmp_path / "kv", 1 << 20)
    assert a.lock_directory() and not b.lock_directory()
    assert b.directory_in_use() and b.lock_holder() == str(os.getpid())
