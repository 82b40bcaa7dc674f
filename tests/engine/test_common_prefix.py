"""Reuse to the exact common prefix: a stored block or tail cut where a prompt leaves it.

Attention-only models keep position-wise KV, so a request that diverges inside a
stored block (an edited earlier turn, a regenerated answer) restores that block's
first tokens instead of recomputing them. The store finds the candidate through
its prefix tree (one walk, no hashing of every prefix); hybrid models, whose
recurrent state exists only at a block's end, keep restoring to block ends.

The index, the lookup and the plan run without MLX or Ray; the exactness tests
drive the real engine and store in-process, on every weight format of the
embedded dense model, against a cold prefill at temperature 0.
"""

from __future__ import annotations

import numpy as np
import pytest

from serve_app.cache.blocks import _checked_blocks
from serve_app.cache.hashing import block_id, chain
from serve_app.cache.hot import HotEntry
from serve_app.cache.layout import KV, RECURRENT, ArraySpec, Layout
from serve_app.cache.match import Match, MatchQuery, Partial, Tier
from serve_app.cache.payload import BlockPayload, PayloadError, RestorePlan, Tensor
from serve_app.cache.request_plan import RequestPlan
from serve_app.cache.tiers import TieredStore
from tests.support.formats import DENSES, Server
from tests.support.prefix import BS, ROOT, diverge, stored, tokens_of

# ---- the prefix tree's index, kept by the store ------------------------------------------


def child(bid: str, parent: str, tokens: list[int], nbytes: int = 100) -> HotEntry:
    return HotEntry(bid, parent, nbytes, False, handle=bid, model="m", token_ids=tuple(tokens))


def indexed(store: TieredStore, parent: str) -> set[str]:
    """The children of ``parent`` in the store's tree, once a lookup has synced it."""
    store.release(store.match(MatchQuery([])).lease)
    return set(store.tree.children(parent))


def test_children_are_indexed_on_put_and_forgotten_when_they_leave():
    store = TieredStore(300)
    assert store.hot.put(child("a", "p", [1, 2, 3]))
    assert store.hot.put(child("b", "p", [1, 2, 9, 9]))
    assert store.hot.put(HotEntry("c", "p", 100, False, handle="c"))  # no tokens: not indexed
    assert indexed(store, "p") == {"a", "b"}
    assert store.hot.remove("a") and indexed(store, "p") == {"b"}
    assert store.hot.put(child("d", "q", [4], nbytes=250))  # evicts b and c (LRU)
    assert indexed(store, "p") == set() and indexed(store, "q") == {"d"}
    assert len(store.tree) == 1


def test_a_replaced_checkpoint_keeps_its_child_indexed_and_late_tokens_are_adopted():
    store = TieredStore(1000)
    store.hot.put(HotEntry("a", "p", 100, False, handle="a"))  # promoted without its tokens
    assert indexed(store, "p") == set()
    store.hot.put(child("a", "p", [1, 2]))
    assert indexed(store, "p") == {"a"}
    store.hot.put(HotEntry("a", "p", 100, True, handle="a2", token_ids=(1, 2)))  # checkpoint
    assert indexed(store, "p") == {"a"} and store.hot.entry("a").handle == "a2"


# ---- lookups through the tiered store ------------------------------------------------


def publish(store: TieredStore, prompt: list[int], *, with_state: bool = False) -> list[str]:
    """Store every full block of ``prompt`` (and a tail of what is left), keyed as captured."""
    ids = chain(ROOT, prompt, BS)
    for i, bid in enumerate(ids):
        own = prompt[i * BS : (i + 1) * BS]
        store.hot.put(HotEntry(bid, ids[i - 1] if i else ROOT, 64, with_state,
                               handle=stored(own, with_state=with_state), token_ids=tuple(own)))
    return ids


def query(prompt: list[int], hybrid: bool = False) -> MatchQuery:
    ids = chain(ROOT, prompt, BS)[: (len(prompt) - 1) // BS]
    return MatchQuery(ids, need_state=hybrid, root=ROOT, tokens=tuple(prompt[:-1]),
                      block_size=BS)


def look(store: TieredStore, prompt: list[int], hybrid: bool = False) -> Match:
    found = store.match(query(prompt, hybrid))
    store.release(found.lease)
    return found


def test_a_dense_lookup_cuts_the_child_where_the_prompt_leaves_it():
    store = TieredStore(1 << 30)
    prompt = tokens_of(43, 3 * BS + 4)
    ids = publish(store, prompt)
    other = diverge(prompt, BS + 5, 2 * BS)
    found = look(store, other)
    assert found.ids == [ids[0], ids[1]] and found.partial == Partial(5, BS)
    assert found.block_tokens(BS) == [BS, 5] and found.stored_tokens(BS) == [BS, BS]
    assert found.sources[-1].tier == Tier.HOT
    assert found.sources[-1].token_ids == tuple(prompt[BS : 2 * BS])  # its own, not the prompt's
    assert store.snapshot()["trim_hits"] == 1 and store.snapshot()["pinned_blocks"] == 0
    # Diverging inside the first block: its root's child is cut (no full block before).
    first = look(store, diverge(prompt, 3, 2 * BS))
    assert first.partial == Partial(3, BS) and first.ids == [ids[0]]


def test_a_trimmed_child_is_pinned_until_released():
    store = TieredStore(1 << 30)
    prompt = tokens_of(41, 2 * BS + 2)
    ids = publish(store, prompt)
    other = diverge(prompt, BS + 7, BS)
    found = store.match(query(other))
    assert found.ids[-1] == ids[1] and found.partial.cut and store.hot.entry(ids[1]).pins == 1
    assert not store.hot.remove(ids[1])  # pinned: never evicted mid-restore
    store.release(found.lease)
    assert store.hot.entry(ids[1]).pins == 0 and store.hot.remove(ids[1])
    assert look(store, other).partial is None  # forgotten with its block


def test_an_exact_tail_wins_a_tie_and_full_matches_are_plain_hits():
    store = TieredStore(1 << 30)
    prompt = tokens_of(37, 2 * BS + 8)
    ids = publish(store, prompt)
    tail = prompt[2 * BS : 2 * BS + 5]
    tid = block_id(ids[1], tail)
    store.hot.put(HotEntry(tid, ids[1], 64, False, handle=stored(tail), token_ids=tuple(tail)))
    again = look(store, prompt[: 2 * BS + 5] + [200, 201, 202])
    assert again.ids[-1] == tid and again.partial == Partial(5, 5) and not again.partial.cut
    # The whole chain present: the full blocks are the hit, nothing is cut.
    same = look(store, prompt[: 2 * BS + 1])
    assert same.ids == ids[:2] and same.partial is None


def test_a_cut_always_leaves_the_last_prompt_token_to_compute():
    store = TieredStore(1 << 30)
    prompt = tokens_of(31, 2 * BS)
    ids = publish(store, prompt)
    found = look(store, prompt)  # the second block is the prompt's last: at most BS - 1
    assert found.ids == ids[:2] and found.partial == Partial(BS - 1, BS)


def test_hybrid_lookups_never_cut():
    store = TieredStore(1 << 30)
    prompt = tokens_of(29, 3 * BS + 4)
    ids = publish(store, prompt, with_state=True)
    found = look(store, diverge(prompt, BS + 5, 2 * BS), hybrid=True)
    assert found.ids == [ids[0]] and found.partial is None
    assert store.snapshot()["trim_hits"] == 0


# ---- payloads, restore plans, request plans --------------------------------------------


def test_a_cut_keeps_the_first_tokens_in_their_own_dtype():
    bits = np.arange(2 * 6 * 4, dtype=np.uint16).reshape(1, 2, 6, 4)
    payload = BlockPayload({0: (Tensor(bits, "bfloat16"), Tensor(bits + 1, "bfloat16"))})
    cut = payload.cut(4)
    keys, values = cut.kv[0]
    assert keys.dtype == "bfloat16" and keys.shape == (1, 2, 4, 4) and cut.tokens == 4
    assert np.array_equal(keys.data, bits[:, :, :4]) and keys.data.flags["C_CONTIGUOUS"]
    assert np.array_equal(values.data, bits[:, :, :4] + 1)
    for bad in (0, 7):
        with pytest.raises(PayloadError):
            payload.cut(bad)


def test_a_cut_restore_is_checked_as_stored_and_cut_only_for_attention_layouts():
    spec = ArraySpec((1, 1, None, 2), "float32")
    dense = Layout((KV,), arrays=((spec, spec),))
    block, tail = stored(list(range(BS))), stored(list(range(BS)))
    plan = RestorePlan([BS, 5], [block, tail], Partial(5, BS))
    assert plan.tokens == BS + 5 and plan.stored_tokens == [BS, BS]
    blocks = _checked_blocks(dense, plan)
    assert [b.tokens for b in blocks] == [BS, 5]
    assert np.array_equal(blocks[1].kv[0][0].data, tail.kv[0][0].data[:, :, :5])
    with pytest.raises(ValueError, match="does not fit"):  # the payload is not what it says
        _checked_blocks(dense, RestorePlan([BS, 5], [block, stored([1] * 9)], Partial(5, BS)))
    with pytest.raises(ValueError, match="out of range"):
        _checked_blocks(dense, RestorePlan([BS, BS], [block, tail], Partial(5, BS)))
    hybrid = Layout((KV, RECURRENT), arrays=((spec, spec), (ArraySpec((1, 3), "float32"),)))
    with_state = stored(list(range(BS)), with_state=True)
    with pytest.raises(ValueError, match="hybrid"):
        _checked_blocks(hybrid, RestorePlan([5], [with_state], Partial(5, BS)))


def test_a_request_restored_to_a_cut_captures_its_own_chain():
    prompt = tokens_of(23, 3 * BS + 6)
    ids = chain(ROOT, prompt, BS)
    published = []
    plan = RequestPlan(BS, ROOT, list(ids), sink=published.append, branch_points=(BS + 9,))
    plan.start(BS + 5)  # restored to a cut of a stored second block
    captures = plan.captures(len(prompt) - 1, prompt, [], state_valid=False)
    blocks = [c for c in captures if not c.tail]
    assert [(c.start, c.block_id, c.parent_id) for c in blocks] == [
        (BS, ids[1], ids[0]), (2 * BS, ids[2], ids[1])]
    assert all(c.token_ids == tuple(prompt[c.start : c.end]) for c in captures)
    tails = [(c.start, c.end, c.parent_id, c.block_id) for c in captures if c.tail]
    end = len(prompt) - 1
    assert tails == [
        (BS, BS + 9, ids[0], block_id(ids[0], prompt[BS : BS + 9])),
        (3 * BS, end, ids[2], block_id(ids[2], prompt[3 * BS : end]))]
    for c in captures:
        plan.publish(c, stored(prompt[c.start : c.end]))
    assert [b.token_ids for b in published] == [c.token_ids for c in captures]


# ---- exactness on the real engine, every dense format -------------------------------------


@pytest.mark.parametrize("name", DENSES)
def test_a_prompt_diverging_mid_block_restores_the_common_prefix_exactly(name, home):
    server = Server(name, home)
    prompt = tokens_of(13, 3 * BS + 3)
    server.ask(prompt)
    edited = diverge(prompt, BS + 5, 2 * BS + 4)  # an earlier turn edited at token 21
    b = server.ask(edited)
    assert b["cached"] == b["planned"] == BS + 5
    assert b["text"] == server.cold_text(edited)
    stats = server.service.cache_stats
    assert (stats.trim_hits, stats.trim_hit_tokens) == (1, 5)
    assert stats.restore_failures == 0 and stats.incompatible_payloads == 0
    # It captured its own chain from the cut: all of it restores now, still exact ...
    again = server.ask(edited)
    assert again["cached"] == len(edited) - 1 and again["text"] == b["text"]
    # ... and its own blocks are cut in turn (keyed by the right parents and tokens).
    deeper = diverge(edited, 2 * BS + 7, BS + 2)
    c = server.ask(deeper)
    assert c["cached"] == 2 * BS + 7 and c["text"] == server.cold_text(deeper)
    # Diverging inside the very first block cuts it too.
    early = diverge(prompt, 4, 2 * BS)
    d = server.ask(early)
    assert d["cached"] == 4 and d["text"] == server.cold_text(early)
    summary = server.service.cache_stats.summary()
    assert (summary["trim_hits"], summary["trim_hit_tokens"]) == (3, 5 + 7 + 4)
    assert server.store.snapshot()["pinned_blocks"] == 0
    server.close()


@pytest.mark.parametrize("name", DENSES)
def test_blocks_promoted_from_ssd_are_cut_too(name, home, tmp_path):
    prompt = tokens_of(17, 3 * BS + 3)
    first = Server(name, home, tmp_path)
    first.ask(prompt)
    first.drain()
    first.close()

    again = Server(name, home, tmp_path)
    assert again.ask(prompt)["cached"] == len(prompt) - 1  # read from SSD, promoted
    edited = diverge(prompt, 2 * BS + 6, BS)
    b = again.ask(edited)
    assert b["cached"] == 2 * BS + 6 and b["text"] == again.cold_text(edited)
    assert again.service.cache_stats.trim_hits == 1
    again.close()


def test_hybrid_models_restore_to_block_ends_as_before(home):
    server = Server("tiny-hybrid-bf16", home)
    prompt = tokens_of(19, 3 * BS + 3)
    server.ask(prompt)
    edited = diverge(prompt, BS + 5, 2 * BS + 4)
    b = server.ask(edited)
    assert b["cached"] == BS  # the checkpoint at the block's end, nothing cut
    assert b["text"] == server.cold_text(edited)
    stats = server.service.cache_stats
    assert stats.trim_hits == 0 and stats.restore_failures == 0
    assert server.store.snapshot()["trim_hits"] == 0
    # indexed all the same; a hybrid lookup never cuts
    assert set(server.store.tree.children(server.ids(prompt)[0]))
    server.close()


def test_a_cut_is_found_among_thousands_of_siblings():
    """Below a parent shared by many sessions the walk goes down one path: the child
    sharing the most tokens is found however many tails that parent has, even the oldest."""
    store = TieredStore(1 << 30)
    prompt = tokens_of(53, 2 * BS + 6)
    ids = publish(store, prompt)
    for i in range(3000):  # tails of other sessions, each leaving the prompt early
        own = prompt[BS : BS + 1 + i % 3] + [300 + i % 9, 400 + i % 200]
        store.hot.put(HotEntry(block_id(ids[0], own), ids[0], 8, False, handle=i,
                               token_ids=tuple(own)))
    store.hot.put(HotEntry("x" * 64, ids[0], 8, False, handle="x", token_ids=(1,)))
    other = diverge(prompt, BS + 5, BS)
    found = look(store, other)
    assert found.ids == [ids[0], ids[1]] and found.partial == Partial(5, BS)


def test_a_restored_cut_child_counts_as_recently_used():
    """The child a lookup cuts was just used: the LRU evicts an older block first."""
    store = TieredStore(1 << 30)
    prompt = tokens_of(47, 2 * BS + 2)
    ids = publish(store, prompt)  # ids[0], then ids[1]: ids[0] is the oldest
    other = diverge(prompt, BS + 6, BS)
    assert look(store, other).ids[-1] == ids[1]
    order = store.hot.ids()
    assert order.index(ids[1]) == len(order) - 1  # the newest now
