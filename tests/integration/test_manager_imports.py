"""The prefix cache's policy, without MLX or Ray: what is due, what is held, why a miss.

The engine reports how far the batch cache covers a request and whether the
recurrent state is exactly there; ``RequestPlan.captures`` answers with the
blocks, tails and checkpoints to slice. Payloads here are small numpy arrays.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from dataclasses import dataclass

import numpy as np

from serve_app.cache.client import FetchedChain, LocalCacheClient
from serve_app.cache.hashing import chain
from serve_app.cache.manager import CacheManager
from serve_app.cache.payload import BlockPayload, CapturedBlock, Tensor
from serve_app.cache.request_plan import Capture, RequestPlan
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


# ---- what is due ----------------------------------------------------------------------


# ---- misses, lookups, stats -----------------------------------------------------------

def fetched(present: int, restored: int = 0, evicted: bool = False, incompatible: int = 0,
            reason: str | None = None) -> FetchedChain:
    return FetchedChain(present=present, walkbacks=present - restored, payloads=[], lease=None,
                        first_missing_evicted=evicted, incompatible=incompatible,
                        incompatible_reason=reason)


@dataclass
class FakeLayout:
    """What the manager and the client read of a layout: no MLX behind it."""

    hybrid: bool = False
    digest: str = "layout"
    unsupported: str | None = None

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


def test_the_policy_imports_neither_mlx_nor_ray():
    code = ("import sys, serve_app.cache.manager; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'ray'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


# ---- requests that arrive together: a new shared prefix is prefilled once --------------
