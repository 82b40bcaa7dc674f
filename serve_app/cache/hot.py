"""The hot tier: block entries in RAM under a byte budget, LRU, pinned while restoring.

Plain Python, no Ray: ``TieredStore`` walks chains across it and the other
tiers. It stores opaque handles (Ray object refs in production, payload dicts
in tests) with their sizes; it never looks inside a payload.

Each entry keeps its own token ids: the store's prefix tree (``tree.py``)
learns them from here, told of every entry that comes or goes by ``on_change``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class HotEntry:
    block_id: str
    parent_id: str
    nbytes: int
    has_checkpoint: bool
    handle: Any
    model: str = ""
    pins: int = 0
    token_ids: tuple[int, ...] = ()  # its own tokens (empty: unknown, so never cut)


@dataclass
class HotStats:
    puts: int = 0
    duplicate_puts: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    lookups: int = 0
    hit_blocks: int = 0
    walkbacks: int = 0
    trim_hits: int = 0  # lookups that restore a stored block or tail cut to the prompt
    by_model: dict[str, dict[str, int]] = field(default_factory=dict)


class HotStore:
    """LRU byte-budgeted map of block id to entry, with pins and leases."""

    def __init__(self, budget_bytes: int, remember_evicted: int = 65536) -> None:
        self.budget_bytes = budget_bytes
        self.bytes = 0
        self.stats = HotStats()
        self._entries: OrderedDict[str, HotEntry] = OrderedDict()
        self._leases: dict[int, list[str]] = {}
        self._lease_ids = itertools.count(1)
        self._evicted: OrderedDict[str, None] = OrderedDict()
        self._remember_evicted = remember_evicted
        # Told the id of every block that enters or leaves (the block directory's feed).
        self.on_change: Callable[[str], None] = lambda block_id: None

    def __contains__(self, block_id: str) -> bool:
        return block_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: HotEntry) -> bool:
        """Store an entry, evicting LRU unpinned ones to make room. False if it cannot fit."""
        old = self._entries.get(entry.block_id)
        if old is not None:
            self.stats.duplicate_puts += 1
            self._entries.move_to_end(entry.block_id)
            if entry.token_ids and not old.token_ids:  # e.g. promoted first, captured now
                old.token_ids = entry.token_ids
                self.on_change(old.block_id)
            if entry.has_checkpoint and not old.has_checkpoint and old.pins == 0:
                entry.token_ids = entry.token_ids or old.token_ids
                self._evict(old, count=False)  # a fresh checkpoint replaces a dropped one
            else:
                return True
        if entry.nbytes > self.budget_bytes or not self._make_room(entry.nbytes):
            self.stats.rejected_puts += 1
            return False
        self._entries[entry.block_id] = entry
        self.on_change(entry.block_id)
        self._evicted.pop(entry.block_id, None)
        self.bytes += entry.nbytes
        self.stats.puts += 1
        self._model_stats(entry.model)["blocks"] += 1
        self._model_stats(entry.model)["bytes"] += entry.nbytes
        return True

    def entry(self, block_id: str) -> HotEntry | None:
        return self._entries.get(block_id)

    def touch(self, block_id: str) -> None:
        if block_id in self._entries:
            self._entries.move_to_end(block_id)

    def was_evicted(self, block_id: str) -> bool:
        return block_id in self._evicted

    def pin(self, block_ids: list[str]) -> int | None:
        """Pin present blocks under a new lease (None when there is nothing to pin)."""
        if not block_ids:
            return None
        lease = next(self._lease_ids)
        self._leases[lease] = list(block_ids)
        for bid in block_ids:
            self._entries[bid].pins += 1
        return lease

    def release(self, lease: int | None) -> None:
        for bid in self._leases.pop(lease, []) if lease is not None else []:
            entry = self._entries.get(bid)
            if entry is not None:
                entry.pins -= 1

    def drop_checkpoint(self, block_id: str) -> bool:
        """Mark a block's checkpoint unusable (invalid on decode, or forced by a test)."""
        entry = self._entries.get(block_id)
        if entry is None or not entry.has_checkpoint:
            return False
        entry.has_checkpoint = False
        return True

    def remove(self, block_id: str, count: bool = True) -> bool:
        """Take an unpinned block out (``count``: as an eviction)."""
        entry = self._entries.get(block_id)
        if entry is None or entry.pins:
            return False
        self._evict(entry, count=count)
        return True

    def remove_model(self, model: str) -> tuple[int, int, int]:
        """Take a model's unpinned blocks out (not as evictions): blocks and bytes taken,
        blocks kept (pinned by a restore)."""
        blocks = nbytes = kept = 0
        for entry in [e for e in self._entries.values() if e.model == model]:
            if entry.pins:
                kept += 1
            elif self.remove(entry.block_id, count=False):
                blocks += 1
                nbytes += entry.nbytes
        return blocks, nbytes, kept

    def pinned_ids(self) -> set[str]:
        return {bid for bid, e in self._entries.items() if e.pins}

    def snapshot(self) -> dict:
        return {
            "budget_bytes": self.budget_bytes,
            "bytes": self.bytes,
            "blocks": len(self._entries),
            "pinned_blocks": sum(1 for e in self._entries.values() if e.pins),
            **{k: v for k, v in self.stats.__dict__.items() if k != "by_model"},
            "by_model": {k: dict(v) for k, v in self.stats.by_model.items()},
        }

    # ---- internals ---------------------------------------------------------------

    def _model_stats(self, model: str) -> dict[str, int]:
        return self.stats.by_model.setdefault(model, {"blocks": 0, "bytes": 0, "evictions": 0})

    def _make_room(self, nbytes: int) -> bool:
        if self.bytes + nbytes <= self.budget_bytes:
            return True
        victims = []
        freed = 0
        for entry in self._entries.values():  # oldest first
            if self.bytes - freed + nbytes <= self.budget_bytes:
                break
            if entry.pins == 0:
                victims.append(entry)
                freed += entry.nbytes
        if self.bytes - freed + nbytes > self.budget_bytes:
            return False
        for entry in victims:
            self._evict(entry)
        return True

    def ids(self) -> list[str]:
        return list(self._entries)

    def _evict(self, entry: HotEntry, count: bool = True) -> None:
        del self._entries[entry.block_id]
        self.on_change(entry.block_id)
        self.bytes -= entry.nbytes
        m = self._model_stats(entry.model)
        m["blocks"] -= 1
        m["bytes"] -= entry.nbytes
        if not count:
            return
        self.stats.evictions += 1
        self.stats.evicted_bytes += entry.nbytes
        m["evictions"] += 1
        self._evicted[entry.block_id] = None
        if len(self._evicted) > self._remember_evicted:
            self._evicted.popitem(last=False)
