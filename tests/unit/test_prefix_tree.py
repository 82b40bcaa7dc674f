"""The store's prefix tree: one walk answers the longest tail and the deepest cut.

Checked against brute force (every child compared with the query) over random
inserts and removals, so the radix splits and re-joins cannot drift from what a
plain scan would say; and through the store, for blocks known only from SSD.
"""

from __future__ import annotations

import random

import numpy as np

from serve_app.cache.hashing import block_id, chain
from serve_app.cache.hot import HotEntry
from serve_app.cache.match import MatchQuery, Partial, Tier
from serve_app.cache.payload import MAX_TOKEN_IDS, decode_token_ids, encode_token_ids
from serve_app.cache.prefix import common_prefix
from serve_app.cache.ssd import SSDStore
from serve_app.cache.ssd_format import DiskInfo
from serve_app.cache.tiers import TieredStore
from serve_app.cache.tree import PrefixTree
from tests.support.prefix import BS, ROOT, diverge, stored, tokens_of
from tests.support.servers import wait_for


def brute(children: dict[str, tuple[int, ...]], query: tuple[int, ...]):
    """(prefix lengths of children that begin the query, most tokens any child shares)."""
    prefixes = sorted(len(t) for t in children.values() if query[: len(t)] == t)
    common = max((common_prefix(t, query) for t in children.values()), default=0)
    return prefixes, common


def test_common_prefix_agrees_with_a_plain_loop():
    rng = random.Random(3)
    for _ in range(2000):
        a = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        b = tuple(rng.randrange(3) for _ in range(rng.randrange(12)))
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        assert common_prefix(a, b) == n == common_prefix(list(a), b)


def test_walks_match_brute_force_through_inserts_and_removals():
    rng = random.Random(7)
    tree = PrefixTree()
    live: dict[str, dict[str, tuple[int, ...]]] = {"p": {}, "q": {}}
    for step in range(3000):
        parent = rng.choice("pq")
        if live[parent] and rng.random() < 0.4:
            bid = rng.choice(sorted(live[parent]))
            tree.remove(bid)
            del live[parent][bid]
        else:
            tokens = tuple(rng.randrange(4) for _ in range(rng.randrange(1, 9)))
            bid = block_id(parent, list(tokens))
            tree.insert(bid, parent, tokens)
            live[parent][bid] = tokens
        query = tuple(rng.randrange(4) for _ in range(rng.randrange(0, 10)))
        walk = tree.walk(parent, query)
        prefixes, common = brute(live[parent], query)
        assert [n for n, _ in walk.prefixes] == prefixes, step
        assert all(live[parent][b] == query[:n] for n, b in walk.prefixes)
        assert walk.common == common, step
        if common:
            assert common_prefix(live[parent][walk.sharing], query) == common
        else:
            assert walk.sharing is None
        assert set(tree.children(parent)) == set(live[parent])
    for parent, kids in live.items():
        for bid in kids:
            tree.remove(bid)
        assert parent not in tree._under  # nothing left behind
    assert len(tree) == 0


def test_a_child_ending_inside_anothers_run_is_both_a_prefix_and_a_cut_source():
    tree = PrefixTree()
    tree.insert("long", "p", (1, 2, 3, 4, 5, 6))
    tree.insert("short", "p", (1, 2, 3))
    walk = tree.walk("p", (1, 2, 3, 4, 9))
    assert walk.prefixes == ((3, "short"),) and (walk.common, walk.sharing) == (4, "long")
    tree.remove("long")
    assert tree.walk("p", (1, 2, 3, 4)).prefixes == ((3, "short"),)
    assert tree.walk("nobody", (1,)).sharing is None


def test_token_ids_round_trip_and_malformed_metadata_is_none():
    assert decode_token_ids(encode_token_ids([0, 7, 2**32 - 1])) == (0, 7, 2**32 - 1)
    assert decode_token_ids(encode_token_ids([])) == ()
    for bad in ("", "not base64!", "AAA=", encode_token_ids([1] * (MAX_TOKEN_IDS + 1))):
        assert decode_token_ids(bad) == ()  # none, junk, 2 bytes, longer than any block


def on_disk(tmp_path, prompt: list[int], lie: bool = False) -> list[str]:
    """``prompt``'s full blocks written to SSD as the store writes them (token ids in the
    metadata); ``lie``: the second block's metadata names other tokens than its id's."""
    writer = TieredStore(1 << 30, SSDStore(tmp_path, 1 << 30))
    ids = chain(ROOT, prompt, BS)
    disk = DiskInfo("m" * 64, "l" * 64, BS, "ssd_sidecar", "exact")
    for i, bid in enumerate(ids):
        own = prompt[i * BS : (i + 1) * BS]
        said = [t + 1 for t in own] if lie and i == 1 else own
        writer.put(HotEntry(bid, ids[i - 1] if i else ROOT, 64, False,
                            handle=stored(own), token_ids=tuple(said)), disk)
    wait_for(lambda: all(writer.ssd.has_block(b) for b in ids), "every block on SSD",
             interval=0.02)
    return ids


def reopened(tmp_path) -> TieredStore:
    ssd = SSDStore(tmp_path, 1 << 30)
    store = TieredStore(1 << 30, ssd)
    ssd.ready.wait(10)
    return store


def query(prompt: list[int]) -> MatchQuery:
    ids = chain(ROOT, prompt, BS)[: (len(prompt) - 1) // BS]
    return MatchQuery(ids, root=ROOT, tokens=tuple(prompt[:-1]), block_size=BS)


def test_a_block_on_ssd_alone_is_cut_without_being_promoted_first(tmp_path):
    prompt = tokens_of(61, 3 * BS + 2)
    ids = on_disk(tmp_path, prompt)
    store = reopened(tmp_path)  # a restart: the hot tier is empty
    found = store.match(query(diverge(prompt, BS + 6, 2 * BS)))
    store.release(found.lease)
    assert found.ids == ids[:2] and found.partial == Partial(6, BS)
    assert [s.tier for s in found.sources] == [Tier.SSD, Tier.SSD]
    assert found.sources[-1].token_ids == tuple(prompt[BS : 2 * BS])
    assert len(store.tree) == len(ids)


def test_a_block_file_whose_token_ids_lie_is_no_cut_candidate(tmp_path):
    prompt = tokens_of(67, 3 * BS + 2)
    ids = on_disk(tmp_path, prompt, lie=True)
    store = reopened(tmp_path)
    found = store.match(query(diverge(prompt, BS + 6, 2 * BS)))
    store.release(found.lease)
    assert found.ids == ids[:1] and found.partial is None  # the full block still hits
    assert ids[1] not in store.tree and ids[0] in store.tree


def test_the_tree_forgets_what_every_tier_lost():
    store = TieredStore(200)
    prompt = tokens_of(71, 2 * BS + 2)
    ids = chain(ROOT, prompt, BS)
    for i, bid in enumerate(ids):
        store.hot.put(HotEntry(bid, ids[i - 1] if i else ROOT, 100, False,
                               handle=np.zeros(1), token_ids=tuple(prompt[i * BS:(i + 1) * BS])))
    store.release(store.match(query(prompt)).lease)
    assert set(store.tree.nodes) == set(ids)
    store.hot.put(HotEntry("z" * 64, "other", 200, False, handle=0, token_ids=(1,)))  # evicts
    store.release(store.match(query(prompt)).lease)
    assert set(store.tree.nodes) == {"z" * 64}
