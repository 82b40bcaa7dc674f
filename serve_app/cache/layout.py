"""Layer layouts: each mlx-lm cache object mapped to a canonical kind.

Signatures are built from canonical kinds, never raw class names, so a
wrapper or subclass (``SizedArraysCache`` vs ``ArraysCache``) cannot split one
layout into two digests. A layout also records the shape and dtype of every
cached array (probed by running the model on two tokens), and the mlx-lm
cache epoch: a bf16 model, a quantized one and an mlx-lm release that changed
what its caches hold all get different digests, and a payload that does not
fit is rejected before it reaches the model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from serve_app.cache.payload import STORAGE, BlockPayload, Tensor
from serve_app.kvquant.format import GROUP_SIZES, KVQuant

KV = "kv"
RECURRENT = "recurrent"

# mlx-lm releases whose cache layouts we checked, by (major, minor), mapped to
# an epoch name; releases that keep the layout share an epoch. A release not
# listed gets an epoch of its own: it may have changed the layout, so caches
# written by another release are never restored under it (fail closed).
MLX_LM_CACHE_EPOCHS = {(0, 32): "mlx-lm-0.32"}


def cache_epoch(version: str) -> str:
    """The cache-layout epoch of an mlx-lm version string such as ``0.32.2``."""
    parts = version.split(".")
    try:
        key = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return f"mlx-lm-{version}"
    return MLX_LM_CACHE_EPOCHS.get(key, f"mlx-lm-{key[0]}.{key[1]}")


def installed_cache_epoch() -> str:
    import mlx_lm

    return cache_epoch(mlx_lm.__version__)


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of one cached array; ``None`` marks the token axis."""

    shape: tuple[int | None, ...]
    dtype: str

    def fits(self, t: Tensor, tokens: int | None = None) -> bool:
        want = tuple(tokens if d is None else d for d in self.shape)
        return t.dtype == self.dtype and t.shape == want

    def describe(self) -> str:
        return f"{self.dtype}{['T' if d is None else d for d in self.shape]}"

    def nbytes(self, tokens: int = 0) -> int:
        n = np.dtype(STORAGE[self.dtype]).itemsize
        for d in self.shape:
            n *= tokens if d is None else d
        return n



@dataclass(frozen=True)
class Layout:
    """The canonical kind of every layer's cache, in order."""

    kinds: tuple[str, ...]
    unsupported: str | None = None
    # Per layer: (keys, values) for kv layers, the state arrays for recurrent ones.
    arrays: tuple[tuple[ArraySpec, ...], ...] = field(default=())
    epoch: str = ""
    # Quantized K/V (``kv_cache.bits``): each attention layer's keys and values are
    # stored packed (``serve_app/kvquant/format.py``), their scales in ``kv_scale_dtype``.
    kv_quant: KVQuant | None = None
    kv_scale_dtype: str = ""

    @property
    def supported(self) -> bool:
        return self.unsupported is None

    @property
    def hybrid(self) -> bool:
        return RECURRENT in self.kinds

    @property
    def kv_format(self) -> str:
        """``float``, or the quantized format and its scales' dtype (``q8g64-bfloat16``)."""
        if self.kv_quant is None:
            return "float"
        return f"{self.kv_quant.name}-{self.kv_scale_dtype}"

    @property
    def digest(self) -> str:
        arrays = ";".join(",".join(a.describe() for a in layer) for layer in self.arrays)
        # Float K/V keeps the digest it always had (caches written before stay valid); a
        # quantized format is named, so no profile change ever restores the other kind.
        quant = [f"kv-{self.kv_format}"] if self.kv_quant else []
        text = "|".join(["layout-v2", *self.kinds, arrays, self.epoch, *quant])
        return hashlib.sha256(text.encode()).hexdigest()

    def block_nbytes(self, tokens: int) -> int:
        """Bytes of the KV of ``tokens`` tokens (what moving a block costs)."""
        return sum(a.nbytes(tokens) for layer, kind in zip(self.arrays, self.kinds, strict=True)
                   if kind == KV for a in layer)

    def state_nbytes(self) -> int:
        """Bytes of one recurrent checkpoint (every recurrent layer's state)."""
        return sum(a.nbytes() for layer, kind in zip(self.arrays, self.kinds, strict=True)
                   if kind == RECURRENT for a in layer)

    def check(self, payload: BlockPayload, tokens: int, need_state: bool) -> str | None:
        """Why ``payload`` cannot be a block of ``tokens`` tokens here (None if it can).

        Fail closed: every KV layer present with the expected shapes and dtypes,
        no unknown layer, and, when a checkpoint is needed, every recurrent
        array present, of its shape and dtype, and finite.
        """
        kv_layers = {i for i, k in enumerate(self.kinds) if k == KV}
        if set(payload.kv) != kv_layers:
            return f"KV layers {sorted(payload.kv)} where {sorted(kv_layers)} were expected"
        for i in kv_layers:
            for spec, t in zip(self.arrays[i], payload.kv[i], strict=True):
                if not spec.fits(t, tokens):
                    return (f"layer {i}: {t.dtype}{list(t.shape)} where {spec.describe()} "
                            f"with T={tokens} was expected")
        if not need_state:
            return None
        recurrent = {i for i, k in enumerate(self.kinds) if k == RECURRENT}
        if set(payload.state) != recurrent:
            return (f"recurrent layers {sorted(payload.state)} where {sorted(recurrent)} "
                    "were expected")
        for i in recurrent:
            specs, arrays = self.arrays[i], payload.state[i]
            if len(specs) != len(arrays):
                return f"layer {i}: {len(arrays)} state arrays where {len(specs)} were expected"
            for spec, t in zip(specs, arrays, strict=True):
                if not spec.fits(t):
                    return f"layer {i}: state {t.dtype}{list(t.shape)} where " \
                           f"{spec.describe()} was expected"
                if not t.is_finite():
                    return f"layer {i}: non-finite recurrent state"
        return None


def canonical_kind(cache: object) -> str:
    # mlx-lm imported here, not at the top: a cache store checking a payload another
    # node asked for needs ``Layout``, not mlx-lm (a second of import in its process).
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        ConcatenateKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

    # Kinds we recognise but cannot slice per block yet, checked before the
    # generic ones because some subclass them.
    from serve_app.kvquant.batch_cache import BatchQuantizedKVCache, QuantizedRowCache

    if isinstance(cache, QuantizedRowCache | BatchQuantizedKVCache):
        return KV  # ours: sliced per block, packed (mlx-lm's own cannot batch)
    unsupported = (
        (RotatingKVCache, "rotating"),
        (QuantizedKVCache, "quantized"),
        (ChunkedKVCache, "chunked"),
        (ConcatenateKVCache, "concatenate"),
        (CacheList, "list"),
    )
    for cls, name in unsupported:
        if isinstance(cache, cls):
            return name
    if isinstance(cache, ArraysCache):
        return RECURRENT
    if isinstance(cache, KVCache):
        return KV
    return f"unknown:{type(cache).__name__}"


def layout_of(prompt_cache: list) -> Layout:
    """Kinds only (no arrays probed): enough to say whether caching is supported."""
    kinds = tuple(canonical_kind(c) for c in prompt_cache)
    bad = sorted({k for k in kinds if k not in (KV, RECURRENT)})
    if bad:
        return Layout(kinds, unsupported=f"cache kind(s) {', '.join(bad)} not supported yet")
    return Layout(kinds)


def probe_layout(model, kv_quant: KVQuant | None = None) -> Layout:
    """The model's layout with every cached array's shape and dtype.

    Runs the model on two tokens with a fresh cache (its attention layers quantized
    where ``kv_quant`` says), on the calling thread (the engine thread: MLX work stays
    there).
    """
    import mlx.core as mx

    from serve_app.kvquant.batch_cache import make_cache
    from serve_app.kvquant.format import pack

    if kv_quant is not None:
        _check_head_dims(model, kv_quant)
    cache = make_cache(model, kv_quant)
    layout = layout_of(cache)
    if not layout.supported:
        return layout
    try:
        mx.eval(model(mx.array([[0, 1]]), cache=cache))
    except Exception as exc:
        if kv_quant is None:
            raise
        # A model whose attention calls MLX's fast kernel itself, not mlx-lm's
        # scaled_dot_product_attention, cannot read quantized K/V.
        raise ValueError(f"kv_cache.bits: {type(model).__module__} does not read quantized "
                         f"K/V ({exc}); use float K/V (bits: null)") from exc
    arrays = []
    scale_dtype = ""
    for c, kind in zip(cache, layout.kinds, strict=True):
        if kind == KV:
            k, v = c.keys, c.values
            if kv_quant is not None:
                scale_dtype = str(k[1].dtype).removeprefix("mlx.core.")
                k, v = pack(k), pack(v)
            arrays.append(tuple(ArraySpec((1, a.shape[1], None, a.shape[3]),
                                          Tensor.from_mlx(a[:1, :1, :1, :1]).dtype)
                                for a in (k, v)))
        else:
            arrays.append(tuple(ArraySpec(tuple(a.shape), Tensor.from_mlx(a[:1]).dtype)
                                for a in c.cache))
    return Layout(layout.kinds, arrays=tuple(arrays), epoch=installed_cache_epoch(),
                  kv_quant=kv_quant, kv_scale_dtype=scale_dtype)


def _check_head_dims(model, quant: KVQuant) -> None:
    """``ValueError`` naming the profile key when the attention heads do not split into
    whole groups of ``quant`` (mx.quantize would fail inside the first prefill)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0, 1]]), cache=cache))
    dims = sorted({a.shape[-1] for c in cache if type(c) is KVCache
                   for a in (c.keys, c.values) if a is not None})
    bad = [d for d in dims if not quant.fits(d)]
    if bad:
        fits = [g for g in GROUP_SIZES if all(d % g == 0 for d in dims)]
        raise ValueError(f"kv_cache.group_size {quant.group_size} does not divide the "
                         f"attention heads' dimension {bad[0]} of this model: use "
                         f"{' or '.join(map(str, fits)) or 'float K/V (bits: null)'}")
