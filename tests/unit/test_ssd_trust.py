"""The SSD directory is not trusted blindly: real directories, real modes, real symlinks.

A cache directory owned by another user, or writable by group or others, is refused
(an ERROR naming it and why; the node serves without the SSD tier and says why). Below
the cache directory nothing is followed through a symlink: a symlink planted in place
of a directory or a file is never read, written through or deleted through.
"""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import SSDError, read_file
from serve_app.cache.ssd_fs import untrusted_reason
from serve_app.config.profile import CacheStoreProfile
from serve_app.store.actor import make_ssd
from tests.support.blocks import MODEL, bid, meta, tensors


def config(root) -> CacheStoreProfile:
    return CacheStoreProfile(ssd=True, ssd_dir=str(root), ssd_cache_max_size=1 << 30,
                             ssd_min_free=0)


@pytest.mark.parametrize(("mode", "who"), [(0o770, "group"), (0o707, "others"),
                                           (0o777, "group and others")])
def test_a_group_or_world_writable_directory_is_refused(tmp_path, caplog, mode, who):
    root = tmp_path / "kv"
    root.mkdir()
    root.chmod(mode)
    with caplog.at_level(logging.ERROR, logger="serve_app.store.actor"):
        store, reason = make_ssd(config(root))
    assert store is None
    assert str(root) in reason and f"writable by {who}" in reason
    assert "without the SSD tier" in reason
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert str(root) in record.getMessage() and "writable" in record.getMessage()
    assert not (root / "v1").exists()  # nothing was created or read in it


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_directory_owned_by_another_user_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.chown(root, 4242, -1)
    store, reason = make_ssd(config(root))
    assert store is None and "owned by uid 4242" in reason and str(root) in reason


def test_a_private_directory_is_accepted_and_new_ones_are_0700(tmp_path):
    assert untrusted_reason(tmp_path / "missing") is None  # will be created 0700
    store, reason = make_ssd(config(tmp_path / "fresh" / "kv"))
    assert reason is None and store is not None
    assert (tmp_path / "fresh" / "kv").stat().st_mode & 0o777 == 0o700


def planted(tmp_path, i: int) -> tuple[SSDStore, SSDStore]:
    """A real block file for ``bid(i)`` in an attacker's directory, and a victim store."""
    evil = SSDStore(tmp_path / "evil", 1 << 30)
    evil.open()
    assert evil.write("block", bid(i), tensors(), meta())
    victim = SSDStore(tmp_path / "kv", 1 << 30)
    victim.open()
    return evil, victim


def test_a_symlinked_directory_below_the_cache_is_never_followed(tmp_path):
    evil, victim = planted(tmp_path, 7)
    evil_file = evil.block_path(bid(7))
    link = victim.block_path(bid(7)).parent  # v1/blocks/<xx> -> the attacker's <xx>
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(evil_file.parent, link)
    again = SSDStore(tmp_path / "kv", 1 << 30)
    again.open()
    assert not again.has_block(bid(7))  # not indexed through the symlink
    with pytest.raises(SSDError):  # a replica reading that path does not follow it
        read_file(victim.block_path(bid(7)), {"model": MODEL})
    # A write of another block under that directory fails (counted), writes nothing there.
    other = next(j for j in range(10_000) if bid(j)[:2] == bid(7)[:2] and j != 7)
    assert not again.write("block", bid(other), tensors(), meta())
    assert again.stats.writes_failed == 1
    assert sorted(p.name for p in evil_file.parent.iterdir()) == [evil_file.name]
    assert not again._unlink(victim.block_path(bid(7)))  # nor deleted through it
    assert evil_file.exists()
    assert read_file(evil_file, {"model": MODEL})[1]["block_id"] == bid(7)


def test_a_symlinked_file_or_tier_directory_is_never_followed(tmp_path):
    evil, victim = planted(tmp_path, 3)
    path = victim.block_path(bid(3))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(evil.block_path(bid(3)), path)  # the file itself
    with pytest.raises(SSDError):
        read_file(path, {"model": MODEL})
    again = SSDStore(tmp_path / "kv", 1 << 30)
    again.open()
    assert not again.has_block(bid(3))
    # v1/sidecars as a whole is a symlink: sidecars are neither indexed nor written there.
    os.symlink(evil.base / "blocks", victim.base / "sidecars")
    assert not again.write("sidecar", bid(3), {"s1.0": np.zeros(4, np.float32)}, meta())
    assert not any(p.name.startswith(bid(3)) and p.parent.name != bid(3)[:2]
                   for p in (evil.base / "blocks").rglob("*"))


def test_a_symlinked_version_directory_is_refused_at_start(tmp_path, caplog):
    (tmp_path / "elsewhere").mkdir(mode=0o700)
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.symlink(tmp_path / "elsewhere", root / "v1")
    with caplog.at_level(logging.ERROR, logger="serve_app.store.actor"):
        store, reason = make_ssd(config(root))
    assert store is None and str(root) in reason
    assert not (tmp_path / "elsewhere" / "LOCK").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="files of another user need root")
def test_a_directory_or_file_of_another_user_below_the_cache_is_not_trusted(tmp_path):
    """The cache directory is ours and private now, but a fan-out directory (or a block
    file) in it belongs to another user (made before it was locked down): not indexed,
    not read, not written through."""
    evil, victim = planted(tmp_path, 11)
    path = victim.block_path(bid(11))
    path.parent.mkdir(parents=True, exist_ok=True)
    os.replace(evil.block_path(bid(11)), path)  # a valid block file, in place...
    os.chown(path, 4242, -1)  # ...but another user's
    with pytest.raises(SSDError):
        read_file(path, {"model": MODEL})
    again = SSDStore(tmp_path / "kv", 1 << 30)
    again.open()
    assert not again.has_block(bid(11))
    os.chown(path, os.geteuid(), -1)
    os.chown(path.parent, 4242, -1)  # now the directory is another user's
    with pytest.raises(SSDError):
        read_file(path, {"model": MODEL})
    other = next(j for j in range(10_000) if bid(j)[:2] == bid(11)[:2] and j != 11)
    assert not again.write("block", bid(other), tensors(), meta())
    fresh = SSDStore(tmp_path / "kv", 1 << 30)
    fresh.open()
    assert not fresh.has_block(bid(11))
    os.chown(path.parent, os.geteuid(), -1)
    path.parent.chmod(0o770)  # ours, but group-writable
    with pytest.raises(SSDError):
        read_file(path, {"model": MODEL})
    path.parent.chmod(0o700)
    assert read_file(path, {"model": MODEL})[1]["block_id"] == bid(11)  # trusted again
