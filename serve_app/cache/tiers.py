"""The cache store's state: hot tier, bounded write staging, SSD tier.

Blocks arrive in the hot tier; when the SSD tier is on they are also queued
for a write-behind thread. Staging is bounded by bytes: when it is full, the
producer waits briefly, then writes inline; nothing is ever dropped. A block
is readable from the pending buffer before its file exists. Lookups walk the
chain across tiers (hot, pending, ssd). Plain Python: the Ray actor is a thin
wrapper, and tests drive it in-process.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

from serve_app.cache import codecs
from serve_app.cache.hashing import block_id
from serve_app.cache.hot import HotEntry, HotStore
from serve_app.cache.match import (
    BlockEvent,
    Drop,
    Match,
    MatchQuery,
    Partial,
    Source,
    StateAt,
    Tier,
)
from serve_app.cache.payload import (
    BlockPayload,
    decode_token_ids,
    encode_token_ids,
    state_tensors,
    to_tensors,
)
from serve_app.cache.ssd import SSDStore, WriteResult
from serve_app.cache.ssd_format import DiskEntry, DiskInfo, digest_of
from serve_app.cache.stats import Cleared, StagingStats, StoreStats, Usage
from serve_app.cache.tree import PrefixTree, Walk

logger = logging.getLogger(__name__)

BACKPRESSURE_WAIT_S = 0.5
REMEMBER_SKIPPED = 65536  # ids of blocks kept out of RAM, for miss reasons
GONE = "gone"  # the digest of a file evicted before a lookup could capture it: matches none
LEASE_TTL_S = 120.0  # a restore copies its blocks in well under this
MIN_CUT_TOKENS = 1  # the fewest tokens worth cutting a stored block to


@dataclass
class PendingWrite:
    entry: HotEntry
    disk: DiskInfo


class PartialHit(NamedTuple):
    """A partial last block a lookup found: which block, where it is, how much of it."""

    block_id: str
    source: Source
    partial: Partial


class TieredStore:
    """Hot + staging + SSD behind one lock-protected interface."""

    def __init__(
        self,
        hot_budget: int,
        ssd: SSDStore | None = None,
        pending_max_bytes: int = 512 * 1000 * 1000,
        resolve: Callable[[Any], BlockPayload] = lambda handle: handle,
    ) -> None:
        self.hot = HotStore(hot_budget)
        self.ssd = ssd
        self.pending_max_bytes = pending_max_bytes
        self.staging = StagingStats()
        self._resolve = resolve
        self._pending: OrderedDict[str, PendingWrite] = OrderedDict()
        # Blocks kept out of RAM as too large with no SSD tier to take them (newest last):
        # a lookup that misses one says why (``Match.first_missing_skipped``).
        self._skipped: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._leases: dict[int, tuple[int | None, list[str], float]] = {}
        self._lease_ids = itertools.count(1)
        self.decode_failures = 0
        # Blocks that entered or left a tier since the directory was last told.
        self._changed: set[str] = set()
        self._tree_changed: set[str] = set()  # the same, for the prefix tree
        self._changed_lock = threading.Lock()  # a leaf: taken under the tier locks
        self.tree = PrefixTree()
        self.hot.on_change = self._mark_changed
        if ssd is not None:
            ssd.on_block_change = self._mark_changed
        if ssd is not None:
            threading.Thread(target=self._open_ssd, args=(ssd,), name="ssd-open",
                             daemon=True).start()
            threading.Thread(target=self._writer, args=(ssd,), name="ssd-writer",
                             daemon=True).start()

    def _open_ssd(self, ssd: SSDStore) -> None:
        """Index the directory, then reconcile: orphan sidecars go, the budget holds."""
        try:
            ssd.open()
            for orphan in ssd.orphans():
                ssd.remove(orphan)
            ssd.enforce_budget()
        except Exception:
            logger.exception("indexing the SSD cache directory failed; serving without it")
        finally:
            ssd.ready.set()

    # ---- puts and write-behind -----------------------------------------------------------

    def put(self, entry: HotEntry, disk: DiskInfo | None, keep_hot: bool = True) -> bool:
        """Store a block; False if it was dropped (counted): no tier could keep it.

        ``keep_hot`` False: its conversation is larger than its model's share of the hot
        tier, so it goes to the SSD tier only (staged, then written), and is dropped
        without one (``oversized_skipped``; a lookup that misses it says so)."""
        with self._lock:
            if keep_hot:
                in_hot = self.hot.put(entry)
            else:
                in_hot = False
                self.staging.oversized_skipped += 1
                self.staging.oversized_skipped_bytes += entry.nbytes
                if self.ssd is None or disk is None:
                    self._skipped[entry.block_id] = None
                    if len(self._skipped) > REMEMBER_SKIPPED:
                        self._skipped.popitem(last=False)
                    return False
            if self.ssd is None or disk is None or entry.block_id in self._pending:
                # disk None: promoted from SSD, where it stays.
                if not in_hot and disk is not None and self.ssd is None:
                    self.staging.dropped_hot_full += 1
                    return False
                return True
            if self.ssd.has_block(entry.block_id) and not self._needs_sidecar(self.ssd, entry,
                                                                              disk):
                return True
            if self.staging.pending_bytes + entry.nbytes > self.pending_max_bytes:
                tic = time.perf_counter()
                self._cv.wait_for(
                    lambda: self.staging.pending_bytes + entry.nbytes <= self.pending_max_bytes,
                    timeout=BACKPRESSURE_WAIT_S,
                )
                self.staging.backpressure_seconds += time.perf_counter() - tic
            inline = self.staging.pending_bytes + entry.nbytes > self.pending_max_bytes
            if not inline:
                self._pending[entry.block_id] = PendingWrite(entry, disk)
                if not in_hot:  # the tree learns of it from staging (the hot tier says nothing)
                    self._mark_changed(entry.block_id)
                self.staging.pending_bytes += entry.nbytes
                self.staging.peak_pending_bytes = max(self.staging.peak_pending_bytes,
                                                      self.staging.pending_bytes)
                self._cv.notify_all()
                return True
            self.staging.inline_writes += 1
        self._write(self.ssd, PendingWrite(entry, disk))  # staging full: write now, never drop
        return True  # a skipped SSD write is counted by the SSD store (writes_dropped)

    def _needs_sidecar(self, ssd: SSDStore, entry: HotEntry, disk: DiskInfo) -> bool:
        """A checkpoint to store beside a block already on disk (or an exact one to
        replace a lossy sidecar, when this model asks for exactness)."""
        if not (entry.has_checkpoint and disk.storage == "ssd_sidecar"):
            return False
        sidecar = ssd.sidecar_entry(disk.layout, entry.block_id)
        return sidecar is None or (disk.codec == codecs.EXACT and not _exact(sidecar))

    def _writer(self, ssd: SSDStore) -> None:
        ssd.ready.wait()  # indexing removes temporary files; ours must come after
        while True:
            with self._lock:
                self._cv.wait_for(lambda: bool(self._pending))
                block_id, item = next(iter(self._pending.items()))
            self._write(ssd, item)
            with self._lock:
                self._pending.pop(block_id, None)
                self.staging.pending_bytes -= item.entry.nbytes
                self._cv.notify_all()
            self._mark_changed(block_id)  # the tree forgets it if no tier kept it

    def _write(self, ssd: SSDStore, item: PendingWrite) -> None:
        entry, disk = item.entry, item.disk
        try:
            payload: BlockPayload = self._resolve(entry.handle)
            embedded = payload.has_state and disk.storage == "embedded"
            tensors, dtypes = to_tensors(payload, with_state=embedded)
            meta = {"model": disk.model, "layout": disk.layout,
                    "block_size": str(disk.block_size), "tokens": str(payload.tokens),
                    "parent_id": entry.parent_id, "dtypes": dtypes,
                    "token_ids": encode_token_ids(entry.token_ids),
                    "kv_format": disk.kv_format}
            if embedded:
                meta["checkpoint"] = "embedded"
            result = WriteResult.DONE
            if not ssd.has_block(entry.block_id):
                result = ssd.write("block", entry.block_id, tensors, meta)
            if result and payload.has_state and disk.storage == "ssd_sidecar":
                state, codec_meta = codecs.encode_state(state_tensors(payload.state), disk.codec)
                result = ssd.write("sidecar", entry.block_id, state,
                                        {**meta, "dtypes": "{}", "codec": disk.codec,
                                         "codec_meta": codec_meta})
        except Exception:
            logger.exception("writing block %s to SSD failed", entry.block_id)
            result = WriteResult.FAILED
        with self._lock:  # a skipped write is counted as dropped by the SSD store
            if result is WriteResult.DONE:
                self.staging.writes_done += 1
            elif result is WriteResult.FAILED:
                self.staging.writes_failed += 1

    # ---- the block directory's feed --------------------------------------------------

    def _mark_changed(self, bid: str) -> None:
        with self._changed_lock:
            self._changed.add(bid)
            self._tree_changed.add(bid)

    def directory_events(self, full: bool = False) -> list[BlockEvent]:
        """Each block that changed since the last call, with the best tier holding it now
        (None: gone); ``full``: every block held, for a directory that must start over."""
        with self._changed_lock:
            changed, self._changed = self._changed, set()
        with self._lock:
            if full:
                held = set(self.hot.ids()) | set(self.ssd.block_ids() if self.ssd else ())
                return [BlockEvent(b, self._best_tier(b)) for b in sorted(held)]
            return [BlockEvent(b, self._best_tier(b)) for b in sorted(changed)]

    def _best_tier(self, bid: str) -> str | None:
        if bid in self.hot:
            return Tier.HOT
        if self.ssd is not None and self.ssd.has_block(bid):
            return Tier.SSD
        return None

    # ---- lookups ------------------------------------------------------------------------

    def match(self, q: MatchQuery) -> Match:
        """The deepest position ``q`` can restore from, across tiers, pinned under one lease.

        One pass: the leading full blocks by id, then from the deepest down, the
        partial position under each (the prefix tree's walk: a tail, or a cut for
        an attention-only model) and the block's own end, until one is restorable
        (a hybrid model needs its recurrent checkpoint there; each full block given
        up is a walkback).
        """
        if self.ssd is not None:
            self.ssd.ready.wait(timeout=2.0)  # a restart's index rebuild, briefly
        # SSD files as this lookup saw them, captured once: the writer thread may
        # evict any of them meanwhile, and a file gone by the time the replica
        # reads it is a clean miss there (its digest then matches nothing).
        seen: dict[str, DiskEntry] = {}
        with self._lock:
            self._expire_leases()
            self._sync_tree()
            sources: list[Source] = []
            for bid in q.block_ids:
                source = self._source(bid, seen)
                if source is None:
                    break
                sources.append(source)
            present = len(sources)
            restore, partial = self._restore_point(q, sources, seen)
            ids, sources = list(q.block_ids[:restore]), sources[:restore]
            if partial is not None:
                ids.append(partial.block_id)
                sources.append(partial.source)
            sidecar = self._locate_state(q, ids, sources, seen) if q.need_state else None
            ssd_ids = [b for b, s in zip(ids, sources, strict=True) if s.tier == Tier.SSD]
            lease = self._lease(ids, sources, ssd_ids)
            for bid in q.block_ids[:present]:
                self.hot.touch(bid)
            if partial is not None:  # a restored tail or cut child is as recently used
                self.hot.touch(partial.block_id)
            touched = [seen.get(bid) for bid in ssd_ids] + [sidecar]
            evicted = present < len(q.block_ids) and self.hot.was_evicted(q.block_ids[present])
            skipped = present < len(q.block_ids) and q.block_ids[present] in self._skipped
            cut = partial.partial if partial is not None else None
            self.hot.stats.lookups += 1
            self.hot.stats.hit_blocks += restore
            self.hot.stats.walkbacks += present - restore
            self.hot.stats.trim_hits += cut is not None and cut.cut
        if self.ssd is not None:
            for disk_entry in touched:
                self.ssd.touch(disk_entry)  # file mtimes: outside the lock
        return Match(ids, sources, cut, present, present - restore, evicted, skipped, lease)

    def _restore_point(self, q: MatchQuery, sources: list[Source], seen: dict[str, DiskEntry]
                       ) -> tuple[int, PartialHit | None]:
        """(full blocks, partial block or None) of the deepest position to start from.

        Positions in order, deepest first: the deepest partial position under
        the last present block, that block's own end, the same under the block
        before it, ... A hybrid model needs a recurrent checkpoint exactly there
        (a tail carries its own; a tail needs none at its parent's end).
        """
        for i in range(len(sources), -1, -1):
            if q.tokens:
                partial = self._partial(q, i, seen)
                if partial is not None:
                    return i, partial
            if i and (not q.need_state or self._has_state(q.block_ids[i - 1], sources[i - 1],
                                                          q)):
                return i, None
        return 0, None

    def _partial(self, q: MatchQuery, i: int, seen: dict[str, DiskEntry]
                 ) -> PartialHit | None:
        """The deepest partial position under full block ``i``, from one walk of the
        tree: the longest stored tail that begins the rest of the prompt (with its
        checkpoint, for a hybrid model) or, for an attention-only model, a stored
        child sharing more leading tokens than that, to be cut to them."""
        start = i * q.block_size
        parent = q.block_ids[i - 1] if i else q.root
        walk = self.tree.walk(parent, q.tokens[start : start + q.block_size])
        tail = None
        for tokens, tid in reversed(walk.prefixes):
            if tokens >= q.block_size:  # the next full block itself: not partial
                continue
            source = self._source(tid, seen)
            if source is not None and (not q.need_state or self._has_state(tid, source, q)):
                tail = PartialHit(tid, source, Partial(tokens, tokens))
                break
        if q.need_state:  # a recurrent state exists only at a child's end: no cut
            return tail
        cut = self._cut(walk, seen)
        if cut is not None and cut.partial.tokens > (tail.partial.tokens if tail else 0):
            return cut
        return tail

    def _cut(self, walk: Walk, seen: dict[str, DiskEntry]) -> PartialHit | None:
        """The child sharing the walk's most tokens, to be cut to them (None: it matches
        whole, which is a tail, or it shares too few)."""
        if walk.sharing is None or walk.common < MIN_CUT_TOKENS:
            return None
        own = self.tree.nodes[walk.sharing].token_ids
        if walk.common >= len(own):
            return None
        source = self._source(walk.sharing, seen)
        if source is None:
            return None
        source.token_ids = own
        return PartialHit(walk.sharing, source, Partial(walk.common, len(own)))

    def _locate_state(self, q: MatchQuery, ids: list[str], sources: list[Source],
                      seen: dict[str, DiskEntry]) -> DiskEntry | None:
        """Say where the last block's checkpoint is read from; the sidecar it uses, if any.
        (Without an SSD tier, a restore point always carries its checkpoint inline.)"""
        if not sources:
            return None
        last = sources[-1]
        if self._inline_state(ids[-1], last):
            last.state = StateAt.INLINE
            return None
        if self.ssd is None:
            return None
        sidecar = self._disk_sidecar(ids[-1], q)
        if sidecar is not None:
            last.state, last.sidecar = StateAt.SIDECAR, str(sidecar.path)
            last.sidecar_digest = digest_of(sidecar)
            return sidecar
        if self._embedded_state(ids[-1]):  # the state is in the block file: read that file
            sources[-1] = self._block_file(self.ssd, ids[-1], seen)
            sources[-1].state = StateAt.EMBEDDED
        return None

    def _lease(self, ids: list[str], sources: list[Source], ssd_ids: list[str]) -> int | None:
        """Pin what a restore will read until it is released (or the lease expires)."""
        if not ids:
            return None
        hot_ids = [b for b, s in zip(ids, sources, strict=True) if s.tier == Tier.HOT]
        lease = next(self._lease_ids)
        self._leases[lease] = (self.hot.pin(hot_ids), ssd_ids, time.monotonic())
        if ssd_ids and self.ssd is not None:
            self.ssd.pin(ssd_ids)
        return lease

    def _sync_tree(self) -> None:
        """Bring the prefix tree up to date with the blocks that entered or left a tier
        (under the store lock, at the start of a lookup: the only reader)."""
        with self._changed_lock:
            changed, self._tree_changed = self._tree_changed, set()
        for bid in changed:
            if bid in self.tree:
                if self._held(bid):
                    continue
                self.tree.remove(bid)
                continue
            known = self._tokens_of(bid)
            if known is not None:
                self.tree.insert(bid, *known)

    def _held(self, bid: str) -> bool:
        return bid in self.hot or bid in self._pending or (
            self.ssd is not None and self.ssd.has_block(bid))

    def _tokens_of(self, bid: str) -> tuple[str, tuple[int, ...]] | None:
        """(parent id, own tokens) of a held block, if known: a hot or staged entry's, or
        those its SSD file records (checked against its id: a file that lies is no
        candidate, and its contents are checksummed when read anyway)."""
        entry = self.hot.entry(bid)
        if entry is None and bid in self._pending:
            entry = self._pending[bid].entry
        if entry is not None and entry.token_ids:
            return entry.parent_id, entry.token_ids
        disk = self.ssd.block_entry(bid) if self.ssd is not None else None
        if disk is None:
            return None
        tokens = decode_token_ids(disk.meta.get("token_ids", ""))
        parent = disk.meta.get("parent_id", "")
        if not tokens or block_id(parent, list(tokens)) != bid:
            return None
        return parent, tokens

    def _expire_leases(self) -> None:
        """Leases of clients that vanished mid-restore must not pin blocks for ever."""
        now = time.monotonic()
        for lease, (_, _, taken) in list(self._leases.items()):
            if now - taken > LEASE_TTL_S:
                self._release_locked(lease)

    def _source(self, bid: str, seen: dict[str, DiskEntry]) -> Source | None:
        """Where block ``bid`` is now; an SSD entry is recorded in ``seen``."""
        entry = self.hot.entry(bid)
        if entry is not None:
            return Source(Tier.HOT, entry.handle)
        pending = self._pending.get(bid)
        if pending is not None:
            return Source(Tier.PENDING, pending.entry.handle)
        if self.ssd is not None:
            disk = self.ssd.block_entry(bid)
            if disk is not None:
                seen[bid] = disk
                return Source(Tier.SSD, str(disk.path), file_digest=digest_of(disk))
        return None

    def _block_file(self, ssd: SSDStore, bid: str, seen: dict[str, DiskEntry]) -> Source:
        """The block's file as a source: the entry this lookup saw, else the one indexed
        now; if it is gone already, its path (reading it is a clean miss)."""
        disk = seen.get(bid) or ssd.block_entry(bid)
        if disk is None:
            return Source(Tier.SSD, str(ssd.block_path(bid)), file_digest=GONE)
        seen[bid] = disk
        return Source(Tier.SSD, str(disk.path), file_digest=digest_of(disk))

    def _has_state(self, bid: str, source: Source, q: MatchQuery) -> bool:
        return self._inline_state(bid, source) or (
            self.ssd is not None and (self._disk_sidecar(bid, q) is not None
                                      or self._embedded_state(bid)))

    def _inline_state(self, bid: str, source: Source) -> bool:
        """Whether the block's own payload (hot or pending) carries its checkpoint.

        Hot and pending payloads are always exact: a block promoted from a lossy
        sidecar is promoted without its state.
        """
        if source.tier == Tier.HOT:  # present: the source was found under this same lock
            entry = self.hot.entry(bid)
            return entry is not None and entry.has_checkpoint
        if source.tier == Tier.PENDING:
            return self._pending[bid].entry.has_checkpoint
        return False

    def _disk_sidecar(self, bid: str, q: MatchQuery) -> DiskEntry | None:
        """The block's sidecar for this layout; a lossy one is none when ``q.exact``."""
        sidecar = self.ssd.sidecar_entry(q.layout, bid) if self.ssd is not None else None
        if sidecar is not None and (_exact(sidecar) or not q.exact):
            return sidecar
        return None

    def _embedded_state(self, bid: str) -> bool:
        block = self.ssd.block_entry(bid) if self.ssd is not None else None
        return block is not None and block.meta.get("checkpoint") == "embedded"

    def demote(self, model: str, layout: str, wait_s: float) -> tuple[int, int]:
        """Take a model's blocks out of RAM where the SSD tier has them (the model pool
        unloaded the model: its hot share goes with its weights). Waits up to ``wait_s``
        for the model's staged writes; a block that is not on SSD with everything a
        restore needs (a hybrid block's checkpoint, exact for this ``layout``) stays hot,
        as does a pinned one. Returns the blocks and bytes taken out."""
        if self.ssd is None:
            return 0, 0
        with self._lock:
            self._wait_staged(model, wait_s)
            blocks = nbytes = 0
            for bid in self.hot.ids():
                entry = self.hot.entry(bid)
                if entry is None or entry.model != model or entry.pins:
                    continue
                if not self.ssd.has_block(bid) or bid in self._pending:
                    continue
                if entry.has_checkpoint and not (self._embedded_state(bid) or _exact(
                        self.ssd.sidecar_entry(layout, bid))):
                    continue
                if self.hot.remove(bid, count=False):  # on SSD: not an eviction
                    blocks += 1
                    nbytes += entry.nbytes
            self.staging.demoted_blocks += blocks
            self.staging.demoted_bytes += nbytes
        return blocks, nbytes

    def clear(self, model: str, identities: frozenset[str], wait_s: float) -> Cleared:
        """Forget a model's blocks (asked for): in RAM by its name, on SSD by its identities
        (every rank's), once its staged writes landed (``wait_s`` at most)."""
        with self._lock:
            self._wait_staged(model, wait_s)
            hot = self.hot.remove_model(model)
        ssd = self.ssd.remove_model(identities) if self.ssd else (0, 0, 0)
        return Cleared(hot[0], hot[1], ssd[0], ssd[1], hot[2] + ssd[2])

    def _wait_staged(self, model: str, wait_s: float) -> None:  # the lock held
        self._cv.wait_for(lambda: not any(p.entry.model == model
                                          for p in self._pending.values()), timeout=wait_s)

    def release(self, lease: int | None) -> None:
        with self._lock:
            self._release_locked(lease)

    def _release_locked(self, lease: int | None) -> None:
        if lease is None:
            return
        hot_lease, ssd_ids, _ = self._leases.pop(lease, (None, [], 0.0))
        self.hot.release(hot_lease)
        if ssd_ids and self.ssd is not None:
            self.ssd.unpin(ssd_ids)

    def drop(self, why: Drop, layout: str, block_id: str, digest: str | None = None) -> None:
        """A block a reader could not use: forget it (and count a sidecar decode failure).

        ``digest`` is the file's checksum as the reader's lookup saw it
        (``Source.file_digest`` / ``sidecar_digest``): only that file goes, never one
        written since under the same name. None removes whatever is indexed.
        """
        if why in (Drop.CHECKPOINT, Drop.LOST):
            with self._lock:
                if why == Drop.CHECKPOINT:
                    self.hot.drop_checkpoint(block_id)
                else:
                    self.hot.remove(block_id)
            return
        if self.ssd is None:
            return
        self.ssd.remove_file("block" if why == Drop.BLOCK else "sidecar", layout, block_id,
                             digest)
        if why == Drop.SIDECAR:
            with self._lock:
                self.decode_failures += 1

    def stats(self) -> StoreStats:
        """The tiers' counters and usage by model, typed (the metrics pump reads them)."""
        with self._lock:
            hot = {model: Usage(blocks=u["blocks"], block_bytes=u["bytes"],
                                evictions=u["evictions"])
                   for model, u in self.hot.stats.by_model.items()}
            staging = replace(self.staging)
        out = StoreStats(self.hot.budget_bytes, hot, staging, self.pending_max_bytes,
                         dropped_hot_full=staging.dropped_hot_full)
        if self.ssd is None:
            return out
        counters = self.ssd.counters()
        wear = self.ssd.write_budget
        return replace(out, dropped_ssd_low_space=counters.writes_skipped_low_space,
                       dropped_ssd_budget=counters.writes_skipped_budget,
                       dropped_ssd_write_budget=counters.writes_skipped_write_budget,
                       ssd_budget_bytes=self.ssd.budget_bytes, ssd_by_model=self.ssd.usage(),
                       ssd_written_bytes=counters.bytes_written,
                       ssd_write_budget_per_hour=None if wear is None else wear.limit_bytes)

    def snapshot(self) -> dict:
        """Tier stats for ``/v1/stats``: ``stats()`` and more (the hot tier's counters, the
        SSD index); ``dropped`` counts blocks and sidecars dropped instead of stored."""
        stats = self.stats()
        with self._lock:
            out = self.hot.snapshot()
            out["staging"] = {**asdict(stats.staging), "pending_blocks": len(self._pending),
                              "pending_max_bytes": stats.staging_budget_bytes,
                              "writes_dropped": stats.writes_dropped}
            out["sidecar_decode_failures"] = self.decode_failures
        out["dropped"] = {"hot_full": stats.dropped_hot_full,
                          "ssd_low_space": stats.dropped_ssd_low_space,
                          "ssd_budget": stats.dropped_ssd_budget,
                          "ssd_write_budget": stats.dropped_ssd_write_budget}
        if self.ssd is not None:
            out["ssd"] = self.ssd.snapshot()
        return out


def _exact(sidecar: DiskEntry | None) -> bool:
    return sidecar is not None and sidecar.meta.get("codec") == codecs.EXACT
