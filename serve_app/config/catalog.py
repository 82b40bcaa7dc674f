"""The embedded models a profile may name (``source: embedded:NAME``) and the profile keys
each brings by default: data only, so the profile is checked without loading MLX.
``serve_app.models.embedded`` builds or materializes them."""

from __future__ import annotations

EMBEDDED_PREFIX = "embedded:"
# The tiny deterministic random-weight models, each in every weight format.
# ``tiny-hybrid-mtp`` is a Qwen3.5 checkpoint (Hugging Face layout) with an MTP head;
# ``tiny-vl`` and ``tiny-qwen25-vl`` are vision-language models (Qwen3.5's, Qwen2.5-VL's);
# ``tiny-bert`` embeds and ``tiny-bert-rerank`` reranks (BERT encoders); ``tiny-xlmr`` and
# ``tiny-xlmr-rerank`` the same in XLM-RoBERTa's layout.
BASE_NAMES = ("tiny-dense", "tiny-hybrid", "tiny-hybrid-mtp", "tiny-vl", "tiny-qwen25-vl",
              "tiny-bert", "tiny-bert-rerank", "tiny-xlmr", "tiny-xlmr-rerank")
FORMATS = ("fp32", "bf16", "fp16", "q4")
# Real models read from a package (serve_app/models/smollm2.py): name -> weight format.
# ``smollm2-135m`` is the GGUF's own 4-bit, the format that decodes fastest on MLX's CPU
# backend (10 tok/s here against 5.8 in fp32); the others are it, dequantized.
REAL_MODELS: dict[str, str] = {
    "smollm2-135m": "q4", "smollm2-135m-fp32": "float32", "smollm2-135m-bf16": "bfloat16",
    # all-MiniLM-L6-v2 (serve_app/models/minilm.py): the wheel's fp32, and cast.
    "all-minilm-l6-v2": "float32", "all-minilm-l6-v2-bf16": "bfloat16",
    "all-minilm-l6-v2-fp16": "float16",
}
# Profile keys an embedded model takes unless its profile sets them (even to null).
# SmolLM2's own template (its GGUF's) has no tools: it is served with ChatML and
# Hermes-style tools, its default system prompt kept (serve_app/config/chat_templates.py).
PROFILE_DEFAULTS: dict[str, dict[str, str]] = {
    name: {"chat_template": "smollm2-tools", "tool_call_format": "json_tools"}
    for name in REAL_MODELS
}


# What an embedded model serves when its profile does not say (``models[].task``).
EMBEDDED_TASKS = {"tiny-bert": "embed", "tiny-bert-rerank": "rerank", "all-minilm-l6-v2": "embed",
                  "tiny-xlmr": "embed", "tiny-xlmr-rerank": "rerank"}


def task_of_config(config: dict) -> str:
    """The task a checkpoint's config implies: an encoder (BERT, RoBERTa) embeds, or reranks with a
    classifier head (a cross-encoder); anything else generates."""
    if config.get("model_type") not in ("bert", "roberta", "xlm-roberta"):
        return "generate"
    archs = config.get("architectures") or []
    return "rerank" if any(a.endswith("ForSequenceClassification") for a in archs) else "embed"


def default_task(source: str) -> str:
    """``models[].task``'s default for ``source``: an embedded model's own, a local
    checkpoint's config's, else generate (a hub repo is not read before it downloads)."""
    import json
    from pathlib import Path

    if source.startswith(EMBEDDED_PREFIX):
        name = source[len(EMBEDDED_PREFIX):]
        for fmt in FORMATS:  # a variant's task is its base model's
            if fmt != "fp32" and name.endswith(f"-{fmt}"):
                name = name[: -len(fmt) - 1]
        return EMBEDDED_TASKS.get(name, "generate")
    try:
        return task_of_config(json.loads((Path(source).expanduser() / "config.json")
                                         .read_text()))
    except (OSError, ValueError):
        return "generate"


def variant_name(base: str, fmt: str) -> str:
    """``tiny-hybrid`` in fp32, ``tiny-hybrid-bf16`` in bf16, ..."""
    return base if fmt == "fp32" else f"{base}-{fmt}"


def profile_defaults(source: str) -> dict[str, str]:
    """The profile keys ``source`` (``embedded:NAME``) brings by default; {} for others."""
    if not source.startswith(EMBEDDED_PREFIX):
        return {}
    return dict(PROFILE_DEFAULTS.get(source[len(EMBEDDED_PREFIX):], {}))


def embedded_names() -> list[str]:
    """Every embedded model's name: the real ones first, then the random-weight ones."""
    return list(REAL_MODELS) + sorted(variant_name(b, f) for b in BASE_NAMES for f in FORMATS)
