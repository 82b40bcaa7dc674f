"""What the engine tells its callers: one ``EngineEvent`` per token, end or failure of a
request (delivered on the engine thread to the request's sink), and ``EngineStats``, the
counters a human or a test reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serve_app.cache.merge import merged

if TYPE_CHECKING:
    from serve_app.cache.request_plan import Published


@dataclass(frozen=True)
class EngineEvent:
    """One thing that happened to a request: a token, its end, or a failure."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    # The error is the server's state, not the request's fault: a sharded model lost a
    # rank (503, retry once Serve replaced the replica), not a failed step (500).
    unavailable: bool = False
    restored: int | None = None  # set once, at insert: tokens the request started from
    # With ``SamplingParams.logprobs``: the token's log-probability and the most likely
    # tokens as (token id, log-probability), most likely first (never -inf: a token a
    # processor ruled out is no alternative, so there may be fewer than asked).
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    at: float = field(default_factory=time.perf_counter)  # when the engine produced it


EventSink = Callable[[EngineEvent], None]


@dataclass(frozen=True)
class StepOutcome:
    """What one decode step did, for the engine's counters."""

    speculated: bool  # a verify step (False: a plain one)
    rows: int  # rows in the batch
    drafting_rows: int  # rows that drafted at least one token
    drafted: int
    accepted: int
    accepted_lengths: tuple[int, ...]  # per drafting row
    rollback_seconds: float


@dataclass
class EngineStats:
    """Counters a human or a test can read to see what the engine did; each says how the
    replicas' combine into the model's (``serve_app.cache.merge``)."""

    submitted: int = merged("sum", default=0)
    finished: int = merged("sum", default=0)
    cancelled: int = merged("sum", default=0)
    rejected: int = merged("sum", default=0)
    failed: int = merged("sum", default=0)
    # gauges whose sum is the model's: requests in flight and in running batches now
    in_flight: int = merged("sum", default=0)
    decode_steps: int = merged("sum", default=0)
    # every step (prefill chunks too) and the longest one: what a rank's progress is
    steps: int = merged("sum", default=0)
    longest_step_seconds: float = merged("max", default=0.0)
    generated_tokens: int = merged("sum", default=0)
    prompt_tokens: int = merged("sum", default=0)
    running_batch_size: int = merged("sum", default=0)
    peak_batch_size: int = merged("max", default=0)  # the largest batch one replica ran
    step_seconds: float = merged("sum", default=0.0)
    restored_tokens: int = merged("sum", default=0)
    restored_bytes: int = merged("sum", default=0)
    restore_seconds: float = merged("sum", default=0.0)
    # restores that did not build: the request prefilled cold
    restore_failures: int = merged("sum", default=0)
    captured_blocks: int = merged("sum", default=0)
    captured_bytes: int = merged("sum", default=0)
    captured_tokens: int = merged("sum", default=0)
    captured_checkpoints: int = merged("sum", default=0)
    # recurrent state (the cost of a hybrid cache); partial blocks captured where
    # conversations branch
    captured_checkpoint_bytes: int = merged("sum", default=0)
    captured_tails: int = merged("sum", default=0)
    capture_seconds: float = merged("sum", default=0.0)
    # KV admission (``Engine.set_kv_budget``): bytes reserved by the requests in the
    # batch, requests waiting for KV to be freed now, requests that ever waited, and
    # requests refused because their KV alone is over the budget.
    kv_in_use_bytes: int = merged("sum", default=0)
    kv_waiting: int = merged("sum", default=0)
    kv_waited: int = merged("sum", default=0)
    kv_rejected: int = merged("sum", default=0)
    # Speculative decoding (``serve_app.serving.speculative``): verify steps, rows that
    # drafted in them (a row-step), tokens drafted and kept, how many each drafting row
    # kept (by count), rows drafting in the last step, and time spent rolling caches back.
    speculative_method: str = merged("answering", default="")  # "" without speculation
    verify_steps: int = merged("sum", default=0)
    drafting_row_steps: int = merged("sum", default=0)
    drafted_tokens: int = merged("sum", default=0)
    accepted_tokens: int = merged("sum", default=0)
    accepted_lengths: dict[str, int] = merged("sum_by_key", default_factory=dict)
    speculating_rows: int = merged("sum", default=0)
    rollback_seconds: float = merged("sum", default=0.0)

    def count_step(self, outcome: StepOutcome) -> None:
        """A decode step's speculation (``serve_app.serving.speculative``)."""
        self.speculating_rows = outcome.drafting_rows
        if not outcome.speculated:
            return
        self.verify_steps += 1
        self.drafting_row_steps += outcome.drafting_rows
        self.drafted_tokens += outcome.drafted
        self.accepted_tokens += outcome.accepted
        self.rollback_seconds += outcome.rollback_seconds
        for n in map(str, outcome.accepted_lengths):
            self.accepted_lengths[n] = self.accepted_lengths.get(n, 0) + 1

    def count_published(self, published: list[Published]) -> None:
        """Blocks a request's plan handed to the store."""
        for item in published:
            self.captured_blocks += 1
            self.captured_bytes += item.block.nbytes
            self.captured_tokens += item.tokens
            self.captured_checkpoints += bool(item.state_bytes)
            self.captured_checkpoint_bytes += item.state_bytes
            self.captured_tails += item.tail
