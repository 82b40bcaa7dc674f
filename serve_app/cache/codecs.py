"""Codecs for recurrent-state sidecars, fail-closed.

``fp32`` is lossless and the default. ``bf16`` and ``int8`` trade precision
for size; ``rht_int8`` / ``rht_int16`` first spread each row's energy with a
random Hadamard transform (a fixed, seeded sign vector, then a normalized
Walsh-Hadamard transform over the last axis, zero-padded to a power of two),
then quantize symmetrically per row with fp32 scales. Every non-fp32 codec is
inexact and is never used where exactness is promised.

Decoding validates everything it is given (codec name and version, dtypes,
scale shape and positivity, finite values, rotation seed and dimension) and
raises ``CodecError`` on any doubt: a bad sidecar is rejected, never guessed.
"""

from __future__ import annotations

import json

import numpy as np

CODEC_VERSION = "1"
CODECS = ("fp32", "bf16", "int8", "rht_int8", "rht_int16")
DEFAULT_RHT_SEED = 0x5EED
_QMAX = {"int8": 127, "rht_int8": 127, "rht_int16": 32767}
_QDTYPE = {"int8": np.int8, "rht_int8": np.int8, "rht_int16": np.int16}


class CodecError(ValueError):
    """A sidecar tensor that does not decode; the caller walks back."""


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _signs(seed: int, dim: int) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(seed))
    return rng.choice(np.array([-1.0, 1.0], dtype=np.float32), size=dim)


def _fwht(x: np.ndarray) -> np.ndarray:
    """Normalized Walsh-Hadamard transform over the last axis (its own inverse)."""
    n = x.shape[-1]
    y = x.astype(np.float32, copy=True)
    h = 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        a, b = y[..., 0, :], y[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(*x.shape[:-1], n)
        h *= 2
    return y / np.float32(np.sqrt(n))


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def encode(name: str, x: np.ndarray, codec: str, seed: int = DEFAULT_RHT_SEED
           ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and string metadata that represent ``x`` under ``codec``."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    x32 = np.array(x, dtype=np.float32)  # a copy: encoded tensors never alias the input
    meta = {"codec": codec, "version": CODEC_VERSION, "shape": json.dumps(list(x.shape))}
    if codec == "fp32":
        return {f"{name}.data": np.ascontiguousarray(x32)}, meta
    if codec == "bf16":
        return {f"{name}.data": _to_bf16_bits(x32)}, meta
    rows = x32.reshape(-1, x32.shape[-1]) if x32.ndim else x32.reshape(1, 1)
    if codec.startswith("rht_"):
        dim = _next_pow2(rows.shape[-1])
        padded = np.zeros((rows.shape[0], dim), dtype=np.float32)
        padded[:, : rows.shape[-1]] = rows
        rows = _fwht(padded * _signs(seed, dim))
        meta.update({"rht_seed": str(seed), "rht_dim": str(dim)})
    qmax = _QMAX[codec]
    scale = np.abs(rows).max(axis=-1, keepdims=True) / np.float32(qmax)
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.clip(np.rint(rows / scale), -qmax, qmax).astype(_QDTYPE[codec])
    return {f"{name}.q": q, f"{name}.scale": scale}, meta


def decode(name: str, tensors: dict[str, np.ndarray], meta: dict[str, str],
           seed: int = DEFAULT_RHT_SEED) -> np.ndarray:
    """The float32 array encoded under ``name``; ``CodecError`` on any inconsistency."""
    codec = meta.get("codec")
    if codec not in CODECS:
        raise CodecError(f"{name}: unknown codec {codec!r}")
    if meta.get("version") != CODEC_VERSION:
        raise CodecError(f"{name}: codec version {meta.get('version')!r} != {CODEC_VERSION}")
    try:
        shape = tuple(int(d) for d in json.loads(meta["shape"]))
    except (KeyError, ValueError, TypeError):
        raise CodecError(f"{name}: missing or malformed shape") from None
    if any(d < 0 for d in shape):
        raise CodecError(f"{name}: negative dimension in {shape}")
    size = int(np.prod(shape)) if shape else 1
    if codec in ("fp32", "bf16"):
        data = _tensor(tensors, f"{name}.data", np.float32 if codec == "fp32" else np.uint16)
        if data.size != size:
            raise CodecError(f"{name}: {data.size} values for shape {shape}")
        out = data if codec == "fp32" else _from_bf16_bits(data)
        return _finite(name, out.reshape(shape))
    q = _tensor(tensors, f"{name}.q", _QDTYPE[codec])
    scale = _tensor(tensors, f"{name}.scale", np.float32)
    if q.ndim != 2 or scale.shape != (q.shape[0], 1):
        raise CodecError(f"{name}: scale shape {scale.shape} does not fit q {q.shape}")
    if not np.isfinite(scale).all() or (scale <= 0).any():
        raise CodecError(f"{name}: scales must be finite and positive")
    last = shape[-1] if shape else 1
    rows = q.astype(np.float32) * scale
    if codec.startswith("rht_"):
        if meta.get("rht_seed") != str(seed):
            raise CodecError(f"{name}: rotation seed {meta.get('rht_seed')!r} != {seed}")
        dim = _next_pow2(last)
        if meta.get("rht_dim") != str(dim) or q.shape[1] != dim:
            raise CodecError(f"{name}: rotation dimension {meta.get('rht_dim')!r} != {dim}")
        rows = (_fwht(rows) * _signs(seed, dim))[:, :last]
    if rows.size != size:
        raise CodecError(f"{name}: {rows.size} values for shape {shape}")
    return _finite(name, rows.reshape(shape))


def _tensor(tensors: dict[str, np.ndarray], key: str, dtype) -> np.ndarray:
    if key not in tensors:
        raise CodecError(f"missing tensor {key}")
    t = tensors[key]
    if t.dtype != np.dtype(dtype):
        raise CodecError(f"{key}: dtype {t.dtype} where {np.dtype(dtype)} was expected")
    return t


def _finite(name: str, x: np.ndarray) -> np.ndarray:
    if not np.isfinite(x).all():
        raise CodecError(f"{name}: non-finite values")
    return x
