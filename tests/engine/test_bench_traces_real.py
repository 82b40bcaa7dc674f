"""The trace replay's defaults for a real model (``bench.traces``): a smaller replay for
SmolLM2 unless an option says otherwise, and token counts without a tokenizer."""

from __future__ import annotations

from bench import traces


def test_a_real_model_gets_a_smaller_replay_unless_told_otherwise(tmp_path):
    """Issue 28: SmolLM2 at ~10 tok/s gets REAL_DEFAULTS; an option given still wins, and
    --quick shrinks it further. The tiny models keep their defaults."""
    tiny = traces.parse_args([])
    assert {k: getattr(tiny, k) for k in traces.TINY_DEFAULTS} == traces.TINY_DEFAULTS
    real = traces.parse_args(["--model", "smollm2-135m"])
    assert {k: getattr(real, k) for k in traces.REAL_DEFAULTS} == traces.REAL_DEFAULTS
    told = traces.parse_args(["--model", "smollm2-135m", "--sessions", "3", "--context", "1024"])
    assert (told.sessions, told.context, told.max_turns) == (3, 1024, 3)
    quick = traces.parse_args(["--model", "smollm2-135m", "--quick"])
    assert (quick.sessions, quick.max_turns, quick.tokens_per_block) == (2, 2, 2)
    # no tokenizer there: its characters, the byte tokenizer's count
    assert traces.count_tokens(tmp_path, "abc d") == 5
