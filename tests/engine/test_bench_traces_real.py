"""The trace replay's loader and scaler (``bench.traces``), without a server.

Same hash id -> same text, the system prompt shared by every session, each turn the
whole conversation so far with the server's own answers in it, sessions ending before
they pass the context, and the report's rows and plot from a synthetic result.
"""

from __future__ import annotations

from bench import traces
from bench.traces import (
    Trace,
    TraceRequest,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def request(ids, think: float = 10.0, t: float = 0.0) -> TraceRequest:
    return TraceRequest(t, 64 * len(ids), 100, tuple(ids), think, "n", ("tool_result",))


def trace(*requests: TraceRequest, system_tokens: int = 3 * 64, tid: str = "t1") -> Trace:
    return Trace(tid, 64, system_tokens, 64, tuple(requests))  # 3 + 1 system blocks


def synthetic_result() -> dict:
    def server(p50: float, p99: float, errors: int = 0) -> dict:
        return {"requests_ok": 10 - errors, "requests_sent": 10, "errors": errors,
                "ttft_p50_s": p50, "ttft_p90_s": p99 * 0.8, "ttft_p99_s": p99,
                "wall_s": 30.0, "cached_fraction": 0.9}
    rows = [{"request": f"s0t{i}", "start_s": float(i), "ttft": 0.1 * i, "error": None}
            for i in range(1, 6)]
    servers = {"mlx_lm_server": server(1.0, 4.0), "ours": server(0.1, 1.0),
               "ours_anthropic": server(0.5, 2.0, errors=1)}
    return {"model": "tiny-hybrid", "settings": {"sessions": 8, "tokens_per_block": 4},
            "servers": servers,
            "ratios_vs_mlx_lm_server": {"ours": {"ttft_p50": 0.1, "ttft_p99": 0.25},
                                        "ours_anthropic": {"ttft_p50": 0.5,
                                                           "ttft_p99": 0.5}},
            "errors": 1,
            "requests": {"mlx_lm_server": rows, "ours": rows,
                         "ours_anthropic": [*rows, {"request": "s1t1", "start_s": 2.0,
                                                    "error": "boom"}]}}


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
