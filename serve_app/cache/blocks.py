"""Blocks on the engine thread: slicing them out of a running batch, rebuilding caches.

A captured block's payload is a ``BlockPayload``: its tokens' keys and values
per attention layer and, when it carries a checkpoint, each recurrent layer's
state exactly at the block's end boundary.
"""

from __future__ import annotations

import mlx.core as mx

from serve_app.cache.layout import KV, RECURRENT, Layout
from serve_app.cache.payload import BlockPayload, RestorePlan, Tensor
from serve_app.kvquant.batch_cache import make_cache
from serve_app.kvquant.format import pack, unpack


def capture_block(
    layer_caches: list, idx: int, layout: Layout, start: int, end: int, checkpoint: bool
) -> BlockPayload:
    """Tokens ``[start, end)`` of batch row ``idx``, copied out of MLX.

    ``layer_caches`` are the batch caches of a running ``BatchGenerator``
    (``BatchKVCache`` with left padding, batched ``ArraysCache``); only this
    block's slice is materialized, so capture stays linear in prompt length. Quantized
    K/V (``layout.kv_quant``) leaves packed: its words, scales and biases in one array.
    """
    kv: dict[int, tuple] = {}
    state: dict[int, tuple] = {}
    for i, (cache, kind) in enumerate(zip(layer_caches, layout.kinds, strict=True)):
        if kind == KV:
            padding = getattr(cache, "left_padding", None)  # None: a single-row KVCache
            pad = 0 if padding is None else int(padding[idx].item())
            if layout.kv_quant is None:
                kv[i] = (cache.keys[idx : idx + 1, :, pad + start : pad + end, :],
                         cache.values[idx : idx + 1, :, pad + start : pad + end, :])
            else:
                kv[i] = tuple(pack(tuple(a[idx : idx + 1, :, pad + start : pad + end, :]
                                         for a in triple))
                              for triple in (cache.keys, cache.values))
        elif kind == RECURRENT and checkpoint:
            state[i] = tuple(s[idx : idx + 1] for s in cache.cache)
    mx.eval([a for pair in kv.values() for a in pair], [a for s in state.values() for a in s])
    return BlockPayload(
        {i: (Tensor.from_mlx(k), Tensor.from_mlx(v)) for i, (k, v) in kv.items()},
        {i: tuple(Tensor.from_mlx(a) for a in arrays) for i, arrays in state.items()},
    )


def build_cache(model, layout: Layout, plan: RestorePlan) -> list:
    """A fresh mlx-lm prompt cache holding ``plan.tokens`` restored tokens.

    Checks every block against the layout first, as stored: a payload that
    does not fit raises ``ValueError`` here, never inside the running batch. A
    cut last block (``plan.partial``, attention-only models: there is no
    recurrent state to cut) keeps the KV of its first ``block_tokens[-1]`` tokens.
    """
    blocks = _checked_blocks(layout, plan)
    cache = make_cache(model, layout.kv_quant)
    checkpoint = blocks[-1].state
    for i, kind in enumerate(layout.kinds):
        if kind == KV:
            keys = [b.kv[i][0].to_mlx() for b in blocks]
            values = [b.kv[i][1].to_mlx() for b in blocks]
            k = mx.concatenate(keys, axis=2) if len(keys) > 1 else keys[0]
            v = mx.concatenate(values, axis=2) if len(values) > 1 else values[0]
            if layout.kv_quant is None:
                cache[i].state = (k, v, k.shape[2])
            else:
                cache[i].keys = unpack(k, layout.kv_quant, layout.kv_scale_dtype)
                cache[i].values = unpack(v, layout.kv_quant, layout.kv_scale_dtype)
                cache[i].offset = k.shape[2]
        else:
            cache[i].cache = [t.to_mlx() for t in checkpoint[i]]
    mx.eval([c.state for c in cache])
    return cache


def _checked_blocks(layout: Layout, plan: RestorePlan) -> list[BlockPayload]:
    """The plan's blocks checked against the layout, the last one cut where planned."""
    if not plan.blocks or len(plan.blocks) != len(plan.block_tokens):
        raise ValueError(f"{len(plan.blocks)} blocks for {len(plan.block_tokens)} token counts")
    for n, (block, tokens) in enumerate(zip(plan.blocks, plan.stored_tokens, strict=True)):
        last = n == len(plan.blocks) - 1
        reason = layout.check(block, tokens, need_state=layout.hybrid and last)
        if reason is not None:
            raise ValueError(f"restored block {n} does not fit the model: {reason}")
    if not plan.cut_from:
        return list(plan.blocks)
    keep = plan.block_tokens[-1]
    if layout.hybrid or not 0 < keep < plan.cut_from:
        raise ValueError(f"cannot cut a block of {plan.cut_from} tokens to {keep} "
                         f"({'hybrid model' if layout.hybrid else 'out of range'})")
    cut = plan.blocks[-1].cut(keep)
    reason = layout.check(cut, keep, need_state=False)
    if reason is not None:
        raise ValueError(f"cut block does not fit the model: {reason}")
    return [*plan.blocks[:-1], cut]
