"""Sidecar codecs: round-trip error bounds, and every malformed case rejected."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve_app.cache.codecs import CODECS, CodecError, decode, decode_state, encode, encode_state
from serve_app.cache.payload import STORAGE, Tensor

RNG = np.random.default_rng(0)
# A GDN-like recurrent state (B, Hv, Dv, Dk) and a conv state with odd last dim.
STATES = [Tensor(RNG.standard_normal((1, 4, 32, 32)).astype(np.float32), "float32"),
          Tensor(RNG.standard_normal((1, 3, 48)).astype(np.float32) * 5, "float32")]
# The same states as real checkpoints hold them: a bf16 or fp16 conv state.
NARROW = [Tensor.from_float32(STATES[1].data, "bfloat16"),
          Tensor.from_float32(STATES[1].data, "float16")]

# Max error relative to the row's max |x|, recorded per codec. fp32 is exact.
BOUNDS = {"fp32": 0.0, "bf16": 2 ** -8, "int8": 0.5 / 127, "rht_int8": 0.02,
          "rht_int16": 1e-4}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("x", STATES + NARROW, ids=["recurrent", "conv", "conv-bf16",
                                                    "conv-fp16"])
def test_round_trip_within_recorded_bound(codec, x):
    tensors, meta = encode("s", x, codec)
    y = decode("s", tensors, meta)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert y.data.dtype == np.dtype(STORAGE[x.dtype])
    rows = x.to_float32().reshape(-1, x.shape[-1])
    err = np.abs(y.to_float32().reshape(rows.shape) - rows).max(axis=-1)
    narrowing = 2 ** -8 if x.dtype == "bfloat16" else 2 ** -11 if x.dtype == "float16" else 0
    bound = BOUNDS[codec] + narrowing
    assert (err <= bound * np.abs(rows).max(axis=-1) + 1e-7).all(), err.max()
    if codec == "fp32":  # exact: the very bits, whatever the dtype
        np.testing.assert_array_equal(y.data, x.data)


def test_bf16_state_stays_bit_exact_through_a_sidecar():
    """The bug of a bf16 model: its conv state's bit patterns were cast as numbers."""
    state = {"s0.0": NARROW[0], "s0.1": STATES[0]}
    tensors, codec_meta = encode_state(state, "fp32")
    back = decode_state(tensors, codec_meta, exact=True)
    for name, t in state.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        np.testing.assert_array_equal(back[name].data, t.data)


def test_lossy_sidecar_refused_where_exactness_is_asked():
    tensors, codec_meta = encode_state({"s0.0": STATES[0]}, "int8")
    assert decode_state(tensors, codec_meta, exact=False)["s0.0"].dtype == "float32"
    with pytest.raises(CodecError, match="lossy"):
        decode_state(tensors, codec_meta, exact=True)


def test_quantized_codecs_are_smaller():
    x = STATES[0]
    sizes = {c: sum(t.nbytes for t in encode("s", x, c)[0].values()) for c in CODECS}
    assert sizes["bf16"] < sizes["fp32"] and sizes["int8"] < sizes["bf16"]
    assert sizes["rht_int8"] < sizes["rht_int16"] < sizes["fp32"]


def test_zero_rows_keep_positive_scales():
    x = Tensor(np.zeros((2, 8), dtype=np.float32), "float32")
    for codec in ("int8", "rht_int8"):
        np.testing.assert_array_equal(decode("s", *encode("s", x, codec)).data, x.data)


def broken(codec, mutate):
    tensors, meta = encode("s", STATES[1], codec)
    tensors, meta = dict(tensors), dict(meta)
    mutate(tensors, meta)
    return tensors, meta


@pytest.mark.parametrize("codec,mutate,words", [
    ("fp32", lambda t, m: m.update(codec="zstd"), "unknown codec"),
    ("fp32", lambda t, m: m.update(version="9"), "codec version"),
    ("fp32", lambda t, m: m.update(dtype="int4"), "unknown dtype"),
    ("fp32", lambda t, m: m.pop("dtype"), "unknown dtype"),
    ("fp32", lambda t, m: m.update(dtype="bfloat16"), "dtype"),
    ("fp32", lambda t, m: m.pop("shape"), "shape"),
    ("fp32", lambda t, m: m.update(shape="[1, -3, 48]"), "negative"),
    ("fp32", lambda t, m: m.update(shape="[2, 3, 48]"), "values for shape"),
    ("fp32", lambda t, m: t.update({"s.data": t["s.data"].astype(np.float64)}), "dtype"),
    ("fp32", lambda t, m: t["s.data"].__setitem__((0, 0, 0), np.inf), "non-finite"),
    ("bf16", lambda t, m: t.pop("s.data"), "missing tensor"),
    ("int8", lambda t, m: t.update({"s.scale": -t["s.scale"]}), "positive"),
    ("int8", lambda t, m: t.update({"s.scale": t["s.scale"][:1]}), "scale shape"),
    ("int8", lambda t, m: t.update({"s.scale": t["s.scale"] * np.nan}), "finite"),
    ("int8", lambda t, m: t.update({"s.q": t["s.q"].astype(np.int16)}), "dtype"),
    ("rht_int8", lambda t, m: m.update(rht_seed="1"), "rotation seed"),
    ("rht_int16", lambda t, m: m.update(rht_dim="32"), "rotation dimension"),
    ("rht_int8", lambda t, m: m.update(shape=json.dumps([1, 3, 80])), "rotation dimension"),
    ("int8", lambda t, m: m.update(shape=json.dumps([1, 2, 48])), "scale shape|values"),
])
def test_malformed_sidecars_are_rejected(codec, mutate, words):
    tensors, meta = broken(codec, mutate)
    with pytest.raises(CodecError, match=words):
        decode("s", tensors, meta)


def test_unknown_codec_refused_at_encode():
    with pytest.raises(CodecError):
        encode("s", STATES[0], "fp8")
