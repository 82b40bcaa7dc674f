"""What a quantized K/V cache holds, and its arrays packed into one for the tiers.

mlx-lm quantizes K/V with ``mx.quantize`` along the head dimension: for each token
and head, ``head_dim`` values become ``head_dim * bits / 32`` packed ``uint32`` words,
plus one scale and one bias per ``group_size`` values in the activations' dtype. The
groups never span tokens, so a token's quantized K/V is a function of its float K/V
alone: blocks of them can be sliced, stored and restored like float K/V.

For the prefix cache's tiers the three arrays travel as one ``uint32`` array (the
words, then the scales and biases' bits), so a block keeps one keys and one values
array per layer whatever the format; ``unpack`` takes them apart again, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from serve_app.config.model_sections import KVCacheProfile

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
SCALE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVQuant:
    """K/V quantized to ``bits`` per value in groups of ``group_size`` values."""

    bits: int
    group_size: int

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"kv_cache bits must be one of {BITS}, not {self.bits}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"kv_cache group_size must be one of {GROUP_SIZES}, "
                             f"not {self.group_size}")

    @property
    def name(self) -> str:
        """``q8g64``: what blocks and layouts call this format."""
        return f"q{self.bits}g{self.group_size}"

    def fits(self, head_dim: int) -> bool:
        """Whether a head of ``head_dim`` values splits into whole groups (and words)."""
        return head_dim % self.group_size == 0 and head_dim * self.bits % 32 == 0

    def packed_width(self, head_dim: int, scale_dtype: str) -> int:
        """``uint32`` words per token and head once packed: words, then scales and biases."""
        return int(self._width_per_value(scale_dtype) * head_dim)

    def head_dim(self, packed_width: int, scale_dtype: str) -> int:
        """The head dimension a packed width came from (``packed_width``'s inverse)."""
        dim = Fraction(packed_width) / self._width_per_value(scale_dtype)
        if dim.denominator != 1:
            raise ValueError(f"{packed_width} words are no head of {self.name} "
                             f"with {scale_dtype} scales")
        return int(dim)

    def bytes_per_value(self, scale_dtype: str) -> float:
        """Bytes per cached value, scales and biases included (float16 K/V: 2)."""
        return float(self._width_per_value(scale_dtype) * 4)

    def _width_per_value(self, scale_dtype: str) -> Fraction:
        scale = SCALE_BYTES.get(scale_dtype)
        if scale is None:
            raise ValueError(f"no quantized K/V with {scale_dtype} scales")
        return Fraction(self.bits, 32) + Fraction(2 * scale, 4 * self.group_size)


def quant_of(settings: KVCacheProfile) -> KVQuant | None:
    """A profile's ``kv_cache`` as a format (None: float K/V)."""
    return None if settings.bits is None else KVQuant(settings.bits, settings.group_size)


def pack(triple: tuple) -> object:
    """``(words, scales, biases)`` as one ``uint32`` array, the same leading axes."""
    import mlx.core as mx

    words, scales, biases = triple
    side = mx.concatenate([scales, biases], axis=-1).view(mx.uint32)
    return mx.concatenate([words, side], axis=-1)


def unpack(packed, quant: KVQuant, scale_dtype: str) -> tuple:
    """The ``(words, scales, biases)`` that ``pack`` joined, bit for bit."""
    import mlx.core as mx

    dim = quant.head_dim(packed.shape[-1], scale_dtype)
    n_words = dim * quant.bits // 32
    side = packed[..., n_words:].view(getattr(mx, scale_dtype))
    groups = dim // quant.group_size
    return packed[..., :n_words], side[..., :groups], side[..., groups:]
