"""A vision model's image processor (Hugging Face's, from the model's directory): an image
becomes pixel patches, its grid, and the number of tokens it takes in the prompt."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serve_app.multimodal.images import ImageError

logger = logging.getLogger(__name__)

DETAILS = ("auto", "low", "high")
LOW_DETAIL_PIXELS = 448 * 448  # ``detail: low``: at most this many pixels reach the tower


@dataclass(frozen=True)
class ProcessedImage:
    """One image as the vision tower takes it. ``digest`` names its content as processed
    (pixels and grid), so the same picture sent as PNG or JPEG of equal pixels, or
    resized to equal patches, is one image to every cache."""

    pixel_values: np.ndarray
    grid: tuple[int, int, int]  # (t, h, w) in patches
    tokens: int  # its placeholder tokens in the prompt
    digest: str


class ImageProcessor:
    """The model's processor with the resolution knob ``detail`` turns."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoImageProcessor

        config = json.loads((model_dir / "preprocessor_config.json").read_text())
        self.merge = int(config.get("merge_size", 2))
        self._inner = AutoImageProcessor.from_pretrained(str(model_dir))
        size = getattr(self._inner, "size", None) or {}
        self.max_pixels = int(size.get("longest_edge") or config.get("max_pixels") or 0)

    def process(self, image: Any, detail: str = "auto") -> ProcessedImage:
        if detail not in DETAILS:
            raise ImageError(f"detail must be one of {', '.join(DETAILS)}, not {detail!r}")
        kwargs: dict[str, Any] = {}
        if detail == "low" and self.max_pixels:
            size = dict(self._inner.size)
            size["longest_edge"] = min(self.max_pixels, LOW_DETAIL_PIXELS)
            size["shortest_edge"] = min(size.get("shortest_edge", 0), size["longest_edge"])
            kwargs["size"] = size
        out = self._inner(images=[image], return_tensors="np", **kwargs)
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        t, h, w = (int(v) for v in np.asarray(out["image_grid_thw"]).reshape(-1, 3)[0])
        digest = hashlib.sha256()
        digest.update(np.asarray([t, h, w], dtype=np.int64).tobytes())
        digest.update(pixels.tobytes())
        return ProcessedImage(pixels, (t, h, w), t * h * w // (self.merge ** 2),
                              digest.hexdigest())
