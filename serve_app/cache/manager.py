"""The prefix cache's policy for one model, in one place (like vLLM's KV-cache manager).

``CacheManager`` plans each request: it looks the prompt's chain up through the
``CacheClient``, turns what was found into a ``RestorePlan``, names every miss
and keeps the replica's ``CacheStats``. The ``RequestPlan`` it returns then
decides, as the engine reports how far the batch cache covers the request,
which blocks, tails and recurrent checkpoints are due (``Capture``), extends
the chain of block ids over generated tokens, and holds back the newest
decode-time checkpoint. The engine only slices what it is told to.

No MLX and no Ray here: the policy is unit-tested in ``tests/unit/test_manager.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.cache import codecs
from serve_app.cache.client import (
    CacheClient,
    FetchedChain,
    FetchRequest,
    store_error_kind,
)
from serve_app.cache.divergence import (
    DivergenceTracker,
)
from serve_app.cache.hashing import (
    chain,
    model_identity,
    root_id,
    salted_root,
    shard_identity,
)
from serve_app.cache.inflight import InflightBlocks
from serve_app.cache.manager_stats import CacheStats
from serve_app.cache.match import Tier
from serve_app.cache.payload import CapturedBlock, RestorePlan
from serve_app.cache.remote import RemoteFetchPolicy
from serve_app.cache.request_plan import Miss, RequestPlan, miss_reason
from serve_app.cache.settings import CacheSettings, disabled_reason
from serve_app.cache.ssd_format import DiskInfo
from serve_app.config.paths import default_home
from serve_app.config.profile import ModelProfile

if TYPE_CHECKING:
    from serve_app.cache.layout import Layout

logger = logging.getLogger(__name__)

# The longest a lookup waits for blocks another request is prefilling: past it, the request
# computes them itself (the other one is stuck behind a full batch, or very long).
INFLIGHT_WAIT_S = 120.0


class CacheManager:
    """The prefix cache of one model replica: lookups, plans, misses and their stats."""

    def __init__(self, settings: CacheSettings, layout: Layout, client: CacheClient | None,
                 identity: str = "", disabled: str | None = None) -> None:
        if disabled is None and client is None:
            disabled = "no cache store"
        self.settings = settings
        self.layout = layout
        self.client = client if disabled is None else None
        self.stats = CacheStats(disabled is None, disabled, settings.block_size)
        self.identity = identity
        # A rank's identity is its shard's: this is the model's, which every rank's derives
        # from (``shard_identity``); a cache clear reaches every rank's blocks through it.
        self.model_identity = identity
        self.root = root_id(identity, layout.digest, settings.block_size)
        self._expect = {"model": identity, "layout": layout.digest,
                        "block_size": str(settings.block_size)}
        self._disk = DiskInfo(identity, layout.digest, settings.block_size, settings.storage,
                              settings.codec, layout.kv_format)
        if layout.kv_quant is not None:  # float blocks written before it named none
            self._expect["kv_format"] = layout.kv_format
        breaker = getattr(client, "breaker", None)  # the store's settings, for nodes too
        self.remote = RemoteFetchPolicy() if breaker is None else RemoteFetchPolicy(
            breaker_failures=breaker.threshold, breaker_cool_down_s=breaker.cool_down_s)
        # Blocks some request of this replica is prefilling now (a request that needs them
        # waits for them instead of computing them too).
        self.inflight = InflightBlocks()
        # A "long" cached prompt, for cache-bust diagnostics: four blocks or more.
        self.divergence = DivergenceTracker(settings.model, 4 * settings.block_size)
        # The model's share of the hot tier (the memory plan's; None: no limit): a
        # conversation larger than that is not kept in RAM (``ram_tokens``).
        self.snapshot_limit_bytes: int | None = None

    @classmethod
    def for_model(cls, profile: ModelProfile, layout: Layout, client: CacheClient | None,
                  model_dir: Path | None, chat_template: str | None,
                  shard: str | None = None) -> CacheManager:
        """The manager of a loaded model; caching is off (and logged) where it cannot work.
        ``shard``: this rank's part of a model sharded over ranks (``tensor:0/2``): its
        blocks are its own, never read by another rank, size or mode."""
        settings = CacheSettings.from_profile(profile, layout.hybrid, layout)
        reason = disabled_reason(profile, layout, client, model_dir)
        if reason is not None:
            logger.warning("model %s: prefix caching off: %s", profile.name, reason)
            return cls(settings, layout, None, disabled=reason)
        assert model_dir is not None  # else disabled: "no cache store"
        identity = model_identity(model_dir, profile.source, chat_template,
                                  memo=default_home() / "weights-digests.json")
        manager = cls(settings, layout, client,
                      identity if shard is None else shard_identity(identity, shard))
        manager.model_identity = identity
        return manager

    @property
    def enabled(self) -> bool:
        return self.client is not None

    async def plan(self, prompt: list[int], *, salt: str | None = None,
                   api_key_digest: str | None = None,
                   branch_points: tuple[int, ...] = (),
                   limit: int | None = None, wait_inflight: bool = True
                   ) -> RequestPlan | None:
        """Look the prompt's blocks up and fetch what can be restored (None: caching off).

        Hybrid models restore only up to a block whose recurrent checkpoint is
        present and valid; each step back is a walkback. At least one prompt
        token is always left to compute; at most ``limit`` are restored (the ranks of a
        sharded model restore what all of them hold).
        """
        stats = self.stats
        client = self.client
        if client is None:
            stats.miss(Miss("disabled", stats.disabled_reason or "no cache store"))
            return None
        bs = self.settings.block_size
        root = salted_root(self.root, salt, api_key_digest)
        self._diagnose(root, prompt)
        ids = chain(root, prompt, bs)
        readable = len(prompt) - 1 if limit is None else min(len(prompt) - 1, limit)
        restorable = min(len(ids), readable // bs)
        if wait_inflight:  # (a rank other than 0 does not: rank 0 has waited)
            await self._wait_for_inflight(ids[:restorable])
        # Claimed before the lookup, so that a request arriving during it waits too.
        claim = self.inflight.claim(ids[:restorable])
        stats.lookups += 1
        tic = time.perf_counter()
        req = FetchRequest(self.settings.model, ids[:restorable], self.layout, bs, self._expect,
                           exact=self.settings.codec == codecs.EXACT,
                           root=root, tokens=tuple(prompt[:readable]))
        found = await self._fetch(client, req)
        try:
            found = await self._extend_from_remote(client, req, found)
        except Exception:  # never a failed request: the blocks are prefilled instead
            logger.exception("model %s: fetching from another node failed", self.settings.model)
            stats.remote_fetch_failures += 1
        stats.fetch_seconds += time.perf_counter() - tic
        restore = self._count(found, len(prompt), restorable)
        restored_blocks = (restore.tokens if restore is not None else 0) // bs
        self.inflight.unclaim(claim, ids[:restored_blocks])  # cached: nothing to compute
        return RequestPlan(bs, root, ids, restore, self.publish, self.settings.checkpoint_every,
                           branch_points, found.lease, self.ram_tokens(), claim=claim)

    async def _wait_for_inflight(self, block_ids: list[str]) -> None:
        """Wait while another request prefills blocks of this prompt (``InflightBlocks``):
        once they are published this request restores them instead of computing them
        again. Bounded by ``INFLIGHT_WAIT_S``; a claim whose request ends wakes it too."""
        deadline = time.monotonic() + INFLIGHT_WAIT_S
        tic = time.perf_counter()
        waited = False
        while (block := self.inflight.awaited(block_ids)) is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not await self.inflight.wait(block, left):
                break
            waited = True
        if waited:
            self.stats.inflight_waits += 1
            self.stats.inflight_wait_seconds += time.perf_counter() - tic

    def settle(self, plan: RequestPlan | None) -> None:
        """A request ended (or never started): the blocks it claimed and did not publish are
        free for another request to compute."""
        if plan is not None and plan.claim is not None:
            self.inflight.unclaim(plan.claim)

    def ram_tokens(self) -> int | None:
        """How long a conversation may grow with its blocks kept in RAM: the tokens whose
        KV, with one recurrent checkpoint, fit in ``snapshot_limit_bytes`` (the model's
        share of the hot tier). A longer one is still served and cached, but past that
        point on SSD only: in RAM it would evict everything else, then itself."""
        limit = self.snapshot_limit_bytes
        per_token = self.layout.block_nbytes(1) if limit is not None else 0
        if limit is None or per_token <= 0:
            return None
        state = self.layout.state_nbytes() if self.layout.hybrid else 0
        return max(0, (limit - state) // per_token)

    async def _fetch(self, client: CacheClient, req: FetchRequest) -> FetchedChain:
        """The local store's answer; a store that fails, times out or is skipped (its
        circuit breaker open) is an empty answer, counted: the request prefills cold."""
        try:
            return await client.fetch(req)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            kind = store_error_kind(exc)
            self.stats.store_error(kind, f"lookup: {exc}")
            if kind != "skipped":
                logger.warning("model %s: cache store lookup failed (%s), prefilling cold: %s",
                               self.settings.model, kind, exc)
            return FetchedChain.nothing(store_error=kind)

    def _diagnose(self, root: str, prompt: list[int]) -> None:
        """Cache-bust diagnostics; a fault in them never fails a request."""
        try:
            bust = self.divergence.observe(root, prompt)
        except Exception:
            logger.exception("model %s: cache-bust diagnostics failed", self.settings.model)
            return
        if bust is not None:
            self.stats.cache_bust(bust)

    async def _extend_from_remote(self, client: CacheClient, req: FetchRequest,
                                  found: FetchedChain) -> FetchedChain:
        """``found`` extended with the blocks another node holds past it, where the
        directory says one holds more and fetching is cheaper than prefilling them."""
        offer = client.remote_prefix(req.block_ids, usable=self.remote.usable)
        bs = self.settings.block_size
        full = found.full_blocks  # local full blocks
        if offer is None or offer.blocks * bs <= sum(found.block_tokens):
            return found
        stats = self.stats
        nbytes = (offer.blocks - full) * self.layout.block_nbytes(bs) + (
            self.layout.state_nbytes() if self.layout.hybrid else 0)
        gain = offer.blocks * bs - sum(found.block_tokens)
        node = offer.node_id
        if not self.remote.worth(nbytes, gain, node) or not self.remote.allow(node):
            stats.remote_fetch_skipped += 1
            return found
        timeout = self.remote.timeout(nbytes, node)
        tic = time.perf_counter()
        chain = await client.fetch_remote(req, full, node, timeout)
        if chain is None:
            stats.remote_fetch_failures += 1
            late = time.perf_counter() - tic >= timeout  # the link is worse than thought
            self.remote.failed(node, nbytes, timeout if late else 0.0)
            logger.warning("model %s: fetching %d blocks from node %s failed; prefilling them",
                           self.settings.model, offer.blocks - full, node)
            return found
        self.remote.fetched(chain.nbytes, chain.seconds, node)
        stats.remote_fetches += 1
        stats.remote_fetch_blocks += len(chain.payloads)
        stats.remote_fetch_bytes += chain.nbytes
        stats.remote_fetch_seconds += chain.seconds
        local = found.payloads[:full]
        if local and self.layout.hybrid:  # the state now comes from the last fetched block
            local[-1] = local[-1].without_state()
        n = full + len(chain.payloads)
        return replace(found, present=max(found.present, n), payloads=local + chain.payloads,
                       tiers=found.tiers[:full] + [Tier.REMOTE] * len(chain.payloads),
                       block_tokens=[bs] * n, partial=None)

    def _count(self, found: FetchedChain, prompt_len: int, restorable: int) -> RestorePlan | None:
        """Count a fetch in the stats; the restore it allows, if any."""
        stats = self.stats
        bs = self.settings.block_size
        stats.walkbacks += found.walkbacks
        stats.checkpoint_rejects += found.checkpoint_rejects
        stats.incompatible_payloads += found.incompatible
        stats.sidecar_loads += found.sidecar_loads
        stats.ssd_read_bytes += found.ssd_bytes
        stats.ssd_read_seconds += found.ssd_seconds
        counts = found.block_tokens
        for tier, count in zip(found.tiers, counts, strict=True):
            stats.hit_tokens_by_tier[tier] = stats.hit_tokens_by_tier.get(tier, 0) + count
        hit = sum(counts)
        stats.hit_tokens += hit
        stats.missed_tokens += prompt_len - hit
        if hit < restorable * bs:
            stats.miss(miss_reason(found, found.full_blocks, bs))
        if not counts:
            return None
        if self.layout.hybrid:
            loads = stats.checkpoint_loads_by_tier
            loads[found.tiers[-1]] = loads.get(found.tiers[-1], 0) + 1
        if found.partial is not None and found.partial.cut:
            stats.trim_hits += 1
            stats.trim_hit_tokens += found.partial.tokens
        return RestorePlan(counts, found.payloads, found.partial)

    def restore_failed(self, planned: int) -> None:
        """The engine could not build a planned restore: those tokens were missed."""
        stats = self.stats
        stats.restore_failures += 1
        stats.hit_tokens -= planned
        stats.missed_tokens += planned
        stats.miss(Miss("restore_failed", f"restore of {planned} tokens failed; prefilled cold"))

    def publish(self, block: CapturedBlock) -> None:
        """A captured block to the store (called on the engine thread; never blocks it:
        a block the publish queue cannot take now is dropped and counted)."""
        if self.client is not None:  # caching off: no plan captures anything
            self.client.publish(self.settings.model, block, self._disk, wait=False)
        # The store sees it before any later lookup (the client waits for its acks).
        self.inflight.published(block.block_id)

    async def release(self, lease: int | None) -> None:
        """Unpin a plan's restored blocks once the engine has copied them; a store that
        fails here is counted, never raised (the store expires the lease)."""
        if lease is not None and self.client is not None:
            kind = await self.client.release_quietly(lease)
            if kind is not None:
                self.stats.store_error(kind, f"release of lease {lease} failed")
