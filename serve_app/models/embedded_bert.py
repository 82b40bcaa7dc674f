"""The tiny random-weight encoders (BERT's layout, as Hugging Face writes it): an embedding
model with sentence-transformers' files (mean pooling, normalised) and a cross-encoder
(a one-label classifier), each in every weight format, for the pooling tests."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# Characters and their continuations: any ASCII text tokenizes, one WordPiece a character.
_CHARS = [c for c in string.printable if not c.isspace() and not c.isupper()]


def vocab() -> list[str]:
    return SPECIALS + _CHARS + [f"##{c}" for c in _CHARS]


def config(layers: int, rerank: bool, roberta: bool = False) -> dict:
    """A tiny encoder's config in BERT's layout, or XLM-RoBERTa's (``roberta``: positions
    after the padding id, one token type, a two-layer classifier head, no pooler in the
    cross-encoder; the same WordPiece vocabulary, [PAD] at 0)."""
    kind = "XLMRoberta" if roberta else "Bert"
    out: dict[str, Any] = {
        "model_type": "xlm-roberta" if roberta else "bert", "architectures": [f"{kind}Model"],
        "vocab_size": len(vocab()), "hidden_size": 64, "num_hidden_layers": layers,
        "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 130 if roberta else 128,
        "type_vocab_size": 1 if roberta else 2, "layer_norm_eps": 1e-5 if roberta else 1e-12,
        "hidden_act": "gelu", "pad_token_id": 0,
    }
    if rerank:
        out.update(architectures=[f"{kind}ForSequenceClassification"],
                   id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter of a Hugging Face ``BertModel`` (and a classifier) with its shape."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    out: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (cfg["vocab_size"], h),
        "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], h),
        "embeddings.token_type_embeddings.weight": (cfg["type_vocab_size"], h),
        "embeddings.LayerNorm.weight": (h,), "embeddings.LayerNorm.bias": (h,),
    }
    roberta = cfg["model_type"] != "bert"
    if not (roberta and "id2label" in cfg):  # RoBERTa's classifiers have no pooler
        out["pooler.dense.weight"], out["pooler.dense.bias"] = (h, h), (h,)
    for n in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{n}"
        for name, rows, cols in (("attention.self.query", h, h), ("attention.self.key", h, h),
                                 ("attention.self.value", h, h),
                                 ("attention.output.dense", h, h),
                                 ("intermediate.dense", i, h), ("output.dense", h, i)):
            out[f"{p}.{name}.weight"], out[f"{p}.{name}.bias"] = (rows, cols), (rows,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            out[f"{p}.{norm}.weight"], out[f"{p}.{norm}.bias"] = (h,), (h,)
    labels = len(cfg.get("id2label") or {})
    if labels and roberta:
        out.update({"classifier.dense.weight": (h, h), "classifier.dense.bias": (h,),
                    "classifier.out_proj.weight": (labels, h),
                    "classifier.out_proj.bias": (labels,)})
    elif labels:
        out["classifier.weight"], out["classifier.bias"] = (labels, h), (labels,)
    return out


def build(cfg: dict, values: Any, fmt: str, dtype_name: str, group_size: int,
          path: Path) -> None:
    """Write the model: ``values(name, shape)`` gives each parameter's seeded fp32 values;
    4-bit quantizes the linear layers (not the embeddings), as mlx's ``nn.quantize`` does."""
    import mlx.core as mx

    dtype = getattr(mx, dtype_name)
    out = dict(cfg, torch_dtype=dtype_name)
    weights: dict[str, Any] = {}
    for name, shape in shapes(cfg).items():
        value = mx.array(values(name, shape)).astype(dtype)
        linear = name.endswith(".weight") and len(shape) == 2 and "embeddings" not in name
        if fmt == "q4" and linear and shape[1] % group_size == 0:
            stem = name[: -len(".weight")]
            q, scales, biases = mx.quantize(value, group_size=group_size, bits=4)
            weights.update({name: q, f"{stem}.scales": scales, f"{stem}.biases": biases})
        else:
            weights[name] = value
    if fmt == "q4":
        out["quantization"] = {"group_size": group_size, "bits": 4}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(out, indent=2))
    (path / "vocab.txt").write_text("\n".join(vocab()) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 128,
        "pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]",
        "sep_token": "[SEP]", "mask_token": "[MASK]"}, indent=2))
    if cfg["architectures"][0].endswith("Model"):  # sentence-transformers: normalised
        mode = "cls" if cfg["model_type"] != "bert" else "mean"  # as bge-m3; as MiniLM
        (path / "modules.json").write_text(json.dumps([
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling",
             "type": "sentence_transformers.models.Pooling"},
            {"idx": 2, "name": "2", "path": "2_Normalize",
             "type": "sentence_transformers.models.Normalize"}], indent=2))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps({
            "word_embedding_dimension": cfg["hidden_size"],
            "pooling_mode_cls_token": mode == "cls",
            "pooling_mode_mean_tokens": mode == "mean", "pooling_mode_max_tokens": False,
            "pooling_mode_mean_sqrt_len_tokens": False}, indent=2))
        (path / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": 128, "do_lower_case": False}))
