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
from typing import Any

from serve_app.cache import codecs
from serve_app.cache.directory import BlockEvent
from serve_app.cache.hashing import block_id
from serve_app.cache.hot import HotEntry, HotStore
from serve_app.cache.payload import BlockPayload, state_tensors, to_tensors
from serve_app.cache.ssd import DiskEntry, SSDStore, WriteResult, token_of
from serve_app.cache.stats import StagingStats, StoreStats, Usage

logger = logging.getLogger(__name__)

BACKPRESSURE_WAIT_S = 0.5
GONE = "gone"  # the token of a file evicted before a lookup could capture it: matches no file
LEASE_TTL_S = 120.0  # a restore copies its blocks in well under this
MIN_TRIM_TOKENS = 1  # the fewest tokens worth cutting a stored block to


@dataclass(frozen=True)
class DiskInfo:
    """What the SSD tier records of a block besides its tensors."""

    model: str  # model identity digest
    layout: str  # layout digest
    block_size: int
    storage: str  # "ssd_sidecar" or "embedded"
    codec: str


@dataclass
class PendingWrite:
    entry: HotEntry
    disk: DiskInfo


@dataclass(frozen=True)
class TailQuery:
    """What a lookup needs to find tails: the chain's root and the restorable tokens."""

    root: str
    tokens: list[int]  # the prompt without its last token (always computed)
    block_size: int


@dataclass
class Source:
    """Where one block of a restore comes from."""

    tier: str  # "hot", "pending" or "ssd"
    handle: Any = None  # hot/pending: the store's handle; ssd: the block file path
    checkpoint: str | None = None  # ssd: sidecar path, "embedded", or None
    token: str | None = None  # ssd: the block file's sha256 when looked up (see drop)
    checkpoint_token: str | None = None  # ssd: the sidecar file's sha256 when looked up


@dataclass(frozen=True)
class Trim:
    """A lookup's last payload is cut: a stored block or tail that shares only its
    first ``common`` tokens with the rest of the prompt (attention-only models)."""

    block_id: str
    stored: int  # tokens the payload holds
    common: int  # of those, the tokens restored


@dataclass(frozen=True)
class PartialHit:
    """A position inside the block after the last full block restored."""

    block_id: str
    tokens: int  # tokens restored from it
    source: Source
    stored: int = 0  # tokens it holds when more than ``tokens`` (a trim); 0: all restored

    @property
    def trim(self) -> Trim | None:
        return Trim(self.block_id, self.stored, self.tokens) if self.stored else None


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
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._leases: dict[int, tuple[int | None, list[str], float]] = {}
        self._lease_ids = itertools.count(1)
        self.decode_failures = 0
        # Blocks that entered or left a tier since the directory was last told.
        self._changed: set[str] = set()
        self._changed_lock = threading.Lock()  # a leaf: taken under the tier locks
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

    def put(self, entry: HotEntry, disk: DiskInfo | None) -> bool:
        """Store a block; False if it was dropped (counted): no tier could keep it."""
        with self._lock:
            in_hot = self.hot.put(entry)
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

    def _write(self, ssd: SSDStore, item: PendingWrite) -> None:
        entry, disk = item.entry, item.disk
        try:
            payload: BlockPayload = self._resolve(entry.handle)
            embedded = payload.has_state and disk.storage == "embedded"
            tensors, dtypes = to_tensors(payload, with_state=embedded)
            meta = {"model": disk.model, "layout": disk.layout,
                    "block_size": str(disk.block_size), "tokens": str(payload.tokens),
                    "parent_id": entry.parent_id, "dtypes": dtypes}
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
            return "hot"
        if self.ssd is not None and self.ssd.has_block(bid):
            return "ssd"
        return None

    # ---- lookups ------------------------------------------------------------------------

    def lookup(self, block_ids: list[str], need_checkpoint: bool, layout: str = "",
               exact: bool = True, tails: TailQuery | None = None) -> dict:
        """The restorable chain across tiers, pinned under one lease.

        ``exact``: a checkpoint in a lossy-codec sidecar does not count.
        ``tails``: also look for a tail (a partial block captured where a
        conversation branches) past the last usable full block and, without
        ``need_checkpoint`` (attention-only models), a stored block or tail to
        cut to the tokens it shares with the prompt (``trim`` in the result).
        """
        if self.ssd is not None:
            self.ssd.ready.wait(timeout=2.0)  # a restart's index rebuild, briefly
        # SSD files as this lookup saw them, captured once: the writer thread may
        # evict any of them meanwhile, and a file gone by the time the replica
        # reads it is a clean miss there (its token then matches nothing).
        seen: dict[str, DiskEntry] = {}
        with self._lock:
            self._expire_leases()
            sources: list[Source] = []
            for bid in block_ids:
                source = self._source(bid, layout, seen)
                if source is None:
                    break
                sources.append(source)
            present = len(sources)
            restore, tail = self._restore_point(block_ids, sources, need_checkpoint, layout,
                                                exact, tails, seen)
            sources = sources[:restore]
            ids = block_ids[:restore]
            if tail is not None:  # a partial block past the last full one
                ids.append(tail.block_id)
                sources.append(tail.source)
            sidecar = None
            # (without an SSD tier, a restore point always carries its checkpoint inline)
            if (need_checkpoint and sources and self.ssd is not None
                    and not self._inline_checkpoint(ids[-1], sources[-1])):
                disk = self._disk_checkpoint(ids[-1], layout, exact)
                if disk == "embedded":  # the state is in the block file: read that file
                    sources[-1] = self._block_file(self.ssd, ids[-1], seen)
                elif disk is not None:
                    sidecar = self.ssd.sidecar_entry(layout, ids[-1])
                    sources[-1].checkpoint_token = token_of(sidecar) if sidecar else GONE
                sources[-1].checkpoint = disk
            hot_ids = [b for b, s in zip(ids, sources, strict=True) if s.tier == "hot"]
            ssd_ids = [b for b, s in zip(ids, sources, strict=True) if s.tier == "ssd"]
            lease = None
            if ids:
                lease = next(self._lease_ids)
                self._leases[lease] = (self.hot.pin(hot_ids), ssd_ids, time.monotonic())
                if ssd_ids and self.ssd is not None:
                    self.ssd.pin(ssd_ids)
            for bid in block_ids[:present]:
                self.hot.touch(bid)
            if tail is not None:  # a restored tail or cut child is as recently used
                self.hot.touch(tail.block_id)
            touched = [seen.get(bid) for bid in ssd_ids] + [sidecar]
            evicted = present < len(block_ids) and self.hot.was_evicted(block_ids[present])
            self.hot.stats.lookups += 1
            self.hot.stats.hit_blocks += restore
            self.hot.stats.walkbacks += present - restore
            self.hot.stats.trim_hits += tail is not None and tail.trim is not None
        if self.ssd is not None:
            for disk_entry in touched:
                self.ssd.touch(disk_entry)  # file mtimes: outside the lock
        return {"present": present, "walkbacks": present - restore, "lease": lease,
                "sources": sources, "first_missing_evicted": evicted, "ids": ids,
                "tail_tokens": tail.tokens if tail is not None else 0,
                "trim": tail.trim if tail is not None else None}

    def _restore_point(self, block_ids: list[str], sources: list[Source], need_checkpoint: bool,
                       layout: str, exact: bool, tails: TailQuery | None,
                       seen: dict[str, DiskEntry]) -> tuple[int, PartialHit | None]:
        """(full blocks, partial hit or None) of the deepest position a request can start from.

        Positions in order, deepest first: the deepest partial position under
        the last present block, that block's own end, the same under the block
        before it, ... A hybrid model needs a recurrent checkpoint exactly there
        (a tail carries its own; a tail needs none at its parent's end).
        """
        for i in range(len(sources), -1, -1):
            if tails is not None:
                partial = self._partial(tails, block_ids, i, need_checkpoint, layout, exact,
                                        seen)
                if partial is not None:
                    return i, partial
            if i and (not need_checkpoint or self._has_checkpoint(
                    block_ids[i - 1], sources[i - 1], layout, exact)):
                return i, None
        return 0, None

    def _partial(self, q: TailQuery, block_ids: list[str], i: int, need_checkpoint: bool,
                 layout: str, exact: bool, seen: dict[str, DiskEntry]) -> PartialHit | None:
        """The deepest partial position under full block ``i``: the longest tail whose
        tokens are a prefix of the rest, or, for a model without recurrent state, a
        stored child cut deeper than that."""
        tail = self._longest_tail(q, block_ids, i, need_checkpoint, layout, exact, seen)
        if need_checkpoint:  # a recurrent state exists only at a child's end: no cut
            return tail
        trim = self._trim(q, block_ids, i)
        if trim is not None and trim.tokens > (tail.tokens if tail is not None else 0):
            return trim
        return tail

    def _longest_tail(self, q: TailQuery, block_ids: list[str], i: int, need_checkpoint: bool,
                      layout: str, exact: bool, seen: dict[str, DiskEntry]) -> PartialHit | None:
        """The longest stored tail under full block ``i`` (in any tier)."""
        start = i * q.block_size
        parent = block_ids[i - 1] if i else q.root
        for k in range(min(q.block_size - 1, len(q.tokens) - start), 0, -1):
            tid = block_id(parent, q.tokens[start : start + k])
            source = self._source(tid, layout, seen)
            if source is None:
                continue
            if need_checkpoint and not self._has_checkpoint(tid, source, layout, exact):
                continue
            return PartialHit(tid, k, source)
        return None

    def _trim(self, q: TailQuery, block_ids: list[str], i: int) -> PartialHit | None:
        """The hot child of full block ``i - 1`` (a block or a tail) sharing the most
        tokens with the rest of the prompt, to be cut to them; None if none shares
        at least ``MIN_TRIM_TOKENS`` or it matches whole (a plain hit)."""
        start = i * q.block_size
        parent = block_ids[i - 1] if i else q.root
        match = self.hot.best_child(parent, q.tokens[start : start + q.block_size])
        if match is None or match.whole or match.common < MIN_TRIM_TOKENS:
            return None
        entry = self.hot.entry(match.block_id)  # present: found under this same lock
        if entry is None:
            return None
        return PartialHit(match.block_id, match.common, Source("hot", entry.handle),
                          match.stored)

    def _expire_leases(self) -> None:
        """Leases of clients that vanished mid-restore must not pin blocks for ever."""
        now = time.monotonic()
        for lease, (_, _, taken) in list(self._leases.items()):
            if now - taken > LEASE_TTL_S:
                self._release_locked(lease)

    def _source(self, bid: str, layout: str, seen: dict[str, DiskEntry]) -> Source | None:
        """Where block ``bid`` is now; an SSD entry is recorded in ``seen``."""
        entry = self.hot.entry(bid)
        if entry is not None:
            return Source("hot", entry.handle)
        pending = self._pending.get(bid)
        if pending is not None:
            return Source("pending", pending.entry.handle)
        if self.ssd is not None:
            disk = self.ssd.block_entry(bid)
            if disk is not None:
                seen[bid] = disk
                return Source("ssd", str(disk.path), token=token_of(disk))
        return None

    def _block_file(self, ssd: SSDStore, bid: str, seen: dict[str, DiskEntry]) -> Source:
        """The block's file as a source: the entry this lookup saw, else the one indexed
        now; if it is gone already, its path (reading it is a clean miss)."""
        disk = seen.get(bid) or ssd.block_entry(bid)
        if disk is None:
            return Source("ssd", str(ssd.block_path(bid)), token=GONE)
        seen[bid] = disk
        return Source("ssd", str(disk.path), token=token_of(disk))

    def _has_checkpoint(self, bid: str, source: Source, layout: str,
                        exact: bool = True) -> bool:
        return self._inline_checkpoint(bid, source) or (
            self.ssd is not None and self._disk_checkpoint(bid, layout, exact) is not None)

    def _inline_checkpoint(self, bid: str, source: Source) -> bool:
        """Whether the block's own payload (hot or pending) carries its checkpoint.

        Hot and pending payloads are always exact: a block promoted from a lossy
        sidecar is promoted without its state.
        """
        if source.tier == "hot":  # present: the source was found under this same lock
            entry = self.hot.entry(bid)
            return entry is not None and entry.has_checkpoint
        if source.tier == "pending":
            return self._pending[bid].entry.has_checkpoint
        return False

    def _disk_checkpoint(self, bid: str, layout: str, exact: bool = True) -> str | None:
        """The sidecar's path, "embedded", or None; a lossy sidecar is None when ``exact``."""
        ssd = self.ssd
        if ssd is None:
            return None
        sidecar = ssd.sidecar_entry(layout, bid)
        if sidecar is not None and (_exact(sidecar) or not exact):
            return str(sidecar.path)
        block = ssd.block_entry(bid)
        if block is not None and block.meta.get("checkpoint") == "embedded":
            return "embedded"
        return None

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

    def drop(self, kind: str, layout: str, block_id: str, token: str | None = None) -> None:
        """A file a reader could not use: remove it (and count a sidecar decode failure).

        ``token`` is the file's checksum as the reader's lookup saw it
        (``Source.token`` / ``checkpoint_token``): only that file goes, never one
        written since under the same name. None removes whatever is indexed.
        """
        if kind in ("checkpoint", "lost"):
            with self._lock:
                if kind == "checkpoint":
                    self.hot.drop_checkpoint(block_id)
                else:
                    self.hot.remove(block_id)
            return
        if self.ssd is None:
            return
        self.ssd.remove_file("block" if kind == "block" else "sidecar", layout, block_id, token)
        if kind == "sidecar":
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
        return replace(out, dropped_ssd_low_space=counters.writes_skipped_low_space,
                       dropped_ssd_budget=counters.writes_skipped_budget,
                       ssd_budget_bytes=self.ssd.budget_bytes, ssd_by_model=self.ssd.usage())

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
                          "ssd_budget": stats.dropped_ssd_budget}
        if self.ssd is not None:
            out["ssd"] = self.ssd.snapshot()
        return out


def _exact(sidecar: DiskEntry) -> bool:
    return sidecar.meta.get("codec") == codecs.EXACT
