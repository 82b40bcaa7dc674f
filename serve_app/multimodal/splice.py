"""Image features and multimodal positions inside mlx-lm's batch, with no change to it.

The engine puts *virtual* token ids (``vocab + k``) in the batch for the part of a prompt
from its first image on; entry ``k`` of the ``SpliceTable`` names the real token (or the
image feature row) and the token's 3-D rotary position. The text stack's embedding and
its attention layers' rotary embeddings are overridden to read them, so prefill chunks,
padding and batching stay mlx-lm's. A decoding row of a request with images is at
``offset + delta`` (``SpliceState.rows``, set for each decode step).

Tokens before a prompt's first image, and every row of a text request, take mlx-lm's own
rotary kernel: their numerics do not depend on what they are batched with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from serve_app.models.compat import override_call


@dataclass
class _Entry:
    base: int
    tokens: np.ndarray  # (n,) int32: the real token ids
    positions: np.ndarray  # (3, n) int32
    features: list[tuple[int, Any]]  # (first row in the entry, (m, D) mx.array)


class SpliceTable:
    """The virtual ids of the requests now prefilling (engine thread only)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self._entries: dict[object, _Entry] = {}
        self._arrays: tuple | None = None

    @property
    def empty(self) -> bool:
        return not self._entries

    def add(self, key: object, tokens: np.ndarray, positions: np.ndarray,
            features: list[tuple[int, Any]]) -> int:
        """Room for ``len(tokens)`` virtual ids (first fit); their first id."""
        n = len(tokens)
        base = 0
        for entry in sorted(self._entries.values(), key=lambda e: e.base):
            if entry.base - base >= n:
                break
            base = max(base, entry.base + len(entry.tokens))
        self._entries[key] = _Entry(base, tokens.astype(np.int32), positions.astype(np.int32),
                                    features)
        self._arrays = None
        return self.vocab + base

    def remove(self, key: object) -> None:
        if self._entries.pop(key, None) is not None:
            self._arrays = None

    def clear(self) -> None:
        self._entries.clear()
        self._arrays = None

    def arrays(self) -> tuple:
        """(real ids (S,), positions (3, S), feature row or -1 (S,), features (F, D) or
        None) as MLX arrays, rebuilt after a change."""
        if self._arrays is None:
            import mlx.core as mx

            size = max((e.base + len(e.tokens) for e in self._entries.values()), default=1)
            ids = np.zeros(size, np.int32)
            pos = np.zeros((3, size), np.int32)
            rows = np.full(size, -1, np.int32)
            feats, total = [], 0
            for e in self._entries.values():
                ids[e.base:e.base + len(e.tokens)] = e.tokens
                pos[:, e.base:e.base + len(e.tokens)] = e.positions
                for first, block in e.features:
                    at = e.base + first
                    rows[at:at + block.shape[0]] = np.arange(total, total + block.shape[0])
                    feats.append(block)
                    total += block.shape[0]
            self._arrays = (mx.array(ids), mx.array(pos), mx.array(rows),
                            mx.concatenate(feats) if feats else None)
        return self._arrays


@dataclass
class SpliceState:
    """What the overridden modules read during one forward pass."""

    table: SpliceTable
    style: str = "interleaved"  # mlx-vlm's layout of the sections (``compat.MROPE_STYLES``)
    current: tuple | None = None  # (virtual mask (B, L), index k (B, L)) of this forward
    decoding: bool = False  # a decode step: every input is a real (sampled) token
    rows: Any = None  # a decode step with image rows: each row's delta (B,), 0 for text
    mrope: dict[int, Any] = field(default_factory=dict)
    # This forward's (cos, sin) by (kind, dtype): every attention layer, queries and keys,
    # sits at the same positions (cleared when a forward or a decode step begins).
    angles: dict[tuple, Any] = field(default_factory=dict)


def install(model: Any, state: SpliceState, mrope_section: list[int]) -> int:
    """Override the model's embedding and its attention layers' rotary embeddings; the
    number of rotary embeddings overridden (0: nothing to splice into, which the caller
    refuses)."""
    import mlx.nn as nn

    embeds = [m for name, m in model.named_modules() if name.endswith("embed_tokens")]
    if len(embeds) != 1:
        raise ValueError(f"expected one token embedding, found {len(embeds)}")
    override_call(embeds[0], lambda m, call, ids: _embed(state, m, call, ids), "Spliced")
    ropes = 0
    for _, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if isinstance(rope, nn.Module) and not getattr(type(rope), "_serve_app_override", None):
            if not isinstance(rope, nn.RoPE) or rope.traditional:
                raise ValueError(f"{type(rope).__name__}: only plain (non-traditional) rotary "
                                 "embeddings take multimodal positions here")
            _mrope(state, rope, mrope_section)
            override_call(rope, lambda m, call, x, offset=0: _rope(state, m, call, x, offset),
                          "Spliced")
            ropes += 1
    return ropes


def _mrope(state: SpliceState, rope: Any, section: list[int]) -> Any:
    from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

    key = id(rope)
    if key not in state.mrope:
        state.mrope[key] = MRoPERotaryEmbedding(rope.dims, base=rope.base,
                                                mrope_section=section, style=state.style)
    return state.mrope[key]


def _embed(state: SpliceState, module: Any, call: Any, ids: Any) -> Any:
    import mlx.core as mx

    state.angles.clear()  # a forward begins here
    if state.table.empty or state.decoding:
        state.current = None
        return call(module, ids)
    real, _, rows, feats = state.table.arrays()
    vocab = state.table.vocab
    virtual = ids >= vocab
    k = mx.where(virtual, ids - vocab, 0)
    out = call(module, mx.where(virtual, real[k], ids))
    if feats is not None:
        row = rows[k]
        image = virtual & (row >= 0)
        out = mx.where(image[..., None], feats[mx.maximum(row, 0)].astype(out.dtype), out)
    state.current = (virtual, k)
    return out


def _rope(state: SpliceState, module: Any, call: Any, x: Any, offset: Any = 0) -> Any:
    import mlx.core as mx
    from mlx_vlm.models.rope_utils import apply_multimodal_rotary_pos_emb

    if state.rows is not None:
        # A generated token's three positions are equal, where multimodal rotary is plain
        # rotary: every row in mlx-lm's fused kernel at offset + delta (0 for text rows).
        return call(module, x, offset=offset + state.rows)
    out = call(module, x, offset=offset)
    mrope = state.mrope[id(module)]

    def explicit(kind: str, positions: Any) -> Any:
        key = (kind, x.dtype, mrope.dim)
        if key not in state.angles:
            state.angles[key] = mrope(x, positions())
        cos, sin = state.angles[key]
        return apply_multimodal_rotary_pos_emb(x, x, cos, sin, style=state.style)[0]

    if state.current is not None:
        virtual, k = state.current
        if virtual.shape == (x.shape[0], x.shape[2]):
            positions = state.table.arrays()[1]
            out = mx.where(virtual[:, None, :, None],
                           explicit("virtual", lambda: positions[:, k]), out)
    return out
