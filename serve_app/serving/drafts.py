"""Where speculative decoding gets its guesses: draft sources behind one interface.

A source proposes up to ``k`` tokens to follow a row's history; the target model then
verifies them all in one forward (``serve_app.serving.speculative``). A source never
decides what is emitted, so any proposal keeps the output exact; a good one only makes
more of each verify step count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol

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
    cheap = True  # proposing costs no forward: fine to do in the shadow every step

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
    cheap = True

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


@dataclass
class _DraftCache:
    """A request's cache of the draft model: it holds ``fed``, which are the request's
    tokens from ``start`` on and then the drafts of the last step but the last one."""

    cache: list
    start: int
    fed: list[int]


class DraftModel:
    """A second, smaller model with the target's tokenizer drafts greedily.

    Each request gets its own cache of the draft model, built from the request's tokens
    the first time it drafts (after a prefix-cache restore too: the draft model has no
    prefix cache, so it reads at most the last ``context`` tokens) and kept in step with
    the request's history after: rejected drafts are trimmed off, new tokens fed. A draft
    model's cache must be trimmable (no recurrent layers).
    """

    method = "draft"

    def __init__(self, model, context: int = 1024, prefill_step: int = 256) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = model
        self.context = context
        self.prefill_step = prefill_step
        self._make_cache = lambda: make_prompt_cache(model)
        if not all(c.is_trimmable() for c in self._make_cache()):
            raise ValueError("a draft model must have trimmable caches (no recurrent layers)")
        self._rows: dict[int, _DraftCache] = {}

    def propose(self, row: DraftRow, k: int) -> list[int]:
        import mlx.core as mx

        if k <= 0:
            return []
        state = self._rows.get(row.uid)
        if state is None:  # first draft of this request: the recent context only
            state = _DraftCache(self._make_cache(), max(0, len(row.tokens) - self.context),
                                [])
            self._rows[row.uid] = state
        history = row.tokens[state.start :]
        fed = state.fed
        same = 0
        while same < min(len(fed), len(history)) and fed[same] == history[same]:
            same += 1
        same = min(same, len(history) - 1)  # the last token is fed again for its logits
        if same < len(fed):
            for c in state.cache:
                c.trim(len(fed) - same)
        new = history[same:]
        logits = None
        for start in range(0, len(new), self.prefill_step):
            logits = self.model(mx.array([new[start : start + self.prefill_step]]),
                                cache=state.cache)
        assert logits is not None
        token = int(mx.argmax(logits[0, -1]).item())  # type: ignore[arg-type]
        out = [token]
        for _ in range(k - 1):
            logits = self.model(mx.array([[token]]), cache=state.cache)
            token = int(mx.argmax(logits[0, -1]).item())  # type: ignore[arg-type]
            out.append(token)
        state.fed = [*history, *out[:-1]]
        return out

    def forget(self, uid: int) -> None:
        self._rows.pop(uid, None)


@dataclass
class _MTPRow:
    """A request's state in the MTP head: its cache holds one entry per position from
    ``first`` to ``fed - 1`` (position ``q``'s entry reads the model's hidden state at
    ``q`` and the token at ``q + 1``); ``hidden`` holds the model's hidden states of
    positions not fed yet; ``last``: the head's output at ``fed - 1``."""

    cache: list
    first: int
    fed: int
    hidden: dict[int, Any] = field(default_factory=dict)  # position -> mx.array
    last: Any = None


class MTPDraft:
    """The model's own multi-token-prediction head drafts greedily
    (``serve_app.models.mtp``).

    The head reads the model's final hidden state at each position, so the speculator
    hands every decode step's hidden states to ``observe``; positions are fed to the
    head's own cache (per request) the next time the request drafts, then each draft
    feeds the head's output back for the next. The head's cache starts at a request's
    first decoded position: a prompt's hidden states are not kept (a prefix-cache restore
    never computes them), and a request's first decode step does not draft.
    """

    method = "mtp"
    needs_hidden = True  # the speculator records the model's hidden states for observe

    def __init__(self, head, embed, logits, context: int = 1024) -> None:
        self.head, self.embed, self.logits = head, embed, logits
        self.context = context
        self._rows: dict[int, _MTPRow] = {}

    def observe(self, uid: int, start: int, hidden) -> None:
        """The model's hidden states (``(n, size)``) at positions ``start ..``, kept."""
        state = self._rows.get(uid)
        if state is None:
            state = self._rows[uid] = _MTPRow(self.head.make_cache(), start, start)
        for j in range(hidden.shape[0]):
            if start + j >= state.fed:
                state.hidden[start + j] = hidden[j]
        while len(state.hidden) > self.context:  # not drafting for long: the oldest go
            del state.hidden[min(state.hidden)]

    def propose(self, row: DraftRow, k: int) -> list[int]:
        import mlx.core as mx

        state = self._rows.get(row.uid)
        target = len(row.tokens) - 2  # its entry drafts the token after the pending one
        if k <= 0 or state is None or target < state.first:
            return []
        span = [q for q in range(state.fed, target + 1) if q in state.hidden]
        if span:
            out = self.head(self.embed(mx.array([[row.tokens[q + 1] for q in span]])),
                            mx.stack([state.hidden.pop(q) for q in span])[None],
                            state.cache)
            state.fed, state.last = target + 1, out[:, -1:]
            for q in [q for q in state.hidden if q <= target]:
                del state.hidden[q]
        elif state.fed != target + 1 or state.last is None:
            return []
        hidden = state.last
        token = int(mx.argmax(self.logits(hidden)[0, -1]).item())  # type: ignore[arg-type]
        drafts = [token]
        for _ in range(k - 1):
            hidden = self.head(self.embed(mx.array([[token]])), hidden, state.cache)
            token = int(mx.argmax(self.logits(hidden)[0, -1]).item())  # type: ignore[arg-type]
            drafts.append(token)
        if k > 1:
            for c in state.cache:  # keep only entries of the model's own hidden states
                c.trim(k - 1)
        return drafts

    def forget(self, uid: int) -> None:
        self._rows.pop(uid, None)
