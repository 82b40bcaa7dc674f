"""An embedding or rerank model, loaded: its tokenizer, its network and its pooling.

Encoders (``model_type: bert``) run on ``serve_app.pooling.bert``; decoders (Qwen3,
Llama, ...: Qwen3-Embedding, Qwen3-Reranker) on mlx-lm's own model classes. Inputs are
batched sorted by length, each batch padded on the right to its longest (a causal decoder's
real tokens never see the padding; an encoder masks it), within ``max_batch_tokens``.
Every call runs on one thread (MLX's)."""

from __future__ import annotations

import glob
import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import numpy as np

from serve_app.models.compat import final_hidden, output_logits
from serve_app.pooling.bert import ENCODER_TYPES, BertConfig, BertModel
from serve_app.pooling.pooler import Pooling, pool, read_pooling

Task = Literal["embed", "rerank"]
# Qwen3-Reranker's prompt (its model card): the answer is "yes" or "no"; the score is
# P(yes) from those two logits at the prompt's last token.
RERANK_PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based "
                 "on the Query and the Instruct provided. Note that the answer can only be "
                 "\"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


class TooLong(ValueError):
    """An input over the model's limit (a 400 naming it, unless the request truncates)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"{tokens} tokens, over the model's limit of {limit}")
        self.tokens, self.limit = tokens, limit


@dataclass(frozen=True)
class Encoded:
    """One input as the network takes it."""

    ids: list[int]
    types: list[int] | None = None  # an encoder's token types (a pair's second segment: 1)


class PoolingModel:
    def __init__(self, model_dir: Path, task: Task, max_batch_tokens: int = 8192) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.task = task
        self.config = json.loads((model_dir / "config.json").read_text())
        self.encoder = self.config.get("model_type") in ENCODER_TYPES
        self.max_batch_tokens = max_batch_tokens
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.model_max_length = 1 << 40  # lengths are ours to check (``limit``)
        # One Rust tokenizer, its truncation set per call: worker threads take turns.
        self._tokenizing = threading.Lock()
        if self.encoder:
            self.net: Any = _load_bert(model_dir, self.config, classifier=task == "rerank")
            labels = self.net.config.num_labels
            if task == "rerank" and labels != 1:
                raise ValueError(f"{model_dir}: an encoder reranks with a one-label classifier "
                                 f"head (a cross-encoder), and this one has {labels}")
        else:
            import mlx_lm

            self.net = mlx_lm.load(str(model_dir))[0]
        self.pooling: Pooling = read_pooling(model_dir, self.config, decoder=not self.encoder)
        if not self.encoder and task == "rerank":
            self._yes_no = [self._one_token(w) for w in ("yes", "no")]
        self.dimension = int(self.config.get("hidden_size") or 0)
        self.pad = int(self.tokenizer.pad_token_id or 0)

    # ---- text in ------------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The longest input in tokens (the model's positions, or its sentence config's)."""
        return self.pooling.max_length

    def encode(self, text: str, truncate: bool = False) -> Encoded:
        """A text's tokens as the model was trained on them (special tokens included); over
        ``limit``: cut to it (``truncate``), else ``TooLong``."""
        with self._tokenizing:
            ids = self.tokenizer(text, truncation=truncate, max_length=self.limit if truncate
                                 else None)["input_ids"]
        return self.checked(Encoded(list(ids)))

    def encode_ids(self, ids: list[int], truncate: bool = False) -> Encoded:
        """Token ids as given (no special tokens added), checked against the vocabulary."""
        vocab = int(self.config.get("vocab_size") or 0)
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"a token id is outside the model's vocabulary (0 to {vocab - 1})")
        return self.checked(Encoded(ids[: self.limit] if truncate else list(ids)))

    def encode_pair(self, query: str, document: str, instruction: str | None = None,
                    truncate: bool = False) -> Encoded:
        """A (query, document) pair for ``scores``: an encoder's two segments (the document
        cut where ``truncate``, as sentence-transformers' cross-encoders do), or a decoder
        reranker's prompt."""
        if self.encoder:
            with self._tokenizing:
                query_ids = self.tokenizer(query)["input_ids"]
                if len(query_ids) + 1 >= self.limit:  # no room for a document
                    raise TooLong(len(query_ids) + 1, self.limit)
                out = self.tokenizer(query, document, max_length=self.limit if truncate
                                     else None, truncation="only_second" if truncate else False)
            return self.checked(Encoded(list(out["input_ids"]),
                                        list(out.get("token_type_ids") or []) or None))
        head = (f"{RERANK_PREFIX}<Instruct>: {instruction or RERANK_INSTRUCTION}\n"
                f"<Query>: {query}\n<Document>: ")
        with self._tokenizing:
            ids = self.tokenizer.encode(head + document + RERANK_SUFFIX,
                                        add_special_tokens=False)
            if len(ids) > self.limit and truncate:  # the document's tokens cut, the rest kept
                before = self.tokenizer.encode(head, add_special_tokens=False)
                after = self.tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
                doc = self.tokenizer.encode(document, add_special_tokens=False)
                room = self.limit - len(before) - len(after)
                if room < 1:
                    raise TooLong(len(before) + len(after) + 1, self.limit)
                ids = before + doc[:room] + after
        return self.checked(Encoded(list(ids)))

    def checked(self, encoded: Encoded) -> Encoded:
        if not encoded.ids:
            raise ValueError("the input is empty")
        if len(encoded.ids) > self.limit:
            raise TooLong(len(encoded.ids), self.limit)
        return encoded

    def _one_token(self, word: str) -> int:
        with self._tokenizing:
            return int(self.tokenizer.encode(word, add_special_tokens=False)[0])

    # ---- the network ----------------------------------------------------------------

    def embed(self, inputs: list[Encoded]) -> np.ndarray:
        """Pooled vectors (N, D), float32, before normalisation (``pooler.finish``)."""
        return self._batched(inputs, self._embed_batch)

    def scores(self, inputs: list[Encoded]) -> np.ndarray:
        """Relevance scores (N,) in [0, 1]: a cross-encoder's sigmoid, a decoder's P(yes)."""
        return self._batched(inputs, self._score_batch)

    def _batched(self, inputs: list[Encoded], run: Any) -> np.ndarray:
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids))
        out: list[Any] = [None] * len(inputs)
        start = 0
        while start < len(order):
            longest, end = 0, start
            while end < len(order):
                longest = max(longest, len(inputs[order[end]].ids))
                if end > start and longest * (end - start + 1) > self.max_batch_tokens:
                    break
                end += 1
            chunk = [inputs[i] for i in order[start:end]]
            for i, row in zip(order[start:end], run(chunk), strict=True):
                out[i] = row
            start = end
        return np.stack(out) if out else np.zeros((0, self.dimension), np.float32)

    def _padded(self, batch: list[Encoded]) -> tuple[mx.array, mx.array, mx.array | None]:
        width = max(len(e.ids) for e in batch)
        ids = np.full((len(batch), width), self.pad, np.int32)
        types = np.zeros((len(batch), width), np.int32)
        for r, e in enumerate(batch):
            ids[r, :len(e.ids)] = e.ids
            if e.types:
                types[r, :len(e.types)] = e.types
        lengths = mx.array([len(e.ids) for e in batch])
        return mx.array(ids), lengths, mx.array(types) if self.encoder else None

    def _embed_batch(self, batch: list[Encoded]) -> np.ndarray:
        ids, lengths, types = self._padded(batch)
        if self.encoder:
            attention = mx.arange(ids.shape[1])[None, :] < lengths[:, None]
            hidden = self.net(ids, attention, types)
        else:
            hidden = final_hidden(self.net, ids)
        vectors = pool(hidden, lengths, self.pooling.mode)
        mx.eval(vectors)
        return np.array(vectors)

    def _score_batch(self, batch: list[Encoded]) -> np.ndarray:
        ids, lengths, types = self._padded(batch)
        if self.encoder:
            attention = mx.arange(ids.shape[1])[None, :] < lengths[:, None]
            logits = self.net.scores(ids, attention, types).astype(mx.float32)[:, 0]
            out = mx.sigmoid(logits)
        else:
            hidden = final_hidden(self.net, ids)  # the head on the last rows only: (B, V)
            last = mx.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
            pair = output_logits(self.net, last).astype(mx.float32)[:, self._yes_no]
            out = mx.softmax(pair, axis=-1)[:, 0]
        mx.eval(out)
        return np.array(out)


def _load_bert(model_dir: Path, config: dict, classifier: bool) -> BertModel:
    c = BertConfig.from_dict(config)
    model = BertModel(c)
    weights: dict[str, Any] = {}
    for file in sorted(glob.glob(str(model_dir / "*.safetensors"))):
        weights.update(mx.load(file))  # type: ignore[arg-type]
    if not weights:
        raise ValueError(f"{model_dir}: no safetensors weights")
    weights = BertModel.sanitize(weights, classifier)
    if not any(k.startswith("pooler.") for k in weights):
        if classifier and not c.roberta:
            raise ValueError(f"{model_dir}: a BERT cross-encoder needs its pooler weights")
        del model.pooler  # sentence-transformers checkpoints may leave it out
    quantization = config.get("quantization")
    if quantization:
        import mlx.nn as nn

        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"],
                    class_predicate=lambda p, m: isinstance(m, nn.Linear) and
                    f"{p}.scales" in weights)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two vectors (tests and benchmarks)."""
    return float(np.dot(a, b) / (math.sqrt(float(np.dot(a, a)) * float(np.dot(b, b))) or 1.0))
