"""A model's own multi-token-prediction (MTP) head, loaded from its checkpoint.

Qwen3-Next and Qwen3.5 checkpoints carry ``mtp.*`` weights that mlx-lm's ``sanitize``
drops: one extra decoder layer that reads the trunk's final hidden state at position
``t`` and the embedding of token ``t + 1`` and predicts token ``t + 2`` through the
trunk's own output head (vLLM's ``qwen3_next_mtp.py`` layout):

    x = fc([pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
    hidden' = norm(layer(x))            logits = trunk head(hidden')

Its weights are read from the checkpoint as the trunk's are sanitized: zero-centred
norms (Hugging Face layout) shifted by one, per-expert MoE weights stacked, and
quantized like the trunk (with its group size and bits) unless the checkpoint already
holds them quantized. ``serve_app.serving.drafts.MTPDraft`` drafts with it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

from serve_app.models.compat import TrunkParts, trunk_parts

PREFIX = "mtp."
# Model types whose MTP head has this layout (and whose trunk ``trunk_parts`` reads).
MTP_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


class MTPHead(nn.Module):
    """The MTP layer(s) and their norms; the embedding and output head are the trunk's."""

    def __init__(self, parts: TrunkParts, num_layers: int = 1) -> None:
        super().__init__()
        args = parts.args
        size, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(size, eps=eps)
        self.fc = nn.Linear(2 * size, size, bias=False)
        self.layers = [parts.layer_class(args, parts.layer_index) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(size, eps=eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list) -> mx.array:
        """The head's hidden state at each position (``(batch, positions, size)``)."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, c in zip(self.layers, cache, strict=True):
            x = layer(x, mask, c)
        return self.norm(x)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]


class MTPUnavailable(ValueError):
    """The checkpoint cannot draft with an MTP head (the reason is the message)."""


def _config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def _weight_files(model_dir: Path, wanted: str | None = None) -> list[Path]:
    """The checkpoint's safetensors files (those holding a key starting with ``wanted``,
    when an index says where keys are)."""
    index = model_dir / "model.safetensors.index.json"
    if wanted is not None and index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / f for k, f in weight_map.items() if k.startswith(wanted)})
    return sorted(model_dir.glob("*.safetensors"))


def _load(path: Path) -> dict[str, mx.array]:
    """A safetensors file's arrays, lazily (only those used are read)."""
    return cast(dict[str, mx.array], mx.load(str(path)))


def mtp_problem(model_dir: Path) -> str | None:
    """Why the checkpoint in ``model_dir`` has no MTP head to draft with; None if it has."""
    model_type = _config(model_dir).get("model_type")
    if model_type not in MTP_MODEL_TYPES:
        return (f"model type {model_type!r} has no MTP head this server reads "
                f"(it reads {', '.join(MTP_MODEL_TYPES)})")
    for path in _weight_files(model_dir, PREFIX):
        if any(k.startswith(PREFIX) for k in _load(path)):
            return None
    return (f"the checkpoint in {model_dir} has no {PREFIX}* weights (converters that "
            "go through mlx-lm's sanitize drop them: use the original checkpoint)")


def _raw_mtp_weights(model_dir: Path) -> tuple[dict[str, mx.array], bool]:
    """The ``mtp.*`` arrays without their prefix (lazy: only these are read), and
    whether the trunk is in Hugging Face's layout (a GDN conv weight not yet moved)."""
    weights: dict[str, mx.array] = {}
    hf_layout = False
    for path in _weight_files(model_dir):
        for key, value in _load(path).items():
            if key.startswith(PREFIX):
                weights[key[len(PREFIX):]] = value
            elif key.endswith("conv1d.weight") and value.ndim == 3 and value.shape[-1] != 1:
                hf_layout = True
    return weights, hf_layout


def sanitize(weights: dict[str, mx.array], hf_layout: bool, num_experts: int
             ) -> dict[str, mx.array]:
    """Hugging Face names and conventions to this module's, as mlx-lm's ``sanitize``
    does for the trunk: per-expert weights stacked into ``switch_mlp``, and zero-centred
    RMSNorm weights (``1 + w`` in Qwen3-Next / Qwen3.5) shifted by one."""
    out = dict(weights)
    expert = re.compile(r"^(layers\.\d+\.mlp)\.experts\.0\.(\w+)\.(weight|scales|biases)$")
    for key in [k for k in out if expert.match(k)]:
        m = expert.match(key)
        assert m is not None
        prefix, name, kind = m.groups()
        out[f"{prefix}.switch_mlp.{name}.{kind}"] = mx.stack(
            [out.pop(f"{prefix}.experts.{e}.{name}.{kind}") for e in range(num_experts)])
    if hf_layout:
        for key, value in out.items():
            if key.endswith("norm.weight") and value.ndim == 1:
                out[key] = value + 1.0
    return out


def load_mtp_head(model: Any, model_dir: Path) -> tuple[MTPHead, TrunkParts]:
    """The MTP head of the checkpoint in ``model_dir``, for ``model`` (its trunk, loaded
    by ``mlx_lm.load``); ``MTPUnavailable`` says why there is none."""
    problem = mtp_problem(model_dir)
    if problem:
        raise MTPUnavailable(problem)
    parts = trunk_parts(model)
    raw, hf_layout = _raw_mtp_weights(model_dir)
    layers = {int(m.group(1)) for k in raw if (m := re.match(r"layers\.(\d+)\.", k))}
    if layers != {0}:
        raise MTPUnavailable(f"the checkpoint in {model_dir} has {len(layers)} MTP layers; "
                             "this server drafts with exactly one")
    weights = sanitize(raw, hf_layout, getattr(parts.args, "num_experts", 0) or 0)
    head = MTPHead(parts)
    config = _config(model_dir)
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    group, bits = quantization.get("group_size", 64), quantization.get("bits", 4)
    if quantization and any(k.endswith(".scales") for k in weights):
        # stored quantized: the modules the checkpoint holds quantized, each with its
        # own settings where the config gives them (mlx-lm's per-path overrides)
        def stored(path: str, _: nn.Module) -> bool | dict:
            if f"{path}.scales" not in weights:
                return False
            own = quantization.get(f"{PREFIX}{path}")
            return own if isinstance(own, dict) else True

        nn.quantize(head, group_size=group, bits=bits, class_predicate=stored)
    dtype = parts.inner.norm.weight.dtype
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in weights.items()}
    try:
        head.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise MTPUnavailable(f"the {PREFIX}* weights in {model_dir} do not fit an MTP head "
                             f"for this model: {e}") from e
    if quantization and not any(k.endswith(".scales") for k in weights):
        predicate = getattr(model, "quant_predicate", None)

        def quantizable(path: str, module: nn.Module) -> bool | dict:
            if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group:
                return False
            return predicate(f"{PREFIX}{path}", module) if predicate else True

        nn.quantize(head, group_size=group, bits=bits, class_predicate=quantizable)
    mx.eval(head.parameters())
    return head, parts
