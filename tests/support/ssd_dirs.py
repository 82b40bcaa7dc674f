"""An SSD cache directory with blocks, sidecars, an orphan and a partial write, as the
garbage collector finds one (its unit and command tests)."""

from __future__ import annotations

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
