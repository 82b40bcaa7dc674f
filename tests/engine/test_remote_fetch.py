"""Blocks fetched from another node's store restore exactly what a cold prefill computes.

In-process (real engine, real stores, no Ray): node B's store is reached through the
same ``CacheClient.fetch_remote`` a replica uses, with the transport (``_export``)
answering from B's ``TieredStore`` as B's store actor does. On every weight format
of both embedded models. The Ray transport, routing and node death are covered on a
real multi-node cluster in ``tests/cluster/test_cluster.py``.
"""

from __future__ import annotations

import asyncio

import pytest

from serve_app.cache.client import FetchedChain, FetchRequest, LocalCacheClient, RemotePrefix
from serve_app.cache.remote import RemoteFetchPolicy
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile
from serve_app.serving.request import CompletionRequest
from serve_app.serving.service import ModelService
from tests.support.engine import run
from tests.support.formats import BS, DENSES, HYBRIDS, load, prompt_of
from tests.support.servers import wait_for


class TwoNodeClient(LocalCacheClient):
    """Node A's client; node B's store answers ``_export`` like B's store actor would."""

    def __init__(self, store: TieredStore, peer: TieredStore, peer_up: bool = True) -> None:
        super().__init__(store)
        self.peer = LocalCacheClient(peer)
        self.peer_up = peer_up
        self.exports: list[FetchRequest] = []

    def remote_prefix(self, block_ids: list[str], usable=None) -> RemotePrefix | None:
        if usable is not None and not usable("node-b"):
            return None
        held = {e.block_id for e in self.peer.store.directory_events(full=True)}
        n = next((i for i, b in enumerate(block_ids) if b not in held), len(block_ids))
        return RemotePrefix("node-b", n) if n else None

    async def _export(self, node_id: str, req: FetchRequest,
                      timeout: float) -> FetchedChain | None:
        self.exports.append(req)
        if not self.peer_up:  # the node went away: its store never answers
            return None
        found = await self.peer.fetch(req)
        await self.peer.release(found.lease)
        return found


def service(name: str, home, client: LocalCacheClient) -> ModelService:
    path, model, tokenizer, _ = load(name, home)
    profile = ModelProfile(name="warm", source=f"embedded:{name}", cache={"block_size": BS})
    return ModelService(profile, model, tokenizer, path, client)


def ask(svc: ModelService, prompt: list[int], n: int = 10) -> dict:
    return run(svc, CompletionRequest(model="m", prompt=prompt, max_tokens=n, temperature=0))


@pytest.mark.parametrize("name", HYBRIDS + DENSES)
def test_blocks_from_another_node_restore_exactly(name, home):
    cold = load(name, home)[3]
    store_a, store_b = TieredStore(1 << 30, None), TieredStore(1 << 30, None)
    prompt = prompt_of(3, 6)  # 6 full blocks and 3 tokens
    # Node A holds the first two blocks of the prompt, node B all six.
    client = TwoNodeClient(store_a, store_b)
    node_a = service(name, home, client)
    ask(node_a, prompt[: 2 * BS + 1])
    node_b = service(name, home, LocalCacheClient(store_b))
    ask(node_b, prompt)
    node_b.shutdown()
    longer = prompt + [7, 8, 9]
    warm = ask(node_a, longer)
    assert warm["text"] == ask(cold, longer)["text"]
    stats = node_a.cache_stats
    assert stats.remote_fetches == 1 and stats.remote_fetch_failures == 0
    assert client.exports[-1].first == 2  # only what A lacked crossed the wire
    assert stats.hit_tokens_by_tier["remote"] == 4 * BS
    assert warm["cached"] == 6 * BS
    # The fetched blocks were promoted into A's hot tier: the next turn needs no fetch.
    again = ask(node_a, longer + [10, 11])
    assert again["text"] == ask(cold, longer + [10, 11])["text"]
    assert node_a.cache_stats.remote_fetches == 1 and again["cached"] >= 6 * BS
    node_a.shutdown()


@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-dense"])
def test_a_node_gone_mid_fetch_is_a_clean_miss(name, home):
    cold = load(name, home)[3]
    store_a, store_b = TieredStore(1 << 30, None), TieredStore(1 << 30, None)
    prompt = prompt_of(5, 4)
    node_b = service(name, home, LocalCacheClient(store_b))
    ask(node_b, prompt)
    node_b.shutdown()
    node_a = service(name, home, TwoNodeClient(store_a, store_b, peer_up=False))
    warm = ask(node_a, prompt)
    assert warm["text"] == ask(cold, prompt)["text"] and warm["cached"] == 0
    stats = node_a.cache_stats
    assert stats.remote_fetch_failures == 1 and stats.remote_fetches == 0
    node_a.shutdown()


def test_blocks_that_do_not_fit_are_refused(home):
    """A peer answering with blocks of another layout (here: cut short) is a clean miss."""
    store_a, store_b = TieredStore(1 << 30, None), TieredStore(1 << 30, None)
    prompt = prompt_of(9, 3)
    node_b = service("tiny-dense", home, LocalCacheClient(store_b))
    ask(node_b, prompt)
    node_b.shutdown()

    class Truncating(TwoNodeClient):
        async def _export(self, node_id, req, timeout):
            found = await super()._export(node_id, req, timeout)
            found.payloads[-1] = found.payloads[-1].cut(BS - 1)
            return found

    node_a = service("tiny-dense", home, Truncating(store_a, store_b))
    warm = ask(node_a, prompt)
    assert warm["cached"] == 0 and node_a.cache_stats.remote_fetch_failures == 1
    assert warm["text"] == ask(load("tiny-dense", home)[3], prompt)["text"]
    node_a.shutdown()


def test_prefilling_is_chosen_when_it_is_cheaper():
    policy = RemoteFetchPolicy(bandwidth=1e6, latency=0.01)
    assert policy.worth(10**9, 16)  # nothing measured yet: fetch
    policy.prefilled(1000, 0.5)  # 2,000 tokens/s
    assert policy.worth(10_000, 256)  # 0.02 s to fetch vs 0.128 s to prefill
    assert not policy.worth(1_000_000, 256)  # 1.01 s to fetch
    policy.fetched(1_000_000, 0.01)  # a measured 100 MB/s pulls the average up
    assert policy.bandwidth > 1e6 and policy.timeout(0) == policy.min_timeout


def test_no_remote_without_a_directory():
    """A client with no cluster (the base) never offers anything remote."""
    client = LocalCacheClient(TieredStore(1 << 20, None))
    assert client.remote_prefix(["a", "b"]) is None
    assert asyncio.run(client._export("n", None, 1.0)) is None


def test_a_node_whose_last_block_has_no_checkpoint_sends_up_to_one_that_has(home):
    """Hybrid: the other node walks back to its last checkpoint; what it sends restores."""
    from tests.support.engine import generated

    name = "tiny-hybrid"
    cold = load(name, home)[3]
    store_a, store_b = TieredStore(1 << 30, None), TieredStore(1 << 30, None)
    prompt = prompt_of(7, 6)  # 6 blocks and 3 tokens
    node_b = service(name, home, LocalCacheClient(store_b))
    ask(node_b, prompt, n=40)  # decode covers blocks 7 and 8; only the newest keeps state
    node_b.shutdown()
    longer = prompt + generated(cold, prompt, 40)[:20]  # restorable: 7 blocks
    client = TwoNodeClient(store_a, store_b)
    node_a = service(name, home, client)
    warm = ask(node_a, longer)
    assert warm["text"] == ask(cold, longer)["text"]
    stats = node_a.cache_stats
    assert stats.remote_fetches == 1 and stats.remote_fetch_failures == 0
    assert warm["cached"] == 6 * BS  # block 7 has no checkpoint on B: B sent six
    node_a.shutdown()


@pytest.mark.parametrize("name,storage", [
    *((n, s) for n in HYBRIDS for s in ("ssd_sidecar", "embedded")),
    *((n, "auto") for n in DENSES),
])
def test_blocks_another_node_holds_only_on_ssd_restore_exactly(name, storage, home, tmp_path):
    """The other node restarted: its blocks (and their recurrent checkpoints, in sidecars
    or embedded) are on its SSD alone; it reads and checks them, and they restore here
    exactly as a cold prefill computes."""
    from serve_app.cache.ssd import SSDStore
    from tests.support.formats import Server

    prompt = prompt_of(13, 5)
    before = Server(name, home, tmp_path, {"gdn_snapshot_storage": storage})
    before.ask(prompt)
    before.drain()
    before.close()
    restarted = TieredStore(1 << 30, SSDStore(tmp_path, 1 << 30))
    assert restarted.ssd.ready.wait(30)  # the index is rebuilt from file metadata
    assert {e.tier for e in restarted.directory_events(full=True)} == {"ssd"}
    node_a = service(name, home, TwoNodeClient(TieredStore(1 << 30, None), restarted))
    longer = prompt + [9, 8, 7]
    warm = ask(node_a, longer)
    assert warm["text"] == ask(load(name, home)[3], longer)["text"]
    stats = node_a.cache_stats
    assert stats.remote_fetches == 1 and stats.remote_fetch_failures == 0
    assert stats.hit_tokens_by_tier == {"remote": 5 * BS} and warm["cached"] == 5 * BS
    assert stats.incompatible_payloads == 0 and stats.checkpoint_rejects == 0
    node_a.shutdown()


class ManyNodeClient(LocalCacheClient):
    """Node A's client with several peers; a ``wedged`` peer never answers (its fetch
    runs into the timeout), the others answer like their store actors would."""

    def __init__(self, store: TieredStore, peers: dict[str, TieredStore]) -> None:
        super().__init__(store)
        self.peers = {n: LocalCacheClient(s) for n, s in peers.items()}
        self.wedged: set[str] = set()
        self.asked: list[str] = []
        self.timeouts: list[float] = []  # the timeout each ask was given
        self.cut: list[str] = []  # the wedged nodes whose asks ran into their timeout

    def remote_prefix(self, block_ids: list[str], usable=None) -> RemotePrefix | None:
        best = None
        for node_id, peer in self.peers.items():
            if usable is not None and not usable(node_id):
                continue
            held = {e.block_id for e in peer.store.directory_events(full=True)}
            n = next((i for i, b in enumerate(block_ids) if b not in held), len(block_ids))
            if n and (best is None or n > best.blocks):
                best = RemotePrefix(node_id, n)
        return best

    async def _export(self, node_id: str, req: FetchRequest,
                      timeout: float) -> FetchedChain | None:
        self.asked.append(node_id)
        self.timeouts.append(timeout)
        if node_id in self.wedged:  # no answer: the caller's timeout runs out
            await asyncio.sleep(timeout)
            self.cut.append(node_id)
            return None
        peer = self.peers[node_id]
        found = await peer.fetch(req)
        await peer.release(found.lease)
        return found


def test_a_wedged_node_is_skipped_and_spares_fetches_from_healthy_ones(home):
    """Node B (holding whole prompts) is wedged: each fetch from it runs into its timeout
    until its breaker opens after 2 in a row; then requests fetch from node C (holding
    half of each prompt) at once, with the timeout of C's own link. After the cool-down
    B is tried again, and once it answers it is used again. Tokens are always exact."""
    name = "tiny-dense"
    cold = load(name, home)[3]
    store_a, store_b, store_c = (TieredStore(1 << 30, None) for _ in range(3))
    prompts = [prompt_of(20 + i, 4) for i in range(5)]
    node_b = service(name, home, LocalCacheClient(store_b))
    node_c = service(name, home, LocalCacheClient(store_c))
    for p in prompts:
        ask(node_b, p)
        ask(node_c, p[: 2 * BS + 1])
    node_b.shutdown()
    node_c.shutdown()
    client = ManyNodeClient(store_a, {"node-b": store_b, "node-c": store_c})
    client.wedged.add("node-b")
    node_a = service(name, home, client)
    policy = node_a.cache.remote
    policy.min_timeout, policy.breaker_failures, policy.breaker_cool_down_s = 0.5, 2, 1.0
    try:
        def exact(p):
            out = ask(node_a, p)
            assert out["text"] == ask(cold, p)["text"]
            return out

        for p in prompts[:2]:  # B is asked and times out: prefilled instead
            out = exact(p)
            assert out["cached"] < BS  # (every prompt_of starts with the same token)
        assert client.asked == ["node-b", "node-b"] and client.cut == ["node-b", "node-b"]
        assert policy.links["node-b"].breaker.is_open
        out = exact(prompts[2])  # B skipped: C's two blocks, without waiting on B
        assert client.asked == ["node-b", "node-b", "node-c"] and out["cached"] == 2 * BS
        assert client.cut == ["node-b", "node-b"]  # no third wait on B
        # C was asked with its own link's timeout, not one stretched by B's failures.
        assert client.timeouts[-1] == policy.min_timeout
        assert policy.links["node-c"].failures == 0
        assert policy.timeout(0, "node-c") == policy.min_timeout  # C's link is unharmed
        # Cool-down over: B is probed again, and now it answers.
        wait_for(lambda: not policy.links["node-b"].breaker.is_open, "node B's cool-down",
                 timeout=10, interval=0.05)
        client.wedged.clear()
        out = exact(prompts[3])
        assert client.asked[-1] == "node-b" and out["cached"] == 4 * BS
        assert not policy.links["node-b"].breaker.is_open
        stats = node_a.cache_stats
        assert stats.remote_fetch_failures == 2 and stats.remote_fetches == 2
        snapshot = policy.snapshot()
        assert snapshot["node-b"]["failures"] == 2 and snapshot["node-c"]["fetches"] == 1
    finally:
        node_a.shutdown()
