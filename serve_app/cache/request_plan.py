"""A request's cache plan: the tokens it restores (and from which tier), the blocks it will
capture as it prefills and decodes, the lease that pins what it restores; and what the
engine publishes back (``Published``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from serve_app.cache.client import (
    FetchedChain,
)
from serve_app.cache.hashing import block_id
from serve_app.cache.payload import BlockPayload, CapturedBlock, RestorePlan

BlockSink = Callable[[CapturedBlock], None]


@dataclass(frozen=True)
class Miss:
    """Why a lookup restored less than it could: a metric label and a human text."""

    label: str
    text: str


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
