"""Block payloads: slicing them out of a running batch and rebuilding caches.

A block's payload holds, for each KV layer, the keys and values of its
``block_size`` tokens, and, when it carries a checkpoint, each recurrent
layer's state exactly at the block's end boundary. Arrays travel as numpy
(bfloat16 through a ``uint16`` view, since numpy has no bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from serve_app.cache.layout import KV, RECURRENT, Layout

Payload = dict[str, np.ndarray]


@dataclass
class CapturedBlock:
    """One block, captured on the engine thread, on its way to the store."""

    block_id: str
    parent_id: str
    index: int
    payload: Payload
    dtypes: dict[str, str]
    has_checkpoint: bool

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.payload.values())


@dataclass
class RestorePlan:
    """What a request starts from: the KV of its first blocks and a checkpoint."""

    tokens: int
    blocks: list[Payload]
    dtypes: dict[str, str]
    checkpoint: Payload | None = None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for b in self.blocks for a in b.values())


def _to_numpy(a: mx.array) -> tuple[np.ndarray, str]:
    """A C-ordered numpy copy (a cache slice can be a transposed view in MLX)."""
    if a.dtype == mx.bfloat16:
        return np.array(a.view(mx.uint16), order="C"), "bfloat16"
    return np.array(a, order="C"), str(a.dtype).removeprefix("mlx.core.")


def _to_mlx(a: np.ndarray, dtype: str) -> mx.array:
    arr = mx.array(a)
    return arr.view(mx.bfloat16) if dtype == "bfloat16" else arr


def slice_block(
    layer_caches: list, idx: int, layout: Layout, start: int, end: int, checkpoint: bool
) -> dict[str, mx.array]:
    """Tokens ``[start, end)`` of batch row ``idx`` as lazy MLX slices.

    ``layer_caches`` are the batch caches of a running ``BatchGenerator``
    (``BatchKVCache`` with left padding, batched ``ArraysCache``); only this
    block's slice is materialized, so capture stays linear in prompt length.
    """
    out: dict[str, mx.array] = {}
    for i, (cache, kind) in enumerate(zip(layer_caches, layout.kinds, strict=True)):
        if kind == KV:
            padding = getattr(cache, "left_padding", None)  # None: a single-row KVCache
            pad = 0 if padding is None else int(padding[idx].item())
            out[f"k{i}"] = cache.keys[idx : idx + 1, :, pad + start : pad + end, :]
            out[f"v{i}"] = cache.values[idx : idx + 1, :, pad + start : pad + end, :]
        elif kind == RECURRENT and checkpoint:
            for j, state in enumerate(cache.cache):
                out[f"s{i}.{j}"] = state[idx : idx + 1]
    return out


def to_payload(arrays: dict[str, mx.array]) -> tuple[Payload, dict[str, str]]:
    """Materialize lazy slices and copy them out of MLX (the one copy on capture)."""
    mx.eval(list(arrays.values()))
    payload: Payload = {}
    dtypes: dict[str, str] = {}
    for key, a in arrays.items():
        payload[key], dtypes[key] = _to_numpy(a)
    return payload, dtypes


def build_cache(model, layout: Layout, plan: RestorePlan) -> list:
    """A fresh mlx-lm prompt cache holding ``plan.tokens`` restored tokens."""
    cache = make_prompt_cache(model)
    for i, kind in enumerate(layout.kinds):
        if kind == KV:
            keys = [_to_mlx(b[f"k{i}"], plan.dtypes[f"k{i}"]) for b in plan.blocks]
            values = [_to_mlx(b[f"v{i}"], plan.dtypes[f"v{i}"]) for b in plan.blocks]
            k = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0]
            v = mx.concatenate(values, axis=2) if len(values) > 1 else values[0]
            cache[i].state = (k, v, k.shape[2])
        else:
            if plan.checkpoint is None:
                raise ValueError("a hybrid restore needs a recurrent checkpoint")
            n = len(cache[i].cache)
            cache[i].cache = [
                _to_mlx(plan.checkpoint[f"s{i}.{j}"], plan.dtypes[f"s{i}.{j}"]) for j in range(n)
            ]
    mx.eval([c.state for c in cache])
    return cache


def validate_checkpoint(layout: Layout, payload: Payload) -> bool:
    """A checkpoint is usable only if it has every recurrent array, finite."""
    for i, kind in enumerate(layout.kinds):
        if kind != RECURRENT:
            continue
        states = [v for k, v in payload.items() if k.startswith(f"s{i}.")]
        if not states:
            return False
        for a in states:
            if a.dtype.kind == "f" and not np.isfinite(a).all():
                return False
    return True
