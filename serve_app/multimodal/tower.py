"""The vision tower (mlx-vlm's model class and the checkpoint's own weights) and the cache
of its outputs by image: a repeated image skips the encoder, whatever text surrounds it."""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serve_app.models.compat import MROPE_STYLES, vision_tower_classes
from serve_app.multimodal.processor import ProcessedImage

PREFIXES = ("vision_tower.", "model.visual.", "visual.")  # mlx-vlm's, Hugging Face's


@dataclass
class VisionStats:
    """The encoder's counters (engine thread writes, a scrape reads)."""

    images: int = 0  # images the tower encoded
    calls: int = 0  # tower calls (images arriving together share one)
    encoder_seconds: float = 0.0
    cache_hits: int = 0  # images whose features came from the cache
    prefix_hits: int = 0  # images the restored prefix covered (no features needed)
    cached_bytes: int = 0


def has_vision(model_dir: Path) -> bool:
    """Whether the checkpoint is a vision-language model of a family this server places
    images for (``compat.MROPE_STYLES``); another family's text is served as a text model's."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config.get("vision_config"), dict) and \
        config.get("model_type") in MROPE_STYLES and \
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

    def encode(self, images: list[ProcessedImage]) -> list[Any]:
        """Each image's features, one row per placeholder token: one call of the tower for
        them all (its attention stays within each image; the rows come out as each image
        alone gives them, tested on every weight format)."""
        import mlx.core as mx

        pixels = mx.concatenate([mx.array(i.pixel_values).astype(self.dtype) for i in images])
        out = self.model(pixels, mx.array([i.grid for i in images], dtype=mx.int32))
        features = out[0] if isinstance(out, tuple) else out
        mx.eval(features)
        sizes = [i.tokens for i in images]
        if features.shape[0] != sum(sizes):
            raise ValueError(f"the vision tower gave {features.shape[0]} features for images "
                             f"of {sum(sizes)} tokens")
        if len(images) == 1:
            return [features]
        cuts = list(itertools.accumulate(sizes[:-1]))
        return list(mx.split(features, cuts, axis=0))


class FeatureCache:
    """The tower's outputs by image digest, least recently used first out, within
    ``max_bytes`` (counted in the memory plan as the model's vision cache)."""

    def __init__(self, tower: VisionTower, max_bytes: int, stats: VisionStats) -> None:
        self.tower = tower
        self.max_bytes = max_bytes
        self.stats = stats
        self._items: OrderedDict[str, Any] = OrderedDict()

    def __contains__(self, digest: str) -> bool:
        return digest in self._items

    def features(self, image: ProcessedImage) -> Any:
        hit = self._items.get(image.digest)
        if hit is not None:
            self._items.move_to_end(image.digest)
            self.stats.cache_hits += 1
            return hit
        return self.encode([image])[0]

    def encode(self, images: list[ProcessedImage]) -> list[Any]:
        """``images`` through the tower in one call, each kept (within ``max_bytes``)."""
        tic = time.perf_counter()
        encoded = self.tower.encode(images)
        self.stats.encoder_seconds += time.perf_counter() - tic
        self.stats.images += len(images)
        self.stats.calls += 1
        for image, features in zip(images, encoded, strict=True):
            if features.nbytes <= self.max_bytes and image.digest not in self._items:
                self._items[image.digest] = features
                self.stats.cached_bytes += features.nbytes
        while self.stats.cached_bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.stats.cached_bytes -= old.nbytes
        return encoded

    def clear(self) -> None:
        self._items.clear()
        self.stats.cached_bytes = 0
