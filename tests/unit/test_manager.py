"""The prefix cache's policy, without MLX or Ray: what is due, what is held, why a miss.

The engine reports how far the batch cache covers a request and whether the
recurrent state is exactly there; ``RequestPlan.captures`` answers with the
blocks, tails and checkpoints to slice. Payloads here are small numpy arrays.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import pytest

from serve_app.cache.client import FetchedChain, LocalCacheClient
from serve_app.cache.hashing import block_id, chain
from serve_app.cache.manager import CacheManager
from serve_app.cache.payload import BlockPayload, CapturedBlock, Tensor
from serve_app.cache.prefix import find_branch_points
from serve_app.cache.request_plan import Capture, RequestPlan, miss_reason
from serve_app.cache.settings import CacheSettings
from serve_app.cache.tiers import TieredStore
from serve_app.config.profile import ModelProfile

BS = 16
ROOT = "root"


def payload(tokens: int, with_state: bool) -> BlockPayload:
    kv = Tensor(np.zeros((1, 1, tokens, 2), np.float32), "float32")
    state = {1: (Tensor(np.ones((1, 3), np.float32), "float32"),)} if with_state else {}
    return BlockPayload({0: (kv, kv)}, state)


def tokens_of(seed: int, n: int) -> list[int]:
    return [5 + (i * seed) % 240 for i in range(n)]


def plan_for(prompt: list[int], every: int = 0, branch: tuple[int, ...] = (),
             restored: int = 0) -> tuple[RequestPlan, list[CapturedBlock]]:
    published: list[CapturedBlock] = []
    plan = RequestPlan(BS, ROOT, chain(ROOT, prompt, BS), sink=published.append,
                       checkpoint_every=every, branch_points=branch)
    plan.start(restored)
    return plan, published


def spans(captures: list[Capture]) -> list[tuple[int, int, bool, bool]]:
    return [(c.start, c.end, c.with_state, c.tail) for c in captures]


def publish_all(plan: RequestPlan, captures: list[Capture]) -> None:
    for c in captures:
        plan.publish(c, payload(c.tokens, c.with_state))


# ---- settings -----------------------------------------------------------------------

def profile(**cache) -> ModelProfile:
    return ModelProfile(name="m", source="embedded:tiny-dense", cache=cache)


def test_settings_defaults_and_checkpoint_interval():
    assert CacheSettings.from_profile(profile(), hybrid=False) == CacheSettings("m", 64, 0)
    hybrid = CacheSettings.from_profile(profile(), hybrid=True)
    assert (hybrid.block_size, hybrid.checkpoint_every, hybrid.storage) == (256, 256,
                                                                             "ssd_sidecar")
    every = CacheSettings.from_profile(profile(block_size=16, checkpoint_interval=48), True)
    assert every.checkpoint_every == 48
    embedded = CacheSettings.from_profile(profile(gdn_snapshot_storage="embedded"), True)
    assert embedded.storage == "embedded"
    with pytest.raises(ValueError, match="checkpoint_interval"):
        CacheSettings.from_profile(profile(block_size=16, checkpoint_interval=24), True)


# ---- what is due ----------------------------------------------------------------------

def test_dense_captures_every_block_without_state_and_tails_once():
    prompt = tokens_of(7, 3 * BS + 5)  # 53 tokens: the prompt ends inside block 3
    plan, _ = plan_for(prompt, branch=(20,))
    assert plan.checkpoints(len(prompt), 0) == []  # attention-only: prefill never pauses
    first = plan.captures(24, prompt, [], state_valid=False)
    # KV needs no pause: blocks, and the branch-point tail, as soon as the cache covers them.
    assert spans(first) == [(0, 16, False, False), (16, 20, False, True)]
    assert spans(plan.captures(40, prompt, [], state_valid=True)) == [(16, 32, False, False)]
    end = plan.captures(len(prompt) - 1, prompt, [], state_valid=False)
    assert spans(end) == [(32, 48, False, False), (48, 52, False, True)]
    assert plan.captures(len(prompt) - 1, prompt, [], state_valid=False) == []  # each once
    assert [c.block_id for c in first + end if not c.tail] == [
        plan.block_ids[0], plan.block_ids[2]]


def test_tail_ids_are_keyed_by_parent_block_and_own_tokens():
    prompt = tokens_of(11, 2 * BS + 6)
    plan, _ = plan_for(prompt)
    captures = plan.captures(len(prompt) - 1, prompt, [], state_valid=False)
    (tail,) = [c for c in captures if c.tail]
    ids = chain(ROOT, prompt, BS)
    assert tail.parent_id == ids[1]
    assert tail.block_id == block_id(ids[1], prompt[2 * BS : len(prompt) - 1])
    assert tail.tokens == 5  # up to the last prompt token, which is always computed


def test_hybrid_checkpoint_positions():
    prompt = tokens_of(11, 5 * BS + 3)  # the last full boundary before the last token: 80
    plan, _ = plan_for(prompt, every=2 * BS)
    assert plan.checkpoints(len(prompt), 0) == [32, 64, 80]
    assert plan.checkpoints(len(prompt), 40) == [64, 80]
    plan, _ = plan_for(prompt, every=2 * BS, branch=(21, 50))
    assert plan.checkpoints(len(prompt), 0) == [21, 32, 50, 64, 80]
    assert plan.tail_points(len(prompt)) == [21, 50, len(prompt) - 1]


def test_hybrid_state_only_at_checkpoints_where_the_state_is():
    prompt = tokens_of(13, 5 * BS + 3)
    plan, _ = plan_for(prompt, every=2 * BS)
    # Segment ends at 32, 64, 80 (the checkpoints), the prefill step cuts in between.
    assert spans(plan.captures(20, prompt, [], state_valid=False)) == [(0, 16, False, False)]
    assert spans(plan.captures(32, prompt, [], state_valid=True)) == [(16, 32, True, False)]
    # 48 is a block boundary but no checkpoint: KV only, even with the state there.
    assert spans(plan.captures(48, prompt, [], state_valid=True)) == [(32, 48, False, False)]
    assert spans(plan.captures(64, prompt, [], state_valid=True)) == [(48, 64, True, False)]
    assert spans(plan.captures(80, prompt, [], state_valid=True)) == [(64, 80, True, False)]
    # The last segment ends at the prompt's last token: its tail carries the state.
    assert spans(plan.captures(82, prompt, [], state_valid=True)) == [(80, 82, True, True)]
    assert plan.captures(82, prompt, [], state_valid=False) == []  # the end of the prompt


def test_hybrid_tails_only_where_the_state_is_exact():
    prompt = tokens_of(17, 4 * BS + 2)
    plan, _ = plan_for(prompt, every=BS, branch=(37,))
    assert plan.captures(40, prompt, [], state_valid=False)[-1].tail is False  # passed 37
    plan, _ = plan_for(prompt, every=BS, branch=(37,))
    due = plan.captures(37, prompt, [], state_valid=True)  # a segment ends at the branch
    assert spans(due) == [(0, 16, False, False), (16, 32, False, False), (32, 37, True, True)]


def test_only_the_newest_decode_time_checkpoint_is_held():
    prompt = tokens_of(19, 2 * BS + 5)
    plan, published = plan_for(prompt, every=BS)
    publish_all(plan, plan.captures(2 * BS, prompt, [], state_valid=True))
    assert len(published) == 2
    output = tokens_of(23, 3 * BS)
    kinds = []
    for n in range(1, len(output) + 1):
        covered = len(prompt) + n
        for c in plan.captures(covered, prompt, output[:n], state_valid=True, decoding=True):
            assert c.with_state and c.hold and c.end == covered
            kinds.append([p.block.has_checkpoint for p in plan.publish(c, payload(BS, True))])
    # Blocks ending at 48 and 64 are published without state when a newer one arrives.
    assert kinds == [[], [False], [False]]
    assert plan.held is not None and plan.held.block.block_id == plan.block_ids[4]
    (last,) = plan.publish_held()
    assert last.block.has_checkpoint and plan.held is None and plan.publish_held() == []
    # The chain continues through generated tokens exactly as a prompt would.
    assert plan.block_ids == chain(ROOT, prompt + output, BS)[: len(plan.block_ids)]
    assert [b.block_id for b in published] == plan.block_ids[:5]


def test_generation_end_tail_and_block_boundaries():
    prompt = tokens_of(29, BS + 3)
    plan, _ = plan_for(prompt, every=BS)
    output = tokens_of(31, 9)
    covered = len(prompt) + len(output)  # 28: inside block 1
    due = plan.captures(covered, prompt, output, state_valid=True, decoding=True, ended=True)
    assert spans(due) == [(0, 16, False, False), (16, 28, True, True)]
    # A generation that ends on a block boundary: that block is the held checkpoint, no tail.
    plan, _ = plan_for(prompt, every=BS)
    output = tokens_of(31, 2 * BS - len(prompt))
    due = plan.captures(2 * BS, prompt, output, state_valid=True, decoding=True, ended=True)
    assert spans(due) == [(0, 16, False, False), (16, 32, True, False)] and due[1].hold


def test_captures_after_a_restore_that_ended_inside_a_block():
    prompt = tokens_of(37, 4 * BS + 2)
    plan, _ = plan_for(prompt, branch=(20, 44), restored=2 * BS + 9)
    assert plan.captured == 2 * BS  # back to the boundary: the block is captured whole
    due = plan.captures(len(prompt) - 1, prompt, [], state_valid=False)
    # The branch at 20 was restored already; the one at 44 is new.
    assert spans(due) == [(32, 48, False, False), (48, 64, False, False),
                          (32, 44, False, True), (64, 65, False, True)]
    assert due[0].parent_id == plan.block_ids[1]


def test_a_plan_without_a_sink_only_restores():
    prompt = tokens_of(41, 3 * BS)
    plan = RequestPlan(BS, ROOT, [], checkpoint_every=BS)
    assert plan.captures(len(prompt) - 1, prompt, [], state_valid=True) == []
    assert plan.checkpoints(len(prompt), 0) == [16, 32]  # the engine still cuts there


# ---- misses, lookups, stats -----------------------------------------------------------

def fetched(present: int, restored: int = 0, evicted: bool = False, incompatible: int = 0,
            reason: str | None = None) -> FetchedChain:
    return FetchedChain(present=present, walkbacks=present - restored, payloads=[], lease=None,
                        first_missing_evicted=evicted, incompatible=incompatible,
                        incompatible_reason=reason)


def test_miss_reasons():
    def named(found, restored):
        miss = miss_reason(found, restored, BS)
        return miss.label, miss.text

    assert named(fetched(0), 0) == ("new_prefix", "new prefix")
    assert named(fetched(2, 2), 2) == ("diverged", "diverged at token 32")
    assert named(fetched(2, 2, evicted=True), 2) == ("evicted", "evicted at token 32")
    assert named(fetched(3, 1), 1) == ("no_checkpoint",
                                       "no valid recurrent checkpoint after token 16")
    assert named(fetched(1, 1, incompatible=1, reason="dtype"), 1) == (
        "incompatible", "cached payload does not fit: dtype")


@dataclass
class FakeLayout:
    """What the manager and the client read of a layout: no MLX behind it."""

    hybrid: bool = False
    digest: str = "layout"
    unsupported: str | None = None
    kv_quant: None = None
    kv_format: str = "float"

    @property
    def supported(self) -> bool:
        return self.unsupported is None

    def check(self, payload: BlockPayload, tokens: int, need_state: bool) -> str | None:
        if payload.tokens != tokens:
            return f"{payload.tokens} tokens, not {tokens}"
        return "no state" if need_state and not payload.has_state else None


def manager(hybrid: bool = False) -> tuple[CacheManager, TieredStore]:
    store = TieredStore(1 << 30)
    settings = CacheSettings("m", BS, BS if hybrid else 0)
    return CacheManager(settings, FakeLayout(hybrid), LocalCacheClient(store), "model-id"), store


def lookup(cache: CacheManager, prompt: list[int], **key) -> RequestPlan | None:
    """Plan a request and release its pins at once (nothing restores here)."""
    plan = asyncio.run(cache.plan(prompt, **key))
    if plan is not None:
        asyncio.run(cache.release(plan.lease))
    return plan


def settled(cache: CacheManager, plan: RequestPlan | None) -> RequestPlan | None:
    """The request ended: its claims on blocks it did not publish end too."""
    cache.settle(plan)
    return plan


def serve(cache: CacheManager, prompt: list[int], output: list[int]) -> RequestPlan:
    """Plan a request and capture it as the engine would: prefill, then decode to the end."""
    plan = lookup(cache, prompt)
    plan.start(plan.restore_tokens)
    for covered in sorted({*plan.checkpoints(len(prompt), plan.restored), len(prompt) - 1}):
        publish_all(plan, plan.captures(covered, prompt, [], state_valid=True))
    publish_all(plan, plan.captures(len(prompt) - 1, prompt, [], state_valid=False))
    for n in range(1, len(output) + 1):
        publish_all(plan, plan.captures(len(prompt) + n, prompt, output[:n], state_valid=True,
                                        decoding=True, ended=n == len(output)))
    plan.publish_held()
    return plan


@pytest.mark.parametrize("hybrid", [False, True])
def test_lookups_hit_what_was_captured_and_name_their_misses(hybrid):
    cache, store = manager(hybrid)
    prompt = tokens_of(43, 2 * BS + 8)
    output = tokens_of(47, 6)
    first = serve(cache, prompt, output)
    assert first.restore is None
    assert cache.stats.misses_by_reason == {"new_prefix": 1}

    again = lookup(cache, prompt)  # two blocks and the prompt-end tail
    assert again.restore.block_tokens == [BS, BS, 7] and again.lease is not None
    turn = prompt + output + tokens_of(53, 5)  # the next turn: to the end of the answer
    assert lookup(cache, turn).restore_tokens == len(prompt) + len(output)
    other = prompt[:20] + tokens_of(59, 30)
    # An attention-only model cuts the second stored block to the 4 tokens it shares;
    # a hybrid model has no recurrent state there and stops at the block boundary.
    shared = BS if hybrid else 20
    assert lookup(cache, other).restore_tokens == shared
    stats = cache.stats
    assert stats.last_miss_reason == f"diverged at token {shared}"
    assert (stats.trim_hits, stats.trim_hit_tokens) == ((0, 0) if hybrid else (1, 4))
    # The turn restored its tail, short of the block it could have had: a miss too.
    assert stats.misses_by_reason == {"new_prefix": 1, "diverged": 2}
    assert stats.lookups == 4 and stats.hit_tokens == 39 + 46 + shared
    assert stats.hit_tokens_by_tier == {"hot": stats.hit_tokens}
    assert stats.checkpoint_loads_by_tier == ({"hot": 3} if hybrid else {})
    assert store.snapshot()["pinned_blocks"] == 0

    cache.restore_failed(shared)
    assert stats.restore_failures == 1 and stats.misses_by_reason["restore_failed"] == 1
    assert stats.hit_tokens == 39 + 46
    assert stats.last_miss_reason.startswith(f"restore of {shared}")
    assert cache.stats.summary()["hit_rate"] == round(stats.hit_tokens / (
        stats.hit_tokens + stats.missed_tokens), 4)


def test_salted_requests_never_share_blocks():
    cache, _ = manager()
    prompt = tokens_of(61, 3 * BS)
    serve(cache, prompt, [])
    salted = lookup(cache, prompt, salt="tenant")
    keyed = lookup(cache, prompt, api_key_digest="tenant")
    assert salted.restore is None and keyed.restore is None and salted.root != keyed.root


def test_a_disabled_cache_plans_nothing_and_says_why():
    cache = CacheManager(CacheSettings("m", BS), FakeLayout(), None)
    assert not cache.enabled and lookup(cache, [1, 2, 3]) is None
    assert cache.stats.misses_by_reason == {"disabled": 1}
    assert cache.stats.last_miss_reason == "no cache store"
    off = CacheManager.for_model(profile(enabled=False), FakeLayout(), None, None, None)
    assert off.stats.disabled_reason == "caching disabled in the profile"
    odd = CacheManager.for_model(profile(), FakeLayout(unsupported="rotating"), None, None, None)
    assert odd.stats.disabled_reason == "rotating" and not odd.stats.enabled


def test_branch_points_from_shorter_renderings():
    def render(messages: list[dict[str, str]]) -> list[int]:
        out = []
        for m in messages:
            out += [1, len(m["role"])] + [ord(c) for c in m["content"]] + [2]
        return out

    messages = [{"role": "system", "content": "be terse"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "more"}]
    prompt = render(messages) + [3]  # the generation prompt
    system_end = len(render(messages[:1])) + 2  # up to the empty user message's content
    last_start = len(render(messages[:-1])) + 2  # up to the last message's content
    assert find_branch_points(messages, prompt, render) == (system_end, last_start)
    assert find_branch_points(messages[1:2], render(messages[1:2]) + [3], render) == ()


# ---- requests that arrive together: a new shared prefix is prefilled once --------------


def test_a_request_waits_for_the_blocks_another_is_prefilling_then_restores_them():
    cache, store = manager()
    prompt = tokens_of(61, 3 * BS + 5)

    async def scenario():
        first = await cache.plan(prompt)
        assert first.restore is None and cache.inflight.claimed() == 3
        second_task = asyncio.create_task(cache.plan(prompt))
        await asyncio.sleep(0.05)
        assert not second_task.done()  # waits: the first is computing those blocks
        first.start(0)
        publish_all(first, first.captures(len(prompt) - 1, prompt, [], state_valid=True))
        second = await asyncio.wait_for(second_task, 5)
        cache.settle(first)
        cache.settle(second)
        await cache.release(second.lease)
        return second

    second = asyncio.run(scenario())
    assert second.restore_tokens >= 3 * BS  # restored, not computed again
    assert cache.stats.inflight_waits == 1 and cache.stats.inflight_wait_seconds > 0
    assert cache.inflight.claimed() == 0 and store.snapshot()["pinned_blocks"] == 0


def test_a_claim_that_ends_unpublished_lets_the_waiter_compute():
    """The first request failed or was cancelled before its prefill: the second one stops
    waiting at once and computes the blocks itself (it claims them in turn)."""
    cache, _ = manager()
    prompt = tokens_of(67, 2 * BS + 3)

    async def scenario():
        first = await cache.plan(prompt)
        second_task = asyncio.create_task(cache.plan(prompt))
        await asyncio.sleep(0.05)
        assert not second_task.done()
        cache.settle(first)
        second = await asyncio.wait_for(second_task, 5)
        claimed = cache.inflight.claimed()
        cache.settle(second)
        return second, claimed

    second, claimed = asyncio.run(scenario())
    assert second.restore is None and claimed == 2
    assert cache.inflight.claimed() == 0


def test_what_is_cached_is_never_claimed_and_other_prompts_do_not_wait():
    cache, _ = manager()
    shared = tokens_of(71, 2 * BS)
    serve(cache, shared + tokens_of(73, BS + 2), [])
    settled(cache, lookup(cache, shared + tokens_of(73, BS + 2)))

    async def scenario():
        # Cached blocks are restored, not claimed: a second prompt sharing only them
        # does not wait for the first one's new block.
        first = await cache.plan(shared + tokens_of(79, 2 * BS))
        # Its one new full block (the last block holds the token left to compute).
        assert cache.inflight.claimed() == 1
        other = await asyncio.wait_for(cache.plan(shared + tokens_of(83, 2 * BS)), 1)
        for plan in (first, other):
            cache.settle(plan)
            await cache.release(plan.lease)
        return first, other

    first, other = asyncio.run(scenario())
    # (a stored block may be cut to the tokens it shares: a token more or so)
    assert 2 * BS <= min(first.restore_tokens, other.restore_tokens) < 3 * BS
    assert cache.stats.inflight_waits == 0 and cache.inflight.claimed() == 0
