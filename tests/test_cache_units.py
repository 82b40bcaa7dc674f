"""Prefix-cache pieces without Ray: hashing, layouts, slicing, the hot store."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from serve_app.cache import hashing
from serve_app.cache.blocks import slice_block, to_payload, validate_checkpoint
from serve_app.cache.hot import HotEntry
from serve_app.cache.layout import KV, RECURRENT, Layout, canonical_kind, layout_of
from serve_app.cache.tiers import TieredStore
from serve_app.embedded import materialize

# ---- hashing --------------------------------------------------------------------------


def test_block_ids_are_chained_and_deterministic():
    root = hashing.root_id("model", "layout", 4)
    tokens = list(range(12))
    ids = hashing.chain(root, tokens, 4)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert ids == hashing.chain(root, tokens, 4)
    changed = hashing.chain(root, [99] + tokens[1:], 4)
    assert all(a != b for a, b in zip(ids, changed, strict=True))  # a change flows down
    later = hashing.chain(root, tokens[:8] + [99] * 4, 4)
    assert later[:2] == ids[:2] and later[2] != ids[2]
    assert hashing.chain(root, tokens[:11], 4) == ids[:2]  # only full blocks


def test_roots_bind_model_layout_block_size_and_salt():
    base = hashing.root_id("model", "layout", 16)
    others = [hashing.root_id("model2", "layout", 16), hashing.root_id("model", "layout2", 16),
              hashing.root_id("model", "layout", 32)]
    assert base not in others
    assert hashing.salted_root(base, None) == base
    assert hashing.salted_root(base, "a") != hashing.salted_root(base, "b") != base
    assert hashing.block_id(base, [1, 2]) != hashing.block_id(base, [1, 2], {"lora": "x"})


def test_model_identity_distinguishes_models(tmp_path):
    dense = materialize("tiny-dense", tmp_path)
    hybrid = materialize("tiny-hybrid", tmp_path)
    a = hashing.model_identity(dense, "embedded:tiny-dense", "tmpl")
    assert a == hashing.model_identity(dense, "embedded:tiny-dense", "tmpl")
    assert a != hashing.model_identity(hybrid, "embedded:tiny-hybrid", "tmpl")
    assert a != hashing.model_identity(dense, "embedded:tiny-dense", "other template")


# ---- layouts ----------------------------------------------------------------------------


class SizedArraysCache(ArraysCache):
    """A wrapper like the one that split oMLX's layouts in two."""


def test_canonical_kinds_ignore_subclass_names():
    assert canonical_kind(KVCache()) == KV
    assert canonical_kind(ArraysCache(2)) == RECURRENT
    assert canonical_kind(SizedArraysCache(2)) == RECURRENT
    a = layout_of([ArraysCache(2), KVCache()])
    b = layout_of([SizedArraysCache(2), KVCache()])
    assert a.digest == b.digest and a.supported and a.hybrid
    assert not layout_of([KVCache()]).hybrid


@pytest.mark.parametrize("cache,kind", [(RotatingKVCache(16), "rotating"),
                                        (QuantizedKVCache(), "quantized")])
def test_unsupported_kinds_disable_caching_with_a_reason(cache, kind):
    layout = layout_of([KVCache(), cache])
    assert not layout.supported
    assert kind in layout.unsupported


# ---- slicing ----------------------------------------------------------------------------


def test_slice_block_undoes_left_padding():
    rng = np.random.default_rng(0)
    rows = []
    for length in (5, 9):
        c = KVCache()
        k = mx.array(rng.standard_normal((1, 2, length, 4)).astype(np.float32))
        v = mx.array(rng.standard_normal((1, 2, length, 4)).astype(np.float32))
        c.update_and_fetch(k, v)
        rows.append((c, np.array(k), np.array(v)))
    batch = BatchKVCache.merge([r[0] for r in rows])  # left-pads the shorter row
    recurrent = ArraysCache(1)
    recurrent.cache = [mx.array(rng.standard_normal((2, 3)).astype(np.float32))]
    layout = Layout((KV, RECURRENT))
    for idx, (_, k, v) in enumerate(rows):
        payload, dtypes = to_payload(slice_block([batch, recurrent], idx, layout, 2, 4, True))
        np.testing.assert_array_equal(payload["k0"], k[:, :, 2:4])
        np.testing.assert_array_equal(payload["v0"], v[:, :, 2:4])
        np.testing.assert_array_equal(payload["s1.0"], np.array(recurrent.cache[0])[idx:idx + 1])
        assert dtypes["k0"] == "float32"
    assert validate_checkpoint(layout, payload)
    payload["s1.0"] = payload["s1.0"] * np.nan
    assert not validate_checkpoint(layout, payload)


def test_bfloat16_round_trips_through_uint16():
    from serve_app.cache.blocks import _to_mlx

    a = mx.array([[1.5, -2.25]], dtype=mx.bfloat16)
    c = KVCache()
    c.update_and_fetch(a.reshape(1, 1, 1, 2), a.reshape(1, 1, 1, 2))
    payload, dtypes = to_payload(slice_block([c], 0, Layout((KV,)), 0, 1, False))
    assert payload["k0"].dtype == np.uint16 and dtypes["k0"] == "bfloat16"
    assert mx.array_equal(_to_mlx(payload["k0"], "bfloat16").reshape(1, 2), a)


# ---- the hot store, through the tiered store's chain lookups ------------------------------


def entry(i: int, nbytes: int = 100, checkpoint: bool = False) -> HotEntry:
    return HotEntry(f"b{i}", f"b{i - 1}", nbytes, checkpoint, handle=i, model="m")


def hot_only(budget: int) -> TieredStore:
    return TieredStore(hot_budget=budget)


def lookup(store: TieredStore, ids: list[str], need_checkpoint: bool = False) -> dict:
    return store.lookup(ids, need_checkpoint=need_checkpoint)


def test_budget_is_never_exceeded_and_lru_goes_first():
    store = hot_only(350)
    for i in range(3):
        assert store.hot.put(entry(i))
    store.release(lookup(store, ["b0"])["lease"])  # b0 becomes most recent
    assert store.hot.put(entry(3))
    assert "b1" not in store.hot
    assert all(f"b{i}" in store.hot for i in (0, 2, 3))
    assert store.hot.bytes <= 350
    assert store.hot.stats.evictions == 1


def test_pinned_blocks_are_never_evicted():
    store = hot_only(300)
    for i in range(3):
        store.hot.put(entry(i))
    found = lookup(store, ["b0", "b1", "b2"])
    assert [s.handle for s in found["sources"]] == [0, 1, 2]
    assert not store.hot.put(entry(3))  # nothing can be evicted: rejected, not over budget
    assert store.hot.bytes == 300 and store.hot.stats.rejected_puts == 1
    store.release(found["lease"])
    assert store.hot.put(entry(3)) and "b0" not in store.hot
    assert store.hot.pinned_ids() == set()


def test_many_puts_keep_bytes_within_budget():
    store = hot_only(1000)
    rng = np.random.default_rng(1)
    lease = None
    for i in range(500):
        store.hot.put(entry(i, int(rng.integers(1, 200))))
        assert store.hot.bytes <= 1000
        if i % 50 == 0:
            store.release(lease)
            lease = lookup(store, [f"b{i}"])["lease"]
        assert store.hot.pinned_ids() <= {f"b{j}" for j in range(i + 1)}
    assert store.snapshot()["bytes"] == store.hot.bytes


def test_hybrid_lookup_walks_back_to_a_checkpoint():
    store = hot_only(10_000)
    store.hot.put(entry(0, checkpoint=True))
    store.hot.put(entry(1, checkpoint=True))
    store.hot.put(entry(2, checkpoint=False))
    found = lookup(store, ["b0", "b1", "b2", "b3"], need_checkpoint=True)
    assert (found["present"], len(found["sources"]), found["walkbacks"]) == (3, 2, 1)
    store.release(found["lease"])
    assert store.hot.drop_checkpoint("b1")
    found = lookup(store, ["b0", "b1", "b2"], need_checkpoint=True)
    assert (len(found["sources"]), found["walkbacks"]) == (1, 2)
    store.release(found["lease"])
    store.hot.put(entry(1, checkpoint=True))  # a fresh capture restores the checkpoint
    assert len(lookup(store, ["b0", "b1"], need_checkpoint=True)["sources"]) == 2
    assert store.snapshot()["lookups"] == 3 and store.snapshot()["hit_blocks"] == 5


def test_lookup_reports_evicted_blocks():
    store = hot_only(100)
    store.hot.put(entry(0))
    store.hot.put(entry(1))  # evicts b0
    assert lookup(store, ["b0"])["first_missing_evicted"]
    assert not lookup(store, ["zz"])["first_missing_evicted"]
