"""Prefix-cache pieces without Ray: hashing, layouts, slicing, the hot store."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

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
from serve_app.cache.blocks import capture_block
from serve_app.cache.hot import HotEntry
from serve_app.cache.layout import (
    KV,
    RECURRENT,
    ArraySpec,
    Layout,
    cache_epoch,
    canonical_kind,
    layout_of,
    probe_layout,
)
from serve_app.cache.match import Match, MatchQuery
from serve_app.cache.payload import BlockPayload, PayloadError, Tensor, from_tensors, to_tensors
from serve_app.cache.tiers import TieredStore
from serve_app.models.embedded import materialize

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
    keyed = hashing.salted_root(base, None, "digest")
    # No cache_salt a client sends reaches an API key's root, nor the other way round.
    assert keyed not in (base, hashing.salted_root(base, "digest"),
                         hashing.salted_root(base, "|key:digest"))
    assert hashing.salted_root(base, "a", "digest") not in (keyed, hashing.salted_root(base, "a"))


def test_block_ids_are_stable_across_releases():
    # Ids name files on SSD: a change here silently turns every stored block into a miss.
    assert hashing.block_id("0" * 64, [1, 2, 3]) == \
        "9a5858ea77ee753d2aadb8af5489a6d9900d27580e88586611aee6f9e84eb1a0"


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


def test_capture_block_undoes_left_padding():
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
    layout = Layout((KV, RECURRENT), arrays=((ArraySpec((1, 2, None, 4), "float32"),) * 2,
                                             (ArraySpec((1, 3), "float32"),)))
    for idx, (_, k, v) in enumerate(rows):
        payload = capture_block([batch, recurrent], idx, layout, 2, 4, True)
        np.testing.assert_array_equal(payload.kv[0][0].data, k[:, :, 2:4])
        np.testing.assert_array_equal(payload.kv[0][1].data, v[:, :, 2:4])
        np.testing.assert_array_equal(payload.state[1][0].data,
                                      np.array(recurrent.cache[0])[idx:idx + 1])
        assert payload.kv[0][0].dtype == "float32"
    assert layout.check(payload, 2, need_state=True) is None
    nan = Tensor(payload.state[1][0].data * np.nan, "float32")
    assert "non-finite" in layout.check(payload.with_state({1: (nan,)}), 2, need_state=True)


def test_bfloat16_round_trips_through_uint16():
    a = mx.array([[1.5, -2.25]], dtype=mx.bfloat16)
    c = KVCache()
    c.update_and_fetch(a.reshape(1, 1, 1, 2), a.reshape(1, 1, 1, 2))
    payload = capture_block([c], 0, Layout((KV,)), 0, 1, False)
    k = payload.kv[0][0]
    assert k.data.dtype == np.uint16 and k.dtype == "bfloat16"
    assert mx.array_equal(k.to_mlx().reshape(1, 2), a)
    back = from_tensors(*to_tensors(payload, with_state=False))
    assert back.kv[0][0].dtype == "bfloat16"
    np.testing.assert_array_equal(back.kv[0][0].data, k.data)


def test_payloads_that_do_not_fit_the_layout_are_named():
    spec = ArraySpec((1, 2, None, 4), "bfloat16")
    layout = Layout((KV, RECURRENT), arrays=((spec, spec),
                                             (ArraySpec((1, 3, 8), "bfloat16"),
                                              ArraySpec((1, 2, 4, 4), "float32"))))
    bits = np.zeros((1, 2, 3, 4), np.uint16)
    kv = {0: (Tensor(bits, "bfloat16"), Tensor(bits, "bfloat16"))}
    conv = Tensor(np.zeros((1, 3, 8), np.uint16), "bfloat16")
    rec = Tensor(np.zeros((1, 2, 4, 4), np.float32), "float32")
    good = BlockPayload(kv, {1: (conv, rec)})
    assert layout.check(good, 3, need_state=True) is None
    # The bf16 bug: bits widened to float32 numbers, then viewed back as bf16.
    doubled = Tensor(np.zeros((1, 3, 16), np.uint16), "bfloat16")
    cases = {
        "state": good.with_state({1: (doubled, rec)}),
        "dtype": BlockPayload({0: (Tensor(np.zeros((1, 2, 3, 4), np.float32), "float32"),
                                   kv[0][1])}, good.state),
        "layers": BlockPayload({}, good.state),
        "arrays": good.with_state({1: (conv,)}),
    }
    for what, payload in cases.items():
        assert layout.check(payload, 3, need_state=True) is not None, what
    assert layout.check(good, 4, need_state=False) is not None  # wrong token count
    with pytest.raises(PayloadError):
        Tensor(np.zeros(2, np.float32), "bfloat16")  # the carrier must match the dtype


def test_probed_layouts_differ_by_weight_format(tmp_path):
    import mlx_lm

    digests = set()
    for name in ("tiny-hybrid", "tiny-hybrid-bf16", "tiny-hybrid-fp16"):
        model, _ = mlx_lm.load(str(materialize(name, tmp_path)))
        layout = probe_layout(model)
        digests.add(layout.digest)
        conv = layout.arrays[0][0]
        assert conv.dtype == {"tiny-hybrid": "float32", "tiny-hybrid-bf16": "bfloat16",
                              "tiny-hybrid-fp16": "float16"}[name]
        assert layout.arrays[0][1].dtype == "float32"  # the GDN state stays fp32
    assert len(digests) == 3


def test_cache_epochs_fail_closed_on_unknown_mlx_lm_releases():
    assert cache_epoch("0.32.2") == cache_epoch("0.32.9") == "mlx-lm-0.32"
    assert cache_epoch("0.33.0") == "mlx-lm-0.33"
    assert cache_epoch("garbage") == "mlx-lm-garbage"
    base = Layout((KV,), arrays=((ArraySpec((1, 2, None, 4), "float32"),) * 2,),
                  epoch="mlx-lm-0.32")
    other = Layout(base.kinds, arrays=base.arrays, epoch="mlx-lm-0.33")
    assert base.digest != other.digest


# ---- the hot store, through the tiered store's chain lookups ------------------------------


def entry(i: int, nbytes: int = 100, checkpoint: bool = False) -> HotEntry:
    return HotEntry(f"b{i}", f"b{i - 1}", nbytes, checkpoint, handle=i, model="m")


def hot_only(budget: int) -> TieredStore:
    return TieredStore(hot_budget=budget)


def lookup(store: TieredStore, ids: list[str], need_checkpoint: bool = False) -> Match:
    return store.match(MatchQuery(ids, need_state=need_checkpoint))


def test_budget_is_never_exceeded_and_lru_goes_first():
    store = hot_only(350)
    for i in range(3):
        assert store.hot.put(entry(i))
    store.release(lookup(store, ["b0"]).lease)  # b0 becomes most recent
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
    assert [s.handle for s in found.sources] == [0, 1, 2]
    assert not store.hot.put(entry(3))  # nothing can be evicted: rejected, not over budget
    assert store.hot.bytes == 300 and store.hot.stats.rejected_puts == 1
    store.release(found.lease)
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
            lease = lookup(store, [f"b{i}"]).lease
        assert store.hot.pinned_ids() <= {f"b{j}" for j in range(i + 1)}
    assert store.snapshot()["bytes"] == store.hot.bytes


def test_hybrid_lookup_walks_back_to_a_checkpoint():
    store = hot_only(10_000)
    store.hot.put(entry(0, checkpoint=True))
    store.hot.put(entry(1, checkpoint=True))
    store.hot.put(entry(2, checkpoint=False))
    found = lookup(store, ["b0", "b1", "b2", "b3"], need_checkpoint=True)
    assert (found.present, len(found.sources), found.walkbacks) == (3, 2, 1)
    store.release(found.lease)
    assert store.hot.drop_checkpoint("b1")
    found = lookup(store, ["b0", "b1", "b2"], need_checkpoint=True)
    assert (len(found.sources), found.walkbacks) == (1, 2)
    store.release(found.lease)
    store.hot.put(entry(1, checkpoint=True))  # a fresh capture restores the checkpoint
    assert len(lookup(store, ["b0", "b1"], need_checkpoint=True).sources) == 2
    assert store.snapshot()["lookups"] == 3 and store.snapshot()["hit_blocks"] == 5


def test_lookup_reports_evicted_blocks():
    store = hot_only(100)
    store.hot.put(entry(0))
    store.hot.put(entry(1))  # evicts b0
    assert lookup(store, ["b0"]).first_missing_evicted
    assert not lookup(store, ["zz"]).first_missing_evicted


# ---- model identity -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["rsync_rename", "in_place"])
def test_new_weights_with_the_same_size_and_mtime_get_a_new_identity(tmp_path, how):
    """``rsync -a`` of new weights keeps the file's size and mtime: the memo must not
    keep the old digest. rsync writes a temporary file, sets its mtime and renames it
    over the old one (a new inode and ctime); an in-place rewrite keeps the inode but
    not the ctime (no tool can set it)."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(materialize("tiny-dense", tmp_path / "home"), model_dir)
    memo = tmp_path / "digests.json"
    first = hashing.model_identity(model_dir, "local", "t", memo)
    weights = model_dir / "model.safetensors"
    before = weights.stat()
    data = bytearray(weights.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    times = (before.st_atime_ns, before.st_mtime_ns)
    if how == "rsync_rename":
        tmp = model_dir / ".model.safetensors.rsync"
        tmp.write_bytes(bytes(data))
        os.utime(tmp, ns=times)
        os.replace(tmp, weights)
    else:
        weights.write_bytes(bytes(data))
        os.utime(weights, ns=times)
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    second = hashing.model_identity(model_dir, "local", "t", memo)
    assert second != first
    hashing._memo.clear()  # a new process: only the memo file remembers
    assert hashing.model_identity(model_dir, "local", "t", memo) == second
    stored = json.loads(memo.read_text())[str(weights.resolve())][-1]
    assert stored == hashlib.sha256(bytes(data)).hexdigest()


def test_identity_binds_weight_bytes_and_is_memoized(tmp_path, monkeypatch):
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(materialize("tiny-dense", tmp_path / "home"), model_dir)
    memo = tmp_path / "digests.json"
    first = hashing.model_identity(model_dir, "local", "t", memo)
    weights = model_dir / "model.safetensors"
    assert json.loads(memo.read_text())[str(weights.resolve())][-1] == \
        hashlib.sha256(weights.read_bytes()).hexdigest()

    reads = []
    real = hashing._file_sha256
    monkeypatch.setattr(hashing, "_file_sha256", lambda p: reads.append(p) or real(p))
    hashing._memo.clear()  # a new process: only the memo file remembers
    assert hashing.model_identity(model_dir, "local", "t", memo) == first
    assert weights not in [Path(p) for p in reads]  # not read again

    # Re-fused in place: same name, same size, other bytes, a new mtime.
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert hashing.model_identity(model_dir, "local", "t", memo) != first
