"""A BERT encoder in MLX, its parameters named as Hugging Face's ``BertModel`` names them,
so a sentence-transformers checkpoint loads with its own weight names (BERT, MiniLM, BGE,
E5 and the other ``model_type: bert`` encoders; a cross-encoder adds its classifier), and
the RoBERTa family's (``roberta``, ``xlm-roberta``: bge-m3, multilingual-e5,
bge-reranker-v2-m3), whose positions start after the padding id and whose classifier is a
two-layer head on the first token.

Written from the architecture (post-norm layers, exact GELU, absolute positions, token
types), not taken from a GPL implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# The encoders this module runs, by ``model_type``.
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    num_labels: int = 0  # a cross-encoder's classifier outputs (0: none)
    model_type: str = "bert"
    pad_token_id: int = 0

    @property
    def roberta(self) -> bool:
        return self.model_type != "bert"

    @property
    def position_offset(self) -> int:
        """The first real token's position: RoBERTa's count from the padding id + 1."""
        return self.pad_token_id + 1 if self.roberta else 0

    @classmethod
    def from_dict(cls, config: dict) -> BertConfig:
        if config.get("model_type") not in ENCODER_TYPES:
            raise ValueError(f"model_type {config.get('model_type')!r} is not one of "
                             f"{', '.join(ENCODER_TYPES)}")
        if config.get("hidden_act", "gelu") not in ("gelu", "gelu_new", "relu"):
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")
        labels = len(config.get("id2label") or {}) if _is_classifier(config) else 0
        names = {f for f in cls.__dataclass_fields__ if f != "num_labels"}
        return cls(**{k: v for k, v in config.items() if k in names}, num_labels=labels)


def _is_classifier(config: dict) -> bool:
    return any(a.endswith("ForSequenceClassification")
               for a in config.get("architectures") or [])


class _Embeddings(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, ids: mx.array, types: mx.array, offset: int = 0) -> mx.array:
        positions = mx.arange(offset, offset + ids.shape[1])[None, :]  # rows padded right
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + \
            self.token_type_embeddings(types)
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)


class _Output(nn.Module):
    def __init__(self, inner: int, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(inner, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class _Attention(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.heads = c.num_attention_heads
        self.self = _SelfAttention(c)
        self.output = _Output(c.hidden_size, c)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        h = self.heads

        def split(t: mx.array) -> mx.array:
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        q, k, v = split(self.self.query(x)), split(self.self.key(x)), split(self.self.value(x))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=(d // h) ** -0.5, mask=mask)
        return self.output(out.transpose(0, 2, 1, 3).reshape(b, n, d), x)


class _Intermediate(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)
        self.act = nn.relu if c.hidden_act == "relu" else (
            nn.gelu_approx if c.hidden_act == "gelu_new" else nn.gelu)

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _Output(c.intermediate_size, c)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.layer = [_Layer(c) for _ in range(c.num_hidden_layers)]


class _Pooler(nn.Module):
    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)

    def __call__(self, hidden: mx.array) -> mx.array:
        return mx.tanh(self.dense(hidden[:, 0]))


class _RobertaHead(nn.Module):
    """RoBERTa's classifier: a dense layer and tanh on the first token, then the labels."""

    def __init__(self, c: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.out_proj = nn.Linear(c.hidden_size, c.num_labels)

    def __call__(self, hidden: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(hidden[:, 0])))


class BertModel(nn.Module):
    """Hidden states for token ids (B, L) and their attention mask (B, L: 1 real, 0 pad);
    a cross-encoder's ``scores`` (its classifier over the pooled first token)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.pooler = _Pooler(config)
        if config.num_labels:
            self.classifier: nn.Module = _RobertaHead(config) if config.roberta else \
                nn.Linear(config.hidden_size, config.num_labels)

    def __call__(self, ids: mx.array, attention: mx.array,
                 types: mx.array | None = None) -> mx.array:
        if types is None or self.config.type_vocab_size == 1:  # RoBERTa's: one type only
            types = mx.zeros_like(ids)
        x = self.embeddings(ids, types, self.config.position_offset)
        # pads are keys no query attends to (each real query has at least itself)
        mask = (attention[:, None, None, :] > 0)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def scores(self, ids: mx.array, attention: mx.array, types: mx.array | None = None
               ) -> mx.array:
        hidden = self(ids, attention, types)
        return self.classifier(hidden if self.config.roberta else self.pooler(hidden))

    @staticmethod
    def sanitize(weights: dict[str, Any], classifier: bool) -> dict[str, Any]:
        """Hugging Face's names onto this module's: a ``bert.`` or ``roberta.`` prefix
        (task heads) dropped, old ``gamma``/``beta`` layer norms renamed, heads we do not
        run (masked-LM, NSP) and position ids left out."""
        out = {}
        for key, value in weights.items():
            for prefix in ("bert.", "roberta."):
                if key.startswith(prefix):
                    key = key[len(prefix):]
            key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace(
                "LayerNorm.beta", "LayerNorm.bias")
            if key.startswith(("cls.", "lm_head.", "embeddings.position_ids")) or (
                    key.startswith("classifier.") and not classifier):
                continue
            out[key] = value
        return out
