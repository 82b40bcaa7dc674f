"""Quantized K/V caches that continuous batching can merge, filter, extend and roll.

mlx-lm's ``QuantizedKVCache`` holds one sequence and has no ``merge``, so
``BatchGenerator`` cannot batch it (``mlx_lm.server`` serves one request at a time
with ``--kv-bits``). ``BatchQuantizedKVCache`` is ``BatchKVCache`` for quantized
K/V: each of keys and values is a ``(words, scales, biases)`` triple, left padded
per row, and it carries ``bits`` and ``group_size``, which mlx-lm's attention reads
to take its quantized path (``scaled_dot_product_attention`` in ``models/base.py``).
``QuantizedRowCache`` is the one-sequence cache a request starts from (fresh or
restored) and leaves with; it merges into a batch cache.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import KVCache, QuantizedKVCache, dynamic_roll, make_prompt_cache

from serve_app.kvquant.format import KVQuant

Triple = tuple[Any, Any, Any]


def _quantize(x, quant: KVQuant) -> Triple:
    words, scales, biases = mx.quantize(x, group_size=quant.group_size, bits=quant.bits)
    return words, scales, biases


def _ints(a: Any) -> list[int]:
    """An MLX vector's values as ints (``tolist`` is typed as any nested value)."""
    return [int(x) for x in a.tolist()]


def _map(fn, triple: Triple) -> Triple:
    return fn(triple[0]), fn(triple[1]), fn(triple[2])


class QuantizedRowCache(QuantizedKVCache):
    """mlx-lm's quantized cache of one sequence, which merges into a batch cache."""

    keys: Any  # (words, scales, biases), or None while empty
    values: Any

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[QuantizedRowCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @property
    def quant(self) -> KVQuant:
        return KVQuant(self.bits, self.group_size)


def make_cache(model, quant: KVQuant | None) -> list:
    """``make_prompt_cache(model)`` with every plain attention cache quantized
    (``quant``; None: as mlx-lm makes it). Recurrent caches stay as they are."""
    cache = make_prompt_cache(model)
    if quant is None:
        return cache
    return [QuantizedRowCache(group_size=quant.group_size, bits=quant.bits)
            if type(c) is KVCache else c for c in cache]


class BatchQuantizedKVCache:
    """``BatchKVCache`` over quantized K/V: rows left padded to a common ``_idx``."""

    step = 256

    def __init__(self, left_padding: list[int], bits: int, group_size: int) -> None:
        self.keys: Any = None  # (words, scales, biases), or None while empty
        self.values: Any = None
        self.left_padding: Any = mx.array(left_padding)
        self.offset: Any = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: Any = None
        self.bits = bits
        self.group_size = group_size

    @property
    def quant(self) -> KVQuant:
        return KVQuant(self.bits, self.group_size)

    def update_and_fetch(self, keys, values) -> tuple[Triple, Triple]:
        prev, n = self._idx, keys.shape[2]
        if self.keys is None or prev + n > self.keys[0].shape[2]:
            b, heads = keys.shape[:2]
            steps = (self.step + n - 1) // self.step * self.step

            def empty(like: Triple) -> Triple:
                return _map(lambda a: mx.zeros((b, heads, steps, a.shape[-1]), a.dtype), like)

            k_new = empty(_quantize(keys[:, :, :1], self.quant))
            v_new = empty(_quantize(values[:, :, :1], self.quant))
            if self.keys is None or self.values is None:
                self.keys, self.values = k_new, v_new
            else:
                def grow(old: Triple, new: Triple) -> Triple:
                    return tuple(mx.concatenate([o[..., :prev, :], z], axis=2)  # type: ignore[return-value]
                                 for o, z in zip(old, new, strict=True))
                self.keys, self.values = grow(self.keys, k_new), grow(self.values, v_new)
        self.offset = self.offset + n
        self._idx += n
        for store, new in ((self.keys, _quantize(keys, self.quant)),
                           (self.values, _quantize(values, self.quant))):
            for a, x in zip(store, new, strict=True):
                a[..., prev : self._idx, :] = x
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Triple, Triple]:
        assert self.keys is not None and self.values is not None
        cut = self._idx
        return _map(lambda a: a[..., :cut, :], self.keys), \
            _map(lambda a: a[..., :cut, :], self.values)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty cache")
            pad = mx.array(left_padding)
            self.left_padding += pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        if self._right_padding is None:
            return
        padding = self._right_padding
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda a: dynamic_roll(a, padding[:, None], axis=2), self.keys)
            self.values = _map(lambda a: dynamic_roll(a, padding[:, None], axis=2),
                               self.values)
        self.offset = self.offset - padding
        self.left_padding += padding
        self._right_padding = None

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding,
                                  **kwargs)

    def filter(self, batch_indices) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = _map(lambda a: a[batch_indices], self.keys)
            self.values = _map(lambda a: a[batch_indices], self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        least = min(_ints(self.left_padding))
        if least > 0:
            if self.keys is not None and self.values is not None:
                self.keys = _map(lambda a: a[..., least:, :], self.keys)
                self.values = _map(lambda a: a[..., least:, :], self.values)
            self._idx -= least
            self.left_padding -= least

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        like = self if self.keys is not None else other
        assert like.keys is not None and like.values is not None
        top = max(self._idx, other._idx)
        size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache) -> tuple:
            left = top - c._idx
            rows = c.offset.shape[0]
            out = []
            for own, ref in ((c.keys, like.keys), (c.values, like.values)):
                arrays = own if own is not None else _map(
                    lambda a: mx.zeros((rows, a.shape[1], 0, a.shape[3]), a.dtype), ref)
                padded = []
                for a in arrays:
                    right = size - a.shape[2] - left
                    if right < 0:
                        a, right = a[..., :right, :], 0
                    if left or right:
                        a = mx.pad(a, [(0, 0), (0, 0), (left, right), (0, 0)])
                    padded.append(a)
                out.append(tuple(padded))
            return out[0], out[1], c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2, strict=True))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2, strict=True))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = top

    def extract(self, idx: int) -> QuantizedRowCache:
        row = QuantizedRowCache(group_size=self.group_size, bits=self.bits)
        assert self.keys is not None and self.values is not None
        pad = _ints(self.left_padding)[idx]
        row.keys = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]),
                        self.keys)
        row.values = _map(lambda a: mx.contiguous(a[idx : idx + 1, :, pad : self._idx]),
                          self.values)
        row.offset = self._idx - pad
        return row

    @classmethod
    def merge(cls, caches: list[QuantizedRowCache]) -> BatchQuantizedKVCache:
        bits, group_size = caches[0].bits, caches[0].group_size
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        longest = max(lengths)
        if longest == 0:
            return cls([0] * len(caches), bits, group_size)
        padding = [longest - n for n in lengths]
        ref = next(c for c in caches if c.keys is not None)

        def zeros(like: Triple) -> Triple:
            return _map(lambda a: mx.zeros((len(caches), a.shape[1], longest, a.shape[3]),
                                           a.dtype), like)

        keys, values = zeros(ref.keys), zeros(ref.values)
        for i, (p, c) in enumerate(zip(padding, caches, strict=True)):
            if c.keys is None:
                continue
            for store, own in ((keys, c.keys), (values, c.values)):
                for a, x in zip(store, own, strict=True):
                    a[i : i + 1, :, p : p + c.offset] = x[..., : c.offset, :]
        cache = cls(padding, bits, group_size)
        cache.keys, cache.values = keys, values
        cache.offset += longest
        cache._idx = longest
        return cache

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None or self.values is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))
