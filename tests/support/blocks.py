"""Made-up blocks for the cache's tiers, shared by the store, SSD and GC tests: ids,
tensors and headers of SSD files, hot entries and captured blocks of known bytes."""

from __future__ import annotations

import hashlib

import numpy as np

from serve_app.cache.hot import HotEntry
from serve_app.cache.layout import KV, ArraySpec, Layout
from serve_app.cache.payload import BlockPayload, CapturedBlock, Tensor
from serve_app.cache.ssd_format import DiskInfo

LAYOUT = hashlib.sha256(b"layout").hexdigest()
"""The layout digest every made-up SSD file is written for."""
MODEL = hashlib.sha256(b"model").hexdigest()
"""The model digest every made-up SSD file is written for."""
DISK = DiskInfo(MODEL, LAYOUT, 16, "ssd_sidecar", "fp32")
"""How a tiered store writes the made-up blocks to its SSD tier."""


def bid(i: int) -> str:
    """The id of made-up block ``i`` (its parent is ``bid(i - 1)``)."""
    return hashlib.sha256(f"block{i}".encode()).hexdigest()


def tensors(n: int = 256) -> dict[str, np.ndarray]:
    """The arrays of a made-up SSD block file."""
    return {"k0": np.arange(n, dtype=np.float32), "v0": np.ones(n, dtype=np.float32)}


def meta(model: str = MODEL) -> dict[str, str]:
    """The header of a made-up SSD block file of ``model``."""
    return {"model": model, "layout": LAYOUT, "parent_id": "", "block_size": "16",
            "tokens": "16"}


def payload(i: int, nbytes: int = 4096) -> BlockPayload:
    """A one-layer payload of ``nbytes`` bytes, filled with ``i``."""
    half = Tensor(np.full(nbytes // 8, i, dtype=np.float32), "float32")
    return BlockPayload({0: (half, half)})


def entry(i: int, nbytes: int = 4096) -> HotEntry:
    """Block ``i`` as the hot tier holds it (parent ``bid(i - 1)``)."""
    return HotEntry(bid(i), bid(i - 1), nbytes, False, handle=payload(i, nbytes), model="m")


def block(i: int, nbytes: int = 4096) -> CapturedBlock:
    """Block ``i`` as an engine captures it (parent ``bid(i - 1)``)."""
    return CapturedBlock(bid(i), bid(i - 1), payload(i, nbytes))


SMALL_BS = 4
SMALL_LAYOUT = Layout((KV,), arrays=((ArraySpec((1, 2, None, 8), "float32"),) * 2,),
                      epoch="t")
"""One attention layer of two heads of 8: the layout cross-node fetches are checked
against."""


def small_payload(seed: int) -> BlockPayload:
    """A random block of :data:`SMALL_LAYOUT` (:data:`SMALL_BS` tokens)."""
    rng = np.random.default_rng(seed)
    arrays = tuple(Tensor(rng.standard_normal((1, 2, SMALL_BS, 8)).astype(np.float32),
                          "float32") for _ in range(2))
    return BlockPayload({0: arrays})
