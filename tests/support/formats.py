"""The embedded models in every weight format, loaded once per test module, and a warm
'process lifetime' of the cache for one of them (:class:`Server`): what the exactness
tests of tests/engine share."""

from __future__ import annotations

from pathlib import Path

import mlx_lm

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.ssd import SSDStore
from serve_app.cache.tiers import TieredStore
from serve_app.config.catalog import EMBEDDED_PREFIX, FORMATS, REAL_MODELS, default_task
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import run
from tests.support.servers import wait_for

BS = 16
HYBRIDS = [f"tiny-hybrid-{f}" if f != "fp32" else "tiny-hybrid" for f in FORMATS]
DENSES = [f"tiny-dense-{f}" if f != "fp32" else "tiny-dense" for f in FORMATS]
# SmolLM2-135M: 4-bit as its GGUF, fp32 and bf16 (the generative real models)
REALS = sorted(n for n in REAL_MODELS if default_task(EMBEDDED_PREFIX + n) == "generate")

_loaded: dict[tuple[str, str], tuple] = {}
_models: dict[str, tuple] = {}


def load(name: str, home: Path, kv_cache: dict | None = None) -> tuple:
    """(path, model, tokenizer, cold service), once per model and K/V format
    (``kv_cache``: the profile's key; the cold service has the same) until
    :func:`close_loaded` (tests/engine/conftest.py calls it after each module)."""
    key = (name, repr(sorted((kv_cache or {}).items())))
    if key not in _loaded:
        if name not in _models:
            path = materialize(name, home)
            _models[name] = (path, *mlx_lm.load(str(path)))
        path, model, tokenizer = _models[name]
        cold = ModelService(ModelProfile(name="cold", source=f"embedded:{name}",
                                         cache={"enabled": False}, kv_cache=kv_cache or {}),
                            model, tokenizer, path)
        _loaded[key] = (path, model, tokenizer, cold)
    return _loaded[key]


def close_loaded() -> None:
    """Shut the cold services of :func:`load` down and forget the models."""
    for *_, cold in _loaded.values():
        cold.shutdown()
    _loaded.clear()
    _models.clear()


class Server:
    """One 'process lifetime' of the cache for one model: service, store, directory."""

    def __init__(self, name: str, home: Path, directory=None, cache: dict | None = None,
                 speculative: dict | None = None, kv_cache: dict | None = None) -> None:
        path, model, tokenizer, self.cold = load(name, home, kv_cache)
        self.ssd = SSDStore(directory, 1 << 30) if directory is not None else None
        self.store = TieredStore(1 << 30, self.ssd)
        profile = ModelProfile(name="warm", source=f"embedded:{name}",
                               cache={"block_size": BS, **(cache or {})},
                               speculative=speculative, kv_cache=kv_cache or {})
        self.service = ModelService(profile, model, tokenizer, path, LocalCacheClient(self.store))

    def ask(self, prompt: list[int], n: int = 10) -> dict:
        return run(self.service, CompletionRequest(model="m", prompt=prompt, max_tokens=n,
                                                   temperature=0))

    def cold_text(self, prompt: list[int], n: int = 10) -> str:
        return run(self.cold, CompletionRequest(model="m", prompt=prompt, max_tokens=n,
                                                temperature=0))["text"]

    def ids(self, prompt: list[int]) -> list[str]:
        return chain(salted_root(self.service.cache.root, None), prompt, BS)

    def drain(self) -> None:
        """Wait until every staged block is on SSD (a 'restart' reads only files)."""
        wait_for(lambda: not self.store.snapshot()["staging"]["pending_bytes"],
                 "the staged blocks to reach SSD", interval=0.02)

    def close(self) -> None:
        self.service.shutdown()


def prompt_of(seed: int, blocks: int) -> list[int]:
    """``blocks`` full blocks and three tokens more."""
    return [5 + (i * seed) % 240 for i in range(blocks * BS + 3)]


def branch(prompt: list[int]) -> list[int]:
    """The same full blocks, other last tokens: no tail of ``prompt`` matches it, so
    a restore of it exercises the full blocks and their checkpoints alone."""
    return prompt[:-3] + [5 + (t + 7) % 240 for t in prompt[-3:]]


def warm_multi_turn_matches_cold(name: str, home: Path, kv_cache: dict | None = None,
                                 label: str = "Format test") -> Server:
    """Three chat turns, each restored from the hot tier as the last left it: the tokens
    of a cold prefill each time (``kv_cache``: with that K/V format, the cold service's
    too). Returns the server (closed) for more checks of its layout."""
    from serve_app.serving.request import ChatCompletionRequest

    server = Server(name, home, kv_cache=kv_cache)
    messages = [{"role": "system", "content": f"{label} of {name}. " * 2},
                {"role": "user", "content": "The first question."}]
    for turn in range(3):
        req = ChatCompletionRequest(model="m", messages=messages, max_tokens=12,
                                    temperature=0)
        warm = run(server.service, req)
        assert warm["text"] == run(server.cold, req)["text"], turn
        if turn:
            assert warm["cached"] >= BS, turn
        messages += [{"role": "assistant", "content": warm["text"]},
                     {"role": "user", "content": f"Question {turn + 2}."}]
    stats = server.service.cache_stats
    assert stats.incompatible_payloads == 0 and stats.restore_failures == 0
    server.close()
    return server


def restart_matches_cold(name: str, storage: str, home: Path, tmp_path: Path,
                         kv_cache: dict | None = None) -> None:
    """Cold, then restored from SSD after a restart, then from the hot tier, then its full
    blocks alone: the same tokens each time (``kv_cache``: with that K/V format, the
    cold service's too)."""
    cache = {"gdn_snapshot_storage": storage}
    prompt = prompt_of(7, 3)
    first = Server(name, home, tmp_path, cache, kv_cache=kv_cache)
    a = first.ask(prompt)
    first.drain()
    first.close()

    again = Server(name, home, tmp_path, cache, kv_cache=kv_cache)
    b = again.ask(prompt)  # three blocks and the tail at the prompt's end
    assert b["cached"] == len(prompt) - 1
    assert b["text"] == a["text"] == again.cold_text(prompt)
    stats = again.service.cache_stats
    assert stats.hit_tokens_by_tier == {"ssd": len(prompt) - 1}
    assert stats.incompatible_payloads == 0 and stats.checkpoint_rejects == 0
    c = again.ask(prompt)  # promoted to the hot tier, still exact
    assert c["text"] == a["text"] and stats.hit_tokens_by_tier["hot"] == len(prompt) - 1
    d = again.ask(branch(prompt))  # the full blocks alone, from the hot tier now
    assert d["cached"] == 3 * BS and d["text"] == again.cold_text(branch(prompt))
    again.close()
