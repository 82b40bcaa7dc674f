"""Images as requests carry them: decoded, bounded, and refused with a clear message."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass
from typing import Any

from serve_app.multimodal.fetch import FetchError, UrlFetch, fetch_image

DATA_URL = re.compile(r"^data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,",
                      re.IGNORECASE)


@dataclass(frozen=True)
class ImageLimits:
    """What one request may send (the profile's ``vision`` keys)."""

    max_bytes: int = 20 * 1024 * 1024  # one image, encoded
    max_pixels: int = 16_000_000  # one image, width x height
    max_images: int = 16  # per request (its whole conversation)
    fetch: UrlFetch = UrlFetch()  # web addresses (off unless the profile turns it on)


class ImageError(ValueError):
    """A 400: the image cannot be used (the message says why)."""


def image_bytes(url: str, limits: ImageLimits) -> bytes:
    """An ``image_url``'s bytes: a base64 data URL, or an http(s) address where the profile
    allows fetching (``limits.fetch``: off by default, since a server that fetches for its
    clients is a proxy into its own network). A local path is never read."""
    if not isinstance(url, str) or not url:
        raise ImageError("the image URL is empty")
    match = DATA_URL.match(url)
    if match is None:
        if url.lower().startswith(("http://", "https://")):
            try:
                return fetch_image(url, limits.fetch, limits.max_bytes)
            except FetchError as exc:
                raise ImageError(str(exc)) from None
        raise ImageError("an image URL must be a base64 data URL (data:image/png;base64,...)")
    media = (match.group("type") or "").lower()
    if media and not media.startswith("image/"):
        raise ImageError(f"the data URL's media type is {media!r}, not an image")
    return decode_base64(url[match.end():], limits)


def decode_base64(data: str, limits: ImageLimits) -> bytes:
    """Base64 text to bytes, refusing what is over ``limits.max_bytes`` before decoding."""
    if len(data) * 3 // 4 > limits.max_bytes + 3:
        raise ImageError(f"the image is over {limits.max_bytes} bytes")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("the image data is not valid base64") from None
    if len(raw) > limits.max_bytes:
        raise ImageError(f"the image is {len(raw)} bytes, over the limit of {limits.max_bytes}")
    if not raw:
        raise ImageError("the image data is empty")
    return raw


def open_image(raw: bytes, limits: ImageLimits) -> Any:
    """A decoded RGB ``PIL.Image``; its size is checked from the header before the pixels
    are decoded, so a small file that expands to billions of pixels costs nothing."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(raw))
    except (UnidentifiedImageError, OSError, ValueError):
        raise ImageError("the data is not an image this server can read (PNG, JPEG, GIF, "
                         "WebP, BMP, ...)") from None
    width, height = image.size
    if width < 1 or height < 1:
        raise ImageError("the image has no pixels")
    if width * height > limits.max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height} pixels, over the "
                         f"limit of {limits.max_pixels}")
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        raise ImageError("the image data is truncated or corrupt") from None
