"""Which node holds which cache block: the cluster-wide block directory.

Each node's cache-store actor reports what its tiers store, move and evict, in
ordered batches (``EventBatch``). The directory applies them per node and keeps,
for every block id, the nodes holding it and in which tier. A router or a replica
keeps its own copy (another ``BlockDirectory``) current with ``changes_since``
deltas pulled in the background, so a routing decision reads local memory only and
never waits on a remote call.

A node's batches carry its store's incarnation (``epoch``) and a sequence number.
A restarted store has a new epoch: its first batch is a full snapshot that replaces
everything known about that node. A gap in the sequence is refused, and the store
answers with a full snapshot. A node that is lost is ``forget``-ed. Plain data, no
Ray: the actor that hosts it is a thin wrapper.

The directory has an incarnation of its own (``incarnation``): a new directory (a
restarted or replaced actor) has a new one. A follower names the incarnation its copy
follows; asked by a follower of another incarnation, the directory answers with
everything (a reset), so no follower ever grafts a new directory's log onto a copy of
an old one.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass, field

from serve_app.cache.match import BlockEvent, Tier

# Credit order when a router compares holders: RAM beats SSD.
TIER_RANK = {Tier.HOT: 0, Tier.SSD: 1}


@dataclass(frozen=True)
class EventBatch:
    """One node's events since its previous batch (``full``: everything it holds)."""

    node_id: str
    epoch: str  # the store's incarnation: new after every restart
    seq: int  # 1, 2, ... within an epoch
    events: tuple[BlockEvent, ...]
    full: bool = False


@dataclass(frozen=True)
class Change:
    """One applied change, as a follower replays it."""

    version: int
    node_id: str
    block_id: str
    tier: str | None


@dataclass(frozen=True)
class Changes:
    """What a follower at some version needs: the changes after it, or (``reset``)
    every entry, when it is older than the directory's change log reaches."""

    version: int
    changes: tuple[Change, ...]
    reset: bool = False
    incarnation: str = ""  # of the directory that answered


class StaleCopy(Exception):
    """A follower's copy follows another incarnation of the directory than the one
    that answered: it must be dropped and resynced, never patched."""


@dataclass
class _Node:
    epoch: str
    seq: int
    blocks: dict[str, str] = field(default_factory=dict)  # block id -> tier


class BlockDirectory:
    """Blocks by node and tier, versioned; ``changes_since`` feeds followers."""

    def __init__(self, log_limit: int = 200_000, incarnation: str | None = None) -> None:
        # A leader's own id; a follower's copy takes its leader's at each reset ("": none).
        self.incarnation = uuid.uuid4().hex if incarnation is None else incarnation
        self.version = 0
        self._nodes: dict[str, _Node] = {}
        self._holders: dict[str, dict[str, str]] = {}  # block id -> node -> tier
        self._log: deque[Change] = deque(maxlen=log_limit)

    # ---- fed by the cache-store actors ----------------------------------------------

    def apply(self, batch: EventBatch) -> bool:
        """Apply one node's batch in order; False when it does not follow the last one
        applied (a gap, or an unknown epoch without a full snapshot): the node must
        send a full snapshot next."""
        node = self._nodes.get(batch.node_id)
        if batch.full:
            self._drop_node(batch.node_id)
            node = self._nodes[batch.node_id] = _Node(batch.epoch, batch.seq)
        elif node is None or node.epoch != batch.epoch or batch.seq != node.seq + 1:
            return False
        node.seq = batch.seq
        for event in batch.events:
            self._set(batch.node_id, node, event.block_id, event.tier)
        return True

    def forget(self, node_id: str) -> None:
        """A node is gone (dead, or its store restarted and has not reported yet)."""
        self._drop_node(node_id)

    def nodes(self) -> dict[str, int]:
        """Blocks held per known node."""
        return {node_id: len(node.blocks) for node_id, node in self._nodes.items()}

    # ---- read by routers and replicas -------------------------------------------------

    def holders(self, block_id: str) -> dict[str, str]:
        """The nodes holding ``block_id``, and in which tier."""
        return dict(self._holders.get(block_id, {}))

    def prefix_by_node(self, block_ids: list[str]) -> dict[str, list[str]]:
        """For each node holding the chain's first block: the tiers of the leading run of
        the chain it holds (its length is how many blocks that node can restore)."""
        runs: dict[str, list[str]] = {}
        alive: set[str] | None = None
        for block_id in block_ids:
            holders = self._holders.get(block_id, {})
            alive = set(holders) if alive is None else alive & holders.keys()
            if not alive:
                break
            for node_id in alive:
                runs.setdefault(node_id, []).append(holders[node_id])
        return runs

    def changes_since(self, version: int, incarnation: str | None = None) -> Changes:
        """The changes a follower at ``version`` has not seen yet. A follower of another
        incarnation (``incarnation``: the one its copy follows; None: not checked) gets
        everything: its versions count in another directory's log."""
        inc = self.incarnation
        stale = incarnation is not None and incarnation != inc
        if version >= self.version and not stale:
            return Changes(self.version, (), incarnation=inc)
        oldest = self._log[0].version if self._log else self.version + 1
        if stale or version + 1 < oldest:  # the log does not reach back that far
            every = tuple(Change(self.version, node_id, block_id, tier)
                          for node_id, node in self._nodes.items()
                          for block_id, tier in node.blocks.items())
            return Changes(self.version, every, reset=True, incarnation=inc)
        return Changes(self.version, tuple(c for c in self._log if c.version > version),
                       incarnation=inc)

    def follow(self, changes: Changes) -> None:
        """Replay a leader's ``changes_since`` answer on this copy. A delta of another
        incarnation than this copy follows is refused (``StaleCopy``): start over."""
        if changes.reset:
            self._nodes.clear()
            self._holders.clear()
            self._log.clear()
            self.incarnation = changes.incarnation
        elif self.version == 0 and not self._nodes:  # an empty copy: any delta from 0
            self.incarnation = changes.incarnation
        elif changes.incarnation != self.incarnation:
            raise StaleCopy(f"a delta of directory {changes.incarnation[:8]!r} on a copy of "
                            f"{self.incarnation[:8]!r}")
        for change in changes.changes:
            node = self._nodes.setdefault(change.node_id, _Node("", 0))
            self._set(change.node_id, node, change.block_id, change.tier, log=False)
        self.version = changes.version

    # ---- internals ----------------------------------------------------------------------

    def _set(self, node_id: str, node: _Node, block_id: str, tier: str | None,
             log: bool = True) -> None:
        if node.blocks.get(block_id) == tier:
            return
        holders = self._holders.setdefault(block_id, {})
        if tier is None:
            node.blocks.pop(block_id, None)
            holders.pop(node_id, None)
            if not holders:
                del self._holders[block_id]
        else:
            node.blocks[block_id] = tier
            holders[node_id] = tier
        if log:
            self.version += 1
            self._log.append(Change(self.version, node_id, block_id, tier))

    def _drop_node(self, node_id: str) -> None:
        node = self._nodes.pop(node_id, None)
        if node is None:
            return
        for block_id in list(node.blocks):
            self._set(node_id, node, block_id, None)
