"""The vision tower (mlx-vlm's model class and the checkpoint's own weights) and the cache
of its outputs by image: a repeated image skips the encoder, whatever text surrounds it."""

from __future__ import annotations

import dataclasses
import glob
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.models.compat import vision_tower_classes
from serve_app.multimodal.processor import ProcessedImage

PREFIXES = ("vision_tower.", "model.visual.", "visual.")  # mlx-vlm's, Hugging Face's


@dataclass
class VisionStats:
    """The encoder's counters (engine thread writes, a scrape reads)."""

    images: int = 0  # images the tower encoded
    encoder_seconds: float = 0.0
    cache_hits: int = 0  # images whose features came from the cache
    prefix_hits: int = 0  # images the restored prefix covered (no features needed)
    cached_bytes: int = 0


def has_vision(model_dir: Path) -> bool:
    """Whether the checkpoint is a vision-language model this server can serve images to."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict) and \
        (model_dir / "preprocessor_config.json").exists()


class VisionTower:
    """Encodes processed images on the engine thread (MLX's one thread)."""

    def __init__(self, model_dir: Path) -> None:
        import mlx.core as mx

        config = json.loads((model_dir / "config.json").read_text())
        self.config = config
        model_cls, config_cls = vision_tower_classes(config["model_type"])
        fields = dataclasses.fields(config_cls)
        names = {f.name for f in fields}
        vision = {k: v for k, v in config["vision_config"].items() if k in names}
        self.model = model_cls(config_cls(**vision))
        weights: dict[str, Any] = {}
        for file in sorted(glob.glob(str(model_dir / "*.safetensors"))):
            for key, value in mx.load(file).items():  # type: ignore[union-attr]
                for prefix in PREFIXES:
                    if key.startswith(prefix):
                        weights[key[len(prefix):]] = value
        if not weights:
            raise ValueError(f"{model_dir} has a vision_config but no vision tower weights")
        if hasattr(self.model, "sanitize"):
            weights = self.model.sanitize(weights)
        self.model.load_weights(list(weights.items()), strict=True)
        mx.eval(self.model.parameters())
        self.dtype = self.model.patch_embed.proj.weight.dtype

    def encode(self, image: ProcessedImage) -> Any:
        """The image's features, one row per placeholder token."""
        import mlx.core as mx

        pixels = mx.array(image.pixel_values).astype(self.dtype)
        out = self.model(pixels, mx.array([image.grid], dtype=mx.int32))
        features = out[0] if isinstance(out, tuple) else out
        mx.eval(features)
        if features.shape[0] != image.tokens:
            raise ValueError(f"the vision tower gave {features.shape[0]} features for an image "
                             f"of {image.tokens} tokens")
        return features


class FeatureCache:
    """The tower's outputs by image digest, least recently used first out, within
    ``max_bytes`` (counted in the memory plan as the model's vision cache)."""

    def __init__(self, tower: VisionTower, max_bytes: int, stats: VisionStats) -> None:
        self.tower = tower
        self.max_bytes = max_bytes
        self.stats = stats
        self._items: OrderedDict[str, Any] = OrderedDict()

    def features(self, image: ProcessedImage) -> Any:
        hit = self._items.get(image.digest)
        if hit is not None:
            self._items.move_to_end(image.digest)
            self.stats.cache_hits += 1
            return hit
        tic = time.perf_counter()
        features = self.tower.encode(image)
        self.stats.encoder_seconds += time.perf_counter() - tic
        self.stats.images += 1
        if features.nbytes <= self.max_bytes:
            self._items[image.digest] = features
            self.stats.cached_bytes += features.nbytes
            while self.stats.cached_bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self.stats.cached_bytes -= old.nbytes
        return features

    def clear(self) -> None:
        self._items.clear()
        self.stats.cached_bytes = 0
