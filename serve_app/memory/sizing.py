"""The "Sizing a Mac" table of docs/mac.md, from the memory plan's own arithmetic.

Two real-world shapes: a Qwen3-8B and a Qwen3.5-27B (a GDN hybrid) at mlx-lm's 4-bit
quantization (group 64, like mlx-community's ``-4bit`` checkpoints). Their weight bytes
come from mlx-lm's own model classes, built lazily (no weight is ever computed or
downloaded) and quantized as ``mlx_lm.convert`` would; their cache bytes from
``cache_shape_from_config``. ``python -m serve_app sizing-table`` prints the table and a
test fails when the page's copy differs.
"""

from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass
from typing import Any, cast

from serve_app.config.profile import ModelProfile, Profile
from serve_app.memory.machine import MachineMemory
from serve_app.memory.plan import ModelFootprint, fmt_bytes, footprint, plan_memory
from serve_app.memory.shapes import KV_STEP_TOKENS, CacheShape, cache_shape_from_config

GB = 1 << 30  # "16 GB" Macs have 16 GiB
MACHINES = (16, 32, 64, 128)
BATCHES = (1, 8)

QWEN3_8B = {
    "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QWEN35_27B = {
    "model_type": "qwen3_5", "tie_word_embeddings": False,
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
        "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
        "head_dim": 256, "vocab_size": 248320, "max_position_embeddings": 262144,
        "full_attention_interval": 4, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "dtype": "bfloat16",
    },
}


# mlx-community checkpoints of the table's shapes: the memory plan knows their size before
# they are downloaded (``check`` of configs/qwen-mac.yaml works offline).
KNOWN_REPOS = {"mlx-community/Qwen3-8B-4bit": QWEN3_8B,
               "mlx-community/Qwen3.5-27B-4bit": QWEN35_27B}


@dataclass(frozen=True)
class Shape:
    """One model of the table: its name, config, 4-bit weight bytes and longest context."""

    name: str
    config: dict
    weights_bytes: int
    max_context: int

    @property
    def cache(self) -> CacheShape:
        return cache_shape_from_config(self.config)


def quantized_weight_bytes(config: dict, bits: int = 4, group_size: int = 64) -> int:
    """Bytes of a model's weights after ``mlx_lm.convert -q`` of its bf16 checkpoint (bf16
    scales, biases and unquantized layers), lazily: nothing is computed."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from serve_app.models.compat import model_classes

    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(mx.bfloat16)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight
        model, _ = quantize_model(model, dict(config), group_size=group_size, bits=bits)
    # a list of (name, array) pairs (mlx types the result as a list or a dict)
    params = cast(list[tuple[str, Any]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in params)


def shapes() -> tuple[Shape, ...]:
    """The table's two models (Qwen3-8B: 128K with YaRN; Qwen3.5-27B: 256K native)."""
    return (Shape("Qwen3-8B 4-bit", QWEN3_8B, quantized_weight_bytes(QWEN3_8B), 131072),
            Shape("Qwen3.5-27B 4-bit", QWEN35_27B, quantized_weight_bytes(QWEN35_27B),
                  262144))


def _profile(models: list[dict]) -> Profile:
    """A profile of pinned models under the defaults: budget and hot tier ``auto``."""
    return Profile.model_validate({"models": models, "cache_store": {"hot_budget": "auto"}})


def _footprint(shape: Shape, batch: int, tokens: int) -> ModelFootprint:
    model = ModelProfile(name=shape.name.split()[0], source="org/model", pinned=True,
                         max_batch_size=batch, context_length=tokens)
    return footprint(model, shape.weights_bytes, shape.cache)


def longest_context(shape: Shape, machine: MachineMemory, batch: int) -> int:
    """The longest ``context_length`` (a multiple of 256, at most the model's) that the
    plan accepts for ``batch`` sequences of this model alone; 0 if none does."""
    def fits(tokens: int) -> bool:
        fp = _footprint(shape, batch, tokens)
        profile = _profile([{"name": fp.name, "source": "org/model", "pinned": True,
                             "max_batch_size": batch, "context_length": tokens}])
        return plan_memory(profile, [fp], machine).fits

    lo, hi = 0, shape.max_context // KV_STEP_TOKENS
    while lo < hi:  # the most steps of 256 tokens that fit
        mid = (lo + hi + 1) // 2
        if fits(mid * KV_STEP_TOKENS):
            lo = mid
        else:
            hi = mid - 1
    return lo * KV_STEP_TOKENS


def _tokens(n: int, limit: int) -> str:
    """Thousands of tokens (of 1024), rounded down."""
    if n < 1024:
        return "does not fit" if n == 0 else str(n)
    return f"{n // 1024}K" + (" (model max)" if n >= limit else "")


def sizing_table(models: tuple[Shape, ...] | None = None) -> str:
    """The docs/mac.md table: per Mac, the auto budget, and per model the longest
    ``context_length`` the plan accepts with ``max_batch_size`` 1 and 8 (the model pinned
    alone, ``hot_budget: auto``, SSD tier on)."""
    models = models or shapes()
    head = ["Mac", "memory budget (auto)"]
    for s in models:
        head += [f"{s.name}: 1 sequence", "8 sequences"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for gb in MACHINES:
        machine = MachineMemory(gb * GB)
        budget = plan_memory(_profile([{"name": "m", "source": "org/model"}]), [],
                             machine).budget_bytes
        row = [f"{gb} GB", fmt_bytes(budget)]
        for s in models:
            row += [_tokens(longest_context(s, machine, b), s.max_context) for b in BATCHES]
        lines.append("| " + " | ".join(row) + " |")
    notes = []
    for s in models:
        c = s.cache
        state = (f" and {fmt_bytes(c.state_bytes_per_sequence)} of recurrent state a sequence "
                 f"({c.recurrent_layers} GDN layers)" if c.state_bytes_per_sequence else "")
        notes.append(f"- {s.name}: weights {fmt_bytes(s.weights_bytes)}, KV "
                     f"{fmt_bytes(c.kv_bytes_per_token)} a token ({c.attention_layers} "
                     f"attention layers){state}.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"
