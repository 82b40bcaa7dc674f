"""How a model's hidden states become one vector: the pooling mode and normalisation its
sentence-transformers files name (``modules.json``, ``1_Pooling/config.json``), or the
defaults for its kind (an encoder: mean; a decoder: its last token, as Qwen3-Embedding)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import mlx.core as mx
import numpy as np

PoolingMode = Literal["cls", "mean", "max", "lasttoken"]
_MODES: dict[str, PoolingMode] = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class Pooling:
    """One model's pooling: its mode, whether vectors are unit length, the longest input
    it takes (tokens), and whether a shorter ``dimensions`` may be asked (Matryoshka)."""

    mode: PoolingMode
    normalize: bool
    max_length: int
    matryoshka: bool = False


def read_pooling(model_dir: Path, config: dict, decoder: bool) -> Pooling:
    """The model's pooling from its sentence-transformers files, else its kind's default."""
    mode: PoolingMode = "lasttoken" if decoder else "mean"
    normalize = True
    modules = _json(model_dir / "modules.json")
    if isinstance(modules, list):
        kinds = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        normalize = any(k.endswith(".Normalize") for k in kinds)
        for m in modules:
            if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling"):
                pooling = _json(model_dir / str(m.get("path", "")) / "config.json")
                pooling = pooling if isinstance(pooling, dict) else {}
                chosen = [v for k, v in _MODES.items() if pooling.get(k)]
                if len(chosen) != 1:
                    raise ValueError(f"{model_dir}: the pooling config names {len(chosen)} "
                                     "modes; this server pools with exactly one")
                mode = chosen[0]
    limit = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("roberta", "xlm-roberta"):  # positions after the pad id
        limit -= int(config.get("pad_token_id", 1)) + 1
    st = _json(model_dir / "sentence_bert_config.json")
    if isinstance(st, dict) and isinstance(st.get("max_seq_length"), int):
        limit = min(limit, st["max_seq_length"])
    return Pooling(mode, normalize, limit)


def _json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pool(hidden: mx.array, lengths: mx.array, mode: PoolingMode) -> mx.array:
    """(B, L, D) hidden states of right-padded rows of ``lengths`` real tokens to (B, D),
    in float32."""
    hidden = hidden.astype(mx.float32)
    real = (mx.arange(hidden.shape[1])[None, :] < lengths[:, None])[..., None]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        return mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.max(mx.where(real, hidden, -mx.inf), axis=1)
    return mx.sum(mx.where(real, hidden, 0.0), axis=1) / lengths[:, None].astype(mx.float32)


def finish(vectors: np.ndarray, pooling: Pooling, dimensions: int | None) -> np.ndarray:
    """Vectors as the API returns them: cut to ``dimensions`` (Matryoshka) and unit length
    where the model's are."""
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    if pooling.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    return vectors.astype(np.float32)
