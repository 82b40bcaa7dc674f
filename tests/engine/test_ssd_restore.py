"""Restores from the SSD tier, in-process (real engine, real files, no Ray).

A "restart" is a fresh ``TieredStore`` (empty hot tier) over the same
directory, whose index is rebuilt from file headers.
"""

from __future__ import annotations

import asyncio
import errno

import mlx_lm
import pytest

from serve_app.cache.client import LocalCacheClient
from serve_app.cache.hashing import chain, salted_root
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import read_file
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.models.embedded import materialize
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import run
from tests.support.servers import wait_for

BS = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = materialize("tiny-hybrid", tmp_path_factory.mktemp("m"))
    model, tokenizer = mlx_lm.load(str(path))
    cold = ModelService(ModelProfile(name="cold", source="embedded:tiny-hybrid",
                                     cache={"enabled": False}), model, tokenizer, path, None)
    yield path, model, tokenizer, cold
    cold.shutdown()


class Server:
    """One 'process lifetime' of the cache: a service over a store over a directory."""

    def __init__(self, loaded, directory, cache=None, ssd_budget=1 << 30, pending=1 << 30,
                 min_free=0):
        path, model, tokenizer, _ = loaded
        self.ssd = SSDStore(directory, ssd_budget, min_free)
        self.store = TieredStore(1 << 30, self.ssd, pending)
        self.client = LocalCacheClient(self.store)
        profile = ModelProfile(name="warm", source="embedded:tiny-hybrid",
                               cache={"block_size": BS, **(cache or {})})
        self.service = ModelService(profile, model, tokenizer, path, self.client)

    def ask(self, prompt: list[int], n: int = 12) -> dict:
        return run(self.service, CompletionRequest(model="m", prompt=prompt, max_tokens=n,
                                                   temperature=0))

    def drain(self, timeout: float = 30.0) -> dict:
        """The staging counters once every staged block is written (or dropped)."""
        def landed() -> dict | None:
            staging = self.store.snapshot()["staging"]
            return staging if staging["pending_bytes"] == 0 else None

        return wait_for(landed, "the staged blocks to reach SSD", timeout, interval=0.02)

    def ids(self, prompt: list[int]) -> list[str]:
        return chain(salted_root(self.service.cache.root, None), prompt, BS)

    def close(self) -> None:
        self.service.shutdown()


def cached_on_disk(loaded, directory, prompt: list[int], cache: dict | None = None) -> Server:
    """Serve ``prompt`` once and stop: its blocks are on disk, that server is closed."""
    first = Server(loaded, directory, cache=cache)
    first.ask(prompt)
    first.drain()
    first.close()
    return first


def prompt_of(seed: int, blocks: int) -> list[int]:
    return [5 + (i * seed) % 240 for i in range(blocks * BS + 3)]


def branch(prompt: list[int]) -> list[int]:
    """The same full blocks, other last tokens: no tail of ``prompt`` matches it, so
    a restore of it exercises the full blocks and their checkpoints alone."""
    return prompt[:-3] + [5 + (t + 7) % 240 for t in prompt[-3:]]


def cold_text(loaded, prompt, n=12) -> str:
    return run(loaded[3], CompletionRequest(model="m", prompt=prompt, max_tokens=n,
                                            temperature=0))["text"]


def test_restart_restores_from_ssd_with_one_sidecar(loaded, tmp_path):
    prompt = prompt_of(7, 4)
    first = Server(loaded, tmp_path)
    a = first.ask(prompt)
    staging = first.drain()
    assert staging["writes_done"] > 0 and staging["writes_dropped"] == 0
    first.close()

    again = Server(loaded, tmp_path)
    b = again.ask(prompt)  # four blocks and the tail at the prompt's end, from SSD
    assert b["cached"] == len(prompt) - 1
    assert b["text"] == a["text"] == cold_text(loaded, prompt)
    stats = again.service.cache_stats
    assert stats.sidecar_loads == 1  # lazily: only the newest checkpoint (the tail's)
    assert stats.hit_tokens_by_tier == {"ssd": len(prompt) - 1}
    c = again.ask(prompt)  # promoted into the hot tier
    assert c["text"] == a["text"] and stats.hit_tokens_by_tier["hot"] == len(prompt) - 1
    d = again.ask(branch(prompt))  # the full blocks alone, their newest checkpoint
    assert d["cached"] == 4 * BS and d["text"] == cold_text(loaded, branch(prompt))
    again.close()


def test_deleted_newest_sidecar_walks_back_once(loaded, tmp_path):
    prompt = prompt_of(11, 4)
    first = cached_on_disk(loaded, tmp_path, prompt)
    ids = first.ids(prompt)
    first.ssd.sidecar_path(first.service.layout.digest, ids[3]).unlink()

    again = Server(loaded, tmp_path)
    b = again.ask(branch(prompt))
    assert again.service.cache_stats.walkbacks == 1
    assert b["cached"] == 3 * BS
    assert b["text"] == cold_text(loaded, branch(prompt))
    again.close()


def test_corrupt_sidecar_is_a_decode_failure_and_a_walkback(loaded, tmp_path):
    prompt = prompt_of(13, 3)
    first = cached_on_disk(loaded, tmp_path, prompt)
    path = first.ssd.sidecar_path(first.service.layout.digest, first.ids(prompt)[2])
    data = bytearray(path.read_bytes())
    data[-8:] = b"\x7f" * 8  # flip bytes inside the tensor data
    path.write_bytes(bytes(data))

    again = Server(loaded, tmp_path)
    b = again.ask(branch(prompt))
    assert again.store.snapshot()["sidecar_decode_failures"] == 1
    assert again.service.cache_stats.walkbacks == 1
    assert b["cached"] == 2 * BS and b["text"] == cold_text(loaded, branch(prompt))
    again.drain()  # the re-prefilled block brought a fresh, valid sidecar
    assert read_file(path, {})[1]["kind"] == "sidecar"
    again.close()


def test_corrupt_kv_block_is_a_clean_miss_from_that_block_on(loaded, tmp_path):
    prompt = prompt_of(17, 4)
    first = cached_on_disk(loaded, tmp_path, prompt)
    path = first.ssd.block_path(first.ids(prompt)[1])
    data = bytearray(path.read_bytes())
    data[-16:] = b"\x00" * 16
    path.write_bytes(bytes(data))

    again = Server(loaded, tmp_path)
    b = again.ask(prompt)
    assert b["cached"] == 1 * BS
    assert b["text"] == cold_text(loaded, prompt)
    again.close()


def test_embedded_checkpoints_need_no_sidecar(loaded, tmp_path):
    prompt = prompt_of(19, 3)
    first = cached_on_disk(loaded, tmp_path, prompt, cache={"gdn_snapshot_storage": "embedded"})
    assert first.ssd.snapshot()["sidecars"] == 0
    again = Server(loaded, tmp_path, cache={"gdn_snapshot_storage": "embedded"})
    b = again.ask(prompt)
    assert b["cached"] == len(prompt) - 1 and b["text"] == cold_text(loaded, prompt)
    assert again.service.cache_stats.sidecar_loads == 0
    again.close()


def test_inexact_codec_restores(loaded, tmp_path):
    """rht_int8 is lossy: restores work, but tokens are not promised to match."""
    prompt = prompt_of(23, 3)
    cached_on_disk(loaded, tmp_path, prompt, cache={"sidecar_codec": "rht_int8"})
    again = Server(loaded, tmp_path, cache={"sidecar_codec": "rht_int8"})
    assert again.ask(prompt)["cached"] == len(prompt) - 1
    assert again.service.cache_stats.sidecar_loads == 1
    again.close()


@pytest.mark.parametrize("blocks_of_staging", [0, 2])
def test_staging_is_bounded_and_drops_nothing(loaded, tmp_path, blocks_of_staging):
    probe = Server(loaded, tmp_path / "probe")
    probe.ask(prompt_of(3, 1), n=1)
    probe.drain()
    block = max(e.nbytes for e in probe.store.hot._entries.values())
    probe.close()
    bound = max(1, blocks_of_staging * block)
    server = Server(loaded, tmp_path / "kv", pending=bound)
    for seed in (29, 31, 37):
        server.ask(prompt_of(seed, 4), n=40)
    staging = server.drain()
    assert staging["peak_pending_bytes"] <= bound
    assert staging["writes_dropped"] == 0 and staging["writes_failed"] == 0
    if blocks_of_staging == 0:
        assert staging["inline_writes"] > 0  # a full staging area writes inline
    hot_ids = set(server.store.hot._entries)
    assert hot_ids <= set(server.ssd._blocks)  # every block reached the disk
    server.close()


def test_directory_stays_within_budget(loaded, tmp_path):
    server = Server(loaded, tmp_path, ssd_budget=200_000)
    for seed in range(41, 53, 2):
        server.ask(prompt_of(seed, 4), n=4)
        server.drain()
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.safetensors"))
        assert on_disk <= 200_000
    assert server.ssd.stats.evictions > 0
    server.close()


def test_low_disk_and_enospc_keep_serving(loaded, tmp_path, monkeypatch):
    prompt = prompt_of(53, 3)
    low = Server(loaded, tmp_path / "low", min_free=1 << 62)
    assert low.ask(prompt)["text"] == cold_text(loaded, prompt)
    low.drain()
    assert low.ssd.stats.writes_skipped_low_space > 0 and low.ssd.snapshot()["blocks"] == 0
    low.close()

    import serve_app.cache.ssd as ssd_module

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ssd_module.os, "write", full)
    broken = Server(loaded, tmp_path / "full")
    a = broken.ask(prompt)
    staging = broken.drain()
    assert staging["writes_failed"] > 0 and staging["writes_dropped"] == 0
    assert a["text"] == cold_text(loaded, prompt)
    assert not list((tmp_path / "full").rglob("*.tmp-*"))  # no partial file left
    assert asyncio.run(broken.service.stats())["cache"]["enabled"]
    broken.close()


def test_truncated_block_file_is_a_clean_miss(loaded, tmp_path):
    prompt = prompt_of(59, 4)
    first = cached_on_disk(loaded, tmp_path, prompt)
    path = first.ssd.block_path(first.ids(prompt)[1])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    again = Server(loaded, tmp_path)
    b = again.ask(prompt)
    assert b["cached"] == 1 * BS and b["text"] == cold_text(loaded, prompt)
    assert again.store.snapshot()["pinned_blocks"] == 0 and not again.ssd._pins
    again.close()


def test_embedded_checkpoint_behind_a_promoted_block(loaded, tmp_path):
    """Blocks promoted from SSD carry no checkpoint in RAM; the file still has it."""
    cache = {"gdn_snapshot_storage": "embedded"}
    prompt = prompt_of(61, 4)
    cached_on_disk(loaded, tmp_path, prompt, cache=cache)
    again = Server(loaded, tmp_path, cache=cache)
    assert again.ask(prompt)["cached"] == len(prompt) - 1  # blocks 0-2 promoted, no state
    other = prompt[: 2 * BS + 5] + [(t + 3) % 250 for t in prompt[2 * BS + 5:]]
    b = again.ask(other)
    assert b["cached"] == 2 * BS and b["text"] == cold_text(loaded, other)
    assert again.ssd.block_path(again.ids(prompt)[1]).exists()
    again.close()
