"""Where prefill pauses and which blocks carry recurrent checkpoints (in-process, no Ray).

Attention-only models are never cut at block boundaries; hybrid models pause
only at checkpoint positions (every ``checkpoint_interval`` tokens and the
prompt's last block boundary), keep only the newest decode-time checkpoint of a
request, and every restore still gives exactly the cold tokens.
"""

from __future__ import annotations

import asyncio

import mlx_lm
import pytest

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.layout import probe_layout
from serve_app.cache.request_plan import RequestPlan
from serve_app.cache.settings import CacheSettings, default_checkpoint_interval
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving import engine_cache
from serve_app.serving.engine_request import EngineRequest
from serve_app.serving.request import CompletionRequest
from serve_app.serving.sampling import SamplingParams
from serve_app.serving.service import ModelService
from tests.support.engine import generated, run

BS = 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    home = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name in ("tiny-dense", "tiny-hybrid-bf16"):
        path = materialize(name, home)
        model, tokenizer = mlx_lm.load(str(path))
        cold = ModelService(ModelProfile(name="cold", source=f"embedded:{name}",
                                         cache={"enabled": False}), model, tokenizer, path)
        out[name] = (path, model, tokenizer, cold)
    yield out
    for *_, cold in out.values():
        cold.shutdown()


def warm(models, name: str, **cache) -> tuple[ModelService, TieredStore]:
    """A caching service of ``name`` with blocks of ``BS`` tokens and, unless ``cache``
    says otherwise, a checkpoint every block (at this block size the default interval
    would be longer: ``test_the_default_interval_weighs_checkpoints_against_kv``)."""
    path, model, tokenizer, _ = models[name]
    store = TieredStore(1 << 30)
    profile = ModelProfile(name="warm", source=f"embedded:{name}",
                           cache={"block_size": BS, "checkpoint_interval": BS, **cache})
    return ModelService(profile, model, tokenizer, path, LocalCacheClient(store)), store


def ask(service: ModelService, prompt: list[int], n: int = 8) -> dict:
    return run(service, CompletionRequest(model="m", prompt=prompt, max_tokens=n,
                                          temperature=0))


def prompt_of(seed: int, tokens: int) -> list[int]:
    return [5 + (i * seed) % 240 for i in range(tokens)]


def checkpointed(service: ModelService, store: TieredStore, tokens: list[int]) -> list[bool]:
    """For each full block of ``tokens``: present in the hot tier with a checkpoint?"""
    ids = chain(salted_root(service.cache.root, None), tokens, BS)
    return [bool(store.hot.entry(b) and store.hot.entry(b).has_checkpoint) for b in ids]


def segments(service: ModelService, prompt: list[int], restored: int = 0) -> list[int]:
    plan = RequestPlan(BS, service.cache.root, [],
                       checkpoint_every=service.cache.settings.checkpoint_every)
    req = EngineRequest(1, prompt, SamplingParams(max_tokens=1), lambda e: None, plan,
                   restored=restored)
    return [len(s) for s in engine_cache.segments(req)]


def test_attention_only_prefill_is_not_cut_at_block_boundaries(models):
    service, store = warm(models, "tiny-dense")
    prompt = prompt_of(7, 5 * BS + 3)
    assert segments(service, prompt) == [len(prompt)]
    assert segments(service, prompt, restored=2 * BS) == [len(prompt) - 2 * BS]
    a = ask(service, prompt)
    # Every full block was captured all the same, without pausing the batch.
    ids = chain(salted_root(service.cache.root, None), prompt, BS)
    assert all(store.hot.entry(i) is not None for i in ids)
    b = ask(service, prompt)  # five blocks and the tail at the prompt's end
    assert b["cached"] == len(prompt) - 1 and a["text"] == b["text"]
    engine = service.engine.snapshot()
    assert engine.captured_checkpoints == 0 and engine.captured_checkpoint_bytes == 0
    service.shutdown()


def test_hybrid_pauses_only_at_checkpoint_positions(models):
    service, store = warm(models, "tiny-hybrid-bf16", checkpoint_interval=2 * BS)
    prompt = prompt_of(11, 5 * BS + 3)  # last full boundary before the last token: 80
    assert segments(service, prompt) == [2 * BS, 2 * BS, BS, 3]
    ask(service, prompt, n=2)
    # Checkpoints at 32, 64 (every 2 blocks) and 80 (the prompt's last boundary).
    assert checkpointed(service, store, prompt) == [False, True, False, True, True]

    # A prompt diverging inside block 4 walks back to the checkpoint at 64, not 48.
    other = prompt[: 3 * BS + 12] + prompt_of(13, 2 * BS)
    restored = ask(service, other)
    assert restored["cached"] == 2 * BS
    assert restored["text"] == ask(models["tiny-hybrid-bf16"][3], other)["text"]
    service.shutdown()


def test_checkpoint_interval_must_be_a_multiple_of_the_block_size(models):
    with pytest.raises(ValueError, match="checkpoint_interval"):
        warm(models, "tiny-hybrid-bf16", checkpoint_interval=BS + 1)


def test_only_the_newest_decode_time_checkpoint_is_kept(models):
    service, store = warm(models, "tiny-hybrid-bf16")
    prompt = prompt_of(17, 2 * BS + 5)
    first = ask(service, prompt, n=3 * BS)  # decoding crosses three block boundaries
    output = generated(models["tiny-hybrid-bf16"][3], prompt, 3 * BS)
    flags = checkpointed(service, store, prompt + output)
    assert flags[:2] == [True, True]  # the prompt's blocks (every block, as asked)
    # Blocks completed while decoding: KV only, except the newest one.
    decode_blocks = flags[2:]
    assert decode_blocks[-1] and not any(decode_blocks[:-1]), flags

    # The next turn restores to the end of the generation (its tail, with the state
    # there) and matches a cold prefill.
    follow = first["prompt"] + output + prompt_of(19, 7)
    warm_turn = ask(service, follow)
    assert warm_turn["cached"] == len(prompt) + 3 * BS
    assert warm_turn["text"] == ask(models["tiny-hybrid-bf16"][3], follow)["text"]
    service.shutdown()


def test_checkpoint_bytes_per_1k_tokens_drop_with_a_larger_interval(models):
    costs = {}
    for interval in (BS, 4 * BS):
        service, _ = warm(models, "tiny-hybrid-bf16", checkpoint_interval=interval)
        ask(service, prompt_of(23, 8 * BS + 3), n=2)
        stats = asyncio.run(service.stats())["cache"]
        assert stats["checkpoint_interval"] == interval
        costs[interval] = stats["checkpoint_bytes_per_1k_tokens"]
        service.shutdown()
    assert costs[4 * BS] < costs[BS] / 2


def test_the_default_interval_weighs_checkpoints_against_kv(models):
    """Unset, a hybrid model's checkpoint interval is the number of blocks whose KV weighs
    what one checkpoint weighs (at least one block, at most 4,096 tokens): the embedded
    models' default 256-token blocks keep one every block; 16-token blocks of the bf16
    hybrid (a 36 KB state beside 8 KB of KV) would keep one every 4 blocks. A block size
    set by hand without an interval keeps one every block."""
    layout = probe_layout(models["tiny-hybrid-bf16"][1])
    assert layout.state_nbytes() == 35840 and layout.block_nbytes(BS) == 8192
    assert default_checkpoint_interval(layout, BS) == 4 * BS
    assert default_checkpoint_interval(layout, 256) == 256
    assert default_checkpoint_interval(layout, 4096) == 4096
    assert default_checkpoint_interval(layout, 8) == 9 * 8  # round(35840 / 4096) blocks
    assert default_checkpoint_interval(probe_layout(models["tiny-dense"][1]), BS) == BS

    def settings(**cache):
        profile = ModelProfile(name="m", source="embedded:tiny-hybrid-bf16", cache=cache)
        return CacheSettings.from_profile(profile, True, layout)

    assert settings().checkpoint_every == 256  # both unset: the layout's interval
    assert settings(block_size=BS).checkpoint_every == BS  # set by hand: every block
    assert settings(block_size=BS, checkpoint_interval=2 * BS).checkpoint_every == 2 * BS
    service, _ = warm(models, "tiny-hybrid-bf16", checkpoint_interval=None)
    assert service.cache.settings.checkpoint_every == BS
    service.shutdown()
