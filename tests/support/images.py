"""Made-up images, as a client sends them."""

from __future__ import annotations

import base64
import io

import numpy as np


def png(seed: int, size: tuple[int, int] = (90, 70)) -> bytes:
    """A random RGB picture, ``size`` (height, width), as PNG bytes."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(seed: int, size: tuple[int, int] = (90, 70)) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed, size)).decode()


def image_part(seed: int, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed), "detail": detail}}
