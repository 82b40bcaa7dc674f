"""Quantized K/V (``kv_cache.bits``) inside continuous batching and on every tier.

In-process (real engine, real store, real files, no Ray), on every weight format of
both tiny families: a request restored from the hot tier or, after a restart, from SSD
gives exactly the tokens of a cold prefill with the same ``kv_cache``; rows batched
together give what each gives alone; blocks are stored quantized (packed) and a
profile with another format never restores them.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from serve_app.cache.ssd_format import read_file
from serve_app.serving.request import ChatCompletionRequest, CompletionRequest
from tests.support.engine import run
from tests.support.formats import (
    BS,
    DENSES,
    HYBRIDS,
    Server,
    load,
    prompt_of,
    restart_matches_cold,
    warm_multi_turn_matches_cold,
)

Q8 = {"bits": 8, "group_size": 32}
Q4 = {"bits": 4, "group_size": 32}


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_warm_multi_turn_matches_cold_with_quantized_kv(name, home):
    server = warm_multi_turn_matches_cold(name, home, Q8, label="Quantized K/V")
    assert server.service.layout.kv_quant is not None


@pytest.mark.parametrize("name", HYBRIDS + DENSES)  # hybrids: checkpoints in SSD sidecars
def test_restart_from_ssd_matches_cold_with_quantized_kv(name, home, tmp_path):
    storage = "ssd_sidecar" if name in HYBRIDS else "auto"
    restart_matches_cold(name, storage, home, tmp_path, kv_cache=Q4)


@pytest.mark.parametrize("name", [HYBRIDS[0], DENSES[2]])
def test_rows_batched_together_give_what_each_gives_alone(name, home):
    """Eight prompts of different lengths at once (merged, extended, filtered as rows
    join and finish) against each alone, both on quantized K/V."""
    _, _, _, cold = load(name, home, Q8)
    prompts = [prompt_of(3 + i, 1)[: 9 + 5 * i] for i in range(8)]
    alone = [run(cold, CompletionRequest(model="m", prompt=p, max_tokens=6 + i,
                                         temperature=0))["text"]
             for i, p in enumerate(prompts)]
    together: list[str | None] = [None] * len(prompts)

    def ask(i: int) -> None:
        together[i] = run(cold, CompletionRequest(model="m", prompt=prompts[i],
                                                  max_tokens=6 + i, temperature=0))["text"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone


def test_blocks_are_stored_packed_and_a_float_profile_never_reads_them(home, tmp_path):
    name = DENSES[0]
    prompt = prompt_of(5, 3)
    quantized = Server(name, home, tmp_path, kv_cache=Q8)
    q = quantized.ask(prompt)
    quantized.drain()
    layout = quantized.service.layout
    (k, v) = next(iter(layout.arrays))
    assert k.dtype == v.dtype == "uint32"
    files = sorted(quantized.ssd.block_path(i) for i in quantized.ids(prompt)[:3])
    assert files
    tensors, meta = read_file(files[0], {"kv_format": layout.kv_format})
    assert meta["kv_format"] == "q8g32-float32" and tensors["k0"].dtype == np.uint32
    quantized.close()

    float_ = Server(name, home, tmp_path)
    f = float_.ask(prompt)
    assert f["cached"] == 0  # another layout digest: another chain of blocks
    assert float_.service.layout.digest != layout.digest
    assert f["text"] == float_.cold_text(prompt)
    float_.close()
    assert q["text"] == quantized.cold_text(prompt)


def test_quantized_blocks_weigh_less_than_float_ones(home):
    name = DENSES[0]
    float_ = Server(name, home).service.layout
    q8 = Server(name, home, kv_cache=Q8).service.layout
    q4 = Server(name, home, kv_cache=Q4).service.layout
    assert q8.block_nbytes(BS) < 0.6 * float_.block_nbytes(BS)  # fp32 model: ~0.28x
    assert q4.block_nbytes(BS) < q8.block_nbytes(BS)


@pytest.mark.parametrize("name,spec", [
    (DENSES[0], {"method": "ngram", "num_draft_tokens": 4, "adaptive": False}),
    (HYBRIDS[2], {"method": "ngram", "num_draft_tokens": 4, "adaptive": False}),
    ("tiny-hybrid-mtp", {"method": "mtp", "num_draft_tokens": 3, "adaptive": False}),
])
def test_speculative_decoding_on_quantized_kv_gives_the_plain_tokens(name, spec, home,
                                                                     tmp_path):
    """Drafted runs rolled back on quantized K/V (trim, right padding rolled): the tokens
    of plain decoding with the same kv_cache, warm and restored from SSD after a restart."""
    prompt = [5 + (i * 7) % 23 for i in range(3 * BS + 3)]  # repeats: n-grams draft
    first = Server(name, home, tmp_path, speculative=spec, kv_cache=Q8)
    a = first.ask(prompt, n=24)
    assert a["text"] == first.cold_text(prompt, n=24)
    assert first.service.engine.snapshot().drafted_tokens > 0
    first.drain()
    first.close()
    again = Server(name, home, tmp_path, speculative=spec, kv_cache=Q8)
    b = again.ask(prompt, n=24)
    assert b["cached"] >= 3 * BS and b["text"] == a["text"]
    again.close()


def test_a_group_size_the_heads_cannot_take_is_an_error_naming_the_key(home):
    with pytest.raises(RuntimeError) as failed:
        Server(DENSES[0], home, kv_cache={"bits": 8, "group_size": 128})
    assert "kv_cache.group_size 128" in str(failed.value.__cause__)
    assert "use 32" in str(failed.value.__cause__)


@pytest.mark.parametrize("name", ["tiny-vl", "tiny-qwen25-vl-bf16"])
def test_an_image_conversation_on_quantized_kv_restores_from_ssd_as_cold(name, home,
                                                                          tmp_path):
    """Image rows (spliced features, 3-D rotary positions) on quantized K/V: restored from
    SSD after a restart, the tokens of a cold prefill with the same kv_cache."""
    from tests.support.images import image_part

    request = ChatCompletionRequest(
        model="m", max_tokens=10, temperature=0,
        chat_template_kwargs={"enable_thinking": False},
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                               image_part(13)]}])
    first = Server(name, home, tmp_path, kv_cache=Q8)
    expected = run(first.cold, request)["text"]
    assert run(first.service, request)["text"] == expected
    first.drain()
    first.close()
    again = Server(name, home, tmp_path, kv_cache=Q8)
    restored = run(again.service, request)
    assert restored["cached"] >= BS and restored["text"] == expected
    again.close()


def test_a_model_whose_attention_cannot_read_quantized_kv_is_a_load_error(home,
                                                                            monkeypatch):
    """A model calling MLX's fast attention kernel itself (as a few of mlx-lm's do) would
    get packed K/V it cannot read: the load fails naming kv_cache.bits."""
    import importlib

    import mlx.core as mx

    from serve_app.cache.layout import probe_layout
    from serve_app.kvquant.format import KVQuant

    _, model, _, _ = load(DENSES[0], home)
    module = importlib.import_module(type(model).__module__)

    def fast_kernel(queries, keys, values, cache, scale, mask, sinks=None):
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
                                                    mask=mask)

    monkeypatch.setattr(module, "scaled_dot_product_attention", fast_kernel)
    with pytest.raises(ValueError, match="kv_cache.bits: .* does not read quantized"):
        probe_layout(model, KVQuant(8, 32))


@pytest.mark.parametrize("name", [DENSES[1], HYBRIDS[0]])
def test_chunked_prefill_past_the_allocation_step_gives_the_whole_prefills_tokens(name,
                                                                                   home):
    """A 300-token prompt prefilled 48 tokens a chunk (the batch cache grown past mlx-lm's
    256-token step mid-prompt) and in one chunk: the same tokens, on quantized K/V; and a
    second request restored from it too."""
    from serve_app.cache.client import LocalCacheClient
    from serve_app.cache.tiers import TieredStore
    from serve_app.config.profile import ModelProfile
    from serve_app.serving.service import ModelService

    path, model, tokenizer, whole = load(name, home, Q4)
    chunked = ModelService(ModelProfile(name="chunked", source=f"embedded:{name}",
                                        prefill_step_size=48, kv_cache=Q4,
                                        cache={"block_size": BS}),
                           model, tokenizer, path, LocalCacheClient(TieredStore(1 << 30)))
    try:
        prompt = [5 + (i * 13) % 240 for i in range(300)]
        request = CompletionRequest(model="m", prompt=prompt, max_tokens=8, temperature=0)
        expected = run(whole, request)["text"]
        assert run(chunked, request)["text"] == expected
        again = run(chunked, request)
        assert again["cached"] >= 288 and again["text"] == expected
    finally:
        chunked.shutdown()
