"""What the memory plan needs to know about a model without loading it: its config.json,
the bytes of its weight files and the dtype its activations (and so its KV) are in.

Embedded models are materialized (tiny, built once); a directory is read as it is; a
hub repo is read from the local Hugging Face cache, or, when asked (``check --hub``),
from the hub's file listing and its config.json alone, never its weights.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from serve_app.config.profile import ModelProfile, source_kind
from serve_app.kvquant.format import KVQuant, quant_of
from serve_app.memory.plan import ModelFootprint, footprint
from serve_app.memory.shapes import CacheShape, cache_shape_from_config

# safetensors dtype names -> the activation dtypes config.json uses
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_MAX_HEADER = 64 << 20


class FactsUnavailable(Exception):
    """The model's config or weight sizes cannot be read here (the message says why)."""


@dataclass(frozen=True)
class ModelFacts:
    """A model's config.json, the bytes of its ``*.safetensors`` files, and the dtype of its
    activations read from the weights' headers (None when only the config is known)."""

    config: dict
    weights_bytes: int
    activation_dtype: str | None
    where: str

    def cache_shape(self, kv_quant: KVQuant | None = None) -> CacheShape:
        try:
            return cache_shape_from_config(self.config, self.activation_dtype, kv_quant)
        except ValueError as exc:
            raise FactsUnavailable(f"{self.where}: {exc}") from None


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (8 bytes of length, then JSON): no tensor read."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise FactsUnavailable(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise FactsUnavailable(f"{path}: safetensors header of {n} bytes")
        try:
            return json.loads(f.read(n))
        except ValueError:
            raise FactsUnavailable(f"{path}: unreadable safetensors header") from None


def activation_dtype(files: list[Path]) -> str | None:
    """The dtype the model computes in: its token embedding's, or for a quantized
    embedding its scales' (mlx-lm dequantizes to them)."""
    for path in files:
        header = safetensors_header(path)
        for suffix in ("embed_tokens.scales", "embed_tokens.weight"):
            for name, info in header.items():
                if name.endswith(suffix) and isinstance(info, dict):
                    dtype = _SAFETENSORS_DTYPES.get(str(info.get("dtype")))
                    if dtype:
                        return dtype
    return None


def facts_from_dir(path: Path) -> ModelFacts:
    """A model directory in mlx-lm's format; incomplete downloads are refused (the plan
    would count too few weight bytes)."""
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except OSError as exc:
        raise FactsUnavailable(f"{config_path}: cannot read: {exc.strerror}") from None
    except ValueError:
        raise FactsUnavailable(f"{config_path}: not valid JSON") from None
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError):
            raise FactsUnavailable(f"{index}: unreadable") from None
        missing = sorted(wanted - {f.name for f in files})
        if missing:
            raise FactsUnavailable(f"{path}: weight files missing (an incomplete download?): "
                                   f"{', '.join(missing[:3])}")
    if not files:
        raise FactsUnavailable(f"{path}: no *.safetensors weight files")
    return ModelFacts(config, sum(f.stat().st_size for f in files), activation_dtype(files),
                      str(path))


def facts_from_hub(repo: str, revision: str | None) -> ModelFacts:
    """From the hub without the weights: the file listing's sizes and config.json."""
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        config_path = hf_hub_download(repo, "config.json", revision=revision)
        config = json.loads(Path(config_path).read_text())
    except Exception as exc:  # network, auth, a missing repo: say which
        raise FactsUnavailable(f"hub {repo}: {type(exc).__name__}: {exc}") from None
    sizes = [s.size or 0 for s in info.siblings or [] if s.rfilename.endswith(".safetensors")
             and "/" not in s.rfilename]
    if not sizes:
        raise FactsUnavailable(f"hub {repo}: no *.safetensors weight files listed")
    return ModelFacts(config, sum(sizes), None, f"hub:{repo}")


def cached_hub_dir(repo: str, revision: str | None) -> Path | None:
    """The repo's snapshot in the local Hugging Face cache, if there is one (no network)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, local_files_only=True))
    except Exception:  # not cached (LocalEntryNotFoundError), or a cache we cannot read
        return None


def real_model_facts(name: str) -> ModelFacts:
    """An embedded real model's facts before it is downloaded: its known config and size."""
    from serve_app.config.catalog import REAL_MODELS
    from serve_app.models import minilm, smollm2

    fmt = REAL_MODELS[name]
    dtype = "float32" if fmt == "q4" else fmt
    known = minilm if name.startswith("all-minilm") else smollm2
    config = {**known.CONFIG, "torch_dtype": dtype}
    return ModelFacts(config, known.WEIGHTS_BYTES[fmt], dtype,
                      f"embedded:{name} (not downloaded yet)")


def model_facts(model: ModelProfile, home: Path | None = None, hub: bool = False) -> ModelFacts:
    """The facts of a profile's model; ``hub``: ask the hub when the local cache lacks it."""
    kind = source_kind(model.source)
    if kind == "embedded":
        from serve_app.config.catalog import EMBEDDED_PREFIX, REAL_MODELS
        from serve_app.config.paths import default_home
        from serve_app.models.embedded import is_materialized, materialize

        name = model.source[len(EMBEDDED_PREFIX):]
        if name in REAL_MODELS and not is_materialized(name, home):
            return real_model_facts(name)  # known without its 93 MB download
        return facts_from_dir(materialize(name, home or default_home()))
    if kind == "path":
        return facts_from_dir(Path(model.source).expanduser())
    local = cached_hub_dir(model.source, model.revision)
    if local is not None:
        return facts_from_dir(local)
    from serve_app.memory.sizing import KNOWN_REPOS, quantized_weight_bytes

    if model.source in KNOWN_REPOS and model.revision is None:
        config = KNOWN_REPOS[model.source]
        return ModelFacts(config, quantized_weight_bytes(config), "bfloat16",
                          f"{model.source} (its known shape: not downloaded yet)")
    if not hub:
        raise FactsUnavailable(f"{model.source} is not in the local Hugging Face cache; "
                               "`check --hub` reads its size from the hub")
    return facts_from_hub(model.source, model.revision)


def model_footprint(model: ModelProfile, home: Path | None = None,
                    hub: bool = False) -> ModelFootprint:
    """The model's planned footprint from its facts (``FactsUnavailable`` if unknown)."""
    facts = model_facts(model, home, hub)
    return footprint(model, facts.weights_bytes, facts.cache_shape(quant_of(model.kv_cache)),
                     vision=isinstance(facts.config.get("vision_config"), dict))


def profile_footprints(models: list[ModelProfile], home: Path | None = None,
                       hub: bool = False) -> tuple[list[ModelFootprint], list[tuple[str, str]]]:
    """Footprints of the models that could be read, and (name, why) for the others."""
    known: list[ModelFootprint] = []
    unknown: list[tuple[str, str]] = []
    for m in models:
        try:
            known.append(model_footprint(m, home, hub))
        except FactsUnavailable as exc:
            unknown.append((m.name, str(exc)))
    return known, unknown
