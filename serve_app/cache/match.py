"""The store's one lookup contract: ``TieredStore.match(MatchQuery) -> Match``.

Typed all the way from the store to the replica that restores: where each
block comes from (``Source``), whether the last one is partial (``Partial``:
a tail, or a stored block or tail cut to the tokens it shares with the prompt),
and how a reader hands back a file it could not use (``Drop``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Tier(enum.StrEnum):
    """Where a restored block came from (``serve_app_prefix_cache_hit_tokens`` label)."""

    HOT = "hot"
    PENDING = "pending"  # staged for SSD, not written yet
    SSD = "ssd"
    REMOTE = "remote"  # another node's store


class StateAt(enum.StrEnum):
    """Where a hybrid block's recurrent checkpoint is to be read from."""

    NONE = "none"  # no checkpoint needed, or none found
    INLINE = "inline"  # in the block's own payload (hot or pending)
    EMBEDDED = "embedded"  # in the block's SSD file
    SIDECAR = "sidecar"  # in a sidecar file beside it


class Drop(enum.StrEnum):
    """Why a reader hands a block back to the store."""

    BLOCK = "block"  # its SSD block file is unreadable or does not fit: remove the file
    SIDECAR = "sidecar"  # its sidecar does not decode or fit: remove the sidecar
    CHECKPOINT = "checkpoint"  # its hot payload's checkpoint does not fit: forget it
    LOST = "lost"  # its hot payload is gone or does not fit: remove the entry


@dataclass
class Source:
    """Where one block of a restore comes from.

    An SSD file is named by ``file_digest``, its checksum as this lookup saw it
    (unique per write): a reader that drops it drops that file, never one written
    since under the same name.
    """

    tier: Tier
    handle: Any = None  # hot/pending: the store's handle; ssd: the block file's path
    file_digest: str | None = None  # ssd: the block file's checksum
    state: StateAt = StateAt.NONE
    sidecar: str | None = None  # StateAt.SIDECAR: the sidecar file's path
    sidecar_digest: str | None = None  # and its checksum
    token_ids: tuple[int, ...] = ()  # a cut block's own tokens (they differ from the prompt's)


@dataclass(frozen=True)
class Partial:
    """The last restored block holds less than a full block of the prompt: a tail
    (``stored == tokens``), or, for an attention-only model, a stored block or tail
    that shares only its first ``tokens`` of ``stored`` with the prompt (cut there)."""

    tokens: int  # tokens restored from it
    stored: int  # tokens its payload holds

    @property
    def cut(self) -> bool:
        return self.stored > self.tokens


@dataclass(frozen=True)
class MatchQuery:
    """A prompt's lookup: its chain of full blocks and, for partial matches, its tokens.

    ``tokens``: the restorable prompt (without its last token), whose full blocks
    ``block_ids`` are (``hashing.chain`` from ``root``, the request's salted root);
    () looks up full blocks only. ``need_state``: a hybrid model, which restores
    only where a recurrent checkpoint is (``exact``: not from a lossy sidecar).
    """

    block_ids: list[str]
    need_state: bool = False
    layout: str = ""
    exact: bool = True
    root: str = ""
    tokens: tuple[int, ...] = ()
    block_size: int = 0


@dataclass
class Match:
    """The deepest restorable position, its blocks pinned under ``lease`` until released.

    ``present``: leading full blocks held in some tier; ``walkbacks``: of those, the
    ones given up for want of a checkpoint. ``ids``/``sources``: what to restore, in
    order; the last one is ``partial`` when it is not a full block of the prompt.
    """

    ids: list[str]
    sources: list[Source]
    partial: Partial | None = None
    present: int = 0
    walkbacks: int = 0
    first_missing_evicted: bool = False
    first_missing_skipped: bool = False  # kept out of RAM as too large, and no SSD tier
    lease: int | None = None
    store_epoch: str | None = None  # the store's incarnation (set by the Ray actor)

    def block_tokens(self, block_size: int) -> list[int]:
        """Tokens restored from each block."""
        full = len(self.ids) - (self.partial is not None)
        return [block_size] * full + ([self.partial.tokens] if self.partial else [])

    def stored_tokens(self, block_size: int) -> list[int]:
        """Tokens each block's payload holds (a cut one holds more than it restores)."""
        full = len(self.ids) - (self.partial is not None)
        return [block_size] * full + ([self.partial.stored] if self.partial else [])


@dataclass(frozen=True)
class BlockEvent:
    """A node now holds ``block_id`` in ``tier``, or (``tier`` None) no longer holds it."""

    block_id: str
    tier: str | None
