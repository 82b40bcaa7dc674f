"""Prompts and stored blocks for the prefix tree's tests: token runs, a prompt leaving
another mid-block, and a block's payload of known tokens."""

from __future__ import annotations

import numpy as np

from serve_app.cache.payload import BlockPayload, Tensor

BS = 16
ROOT = "root"


def tokens_of(seed: int, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of a run named by ``seed`` (and ``offset``)."""
    return [5 + (i * seed + offset) % 240 for i in range(n)]


def diverge(prompt: list[int], at: int, n: int) -> list[int]:
    """``prompt[:at]`` then ``n`` tokens of its own, the first one surely different."""
    rest = [5 + (t + 101) % 240 for t in prompt[at : at + n]]
    rest += tokens_of(7, n - len(rest), offset=3)
    assert rest[0] != prompt[at]
    return prompt[:at] + rest


def stored(tokens: list[int], *, with_state: bool = False) -> BlockPayload:
    """The payload of a block of ``tokens``: one attention layer whose values count up (a
    cut is checkable), and with ``with_state`` a recurrent state."""
    kv = Tensor(np.arange(len(tokens) * 2, dtype=np.float32).reshape(1, 1, len(tokens), 2),
                "float32")
    state = {1: (Tensor(np.ones((1, 3), np.float32), "float32"),)} if with_state else {}
    return BlockPayload({0: (kv, kv)}, state)
