"""Where speculative decoding gets its guesses: draft sources behind one interface.

A source proposes up to ``k`` tokens to follow a row's history; the target model then
verifies them all in one forward (``serve_app.serving.speculative``). A source never
decides what is emitted, so any proposal keeps the output exact; a good one only makes
more of each verify step count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class DraftRow:
    """One running request as a draft source sees it: ``tokens`` is the prompt, then
    every generated token (the last one not yet fed to the model)."""

    uid: int
    tokens: list[int]
    prompt_len: int


class DraftSource(Protocol):
    """Proposes continuations; ``method`` labels its metrics."""

    method: str

    def propose(self, row: DraftRow, k: int) -> list[int]: ...

    def forget(self, uid: int) -> None:
        """The row left the batch: drop whatever was kept for it."""


class NgramDraft:
    """Prompt lookup: find the latest earlier place where the history's last ``n`` tokens
    occurred (``n`` from ``max_n`` down to ``min_n``) and propose what followed there.

    No model and no state: edits and rewrites of text already in the conversation (a file
    in the prompt, code written a turn before) are where it pays.
    """

    method = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError("ngram sizes need 1 <= min_n <= max_n")
        self.max_n, self.min_n = max_n, min_n

    def propose(self, row: DraftRow, k: int) -> list[int]:
        if k <= 0:
            return []
        return lookup(np.asarray(row.tokens, dtype=np.int64), k, self.max_n, self.min_n)

    def forget(self, uid: int) -> None:
        pass


def lookup(history: np.ndarray, k: int, max_n: int, min_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the latest earlier match of the history's last
    ``n``-gram (the longest ``n`` that matches)."""
    size = history.size
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # match[s]: history[s : s + n] equals the last n tokens, for s < size - n
        match = history[: size - n] == history[size - n]
        for i in range(1, n):
            match &= history[i : size - n + i] == history[size - n + i]
        found = np.flatnonzero(match)
        if found.size:
            start = int(found[-1]) + n
            return [int(t) for t in history[start : start + k]]
    return []


class ControlledDraft:
    """A draft of known quality, for benches and tests: each proposed token is the one
    plain decoding will produce (``references``: the greedy continuation of a prompt)
    with probability ``alpha``, otherwise a wrong one. Acceptance per token is then
    ``alpha`` exactly, which is what the speedup formula assumes."""

    method = "controlled"

    def __init__(self, references: dict[tuple[int, ...], list[int]], alpha: float,
                 vocab_size: int, seed: int = 0) -> None:
        self.references = references
        self.alpha = alpha
        self.vocab_size = vocab_size
        self._random = random.Random(seed)
        self._by_uid: dict[int, list[int]] = {}

    def propose(self, row: DraftRow, k: int) -> list[int]:
        ref = self._by_uid.get(row.uid)
        if ref is None:
            ref = self.references.get(tuple(row.tokens[: row.prompt_len]), [])
            self._by_uid[row.uid] = ref
        at = len(row.tokens) - row.prompt_len  # the pending token is output[at - 1]
        out = []
        for token in ref[at : at + k]:
            good = self._random.random() < self.alpha
            out.append(token if good else (token + 1) % self.vocab_size)
        return out

    def forget(self, uid: int) -> None:
        self._by_uid.pop(uid, None)
