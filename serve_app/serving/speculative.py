"""Speculative decoding inside the running batch: draft, verify in one forward, roll back.

Each decode step the ``Speculator`` asks its draft source (``serve_app.serving.drafts``)
for up to ``k`` tokens per row, feeds every row's pending token and its drafts to the
target model in one batched forward, keeps per row the drafts the target agrees with plus
one token of its own, and rolls every cache back to exactly what was kept:

- attention KV (``BatchKVCache``): trimmed by what all rows rejected, then, when rows
  rejected different numbers, mlx-lm's right-padding roll shifts each row right by what
  it rejected beyond that: a copy of every layer's whole K/V buffer, all rows, and the
  shift stays as left padding until the batch's filter takes off what all rows share;
- recurrent state (``ArraysCache``: GDN, Mamba) cannot be trimmed: it is snapshotted
  before the verify forward and, when any row rejected a draft, put back and the kept
  tokens fed again (one more forward; none when every row kept every draft).

A row keeps a draft while it is the token the row would take at that position (after its
logits processors): the argmax at temperature 0; above it, the token the row's own
sampler draws there (``samplers.draw``), the first mismatch being the token it takes.
For a draft source that does not read the target's randomness this keeps ``d`` with
probability ``p(d)`` and is distributed as plain decoding; a seeded row draws token ``i``
with the key of position ``i`` whichever step draws it, so it gives plain decoding's
tokens (given the same logits), at any depth, beside any batch-mates.

With ``adaptive`` the depth follows each row's measured acceptance and what a verify of
``k + 1`` positions costs on this host at this batch size (measured at start): a step
drafts only when its expected tokens per unit of cost beat plain decoding. Rows that do
not draft keep scoring what the source would have proposed against what they produce,
so a row whose drafting stops paying starts again when it would pay.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, make_prompt_cache

from serve_app.config.profile import SpeculativeProfile
from serve_app.kvquant.batch_cache import BatchQuantizedKVCache
from serve_app.models.compat import (
    DecodeRows,
    recording_final_hidden,
    recording_mixer_inputs,
    recurrent_mixers,
    trunk_parts,
)
from serve_app.serving.drafts import DraftModel, DraftRow, DraftSource, MTPDraft, NgramDraft
from serve_app.serving.engine_events import StepOutcome
from serve_app.serving.samplers import advance, draw
from serve_app.serving.sampling import SamplingParams

logger = logging.getLogger(__name__)

PRIOR_ACCEPTANCE = 0.5  # what a row's acceptance is taken to be before it is measured
PRIOR_WEIGHT = 1.0  # in outcomes: how soon measurements outweigh the prior
DECAY = 0.8  # each new outcome's weight against the ones before (recent acceptance counts)
MIN_GAIN = 1.02  # a step drafts only when it expects at least this over plain decoding
PROBE_EVERY = 256  # steps that cannot pay before a model-backed source is asked again


@dataclass(frozen=True)
class SpeculationSettings:
    """``num_draft_tokens``: the most tokens a row drafts in a step; ``adaptive``: the
    depth follows acceptance and verify cost (False keeps it at ``num_draft_tokens``)."""

    num_draft_tokens: int = 4
    adaptive: bool = True
    # How recurrent state goes back after a rejection: "mixers" runs the recurrent layers
    # alone again on their recorded inputs; "forward" the whole model (any layer layout).
    recurrent_rollback: str = "mixers"


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verify step yields when each draft is kept with probability ``alpha``,
    independently, ``k`` drafted: ``(1 - alpha^(k+1)) / (1 - alpha)``."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class VerifyCost:
    """What a forward of ``t`` positions per row costs over one of a single position, at
    batch sizes measured on this host (``measure``), interpolated between them."""

    ratios: dict[int, list[float]] = field(default_factory=dict)  # batch -> [t=1, 2, ...]
    step_seconds: dict[int, float] = field(default_factory=dict)  # batch -> one position

    def plain_seconds(self, batch: int) -> float | None:
        """What a plain step costs at ``batch`` (the nearest measured size), in seconds."""
        if not self.step_seconds:
            return None
        return self.step_seconds[min(self.step_seconds, key=lambda b: abs(b - batch))]

    def ratio(self, batch: int, positions: int) -> float:
        if positions <= 1 or not self.ratios:
            return 1.0 if positions <= 1 else float(positions)
        sizes = sorted(self.ratios)

        def at(b: int) -> float:
            row = self.ratios[b]
            if positions <= len(row):
                return row[positions - 1]
            return row[-1] * positions / len(row)  # beyond what was measured: linear

        if batch <= sizes[0]:
            return at(sizes[0])
        if batch >= sizes[-1]:
            return at(sizes[-1])
        hi = next(s for s in sizes if s >= batch)
        lo = max(s for s in sizes if s <= batch)
        if hi == lo:
            return at(lo)
        w = (batch - lo) / (hi - lo)
        return at(lo) * (1 - w) + at(hi) * w

    @classmethod
    def measure(cls, model, batch_sizes: list[int], max_positions: int,
                context: int = 64, repeats: int = 8) -> VerifyCost:
        """Time forwards of 1..``max_positions`` positions after ``context`` tokens."""
        ratios, seconds = {}, {}
        for batch in sorted(set(batch_sizes)):
            cache = make_prompt_cache(model)
            model(mx.zeros((batch, context), dtype=mx.int32), cache=cache)
            mx.eval([c.state for c in cache])
            times = []
            for t in range(1, max_positions + 1):
                best = math.inf
                for n in range(repeats + 1):  # the first is a warm-up (compiles, allocates)
                    tic = time.perf_counter()
                    mx.eval(model(mx.zeros((batch, t), dtype=mx.int32), cache=cache))
                    if n:
                        best = min(best, time.perf_counter() - tic)
                    for c in cache:
                        if c.is_trimmable():
                            c.trim(t)
                times.append(best)
            ratios[batch] = [x / times[0] for x in times]
            seconds[batch] = times[0]
        return cls(ratios, seconds)


@dataclass
class _Row:
    """One request's speculation state."""

    params: SamplingParams
    prompt_len: int
    kept: float = 0.0  # decayed drafts kept
    missed: float = 0.0  # decayed drafts rejected (at most one per step)
    # What the source proposed while the row did not draft, and where in the row's history
    # (the tokens its cache holds) the proposal starts: scored as the history grows.
    shadow: list[int] = field(default_factory=list)
    shadow_at: int = 0

    @property
    def acceptance(self) -> float:
        return ((self.kept + PRIOR_ACCEPTANCE * PRIOR_WEIGHT)
                / (self.kept + self.missed + PRIOR_WEIGHT))

    def record(self, kept: int, missed: int) -> None:
        self.kept = self.kept * DECAY + kept
        self.missed = self.missed * DECAY + missed


def speculator_for(profile: SpeculativeProfile | None, stop_tokens: set[int],
                   load_draft: Callable[[str], object] | None = None,
                   load_mtp: Callable[[], tuple] | None = None) -> Speculator | None:
    """The speculator a model's ``speculative:`` profile asks for (None: plain decoding).
    ``load_draft`` loads a draft model from its source (``method: draft``); ``load_mtp``
    the model's MTP head and the trunk parts it shares (``method: mtp``)."""
    if profile is None:
        return None
    source: DraftSource
    if profile.method == "mtp":
        if load_mtp is None:
            raise ValueError("speculative.method: mtp needs the model's checkpoint")
        head, parts = load_mtp()
        source = MTPDraft(head, parts.embed, parts.logits, context=profile.draft_context)
    elif profile.method == "draft":
        if profile.draft_model is None or load_draft is None:
            raise ValueError("speculative.draft_model: method draft needs a draft model")
        source = DraftModel(load_draft(profile.draft_model), context=profile.draft_context)
    else:
        source = NgramDraft(profile.ngram_max, profile.ngram_min)
    return Speculator(source, SpeculationSettings(profile.num_draft_tokens, profile.adaptive),
                      stop_tokens=stop_tokens)


class Speculator:
    """Speculative decode steps for one engine's batch (its thread only)."""

    def __init__(self, source: DraftSource, settings: SpeculationSettings, *,
                 stop_tokens: set[int], record: Callable[[StepOutcome], None] | None = None
                 ) -> None:
        self.source = source
        self.settings = settings
        self.stop_tokens = set(stop_tokens)
        self.record = record or (lambda outcome: None)
        self.cost = VerifyCost()
        self.supported = True
        self._rows: dict[int, _Row] = {}
        self._stack: object | None = None  # the model's decoder stack (sources that read it)
        # What proposing one token costs a row, in seconds (decayed mean; sources that run
        # a model: a draft model, an MTP head), against the plain step it must beat.
        self._draft_seconds = 0.0
        self._draft_samples = 0  # the first is not counted: it holds one-time costs
        self._unpaid = 0  # steps in a row on which no depth could pay

    @property
    def method(self) -> str:
        return self.source.method

    def calibrate(self, model, max_batch_size: int) -> None:
        """Measure verify costs on this host (adaptive depth needs them)."""
        if not self.settings.adaptive:
            return
        tic = time.perf_counter()
        sizes = [1, max_batch_size] if max_batch_size > 1 else [1]
        self.cost = VerifyCost.measure(model, sizes, self.settings.num_draft_tokens + 1)
        logger.info("speculative: verify cost ratios %s (measured in %.1f s)",
                    {b: [round(x, 2) for x in r] for b, r in self.cost.ratios.items()},
                    time.perf_counter() - tic)

    def add(self, uid: int, params: SamplingParams, prompt_len: int) -> None:
        self._rows[uid] = _Row(params, prompt_len)

    def forget(self, uid: int) -> None:
        self._rows.pop(uid, None)
        self.source.forget(uid)

    # ---- one step ----------------------------------------------------------------------

    def step(self, rows: DecodeRows) -> list:
        """One decode step of the whole batch: a verify step when drafting pays."""
        states = [self._row(uid, rows, i) for i, uid in enumerate(rows.uids)]
        for i, state in enumerate(states):
            self._score_shadow(state, rows.tokens(i))
        if not self.supported or not (self._may_pay(states) or self._probe()):
            # Nothing can pay at this batch size: not even the pending tokens are read
            # (that would stall mlx-lm's pipelined step); cheap sources keep proposing in
            # the shadow, so acceptance keeps being learnt. No hidden state is recorded
            # for a source that reads them (an MTP head): it drafts again one step after
            # this stops, from the positions it has.
            for i, state in enumerate(states):
                if not state.shadow and getattr(self.source, "cheap", False):
                    history = rows.tokens(i)
                    self._shadow(state, rows, i, history, len(history))
            self.record(StepOutcome(False, len(states), 0, 0, 0, (), 0.0))
            return rows.plain_step()
        pending = rows.pending()
        mx.eval(pending)
        ys = [int(t) for t in pending.tolist()]
        proposals = self._proposals(rows, ys, states)
        depth = self._depth(states, proposals)
        if depth == 0:
            for i, state in enumerate(states):
                if not state.shadow and proposals[i]:  # it predicts what follows y
                    state.shadow, state.shadow_at = proposals[i], len(rows.tokens(i)) + 1
            self.record(StepOutcome(False, len(ys), 0, 0, 0, (), 0.0))
            return self._plain(rows)
        drafts = [p[:depth] for p in proposals]
        for state in states:
            state.shadow = []
        return self._verify(rows, ys, states, drafts)

    def _plain(self, rows: DecodeRows) -> list:
        """mlx-lm's own one-token step (the hidden states it computes go to a source
        that drafts from them)."""
        if not getattr(self.source, "needs_hidden", False):
            return rows.plain_step()
        uids = list(rows.uids)
        starts = [len(rows.tokens(i)) for i in range(len(uids))]
        with recording_final_hidden(self._decoder_stack(rows.model)) as seen:
            responses = rows.plain_step()
        if seen:
            self._observe(uids, starts, seen[-1], [1] * len(uids))
        return responses

    def _decoder_stack(self, model) -> object:
        if self._stack is None:
            self._stack = trunk_parts(model).inner
        return self._stack

    def _observe(self, uids: list[int], starts: list[int], hidden: mx.array,
                 counts: list[int]) -> None:
        observe = self.source.observe  # type: ignore[attr-defined]
        for i, (uid, start, n) in enumerate(zip(uids, starts, counts, strict=True)):
            if n and uid in self._rows:
                observe(uid, start, hidden[i, :n])

    def _row(self, uid: int, rows: DecodeRows, i: int) -> _Row:
        state = self._rows.get(uid)
        if state is None:  # not registered (a test driving mlx-lm directly): greedy
            state = _Row(SamplingParams(max_tokens=1), len(rows.tokens(i)))
            self._rows[uid] = state
        return state

    def _shadow(self, state: _Row, rows: DecodeRows, i: int, history: list[int],
                at: int) -> None:
        room = min(self.settings.num_draft_tokens, rows.remaining(i))
        proposal = self.source.propose(DraftRow(rows.uids[i], history, state.prompt_len),
                                       room) if room > 0 else []
        state.shadow, state.shadow_at = proposal, at

    @staticmethod
    def _score_shadow(state: _Row, history: list[int]) -> None:
        """A row that did not draft: did what it produced match what was proposed?"""
        if not state.shadow:
            return
        produced = history[state.shadow_at : state.shadow_at + len(state.shadow)]
        kept = 0
        while kept < len(produced) and produced[kept] == state.shadow[kept]:
            kept += 1
        if kept < len(produced):
            state.record(kept, 1)
            state.shadow = []
        elif kept == len(state.shadow):
            state.record(kept, 0)
            state.shadow = []

    def _probe(self) -> bool:
        """Now and then a source that costs a forward to ask is asked although nothing
        could pay: what drafting costs is measured again (it was high once: a cold
        start), and new requests learn their own acceptance."""
        if getattr(self.source, "cheap", False):
            return False  # it keeps proposing in the shadow instead
        self._unpaid += 1
        if self._unpaid < PROBE_EVERY:
            return False
        self._unpaid = 0
        return True

    def _may_pay(self, states: list[_Row]) -> bool:
        """Whether any depth could beat plain decoding for this batch, were every row to
        find drafts: an upper bound of ``_depth``'s gain."""
        if not self.settings.adaptive:
            return True
        batch = len(states)
        alphas = [s.acceptance for s in states]
        return any(
            sum(expected_tokens(a, depth) for a in alphas)
            / (batch * self._step_cost(batch, depth, batch * depth)) > MIN_GAIN
            for depth in range(1, self.settings.num_draft_tokens + 1))

    def _step_cost(self, batch: int, depth: int, drafted: int) -> float:
        """A verify step of ``depth`` drafts with ``drafted`` tokens proposed in all, over
        a plain step at this batch size: the verify forward and the drafting."""
        plain = self.cost.plain_seconds(batch)
        drafting = drafted * self._draft_seconds / plain if plain else 0.0
        return self.cost.ratio(batch, depth + 1) + drafting

    def _proposals(self, rows: DecodeRows, ys: list[int], states: list[_Row]) -> list[list[int]]:
        """Each row's drafts at full depth: never past its ``max_tokens`` or a stop token."""
        k = self.settings.num_draft_tokens
        out: list[list[int]] = []
        for i, (y, state) in enumerate(zip(ys, states, strict=True)):
            room = min(k, rows.remaining(i) - 1)
            if room <= 0 or y in self.stop_tokens:
                out.append([])
                continue
            tic = time.perf_counter()
            draft = self.source.propose(
                DraftRow(rows.uids[i], [*rows.tokens(i), y], state.prompt_len), room)
            if draft and not getattr(self.source, "cheap", False):
                # A row's first proposal catches the source up on its history (and MLX
                # compiles): only the ones after measure what drafting costs.
                spent = (time.perf_counter() - tic) / len(draft)
                self._draft_samples += 1
                if self._draft_samples > 1:
                    self._draft_seconds = (spent if self._draft_samples == 2 else
                                           DECAY * self._draft_seconds + (1 - DECAY) * spent)
            for j, token in enumerate(draft):
                if token in self.stop_tokens:
                    draft = draft[: j + 1]
                    break
            out.append(draft)
        return out

    def _depth(self, states: list[_Row], proposals: list[list[int]]) -> int:
        """The step's depth: the most drafts any row feeds (0: a plain step)."""
        longest = max((len(p) for p in proposals), default=0)
        if longest == 0 or not self.settings.adaptive:
            return longest
        batch = len(states)
        best, best_gain = 0, MIN_GAIN
        for depth in range(1, longest + 1):
            tokens = sum(expected_tokens(s.acceptance, min(depth, len(p)))
                         for s, p in zip(states, proposals, strict=True))
            # the proposals are made (their cost is spent): only verifying them counts
            gain = tokens / (batch * self.cost.ratio(batch, depth + 1))
            if gain > best_gain:
                best, best_gain = depth, gain
        return best

    def _verify(self, rows: DecodeRows, ys: list[int], states: list[_Row],
                drafts: list[list[int]]) -> list:
        depth = max(len(d) for d in drafts)
        caches = rows.caches
        if not all(isinstance(c, BatchKVCache | BatchQuantizedKVCache | ArraysCache)
                   for c in caches):
            self.supported = False  # sliding windows and the like: plain decoding
            logger.warning("speculative decoding is off: cache types %s cannot roll back",
                           sorted({type(c).__name__ for c in caches}))
            return self._plain(rows)
        arrays = [c for c in caches if isinstance(c, ArraysCache)]
        snapshot = [list(c.cache) for c in arrays]
        inputs = mx.array([[y, *d] + [0] * (depth - len(d)) for y, d in zip(ys, drafts,
                                                                          strict=True)])
        mixers = (recurrent_mixers(rows.model, caches)
                  if arrays and self.settings.recurrent_rollback == "mixers" else None)
        hidden_of = (self._decoder_stack(rows.model)
                     if getattr(self.source, "needs_hidden", False) else None)
        starts = [len(rows.tokens(i)) for i in range(len(ys))]
        uids = list(rows.uids)
        with (recording_mixer_inputs(mixers or []) as mixer_inputs,
              recording_final_hidden(hidden_of) as hidden):
            logits = rows.model(inputs, cache=caches)  # (batch, depth + 1, vocab)
        # Log-probabilities in the model's dtype, and their argmax at every position, as
        # mlx-lm's greedy sampler takes it: rounding can tie two logits that differ (the
        # first one wins). Rows with logits processors recompute theirs after them.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        greedy: list[list[int]] = mx.argmax(logprobs, axis=-1).tolist()  # type: ignore[assignment]
        drawn = self._draws(rows, states, drafts, logprobs)
        pending_lps = rows.pending_logprobs()
        emitted: list[list[int]] = []
        emitted_lps: list[list[mx.array]] = []
        next_tokens: list[int] = []
        next_lps: list[mx.array] = []
        reasons: list[str | None] = []
        lengths = []
        drafted = accepted = 0
        for i, (y, state, draft) in enumerate(zip(ys, states, drafts, strict=True)):
            kept, token, lps = self._accept(rows, i, y, draft, logits[i], logprobs[i], state,
                                            drawn.get(i, greedy[i]))
            if draft:
                drafted += len(draft)
                accepted += kept
                lengths.append(kept)
                state.record(kept, int(kept < len(draft)))
            tokens = [y, *draft[:kept]]
            token_lps = [pending_lps[i], *lps[:kept]]
            reason = None
            for n, t in enumerate(tokens):
                reason = rows.count(i, t)
                if reason is not None:
                    tokens, token_lps = tokens[: n + 1], token_lps[: n + 1]
                    break
            if rows.processors(i):
                rows.feed_context(i, mx.array(tokens, dtype=mx.int32))
            rows.tokens(i).extend(tokens)
            emitted.append(tokens)
            emitted_lps.append(token_lps)
            next_tokens.append(token)
            next_lps.append(lps[kept])
            reasons.append(reason)
        tic = time.perf_counter()
        self._roll_back(rows.model, caches, arrays, snapshot, depth, emitted,
                        [(i, m, mixer_inputs[i]) for i, m in mixers or []
                         if i in mixer_inputs] if mixers else None)
        rollback = time.perf_counter() - tic
        rows.set_pending(mx.array(next_tokens, dtype=rows.pending().dtype), next_lps)
        if hidden:
            self._observe(uids, starts, hidden[-1], [len(t) for t in emitted])
        responses, keep = [], []
        for i, (tokens, lps, reason) in enumerate(zip(emitted, emitted_lps, reasons,
                                                       strict=True)):
            # A row that ends hands its own cache with every token (it leaves the batch).
            own = rows.extract(i) if reason is not None else None
            last = len(tokens) - 1
            for n, (t, lp) in enumerate(zip(tokens, lps, strict=True)):
                responses.append(rows.response(i, t, lp, reason if n == last else None, own))
            if reason is None:
                keep.append(i)
        rows.keep(keep)
        self.record(StepOutcome(True, len(ys), len(lengths), drafted, accepted,
                                tuple(lengths), rollback))
        return responses

    @staticmethod
    def _draws(rows: DecodeRows, states: list[_Row], drafts: list[list[int]],
               logprobs: mx.array) -> dict[int, list[int]]:
        """Above temperature 0, the token each row without processors draws at every
        position it verifies, by its own sampler, all rows in one evaluation (positions
        past its first mismatch go unused: its sampler is moved on past the kept ones
        only)."""
        out: dict[int, mx.array] = {}
        for i, (state, draft) in enumerate(zip(states, drafts, strict=True)):
            if state.params.temperature == 0 or rows.processors(i):
                continue
            sampler = rows.sampler(i)
            out[i] = mx.concatenate([draw(sampler, logprobs[i, j : j + 1], j)
                                     for j in range(len(draft) + 1)])
        if not out:
            return {}
        mx.eval(list(out.values()))
        return {i: tokens.tolist() for i, tokens in out.items()}  # type: ignore[misc]

    def _accept(self, rows: DecodeRows, i: int, y: int, draft: list[int], logits: mx.array,
                logprobs: mx.array, state: _Row, targets: list[int]
                ) -> tuple[int, int, list[mx.array]]:
        """How many of ``draft`` row ``i`` keeps, the token it takes after them, and the
        log-probabilities at each position up to that one (``logprobs``: the row's, before
        any processor; ``targets``: the token it takes at each position, for a row without
        processors: its argmax, or above temperature 0 what its sampler drew there)."""
        params = state.params
        processors = rows.processors(i)
        sampler = rows.sampler(i)
        base = rows.context(i) if processors else None
        seen = [y]
        lps: list[mx.array] = []
        for j in range(len(draft) + 1):
            if base is None:
                lp = logprobs[j : j + 1]
                target = targets[j]
            else:
                row_logits = logits[j : j + 1]
                context = mx.concatenate([base, mx.array(seen, dtype=base.dtype)])
                for processor in processors:
                    row_logits = processor(context, row_logits)
                lp = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                chosen = mx.argmax(lp) if params.temperature == 0 else draw(sampler, lp, j)
                target = int(chosen.item())  # type: ignore[arg-type]
            lps.append(lp[0])
            if j < len(draft) and target == draft[j]:
                seen.append(draft[j])
                continue
            advance(sampler, j + 1)  # a seeded row's next token is the one after these
            return j, target, lps
        raise AssertionError("unreachable: the last position always returns")

    @staticmethod
    def _roll_back(model, caches: list, arrays: list[ArraysCache], snapshot: list[list],
                   depth: int, emitted: list[list[int]],
                   mixers: list[tuple[int, object, mx.array]] | None) -> None:
        """Every cache back to exactly each row's emitted tokens (of ``depth + 1`` fed).

        ``mixers``: each recurrent layer's mixer and its recorded input; None to feed the
        kept tokens through the whole model again instead.
        """
        drop = [depth + 1 - len(t) for t in emitted]
        if max(drop) == 0:
            return
        for arrays_cache, saved in zip(arrays, snapshot, strict=True):
            arrays_cache.cache = saved  # recurrent state: back to before the verify
        kv = [c for c in caches if isinstance(c, BatchKVCache | BatchQuantizedKVCache)]
        lengths = [len(t) for t in emitted]
        width = max(lengths)
        padding = [width - n for n in lengths]
        if not arrays or mixers is not None:
            least = min(drop)  # KV: trim what every row dropped, roll what each dropped more
            extra = [d - least for d in drop]
            for c in kv:
                c.trim(least)
                if max(extra) > 0:
                    c.prepare(right_padding=extra)
                    c.finalize()
            for i, mixer, recorded in mixers or []:
                cache = caches[i]
                mask = None
                if max(padding) > 0:
                    cache.prepare(lengths=lengths)
                    mask = cache.make_mask(width)
                mixer(recorded[:, :width], mask, cache)  # type: ignore[operator]
                cache.finalize()
            mx.eval([c.state for c in caches])
            return
        for c in kv:  # the whole model again, on the kept tokens
            c.trim(depth + 1)
        inputs = mx.array([t + [0] * (width - len(t)) for t in emitted])
        if max(padding) > 0:
            for c in caches:
                c.prepare(lengths=lengths, right_padding=padding)
        model(inputs, cache=caches)  # the logits are known: only the caches matter
        if max(padding) > 0:
            for c in caches:
                c.finalize()
        mx.eval([c.state for c in caches])
