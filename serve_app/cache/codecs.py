"""Codecs for recurrent-state sidecars, fail-closed.

``fp32`` is the exact codec and the default: each array is stored in its own
dtype, bit for bit (float32 as float32, a bf16 conv state as its uint16 bit
pattern, float16 as float16), so it is lossless for every state dtype. The
lossy codecs work on the values widened to float32 and decode back to the
array's own dtype and shape: ``bf16`` and ``int8`` trade precision for size;
``rht_int8`` / ``rht_int16`` first spread each row's energy with a random
Hadamard transform (a fixed, seeded sign vector, then a normalized
Walsh-Hadamard transform over the last axis, zero-padded to a power of two),
then quantize symmetrically per row with fp32 scales. A lossy sidecar is never
restored where exactness is asked for (``EXACT``).

Decoding validates everything it is given (codec name and version, dtypes,
scale shape and positivity, finite values, rotation seed and dimension) and
raises ``CodecError`` on any doubt: a bad sidecar is rejected, never guessed.
"""

from __future__ import annotations

import json

import numpy as np

from serve_app.cache.payload import STORAGE, Tensor

CODEC_VERSION = "2"  # 2: arrays keep their own dtype ("dtype" in the metadata)
EXACT = "fp32"
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


def encode(name: str, t: Tensor, codec: str, seed: int = DEFAULT_RHT_SEED
           ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Tensors and string metadata that represent ``t`` under ``codec``."""
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}")
    meta = {"codec": codec, "version": CODEC_VERSION, "shape": json.dumps(list(t.shape)),
            "dtype": t.dtype}
    if codec == EXACT:  # a copy: encoded tensors never alias the input
        return {f"{name}.data": np.array(t.data, order="C")}, meta
    x32 = t.to_float32()
    if codec == "bf16":
        return {f"{name}.data": Tensor.from_float32(x32, "bfloat16").data}, meta
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
           seed: int = DEFAULT_RHT_SEED) -> Tensor:
    """The array encoded under ``name``, in its own dtype; ``CodecError`` on any doubt."""
    codec = meta.get("codec")
    if codec not in CODECS:
        raise CodecError(f"{name}: unknown codec {codec!r}")
    if meta.get("version") != CODEC_VERSION:
        raise CodecError(f"{name}: codec version {meta.get('version')!r} != {CODEC_VERSION}")
    dtype = meta.get("dtype")
    if dtype not in STORAGE:
        raise CodecError(f"{name}: unknown dtype {dtype!r}")
    try:
        shape = tuple(int(d) for d in json.loads(meta["shape"]))
    except (KeyError, ValueError, TypeError):
        raise CodecError(f"{name}: missing or malformed shape") from None
    if any(d < 0 for d in shape):
        raise CodecError(f"{name}: negative dimension in {shape}")
    size = int(np.prod(shape)) if shape else 1
    if codec == EXACT:
        data = _tensor(tensors, f"{name}.data", STORAGE[dtype])
        if data.size != size:
            raise CodecError(f"{name}: {data.size} values for shape {shape}")
        return _finite(name, Tensor(data.reshape(shape), dtype))
    if codec == "bf16":
        data = _tensor(tensors, f"{name}.data", np.uint16)
        if data.size != size:
            raise CodecError(f"{name}: {data.size} values for shape {shape}")
        values = Tensor(data.reshape(shape), "bfloat16").to_float32()
        return _finite(name, Tensor.from_float32(values, dtype))
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
    return _finite(name, Tensor.from_float32(rows.reshape(shape), dtype))


def encode_state(state: dict[str, Tensor], codec: str) -> tuple[dict[str, np.ndarray], str]:
    """A sidecar's tensors and the JSON of each array's codec metadata."""
    tensors: dict[str, np.ndarray] = {}
    codec_meta: dict[str, dict[str, str]] = {}
    for name, t in state.items():
        encoded, meta = encode(name, t, codec)
        tensors.update(encoded)
        codec_meta[name] = meta
    return tensors, json.dumps(codec_meta, sort_keys=True)


def decode_state(tensors: dict[str, np.ndarray], codec_meta_json: str,
                 exact: bool) -> dict[str, Tensor]:
    """Every array of a sidecar; ``CodecError`` if any fails, or is lossy when ``exact``."""
    try:
        codec_meta = json.loads(codec_meta_json)
    except (json.JSONDecodeError, TypeError):
        raise CodecError("codec metadata is not JSON") from None
    if not isinstance(codec_meta, dict) or not codec_meta:
        raise CodecError("no codec metadata")
    out = {}
    for name, meta in codec_meta.items():
        if not isinstance(meta, dict):
            raise CodecError(f"{name}: malformed codec metadata")
        if exact and meta.get("codec") != EXACT:
            raise CodecError(f"{name}: lossy codec {meta.get('codec')!r} where exact "
                             "state is required")
        out[name] = decode(name, tensors, meta)
    return out


def _tensor(tensors: dict[str, np.ndarray], key: str, dtype) -> np.ndarray:
    if key not in tensors:
        raise CodecError(f"missing tensor {key}")
    t = tensors[key]
    if t.dtype != np.dtype(dtype):
        raise CodecError(f"{key}: dtype {t.dtype} where {np.dtype(dtype)} was expected")
    return t


def _finite(name: str, t: Tensor) -> Tensor:
    if not t.is_finite():
        raise CodecError(f"{name}: non-finite values")
    return t
