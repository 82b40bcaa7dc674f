"""``python -m serve_app local-cluster``'s default SSD root: this user's, and private (the
real nodes are tests/cluster/test_local_cluster.py)."""

from __future__ import annotations

import os
import stat

from serve_app.cli.local_cluster import private_dir
from serve_app.config.paths import default_ssd_root


def test_the_default_ssd_root_is_this_users_and_private(tmp_path, monkeypatch):
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_ssd_root() == tmp_path / ".cache" / "serve_app" / "cluster"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = default_ssd_root()
    assert root == tmp_path / "xdg" / "serve_app" / "cluster"
    old = os.umask(0)  # even with a permissive umask
    try:
        private_dir(root)
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    private_dir(root)  # an existing private directory is fine
