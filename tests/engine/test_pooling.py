"""Embedding and rerank models in process (issue 43), on the tiny embedded ones in every
weight format: vectors match an independent float64 reference (encoders) or the model's own
unpadded forward pass (decoders), batched or alone; scores batched equal scores alone.
The real all-MiniLM-L6-v2 is in tests/integration/test_minilm.py (it downloads a wheel)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from serve_app.config.catalog import FORMATS, variant_name
from serve_app.models.compat import final_hidden
from serve_app.models.embedded import materialize
from serve_app.pooling.model import Encoded, PoolingModel, cosine
from serve_app.pooling.pooler import finish
from tests.support.pooling import reference_embedding


def vectors(model: PoolingModel, texts: list[str]) -> np.ndarray:
    return finish(model.embed([model.encode(t) for t in texts]), model.pooling, None)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("base", ["tiny-bert", "tiny-xlmr"])
def test_tiny_encoder_batched_equals_alone_and_the_reference(tmp_path, base, fmt):
    """BERT's layout (mean pooling) and XLM-RoBERTa's (positions after the padding id, CLS
    pooling as bge-m3 pools)."""
    model = PoolingModel(materialize(variant_name(base, fmt), tmp_path), "embed")
    texts = ["a", "hello world", "x " * 60, "the last one, of medium length"]
    encoded = [model.encode(t) for t in texts]
    together = finish(model.embed(encoded), model.pooling, None)
    for row, e in zip(together, encoded, strict=True):
        alone = finish(model.embed([e]), model.pooling, None)[0]
        assert cosine(row, alone) >= 0.99999
        assert abs(np.linalg.norm(row) - 1) < 1e-5
        if fmt != "q4":
            floor = 0.9999 if fmt == "fp32" else 0.999
            assert cosine(row, reference_embedding(model.model_dir, e.ids)) >= floor


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_decoder_embeds_with_its_last_token(tmp_path, fmt):
    """A decoder (mlx-lm's model class; Qwen3-Embedding's pooling): each vector is the
    final hidden state at the input's last token, as the model's own forward pass over
    that input alone gives it; padding the batch on the right changes nothing."""
    model = PoolingModel(materialize(variant_name("tiny-dense", fmt), tmp_path), "embed")
    assert model.pooling.mode == "lasttoken"
    encoded = [Encoded(list(range(40, 40 + n))) for n in (1, 5, 23)]
    together = model.embed(encoded)
    for row, e in zip(together, encoded, strict=True):
        own = final_hidden(model.net, mx.array([e.ids]))[0, -1].astype(mx.float32)
        assert np.array_equal(row, np.array(own)) or cosine(row, np.array(own)) >= 0.99999


def test_matryoshka_cut_renormalises():
    from serve_app.pooling.pooler import Pooling

    v = np.array([[3.0, 4.0, 12.0]], np.float32)
    out = finish(v, Pooling("mean", True, 8), 2)
    assert out.shape == (1, 2) and np.allclose(out, [[0.6, 0.8]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_rerank_scores_batched_equal_alone(tmp_path, fmt):
    """A cross-encoder's sigmoid score (BERT's pooler head, XLM-RoBERTa's two-layer head)
    and a decoder reranker's P(yes), in [0, 1], the same batched and alone; the decoder's
    is its own forward pass's yes/no softmax."""
    pairs = [("what is x", "x is a letter"), ("q", "a much longer document " * 4),
             ("colour", "red")]
    for name in ("tiny-bert-rerank", "tiny-xlmr-rerank", "tiny-dense"):
        model = PoolingModel(materialize(variant_name(name, fmt), tmp_path), "rerank")
        encoded = [model.encode_pair(q, d) for q, d in pairs]
        together = model.scores(encoded)
        assert all(0.0 <= s <= 1.0 for s in together)
        for score, e in zip(together, encoded, strict=True):
            assert abs(score - model.scores([e])[0]) < 1e-5
        if name == "tiny-dense":
            e = encoded[0]
            last = model.net(mx.array([e.ids]))[0, -1].astype(mx.float32)
            yes, no = (float(last[t]) for t in model._yes_no)
            assert abs(together[0] - 1 / (1 + np.exp(no - yes))) < 1e-5


def test_inputs_over_the_limit_are_refused_or_cut(tmp_path):
    from serve_app.pooling.model import TooLong

    model = PoolingModel(materialize("tiny-bert", tmp_path), "embed")
    with pytest.raises(TooLong, match="over the model's limit of 128"):
        model.encode("x " * 200)
    cut = model.encode("x " * 200, truncate=True)
    assert len(cut.ids) == 128 and cut.ids[-1] == model.tokenizer.sep_token_id
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        model.encode_ids([1, 10_000])
    assert len(model.encode_ids([7] * 300, truncate=True).ids) == 128
    rerank = PoolingModel(materialize("tiny-bert-rerank", tmp_path), "rerank")
    pair = rerank.encode_pair("a question", "a long document " * 40, truncate=True)
    assert len(pair.ids) == 128 and pair.types is not None and pair.types[-1] == 1
    with pytest.raises(TooLong):
        rerank.encode_pair("a question", "a long document " * 40)


def test_the_tokenizer_is_shared_safely_between_threads(tmp_path):
    """Worker threads tokenize at once, with and without truncation (one Rust tokenizer
    whose truncation is set per call): every result is the one a lone call gives."""
    from concurrent.futures import ThreadPoolExecutor

    model = PoolingModel(materialize("tiny-bert", tmp_path), "embed")
    texts = [("x " * n, n % 2 == 0) for n in range(1, 200)]

    def one(item):
        text, cut = item
        try:
            return model.encode(text, truncate=cut).ids
        except ValueError as exc:  # TooLong, as alone
            return str(exc)

    alone = [one(t) for t in texts]
    with ThreadPoolExecutor(8) as pool:
        for _ in range(3):
            assert list(pool.map(one, texts)) == alone


def test_a_decoder_reranker_cuts_the_document_only(tmp_path):
    from serve_app.pooling.model import TooLong
    from serve_app.pooling.pooler import Pooling

    model = PoolingModel(materialize("tiny-dense", tmp_path), "rerank")
    model.pooling = Pooling("lasttoken", True, 400)  # a small limit, to reach it
    long_doc = "a long document " * 40
    with pytest.raises(TooLong):
        model.encode_pair("what is x", long_doc)
    cut = model.encode_pair("what is x", long_doc, truncate=True)
    whole = model.encode_pair("what is x", "a long")
    assert len(cut.ids) == 400
    suffix = model.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n<think>\n\n"
                                    "</think>\n\n", add_special_tokens=False)
    assert cut.ids[-len(suffix):] == suffix == whole.ids[-len(suffix):]
    assert 0.0 <= model.scores([cut])[0] <= 1.0
