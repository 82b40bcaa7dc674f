"""Made-up images, as a client sends them (``bench.vision``'s, with a default size)."""

from __future__ import annotations

from bench import vision

SIZE = (90, 70)  # (height, width): 6x4 patches of the embedded tiny-vl's processor


def png(seed: int, size: tuple[int, int] = SIZE) -> bytes:
    return vision.png(seed, size)


def data_url(seed: int, size: tuple[int, int] = SIZE) -> str:
    return vision.image_url(seed, size)


def image_part(seed: int, detail: str = "auto") -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(seed), "detail": detail}}
