"""A prompt with images: each image's placeholder expanded to its tokens, the keys the
prefix cache hashes (an image's tokens stand for its content), and the rotary positions
its text stack reads."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serve_app.models.compat import mrope_positions
from serve_app.multimodal.images import ImageError, ImageLimits, image_bytes, open_image
from serve_app.multimodal.processor import ImageProcessor, ProcessedImage

KEY_BASE = 1 << 31  # image keys live above every vocabulary and fit the hash's uint32


@dataclass(frozen=True)
class ImageSpan:
    """One image's tokens in the prompt: ``image.tokens`` of them from ``start``."""

    start: int
    image: ProcessedImage

    @property
    def end(self) -> int:
        return self.start + self.image.tokens


@dataclass(frozen=True)
class VisionPrompt:
    """What the engine needs to serve a prompt with images.

    ``tokens`` are the model's (each image's placeholder repeated); ``keys`` are what the
    prefix cache hashes and stores: ``tokens`` with every image token replaced by a key of
    the image's content and the token's place in it, so a block's id covers the images in
    it (vLLM's "extra keys"): the same image restores, another at the same place misses.
    ``positions`` (3, len) are the multimodal rotary positions; a generated token at index
    ``i`` is at ``i + delta``."""

    tokens: list[int]
    keys: list[int]
    spans: tuple[ImageSpan, ...]
    positions: np.ndarray
    delta: int

    @property
    def first_image(self) -> int:
        return self.spans[0].start


def image_keys(digest: str, count: int) -> list[int]:
    """A key per image token: 31 bits of sha256(digest, index) each, so a block holding
    ``m`` of an image's tokens names it with ``31 m`` bits."""
    seed = bytes.fromhex(digest)
    return [KEY_BASE + int.from_bytes(hashlib.sha256(seed + i.to_bytes(4, "little")).digest()[:4],
                                      "little") % KEY_BASE for i in range(count)]


def expand_images(tokens: list[int], images: list[ProcessedImage],
                  pad: int) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The chat template rendered one ``pad`` per image: each becomes the image's tokens."""
    found = [i for i, t in enumerate(tokens) if t == pad]
    if len(found) != len(images):
        raise ImageError(f"the prompt has {len(found)} image placeholders for {len(images)} "
                         "images (does the text contain the model's image token?)")
    out: list[int] = []
    spans: list[ImageSpan] = []
    last = 0
    for at, image in zip(found, images, strict=True):
        out += tokens[last:at]
        spans.append(ImageSpan(len(out), image))
        out += [pad] * image.tokens
        last = at + 1
    out += tokens[last:]
    return out, tuple(spans)


def keyed(tokens: list[int], spans: tuple[ImageSpan, ...]) -> list[int]:
    keys = list(tokens)
    for span in spans:
        keys[span.start:span.end] = image_keys(span.image.digest, span.image.tokens)
    return keys


class ImagePrompts:
    """A vision model's requests with images: their images decoded and processed, their
    prompt expanded, keyed and placed (on the replica's worker threads, not the engine's)."""

    def __init__(self, model_dir: Path, limits: ImageLimits) -> None:
        self.config = json.loads((model_dir / "config.json").read_text())
        self.pad = int(self.config["image_token_id"])
        self.processor = ImageProcessor(model_dir)
        self.limits = limits

    def prompt(self, tokens: list[int], images: list[tuple[str, str]]) -> VisionPrompt:
        """``tokens`` (one placeholder per image) with ``images`` ((data URL, detail) in the
        prompt's order)."""
        if len(images) > self.limits.max_images:
            raise ImageError(f"the request has {len(images)} images, over the limit of "
                             f"{self.limits.max_images}")
        processed = [self.processor.process(open_image(image_bytes(url, self.limits),
                                                       self.limits), detail)
                     for url, detail in images]
        real, spans = expand_images(tokens, processed, self.pad)
        if spans and spans[-1].end >= len(real):
            raise ImageError("the prompt ends with an image: text must follow it")
        return self._placed(real, spans)

    def keys_of(self, tokens: list[int], images: list[ProcessedImage]) -> list[int]:
        """A rendering's tokens (one placeholder per image) as the cache keys them, its
        placeholders taken by ``images`` in order (a conversation's next-turn prefix)."""
        real, spans = expand_images(tokens, images[:tokens.count(self.pad)], self.pad)
        return keyed(real, spans)

    def from_keys(self, keys: list[int], images: list[ProcessedImage]) -> VisionPrompt:
        """The prompt whose cache keys are ``keys`` (``keys_of``'s), its image tokens
        ``images`` in order."""
        real = [self.pad if k >= KEY_BASE else k for k in keys]
        starts = [i for i, k in enumerate(keys) if k >= KEY_BASE
                  and (i == 0 or keys[i - 1] < KEY_BASE)]
        spans = tuple(ImageSpan(s, image) for s, image in zip(starts, images, strict=False))
        if len(spans) != len(starts) or keyed(real, spans) != keys:
            raise ImageError("the keys do not match the images")
        return self._placed(real, spans)

    def _placed(self, real: list[int], spans: tuple[ImageSpan, ...]) -> VisionPrompt:
        positions, delta = mrope_positions(real, [s.image.grid for s in spans], self.config)
        return VisionPrompt(real, keyed(real, spans), spans, positions, delta)
