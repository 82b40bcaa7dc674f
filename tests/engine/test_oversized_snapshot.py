"""A conversation larger than its model's share of the hot tier (issue 22).

It is still served and still cached, but past the share its blocks are kept out of RAM:
on SSD only, from where the next turn restores them exactly; without an SSD tier they
are dropped, and the next turn's miss says why (``oversized_snapshot_skipped``).
In-process (the store's own tiers, real files), on every embedded weight format.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.cache.hashing import chain, salted_root
from tests.support.formats import (
    BS,
    DENSES,
    HYBRIDS,
    Server,
    branch,
    prompt_of,
)

RAM_BLOCKS = 2  # the share holds this many blocks of a conversation


def limit_to(server: Server, blocks: int) -> int:
    """Set the model's share so that ``blocks`` blocks (and one checkpoint) fit."""
    layout = server.service.cache.layout
    state = layout.state_nbytes() if layout.hybrid else 0
    server.service.cache.snapshot_limit_bytes = layout.block_nbytes(blocks * BS) + state
    assert server.service.cache.ram_tokens() == blocks * BS
    return blocks * BS


def hot_blocks(server: Server, prompt: list[int]) -> list[bool]:
    ids = chain(salted_root(server.service.cache.root, None), prompt, BS)
    return [server.store.hot.entry(b) is not None for b in ids]


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_past_its_share_a_conversation_lives_on_ssd_and_restores_exactly(name, home, tmp_path):
    server = Server(name, home, tmp_path / "kv", cache={"checkpoint_interval": BS})
    try:
        limit_to(server, RAM_BLOCKS)
        prompt = prompt_of(11, 6)
        first = server.ask(prompt, n=2)
        server.drain()
        assert hot_blocks(server, prompt)[:RAM_BLOCKS] == [True] * RAM_BLOCKS
        assert not any(hot_blocks(server, prompt)[RAM_BLOCKS:])  # kept out of RAM
        staging = server.store.snapshot()["staging"]
        assert staging["oversized_skipped"] >= 6 - RAM_BLOCKS
        assert server.ssd is not None and all(
            server.ssd.has_block(b)
            for b in chain(salted_root(server.service.cache.root, None), prompt, BS)[:6])
        # The next request restores all of it (from SSD past the share) and matches cold.
        follow = branch(prompt)
        again = server.ask(follow)
        assert again["cached"] == 6 * BS
        assert again["text"] == server.cold_text(follow)
        assert first["cached"] == 0
    finally:
        server.close()


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_without_ssd_the_miss_says_why(name, home):
    server = Server(name, home, None, cache={"checkpoint_interval": BS})
    try:
        limit_to(server, RAM_BLOCKS)
        prompt = prompt_of(13, 5)
        server.ask(prompt, n=2)
        follow = branch(prompt)
        again = server.ask(follow)
        assert again["cached"] == RAM_BLOCKS * BS  # what the share held
        assert again["text"] == server.cold_text(follow)
        stats = asyncio.run(server.service.stats())["cache"]
        assert stats["misses_by_reason"].get("oversized_snapshot_skipped") == 1, stats
        assert "larger than the model's share of the hot tier" in stats["last_miss_reason"]
        assert server.store.snapshot()["staging"]["oversized_skipped"] >= 5 - RAM_BLOCKS
    finally:
        server.close()


def test_no_share_no_limit(home, tmp_path):
    server = Server("tiny-hybrid", home, None, cache={"checkpoint_interval": BS})
    try:
        assert server.service.cache.ram_tokens() is None
        prompt = prompt_of(17, 5)
        server.ask(prompt, n=2)
        assert all(hot_blocks(server, prompt)[:5])
        assert server.store.snapshot()["staging"]["oversized_skipped"] == 0
    finally:
        server.close()
