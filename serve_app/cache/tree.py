"""The store's block-level prefix tree: every stored block and tail under its parent.

A block's id is ``H(parent id, its tokens)`` (``hashing.block_id``), so a full
block of a prompt is found by its id alone. What ids cannot answer is a
*partial* position inside the block after the last one found: the longest
stored tail whose tokens begin the rest of the prompt, or (attention-only
models) the stored child sharing the most leading tokens with it, to be cut
there. The tree answers both with one walk: under each parent, the children's
own tokens form a radix tree (SGLang-style: edges labelled with token runs,
split where two children part), so a walk compares each query token at most
once, whatever the block size and however many tails share that parent.

Plain data under the caller's lock (the ``TieredStore``'s); no Ray, no MLX.
Which tier holds a block, its checkpoint and its pins stay with the tiers
themselves (one source of truth each); the tree only knows ids and tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from serve_app.cache.prefix import common_prefix


@dataclass(eq=False)
class _Edge:
    """A radix node under one parent: the token run leading to it from the node above,
    the child whose tokens end exactly here (if any) and the branches below by next token."""

    run: tuple[int, ...]
    end: str | None = None
    below: dict[int, _Edge] = field(default_factory=dict)

    def any_end(self) -> str | None:
        """One child at or below this node: they all share the tokens up to it."""
        node: _Edge | None = self
        while node is not None:
            if node.end is not None:
                return node.end
            node = next(iter(node.below.values()), None)
        return None


@dataclass(frozen=True)
class Node:
    """A stored block or tail: its parent's id and its own tokens."""

    parent_id: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Walk:
    """What one parent's children share with a query, from one walk.

    ``prefixes``: children whose tokens all begin the query, as (tokens, id),
    shortest first. ``common``: the most leading tokens any child shares with
    the query; ``sharing``: one child that shares them (None: none shares any).
    """

    prefixes: tuple[tuple[int, str], ...]
    common: int
    sharing: str | None


NO_WALK = Walk((), 0, None)


class PrefixTree:
    """Block ids by parent, with their tokens, for partial matches."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}
        self._under: dict[str, _Edge] = {}  # parent id -> the radix root of its children

    def __len__(self) -> int:
        return len(self.nodes)

    def __contains__(self, block_id: str) -> bool:
        return block_id in self.nodes

    def insert(self, block_id: str, parent_id: str, token_ids: Sequence[int]) -> None:
        """Add a block or tail (its tokens never change: they are part of its id)."""
        tokens = tuple(token_ids)
        if block_id in self.nodes or not tokens:
            return
        self.nodes[block_id] = Node(parent_id, tokens)
        node = self._under.setdefault(parent_id, _Edge(()))
        i = 0
        while i < len(tokens):
            kid = node.below.get(tokens[i])
            if kid is None:
                node.below[tokens[i]] = _Edge(tokens[i:], block_id)
                return
            n = common_prefix(kid.run, tokens[i : i + len(kid.run)])
            if n < len(kid.run):  # part ways inside this run: split it there
                mid = _Edge(kid.run[:n], below={kid.run[n]: kid})
                kid.run = kid.run[n:]
                node.below[tokens[i]] = mid
                kid = mid
            node, i = kid, i + n
        node.end = block_id  # another child passes through: this one ends inside its run

    def remove(self, block_id: str) -> None:
        """Forget a block; the radix nodes it alone needed go, runs re-join."""
        found = self.nodes.pop(block_id, None)
        if found is None:
            return
        root = self._under[found.parent_id]
        path: list[tuple[_Edge, int]] = []  # (node above, its key) down to the block's end
        node, i, tokens = root, 0, found.token_ids
        while i < len(tokens):
            path.append((node, tokens[i]))
            node = node.below[tokens[i]]
            i += len(node.run)
        node.end = None
        for above, key in reversed(path):
            below = above.below[key]
            if below.end is None and not below.below:
                del above.below[key]
            elif below.end is None and len(below.below) == 1:
                (only,) = below.below.values()
                only.run = below.run + only.run
                above.below[key] = only
            else:
                break
        if not root.below:
            del self._under[found.parent_id]

    def walk(self, parent_id: str, query: Sequence[int]) -> Walk:
        """What the children of ``parent_id`` share with ``query``: one pass down."""
        node = self._under.get(parent_id)
        if node is None or not query:
            return NO_WALK
        query = tuple(query)  # runs are tuples: slices compare only with their own type
        prefixes: list[tuple[int, str]] = []
        depth = 0
        while depth < len(query):
            kid = node.below.get(query[depth])
            if kid is None:
                break
            n = common_prefix(kid.run, query[depth : depth + len(kid.run)])
            depth += n
            if n < len(kid.run):  # the query leaves this run: all below share ``depth``
                return Walk(tuple(prefixes), depth, kid.any_end())
            node = kid
            if node.end is not None:
                prefixes.append((depth, node.end))
        return Walk(tuple(prefixes), depth, node.any_end() if depth else None)

    def children(self, parent_id: str) -> Iterator[str]:
        """Every child of ``parent_id`` (tests, diagnostics)."""
        stack = [self._under[parent_id]] if parent_id in self._under else []
        while stack:
            node = stack.pop()
            if node.end is not None:
                yield node.end
            stack.extend(node.below.values())
