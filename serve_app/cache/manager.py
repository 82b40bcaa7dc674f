"""The prefix cache's policy for one model, in one place (like vLLM's KV-cache manager).

``CacheManager`` plans each request: it looks the prompt's chain up through the
``CacheClient``, turns what was found into a ``RestorePlan``, names every miss
and keeps the replica's ``CacheStats``. The ``RequestPlan`` it returns then
decides, as the engine reports how far the batch cache covers the request,
which blocks, tails and recurrent checkpoints are due (``Capture``), extends
the chain of block ids over generated tokens, and holds back the newest
decode-time checkpoint. The engine only slices what it is told to.

No MLX and no Ray here: the policy is unit-tested in ``tests/test_manager.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from serve_app.cache import codecs
from serve_app.cache.client import (
    STORE_ERROR_KINDS,
    CacheClient,
    CircuitBreaker,
    FetchedChain,
    FetchRequest,
    store_error_kind,
)
from serve_app.cache.divergence import (
    POSITION_BUCKETS,
    CacheBust,
    DivergenceTracker,
    position_bucket,
)
from serve_app.cache.hashing import block_id, chain, model_identity, root_id, salted_root
from serve_app.cache.inflight import InflightBlocks
from serve_app.cache.match import Tier
from serve_app.cache.payload import BlockPayload, CapturedBlock, RestorePlan
from serve_app.cache.tiers import DiskInfo
from serve_app.config.paths import default_home
from serve_app.config.profile import ModelProfile

if TYPE_CHECKING:
    from serve_app.cache.layout import Layout

logger = logging.getLogger(__name__)

BlockSink = Callable[[CapturedBlock], None]
RECENT_CACHE_BUSTS = 8  # shown in /v1/stats
# The longest a lookup waits for blocks another request is prefilling: past it, the request
# computes them itself (the other one is stuck behind a full batch, or very long).
INFLIGHT_WAIT_S = 120.0


@dataclass(frozen=True)
class Miss:
    """Why a lookup restored less than it could: a metric label and a human text."""

    label: str
    text: str


@dataclass
class CacheStats:
    """Prefix-cache counters of one replica, token-granular like vLLM's."""

    enabled: bool
    disabled_reason: str | None
    block_size: int
    lookups: int = 0
    hit_tokens: int = 0
    missed_tokens: int = 0
    walkbacks: int = 0
    # Attention-only models: restores that cut a stored block or tail to the tokens it
    # shares with the prompt (a request that diverges inside it), and the tokens so kept.
    trim_hits: int = 0
    trim_hit_tokens: int = 0
    checkpoint_loads_by_tier: dict[str, int] = field(default_factory=dict)
    checkpoint_rejects: int = 0
    incompatible_payloads: int = 0  # cached payloads whose shapes/dtypes did not fit
    restore_failures: int = 0  # restores that failed to build: prefilled cold instead
    sidecar_loads: int = 0
    ssd_read_bytes: int = 0
    ssd_read_seconds: float = 0.0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    fetch_seconds: float = 0.0
    # Blocks fetched from another node's store (a cluster), and fetches that came back
    # with nothing usable (the node died or answered late: the request went on without).
    remote_fetches: int = 0
    remote_fetch_blocks: int = 0
    remote_fetch_bytes: int = 0
    remote_fetch_seconds: float = 0.0
    remote_fetch_failures: int = 0
    remote_fetch_skipped: int = 0  # another node had more, but recomputing was cheaper
    # Store calls a request waited on that failed, timed out or were skipped (the
    # store's circuit breaker open): each such request went on without the cache.
    store_errors_by_kind: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(STORE_ERROR_KINDS, 0))
    last_store_error: str | None = None
    misses_by_reason: dict[str, int] = field(default_factory=dict)
    last_miss_reason: str | None = None
    # Prompts that left a cached prompt early and rejoined it (see ``divergence``), by
    # the position bucket where they left it, and the last few of them (lengths only).
    cache_busts_by_position: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(POSITION_BUCKETS, 0))
    recent_cache_busts: list[dict] = field(default_factory=list)
    # Lookups that first waited for blocks another request was prefilling, and how long.
    inflight_waits: int = 0
    inflight_wait_seconds: float = 0.0

    def miss(self, miss: Miss) -> None:
        """A lookup that restored less than it could (counted by its label)."""
        self.misses_by_reason[miss.label] = self.misses_by_reason.get(miss.label, 0) + 1
        self.last_miss_reason = miss.text

    def store_error(self, kind: str, text: str) -> None:
        self.store_errors_by_kind[kind] = self.store_errors_by_kind.get(kind, 0) + 1
        self.last_store_error = text

    def cache_bust(self, bust: CacheBust) -> None:
        self.cache_busts_by_position[position_bucket(bust.position)] += 1
        self.recent_cache_busts = [*self.recent_cache_busts[1 - RECENT_CACHE_BUSTS:],
                                   asdict(bust)]

    def summary(self) -> dict:
        """The counters plus the derived hit rate (of prompt tokens)."""
        seen = self.hit_tokens + self.missed_tokens
        return {**self.__dict__, "hit_rate": round(self.hit_tokens / seen, 4) if seen else None}


def miss_reason(found: FetchedChain, restored: int, block_size: int) -> Miss:
    """The miss of a lookup that restored ``restored`` full blocks of those it asked for."""
    if found.store_error is not None:
        return Miss("store_unavailable", f"cache store {found.store_error}: prefilled cold")
    if found.incompatible:
        return Miss("incompatible", f"cached payload does not fit: {found.incompatible_reason}")
    if found.present > restored:
        return Miss("no_checkpoint",
                    f"no valid recurrent checkpoint after token {restored * block_size}")
    cut = found.partial is not None and found.partial.cut
    where = found.present * block_size + (found.partial.tokens if cut and found.partial else 0)
    if found.first_missing_evicted:
        return Miss("evicted", f"evicted at token {where}")
    if found.first_missing_skipped:
        return Miss("oversized_snapshot_skipped",
                    f"not kept at token {where}: the conversation is larger than the model's "
                    "share of the hot tier (and there is no SSD tier)")
    if found.present == 0:
        return Miss("new_prefix", "new prefix")
    return Miss("diverged", f"diverged at token {where}")


@dataclass
class NodeLink:
    """What this replica measured of fetching from one other node, and its breaker."""

    bandwidth: float
    latency: float
    breaker: CircuitBreaker
    fetches: int = 0
    failures: int = 0

    def snapshot(self) -> dict:
        return {"bandwidth_bytes_per_s": round(self.bandwidth), "fetches": self.fetches,
                "failures": self.failures, **self.breaker.snapshot()}


@dataclass
class RemoteFetchPolicy:
    """Whether fetching blocks from another node beats prefilling them here: measured
    fetch bandwidth against measured prefill rate (moving averages).

    Bandwidth is measured per node (``links``): a wedged or slow node never makes
    fetches from healthy ones look slower, and a node whose fetches fail or time out
    ``breaker_failures`` times in a row is skipped for ``breaker_cool_down_s`` (its
    circuit breaker), then tried again. ``bandwidth`` and ``latency`` are what a node
    not measured yet starts from (and, without a node, the replica-wide average).

    Until this replica has measured a prefill, fetching wins: KV bytes per token are
    small against what a token of prefill costs on any real model and link.
    """

    bandwidth: float = 1e9  # bytes/s until measured (10 GbE or Thunderbolt: 1-4 GB/s)
    latency: float = 0.005  # seconds a fetch costs beyond its bytes
    prefill_rate: float | None = None  # tokens/s, once measured
    min_timeout: float = 2.0
    weight: float = 0.3  # of a new measurement in the moving averages
    breaker_failures: int = 3
    breaker_cool_down_s: float = 10.0
    links: dict[str, NodeLink] = field(default_factory=dict)

    def link(self, node_id: str) -> NodeLink:
        link = self.links.get(node_id)
        if link is None:
            link = self.links[node_id] = NodeLink(
                self.bandwidth, self.latency,
                CircuitBreaker(self.breaker_failures, self.breaker_cool_down_s))
        return link

    def usable(self, node_id: str) -> bool:
        """False while the node's breaker is open (it is skipped; nothing consumed)."""
        link = self.links.get(node_id)
        return link is None or not link.breaker.is_open

    def allow(self, node_id: str) -> bool:
        """Fetch from this node now? (After a cool-down: one probe at a time.)"""
        return self.link(node_id).breaker.allow()

    def worth(self, nbytes: int, tokens: int, node_id: str | None = None) -> bool:
        if self.prefill_rate is None:
            return True
        return self.fetch_seconds(nbytes, node_id) < tokens / self.prefill_rate

    def fetch_seconds(self, nbytes: int, node_id: str | None = None) -> float:
        link = self.link(node_id) if node_id is not None else self
        return link.latency + nbytes / link.bandwidth

    def timeout(self, nbytes: int, node_id: str | None = None) -> float:
        """How long to wait for a fetch before prefilling instead: far past its estimate."""
        return max(self.min_timeout, 4 * self.fetch_seconds(nbytes, node_id))

    def fetched(self, nbytes: int, seconds: float, node_id: str | None = None) -> None:
        if nbytes > 0 and seconds > 0:
            self.bandwidth = self._mix(self.bandwidth, nbytes / seconds)
            if node_id is not None:
                link = self.link(node_id)
                link.bandwidth = self._mix(link.bandwidth, nbytes / seconds)
        if node_id is not None:
            link = self.link(node_id)
            link.fetches += 1
            link.breaker.success()

    def failed(self, node_id: str, nbytes: int = 0, timed_out_after: float = 0.0) -> None:
        """A fetch from ``node_id`` brought nothing (``timed_out_after``: it ran into its
        timeout, so that link is slower than thought). Only that node's link learns it."""
        link = self.link(node_id)
        link.failures += 1
        link.breaker.failure()
        if nbytes > 0 and timed_out_after > 0:
            link.bandwidth = self._mix(link.bandwidth, nbytes / timed_out_after)

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            rate = tokens / seconds
            self.prefill_rate = rate if self.prefill_rate is None else self._mix(
                self.prefill_rate, rate)

    def snapshot(self) -> dict:
        return {node_id: link.snapshot() for node_id, link in self.links.items()}

    def _mix(self, old: float, new: float) -> float:
        return (1 - self.weight) * old + self.weight * new


@dataclass(frozen=True)
class Capture:
    """One slice of a request's cache that is due: tokens ``[start, end)``."""

    start: int
    end: int
    block_id: str
    parent_id: str
    with_state: bool  # carries the recurrent state at ``end`` (a checkpoint)
    hold: bool = False  # a decode-time checkpoint: held back until a newer one or the end
    tail: bool = False  # a partial block, keyed by its parent and its own tokens
    token_ids: tuple[int, ...] = ()  # its own tokens: the store indexes children by them

    @property
    def tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Published:
    """A block or tail handed to the store: what the engine counts."""

    block: CapturedBlock
    tokens: int
    tail: bool = False

    @property
    def state_bytes(self) -> int:
        """Recurrent-state bytes: the cost of a hybrid model's checkpoint."""
        return sum(t.nbytes for arrays in self.block.payload.state.values() for t in arrays)


@dataclass
class RequestPlan:
    """A request's part in the prefix cache: what it restores and what it captures.

    ``block_ids`` are the ids of the prompt's full blocks; the chain is extended
    over generated tokens as the cache covers them. Blocks from the restored
    position on are captured and handed to ``sink`` (None: restore only).
    """

    block_size: int
    root: str
    block_ids: list[str]
    restore: RestorePlan | None = None
    sink: BlockSink | None = None
    # Hybrid models: a recurrent checkpoint every this many tokens (a multiple of
    # block_size), plus one at the prompt's last block boundary and the newest one
    # reached while decoding. 0: no recurrent state (attention-only models).
    checkpoint_every: int = 0
    # Where conversations branch inside the prompt (the end of the system prompt,
    # the start of the last message): a tail is captured there, so a request that
    # shares the prompt up to that point restores exactly to it.
    branch_points: tuple[int, ...] = ()
    lease: int | None = None  # the store's pins on the restored blocks, until copied
    # Blocks that end past this many tokens of the conversation are not kept in RAM: the
    # conversation is larger than the model's share of the hot tier (None: no limit).
    ram_tokens: int | None = None
    claim: int | None = None  # its claim on the blocks it computes (``InflightBlocks``)
    # Progress, kept by the plan as the engine reports it:
    restored: int = field(default=0, init=False)  # tokens the request really started from
    captured: int = field(default=0, init=False)  # tokens covered by the blocks captured
    held: Published | None = field(default=None, init=False)  # newest decode checkpoint
    _tails: set[int] = field(default_factory=set, init=False)  # positions already taken

    @property
    def hybrid(self) -> bool:
        """The model has recurrent state: captures carry it where it is exact."""
        return self.checkpoint_every > 0

    @property
    def restore_tokens(self) -> int:
        return self.restore.tokens if self.restore is not None else 0

    def checkpoints(self, prompt_len: int, start: int) -> list[int]:
        """Prompt positions in ``(start, prompt_len)`` where prefill pauses for a checkpoint."""
        if not self.checkpoint_every:
            return []
        last = (prompt_len - 1) // self.block_size * self.block_size
        every = range(self.checkpoint_every, last, self.checkpoint_every)
        points = (*every, last, *self.branch_points)
        return sorted({p for p in points if start < p < prompt_len})

    def tail_points(self, prompt_len: int) -> list[int]:
        """Prompt positions where a tail is captured: branch points and the prompt's end."""
        return sorted({p for p in (*self.branch_points, prompt_len - 1) if 0 < p < prompt_len})

    def start(self, restored: int) -> None:
        """The engine started the request from ``restored`` tokens (0: the restore failed).

        A restore may end inside a block (a tail): capture resumes at the block
        boundary before it, so the next full block is captured whole.
        """
        self.restored = restored
        self.captured = restored // self.block_size * self.block_size

    def captures(self, covered: int, prompt: list[int], output: list[int], *,
                 state_valid: bool, decoding: bool = False, ended: bool = False
                 ) -> list[Capture]:
        """What is due now that the cache covers ``covered`` tokens of prompt + output.

        ``state_valid``: the recurrent state is exactly at ``covered``, so what
        ends there can carry a checkpoint. ``decoding``: ``covered`` is past the
        prompt. ``ended``: the generation ends at ``covered`` (finished or
        cancelled), where a tail is due. Full blocks come first, then tails.
        """
        if self.sink is None:
            return []
        tails = self._tails_due(covered, len(prompt), state_valid, ended)
        if covered - self.captured < self.block_size and not tails:
            return []
        tokens = prompt + output
        bs = self.block_size
        out = []
        while self.captured + bs <= covered:
            end = self.captured + bs
            index = end // bs - 1
            self._extend(index + 1, tokens)
            with_state = self.hybrid and state_valid and end == covered and (
                decoding or self._is_checkpoint(end, len(prompt)))
            out.append(Capture(end - bs, end, self.block_ids[index], self._parent(index),
                               with_state, hold=with_state and decoding,
                               token_ids=tuple(tokens[end - bs : end])))
            self.captured = end
        for position in tails:
            start = position // bs * bs
            self._extend(start // bs, tokens)
            parent = self._parent(start // bs)
            own = tokens[start:position]
            out.append(Capture(start, position, block_id(parent, own), parent, self.hybrid,
                               tail=True, token_ids=tuple(own)))
        return out

    def publish(self, capture: Capture, payload: BlockPayload) -> list[Published]:
        """Hand a captured slice to the store, or hold it back; returns what was published.

        While decoding only the newest checkpoint keeps its state: the one it
        replaces is published as KV only.
        """
        keep_hot = self.ram_tokens is None or capture.end <= self.ram_tokens
        item = Published(CapturedBlock(capture.block_id, capture.parent_id, payload,
                                       token_ids=capture.token_ids, keep_hot=keep_hot),
                         capture.tokens, capture.tail)
        if not capture.hold:
            return self._send([item])
        previous, self.held = self.held, item
        if previous is None:
            return []
        old = previous.block
        return self._send([replace(previous, block=replace(
            old, payload=old.payload.without_state()))])

    def publish_held(self) -> list[Published]:
        """A request that ends publishes its newest decode-time checkpoint."""
        held, self.held = self.held, None
        return self._send([held]) if held is not None else []

    def _send(self, items: list[Published]) -> list[Published]:
        sink = self.sink
        if sink is None:  # restore only: nothing is ever captured
            return []
        for item in items:
            sink(item.block)
        return items

    def _is_checkpoint(self, position: int, prompt_len: int) -> bool:
        return position in self.checkpoints(prompt_len, position - 1)

    def _tails_due(self, covered: int, prompt_len: int, state_valid: bool,
                   ended: bool) -> list[int]:
        """Tail positions due now: prompt tail points the cache has reached (exactly,
        with the state there, for a hybrid model) and the end of the generation."""
        points = [p for p in self.tail_points(prompt_len) if p <= covered and (
            not self.hybrid or (state_valid and p == covered))]
        if ended:
            points.append(covered)
        due = sorted({p for p in points if p % self.block_size and p > self.restored
                      and p not in self._tails})
        self._tails.update(due)
        return due

    def _extend(self, n: int, tokens: list[int]) -> None:
        """Extend the chain of block ids to ``n`` full blocks (into generated tokens)."""
        bs = self.block_size
        while len(self.block_ids) < n:
            b = len(self.block_ids)
            parent = self.block_ids[-1] if self.block_ids else self.root
            self.block_ids.append(block_id(parent, tokens[b * bs : (b + 1) * bs]))

    def _parent(self, index: int) -> str:
        return self.block_ids[index - 1] if index else self.root


@dataclass(frozen=True)
class CacheSettings:
    """One model's cache settings, resolved from its profile and its probed layout."""

    model: str  # the name the model is served under
    block_size: int
    checkpoint_every: int = 0  # 0: attention-only, no recurrent checkpoints
    storage: str = "ssd_sidecar"  # where SSD checkpoints go: "ssd_sidecar" or "embedded"
    codec: str = codecs.EXACT  # the sidecar codec

    @classmethod
    def from_profile(cls, profile: ModelProfile, hybrid: bool,
                     layout: Layout | None = None) -> CacheSettings:
        """Defaults: blocks of 64 tokens (256 for hybrid models); with both unset, a
        hybrid model's checkpoint interval from its ``layout``
        (``default_checkpoint_interval``)."""
        cache = profile.cache
        block_size = cache.block_size or (256 if hybrid else 64)
        # A block size set by hand without an interval keeps a checkpoint every block:
        # the finest restore points, as asked.
        interval = cache.checkpoint_interval or (
            default_checkpoint_interval(layout, block_size)
            if hybrid and layout is not None and cache.block_size is None else block_size)
        if interval % block_size:
            raise ValueError(f"model {profile.name}: cache.checkpoint_interval ({interval}) "
                             f"must be a multiple of the block size ({block_size})")
        storage = cache.gdn_snapshot_storage
        return cls(profile.name, block_size, interval if hybrid else 0,
                   "ssd_sidecar" if storage == "auto" else storage, cache.sidecar_codec)


# The longest default checkpoint interval: a prompt that diverges inside a long message
# restores at most this far back (message boundaries are branch points, always kept).
MAX_DEFAULT_CHECKPOINT_INTERVAL = 4096


def default_checkpoint_interval(layout: Layout, block_size: int) -> int:
    """A hybrid model's recurrent checkpoints, by default, weigh about what the KV they sit
    beside weighs: one every k blocks, k = one checkpoint's bytes / one block's KV bytes
    (at least 1; at most ``MAX_DEFAULT_CHECKPOINT_INTERVAL`` tokens).

    Each checkpoint pauses prefill (measured on a 2-core CPU: no difference between every
    256 and every 2,048 tokens, ``bench/checkpoints.py``) and is stored in the hot tier and
    on SSD. The embedded tiny hybrid (38 KB of state, 262 KB of KV per 256-token block)
    keeps one every block; a Qwen3.5-27B-style model on a Mac (~150 MiB of state, 16 MiB
    of KV per block at 4-bit) one every ~2,300 tokens instead of 9x its KV in checkpoints.
    """
    kv = layout.block_nbytes(block_size)
    blocks = max(1, round(layout.state_nbytes() / kv)) if kv else 1
    return min(blocks, max(1, MAX_DEFAULT_CHECKPOINT_INTERVAL // block_size)) * block_size


def disabled_reason(profile: ModelProfile, layout: Layout, client: CacheClient | None,
                    model_dir: Path | None) -> str | None:
    """Why a model is served without prefix caching, or None."""
    if not profile.cache.enabled:
        return "caching disabled in the profile"
    if not layout.supported:
        return layout.unsupported
    if client is None or model_dir is None:
        return "no cache store"
    return None


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
        self.root = root_id(identity, layout.digest, settings.block_size)
        self._expect = {"model": identity, "layout": layout.digest,
                        "block_size": str(settings.block_size)}
        self._disk = DiskInfo(identity, layout.digest, settings.block_size, settings.storage,
                              settings.codec)
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
                  model_dir: Path | None, chat_template: str | None) -> CacheManager:
        """The manager of a loaded model; caching is off (and logged) where it cannot work."""
        settings = CacheSettings.from_profile(profile, layout.hybrid, layout)
        reason = disabled_reason(profile, layout, client, model_dir)
        if reason is not None:
            logger.warning("model %s: prefix caching off: %s", profile.name, reason)
            return cls(settings, layout, None, disabled=reason)
        assert model_dir is not None  # else disabled: "no cache store"
        identity = model_identity(model_dir, profile.source, chat_template,
                                  memo=default_home() / "weights-digests.json")
        return cls(settings, layout, client, identity)

    @property
    def enabled(self) -> bool:
        return self.client is not None

    async def plan(self, prompt: list[int], *, salt: str | None = None,
                   api_key_digest: str | None = None,
                   branch_points: tuple[int, ...] = ()) -> RequestPlan | None:
        """Look the prompt's blocks up and fetch what can be restored (None: caching off).

        Hybrid models restore only up to a block whose recurrent checkpoint is
        present and valid; each step back is a walkback. At least one prompt
        token is always left to compute.
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
        restorable = min(len(ids), (len(prompt) - 1) // bs)
        await self._wait_for_inflight(ids[:restorable])
        # Claimed before the lookup, so that a request arriving during it waits too.
        claim = self.inflight.claim(ids[:restorable])
        stats.lookups += 1
        tic = time.perf_counter()
        req = FetchRequest(self.settings.model, ids[:restorable], self.layout, bs, self._expect,
                           exact=self.settings.codec == codecs.EXACT,
                           root=root, tokens=tuple(prompt[:-1]))
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
            return FetchedChain(0, 0, [], None, False, store_error=kind)

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
