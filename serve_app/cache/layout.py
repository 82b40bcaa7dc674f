"""Layer layouts: each mlx-lm cache object mapped to a canonical kind.

Signatures are built from canonical kinds, never raw class names, so a
wrapper or subclass (``SizedArraysCache`` vs ``ArraysCache``) cannot split one
layout into two digests.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

KV = "kv"
RECURRENT = "recurrent"

# Kinds we recognise but cannot slice per block yet, checked before the
# generic ones because some subclass them.
_UNSUPPORTED = (
    (RotatingKVCache, "rotating"),
    (QuantizedKVCache, "quantized"),
    (ChunkedKVCache, "chunked"),
    (ConcatenateKVCache, "concatenate"),
    (CacheList, "list"),
)


@dataclass(frozen=True)
class Layout:
    """The canonical kind of every layer's cache, in order."""

    kinds: tuple[str, ...]
    unsupported: str | None = None

    @property
    def supported(self) -> bool:
        return self.unsupported is None

    @property
    def hybrid(self) -> bool:
        return RECURRENT in self.kinds

    @property
    def digest(self) -> str:
        return hashlib.sha256(("layout-v1|" + "|".join(self.kinds)).encode()).hexdigest()


def canonical_kind(cache: object) -> str:
    for cls, name in _UNSUPPORTED:
        if isinstance(cache, cls):
            return name
    if isinstance(cache, ArraysCache):
        return RECURRENT
    if isinstance(cache, KVCache):
        return KV
    return f"unknown:{type(cache).__name__}"


def layout_of(prompt_cache: list) -> Layout:
    kinds = tuple(canonical_kind(c) for c in prompt_cache)
    bad = sorted({k for k in kinds if k not in (KV, RECURRENT)})
    if bad:
        return Layout(kinds, unsupported=f"cache kind(s) {', '.join(bad)} not supported yet")
    return Layout(kinds)
