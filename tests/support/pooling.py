"""An independent reference for the pooling tests: a BERT forward pass in float64 numpy,
written from the architecture, read from the saved weights."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def reference_embedding(path: Path, ids: list[int]) -> np.ndarray:
    """One input's normalised vector, pooled as the model's sentence-transformers files say
    (mean or the first token), BERT's positions or RoBERTa's (fp32, bf16 and fp16 weights:
    a 4-bit checkpoint's are not read here)."""
    import mlx.core as mx

    w = {k: np.array(v.astype(mx.float32), dtype=np.float64)
         for k, v in mx.load(str(path / "model.safetensors")).items()}  # type: ignore[union-attr]
    cfg = json.loads((path / "config.json").read_text())
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

    def norm(x: np.ndarray, name: str) -> np.ndarray:
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(x: np.ndarray, name: str) -> np.ndarray:
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    n = len(ids)
    offset = cfg["pad_token_id"] + 1 if cfg["model_type"] != "bert" else 0  # RoBERTa's
    x = w["embeddings.word_embeddings.weight"][ids] + \
        w["embeddings.position_embeddings.weight"][offset:offset + n] + \
        w["embeddings.token_type_embeddings.weight"][0]
    x = norm(x, "embeddings.LayerNorm")
    d = x.shape[-1] // heads
    from math import erf, sqrt
    gelu = np.vectorize(lambda v: 0.5 * v * (1 + erf(v / sqrt(2))))
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}"
        q, k, v = (linear(x, f"{p}.attention.self.{m}").reshape(n, heads, d).transpose(1, 0, 2)
                   for m in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / np.sqrt(d)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        attn = (scores / scores.sum(-1, keepdims=True)) @ v
        x = norm(linear(attn.transpose(1, 0, 2).reshape(n, -1), f"{p}.attention.output.dense")
                 + x, f"{p}.attention.output.LayerNorm")
        h = gelu(linear(x, f"{p}.intermediate.dense"))
        x = norm(linear(h, f"{p}.output.dense") + x, f"{p}.output.LayerNorm")
    pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
    vec = x[0] if pooling["pooling_mode_cls_token"] else x.mean(0)
    return vec / np.linalg.norm(vec)
