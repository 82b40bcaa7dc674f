"""Whether a model can be sharded as its profile asks, read from its config alone (no
weights): ``python -m serve_app check`` refuses what cannot work, naming the key."""

from __future__ import annotations

from pathlib import Path

from serve_app.config.profile import ParallelProfile

# Dimensions tensor parallelism splits over the ranks (mlx-lm's ``shard``: attention and
# GDN heads, MLP widths), by config key; those a config has must divide by N.
TENSOR_SPLIT = ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "moe_intermediate_size", "shared_expert_intermediate_size",
                "linear_num_key_heads", "linear_num_value_heads")
# Model types whose shard() splits the vocabulary (the output head) too (mlx-lm 0.32).
VOCAB_SPLIT = ("qwen3_5", "qwen3_5_moe")


def parallel_problem(config: dict, parallel: ParallelProfile, model_dir: Path | None = None
                     ) -> tuple[str, str] | None:
    """``(key under parallel, why)`` when the model cannot be sharded so, else None."""
    from serve_app.models.compat import model_classes

    text = config.get("text_config", config)
    mode, n = parallel.mode, parallel.size
    try:
        model_cls, args_cls = model_classes(config)
    except Exception as exc:
        return mode, f"mlx-lm has no model for this checkpoint's type: {exc}"
    model = model_cls(args_cls.from_dict(config))  # arrays are lazy: nothing is allocated
    model_type = config.get("model_type")
    if mode == "tensor":
        if not hasattr(model, "shard"):
            return mode, (f"mlx-lm's {model_type!r} model has no tensor-parallel shard(): "
                          "use pipeline, or a model type that has it")
        keys = TENSOR_SPLIT + (("vocab_size",) if model_type in VOCAB_SPLIT else ())
        for key in keys:
            value = text.get(key)
            if isinstance(value, int) and value > 0 and value % n:
                return mode, f"{n} does not divide the model's {key} ({value})"
        quantization = config.get("quantization")
        group = quantization.get("group_size") if isinstance(quantization, dict) else None
        heads, dim = text.get("num_attention_heads"), text.get("head_dim")
        if group and isinstance(heads, int) and isinstance(dim, int) and heads * dim // n % group:
            return mode, (f"each rank's share of the attention output ({heads * dim // n}) "
                          f"is not a multiple of the quantization group size ({group})")
    else:
        inner = getattr(model, "model", None)
        if inner is None or not hasattr(inner, "pipeline"):
            return mode, (f"mlx-lm's {model_type!r} model has no pipeline(): use tensor, or a "
                          "model type that has it")
        layers = text.get("num_hidden_layers")
        if isinstance(layers, int) and n > layers:
            return mode, f"{n} ranks for {layers} layers: every rank needs one at least"
        if model_dir is not None and not (model_dir / "model.safetensors.index.json").exists():
            return mode, (f"{model_dir} has no model.safetensors.index.json, which mlx-lm's "
                          "sharded_load reads to give each rank its layers' files")
    return None
