"""Exactness on every weight format the embedded models come in (fp32, bf16, fp16, 4-bit;
the real SmolLM2-135M in its 4-bit, fp32 and bf16).

In-process (real engine, real store, real files, no Ray): warm restores from
the hot tier, restores after a restart from SSD in every storage mode, and
walkbacks give exactly the tokens of a cold prefill. Payloads that do not fit
the model are clean misses, and a restore that fails to build costs one
request its hit, never the batch.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve_app.cache.payload import BlockPayload, RestorePlan, Tensor, from_tensors
from serve_app.cache.request_plan import RequestPlan
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import read_file
from serve_app.serving.sampling import SamplingParams
from tests.support.formats import (
    BS,
    DENSES,
    HYBRIDS,
    Server,
    branch,
    prompt_of,
    restart_matches_cold,
    warm_multi_turn_matches_cold,
)


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_warm_multi_turn_matches_cold(name, home):
    warm_multi_turn_matches_cold(name, home)


@pytest.mark.parametrize("name,storage", [
    *((n, s) for n in HYBRIDS for s in ("ssd_sidecar", "embedded")),
    *((n, "auto") for n in DENSES),  # no recurrent state: KV block files only
])
def test_restart_from_ssd_matches_cold(name, storage, home, tmp_path):
    """Cold, then restored from SSD after a restart, then from the hot tier, then its full
    blocks alone: the same tokens each time (SmolLM2's formats: the same check in
    tests/integration/test_real_model_formats.py, where its build may download)."""
    restart_matches_cold(name, storage, home, tmp_path)


@pytest.mark.parametrize("name", HYBRIDS)
def test_walkback_after_a_lost_sidecar_matches_cold(name, home, tmp_path):
    prompt = prompt_of(11, 4)
    first = Server(name, home, tmp_path)
    first.ask(prompt)
    first.drain()
    first.close()
    first.ssd.sidecar_path(first.service.layout.digest, first.ids(prompt)[3]).unlink()

    again = Server(name, home, tmp_path)
    b = again.ask(branch(prompt))
    assert again.service.cache_stats.walkbacks == 1
    assert b["cached"] == 3 * BS and b["text"] == again.cold_text(branch(prompt))
    again.close()


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_a_cache_clear_then_cold_then_restored_again_matches_cold(name, home, tmp_path):
    """The status page's cache clear (``TieredStore.clear``, what each node's store runs):
    the prompt restored before it is prefilled cold after it (nothing left in either tier)
    with the same tokens, and once captured again restores exactly."""
    prompt = prompt_of(17, 3)
    server = Server(name, home, tmp_path)
    a = server.ask(prompt)
    server.drain()
    assert server.ask(prompt)["cached"] == len(prompt) - 1
    cache = server.service.cache
    cleared = server.store.clear(cache.settings.model, frozenset({cache.identity}), 10.0)
    assert cleared.hot_blocks >= 3 and cleared.ssd_files >= 3 and cleared.kept_in_use == 0
    assert not list(tmp_path.rglob("*.safetensors"))
    b = server.ask(prompt)
    assert b["cached"] == 0 and b["text"] == a["text"] == server.cold_text(prompt)
    server.drain()
    c = server.ask(prompt)
    assert c["cached"] == len(prompt) - 1 and c["text"] == a["text"]
    stats = server.service.cache_stats
    assert stats.incompatible_payloads == 0 and stats.restore_failures == 0
    server.close()


@pytest.mark.parametrize("codec", ["bf16", "int8", "rht_int8", "rht_int16"])
@pytest.mark.parametrize("name", ["tiny-hybrid-bf16", "tiny-hybrid-fp16"])
def test_lossy_codecs_restore_the_right_shapes_and_dtypes(name, codec, home, tmp_path):
    """Lossy sidecars decode to each array's own dtype: the restore builds and runs."""
    cache = {"sidecar_codec": codec}
    prompt = prompt_of(13, 3)
    first = Server(name, home, tmp_path, cache)
    first.ask(prompt)
    first.drain()
    first.close()
    again = Server(name, home, tmp_path, cache)
    b = again.ask(prompt)
    stats = again.service.cache_stats
    assert b["cached"] == len(prompt) - 1 and stats.sidecar_loads == 1
    assert stats.checkpoint_rejects == 0 and stats.restore_failures == 0
    assert again.service.engine.snapshot().restore_failures == 0
    again.close()


def test_lossy_sidecar_never_used_where_exactness_is_asked(home, tmp_path):
    name = "tiny-hybrid-bf16"
    prompt = prompt_of(17, 3)
    lossy = Server(name, home, tmp_path, {"sidecar_codec": "rht_int8"})
    lossy.ask(prompt)
    lossy.drain()
    lossy.close()

    exact = Server(name, home, tmp_path)  # the default codec, fp32, is exact
    b = exact.ask(prompt)
    assert b["cached"] == 0 and b["text"] == exact.cold_text(prompt)
    assert exact.service.cache_stats.misses_by_reason == {"no_checkpoint": 1}
    exact.drain()  # the prefill wrote exact sidecars over the lossy ones
    exact.close()
    codecs_on_disk = {e.meta["codec"] for e in exact.ssd._sidecars.values()}
    assert codecs_on_disk == {"fp32"}

    again = Server(name, home, tmp_path)
    c = again.ask(prompt)
    assert c["cached"] == len(prompt) - 1 and c["text"] == b["text"]
    again.close()


def test_hot_payload_of_the_wrong_shape_is_a_clean_miss(home):
    """The bf16 bug's payload (conv state with its last axis doubled) never reaches MLX."""
    name = "tiny-hybrid-bf16"
    server = Server(name, home)
    prompt = prompt_of(19, 3)
    server.ask(prompt)
    ids = server.ids(prompt)
    payload: BlockPayload = server.store.hot.entry(ids[2]).handle
    layer = next(iter(payload.state))
    conv, *rest = payload.state[layer]
    widened = conv.to_float32().view(np.uint16)  # float32 bits read as bf16: twice as wide
    payload.state[layer] = (Tensor(np.ascontiguousarray(widened), "bfloat16"), *rest)

    b = server.ask(branch(prompt))
    stats = server.service.cache_stats
    assert stats.incompatible_payloads == 1 and stats.last_miss_reason.startswith(
        "cached payload does not fit")
    assert b["cached"] == 2 * BS  # walked back to the previous checkpoint
    assert b["text"] == server.cold_text(branch(prompt))
    # Dropped, and replaced by the re-prefill's own checkpoint, which fits:
    fresh = server.store.hot.entry(ids[2]).handle
    assert fresh is not payload
    assert server.service.layout.check(fresh, BS, need_state=True) is None
    assert server.service.engine.snapshot().restore_failures == 0
    server.close()


def test_ssd_block_of_the_wrong_dtype_is_dropped_and_counted(home, tmp_path):
    """A block file that passes its checksum but does not fit (an older, buggy writer)."""
    name = "tiny-dense-bf16"
    prompt = prompt_of(23, 3)
    first = Server(name, home, tmp_path)
    first.ask(prompt)
    first.drain()
    first.close()
    bid = first.ids(prompt)[1]
    entry = first.ssd.block_entry(bid)
    tensors, meta = read_file(entry.path, {})
    widened = {k: v.astype(np.float32) for k, v in tensors.items()}  # bits cast as numbers
    dtypes = '{"' + '": "float32", "'.join(sorted(widened)) + '": "float32"}'
    meta = {k: v for k, v in meta.items() if k not in ("sha256", "created", "kind",
                                                       "block_id", "format_version")}
    writer = SSDStore(tmp_path, 1 << 30)
    writer.open()
    assert writer.write("block", bid, widened, {**meta, "dtypes": dtypes})

    again = Server(name, home, tmp_path)
    b = again.ask(branch(prompt))
    stats = again.service.cache_stats
    assert b["cached"] == BS and b["text"] == again.cold_text(branch(prompt))
    assert stats.incompatible_payloads == 1
    again.drain()  # dropped, and written again by the re-prefill, in the model's dtype
    tensors, meta = read_file(again.ssd.block_entry(bid).path, {})
    rewritten = from_tensors(tensors, meta["dtypes"])
    assert again.service.layout.check(rewritten, BS, need_state=False) is None
    again.close()


def test_a_restore_that_fails_to_build_prefills_cold_and_spares_the_batch(home):
    name = "tiny-hybrid-bf16"
    server = Server(name, home)
    engine = server.service.engine
    events: dict[str, list] = {"bad": [], "other": []}
    done = {k: threading.Event() for k in events}

    def sink(key):
        def put(event):
            events[key].append(event)
            if event.finish_reason or event.error:
                done[key].set()
        return put

    prompt = prompt_of(29, 3)
    other = prompt_of(31, 2)
    params = SamplingParams(max_tokens=24)
    engine.submit(other, params, sink("other"))
    good = server.ask(prompt)  # the model's real payloads, then one broken on purpose
    blocks = [server.store.hot.entry(b).handle for b in server.ids(prompt)]
    broken = [BlockPayload(dict(b.kv), dict(b.state)) for b in blocks]
    layer = next(iter(broken[-1].state))
    broken[-1].state[layer] = broken[-1].state[layer][:1]  # a recurrent array missing
    plan = RequestPlan(BS, server.service.cache.root, [], RestorePlan([BS] * 3, broken))
    engine.submit(prompt, SamplingParams(max_tokens=10), sink("bad"), plan)
    assert done["bad"].wait(60) and done["other"].wait(60)
    assert all(e.error is None for e in events["bad"] + events["other"])
    restored = [e.restored for e in events["bad"] if e.restored is not None]
    assert restored == [0]
    tokens = [e.token for e in events["bad"] if e.token is not None]
    text = server.service.tokenizer.decode(tokens)
    assert text == good["text"] == server.cold_text(prompt)
    assert len([e for e in events["other"] if e.token is not None]) == 24
    assert engine.snapshot().restore_failures == 1
    server.close()


def test_restore_failure_is_reported_as_a_miss(home, monkeypatch):
    """Through the service: usage says 0 cached tokens and the stats name the reason.

    A payload that passed every check can still fail to build (MLX out of
    memory, say): a fault we cannot cause here, so ``build_cache`` is made to fail.
    """
    import serve_app.serving.engine_cache as engine_module

    server = Server("tiny-dense-q4", home)
    prompt = prompt_of(37, 3)
    first = server.ask(prompt)

    def no_memory(*args, **kwargs):
        raise RuntimeError("[metal::malloc] Attempting to allocate more than the device has")

    monkeypatch.setattr(engine_module, "build_cache", no_memory)
    b = server.ask(prompt)
    stats = server.service.cache_stats
    assert b["cached"] == 0 and b["text"] == first["text"] == server.cold_text(prompt)
    assert stats.restore_failures == 1 and stats.misses_by_reason["restore_failed"] == 1
    assert server.service.engine.snapshot().restore_failures == 1
    assert server.store.snapshot()["pinned_blocks"] == 0
    server.close()
