"""The quantized K/V format and the batch cache continuous batching runs on
(``serve_app/kvquant``), against mlx-lm's own one-sequence ``QuantizedKVCache``."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, QuantizedKVCache

from serve_app.config.profile import ProfileError, parse_profile
from serve_app.kvquant.batch_cache import BatchQuantizedKVCache, QuantizedRowCache
from serve_app.kvquant.format import KVQuant, pack, unpack

H, D = 2, 64


def kv(n: int, seed: int, dtype=mx.float32) -> tuple:
    k = mx.random.normal((1, H, n, D), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, H, n, D), key=mx.random.key(seed + 1000)).astype(dtype)
    return k, v


def row(n: int, seed: int, cls=QuantizedRowCache):
    cache = cls(group_size=64, bits=8)
    cache.update_and_fetch(*kv(n, seed))
    return cache


def equal(a: tuple, b: tuple) -> bool:
    return all(mx.array_equal(x, y).item() for x, y in zip(a, b, strict=True))


def valid(cache: QuantizedKVCache) -> tuple[tuple, tuple]:
    return cache.keys_and_values()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_packing_round_trips_bit_for_bit(bits, group, dtype):
    quant = KVQuant(bits, group)
    dim = 128
    x = mx.random.normal((1, H, 5, dim), key=mx.random.key(1)).astype(getattr(mx, dtype))
    triple = tuple(mx.quantize(x, group_size=group, bits=bits))
    packed = pack(triple)
    assert packed.dtype == mx.uint32 and packed.shape[-1] == quant.packed_width(dim, dtype)
    assert quant.head_dim(packed.shape[-1], dtype) == dim
    assert equal(unpack(packed, quant, dtype), triple)
    assert equal(unpack(packed[:, :, 1:3], quant, dtype), tuple(a[:, :, 1:3] for a in triple))


def test_bytes_per_value_and_bad_formats():
    assert KVQuant(8, 64).bytes_per_value("float16") == 1 + 4 / 64
    assert KVQuant(4, 32).bytes_per_value("float32") == 0.5 + 8 / 32
    with pytest.raises(ValueError, match="bits"):
        KVQuant(3, 64)
    with pytest.raises(ValueError, match="group_size"):
        KVQuant(8, 16)
    assert not KVQuant(8, 128).fits(64) and KVQuant(4, 32).fits(64)
    with pytest.raises(ValueError, match="no head"):
        KVQuant(8, 64).head_dim(17, "float32")


def test_merge_and_extract_give_each_row_back():
    rows = [row(n, seed) for seed, n in enumerate((5, 1, 9))]
    batch = BatchQuantizedKVCache.merge(rows)
    assert batch.left_padding.tolist() == [4, 8, 0] and batch.size() == 9
    for i, r in enumerate(rows):
        out = batch.extract(i)
        assert out.offset == r.offset and equal(valid(out)[0], valid(r)[0])
        assert equal(valid(out)[1], valid(r)[1])


def test_a_decode_step_appends_to_every_row_as_alone():
    """The batch's K/V after two steps == each row's own mlx-lm cache after them."""
    lengths = (5, 2, 7)
    rows = [row(n, seed, cls=QuantizedKVCache) for seed, n in enumerate(lengths)]
    batch = BatchQuantizedKVCache.merge([row(n, seed) for seed, n in enumerate(lengths)])
    for step in range(2):
        new = [kv(1, 50 + 10 * step + i) for i in range(3)]
        batch.update_and_fetch(mx.concatenate([k for k, _ in new]),
                               mx.concatenate([v for _, v in new]))
        for r, (k, v) in zip(rows, new, strict=True):
            r.update_and_fetch(k, v)
    for i, r in enumerate(rows):
        assert equal(valid(batch.extract(i))[0], valid(r)[0])
        assert equal(valid(batch.extract(i))[1], valid(r)[1])


def test_attention_over_the_batch_is_each_rows_attention():
    """mlx-lm's attention takes the quantized path for the batch cache (it has ``bits``)
    and, with the batch's mask, gives each row what its own cache gives."""
    lengths = (6, 3)
    rows = [row(n, seed, cls=QuantizedKVCache) for seed, n in enumerate(lengths)]
    batch = BatchQuantizedKVCache.merge([row(n, seed) for seed, n in enumerate(lengths)])
    q = mx.random.normal((2, H, 1, D), key=mx.random.key(9))
    new = [kv(1, 70 + i) for i in range(2)]
    mask = batch.make_mask(1)  # as the model makes it: before the step's K/V are in
    keys, values = batch.update_and_fetch(mx.concatenate([k for k, _ in new]),
                                          mx.concatenate([v for _, v in new]))
    # mlx-lm scales the queries in place (``queries *= scale``): each call its own copy
    out = scaled_dot_product_attention(q * 1, keys, values, batch, scale=D ** -0.5,
                                       mask=mask)
    for i, (r, (k, v)) in enumerate(zip(rows, new, strict=True)):
        rk, rv = r.update_and_fetch(k, v)
        alone = scaled_dot_product_attention(q[i : i + 1] * 1, rk, rv, r, scale=D ** -0.5,
                                             mask=None)
        assert mx.allclose(out[i : i + 1], alone, atol=1e-5).item()


def test_the_mask_is_batch_kv_caches_for_the_same_padding():
    batch = BatchQuantizedKVCache.merge([row(4, 1), row(2, 2)])
    ref = BatchKVCache.merge([_float_row(4, 1), _float_row(2, 2)])
    assert mx.array_equal(batch.make_mask(3), ref.make_mask(3)).item()


def _float_row(n: int, seed: int):
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(*kv(n, seed))
    return cache


def test_filter_extend_and_trim_keep_rows_intact():
    a = BatchQuantizedKVCache.merge([row(5, 1), row(2, 2), row(8, 3)])
    b = BatchQuantizedKVCache.merge([row(3, 4)])
    a.filter([0, 1])  # the longest row left: the common padding is shifted out
    assert a.left_padding.tolist() == [0, 3] and a.size() == 5
    a.extend(b)
    for i, ref in enumerate((row(5, 1), row(2, 2), row(3, 4))):
        assert equal(valid(a.extract(i))[0], valid(ref)[0])
    a.trim(1)
    assert equal(valid(a.extract(0))[0], tuple(t[..., :4, :] for t in valid(row(5, 1))[0]))


def test_right_padded_prefill_rolled_into_left_padding():
    """A chunk prefilled right padded (rows of different lengths), then ``finalize``:
    each row's K/V == the row prefilled alone."""
    lengths = [4, 2]
    batch = BatchQuantizedKVCache.merge([QuantizedRowCache(64, 8), QuantizedRowCache(64, 8)])
    pairs = [kv(n, 30 + i) for i, n in enumerate(lengths)]
    pad = [max(lengths) - n for n in lengths]
    k = mx.concatenate([mx.pad(k, [(0, 0), (0, 0), (0, p), (0, 0)])
                        for (k, _), p in zip(pairs, pad, strict=True)])
    v = mx.concatenate([mx.pad(v, [(0, 0), (0, 0), (0, p), (0, 0)])
                        for (_, v), p in zip(pairs, pad, strict=True)])
    batch.prepare(lengths=lengths, right_padding=pad)
    batch.update_and_fetch(k, v)
    batch.finalize()
    assert batch.left_padding.tolist() == pad
    for i, (kk, vv) in enumerate(pairs):
        alone = QuantizedRowCache(64, 8)
        alone.update_and_fetch(kk, vv)
        assert equal(valid(batch.extract(i))[0], valid(alone)[0])


def test_merging_empty_rows_then_prefilling():
    batch = BatchQuantizedKVCache.merge([QuantizedRowCache(32, 4)] * 2)
    assert batch.empty() and batch.bits == 4 and batch.group_size == 32
    k, v = kv(3, 5)
    batch.update_and_fetch(mx.concatenate([k, k]), mx.concatenate([v, v]))
    assert batch.size() == 3 and batch.nbytes > 0


def _profile(kv_cache: dict, **model) -> None:
    parse_profile({"models": [{"name": "m", "source": "embedded:tiny-dense",
                               "kv_cache": kv_cache, **model}]}, where="p.yaml")


@pytest.mark.parametrize("kv_cache,model,words", [
    ({"bits": 3}, {}, "models[0].kv_cache.bits"),
    ({"bits": 8, "group_size": 16}, {}, "models[0].kv_cache.group_size"),
    ({"bits": 8, "quantized_after": 1024}, {}, "only 0 is served"),
    ({"bits": 8, "scale": 2}, {}, "models[0].kv_cache.scale"),
    ({"bits": 8}, {"source": "embedded:tiny-bert"}, "task embed keeps no K/V cache"),
])
def test_a_bad_kv_cache_key_is_a_config_error_naming_it(kv_cache, model, words):
    with pytest.raises(ProfileError) as bad:
        _profile(kv_cache, **model)
    assert words in str(bad.value) and "p.yaml" in str(bad.value)


def test_a_good_kv_cache_reads():
    _profile({"bits": 4, "group_size": 32})
    _profile({"bits": None})
