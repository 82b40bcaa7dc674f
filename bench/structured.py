"""Cost of structured output (grammar-constrained decoding) against free decoding (in-process).

Compile times (llguidance's tokenizer, a nested schema, json_object, a cache hit, a new
processor), the per-token cost of the logits processor alone (mask computed and applied to
an MLX ``(1, vocab)`` array), ms/token of ``generate_step`` constrained and free, and ms per
step of a ``BatchGenerator`` batch with 0, half and all rows constrained. Prints JSON.

    python -m bench.structured --model tiny-dense
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step

from serve_app.models.embedded import materialize
from serve_app.serving import structured
from serve_app.serving.structured import compile_response_format

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "Ada", "age": 36, "role": "admin",
            "address": {"city": "Paris", "zip": "75001"}, "tags": ["x", "math"]}
PROMPTS = ["hi", "Give me JSON", "x", "a person", "json please", "q"]


def person(title: str = "person") -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": {**SCHEMA, "title": title}}}


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 1)


def bench_compile(tokenizer) -> dict:
    tic = time.perf_counter()
    compile_response_format({"type": "json_object"}, tokenizer)  # builds the tokenizer too
    first = time.perf_counter() - tic
    cold = []
    for i in range(5):  # a new title is a new schema: compiled, not looked up
        tic = time.perf_counter()
        compile_response_format(person(f"cold-{time.time_ns()}-{i}"), tokenizer)
        cold.append(time.perf_counter() - tic)
    grammar = compile_response_format(person(), tokenizer)
    tic = time.perf_counter()
    for _ in range(200):
        compile_response_format(person(), tokenizer)
    cached = (time.perf_counter() - tic) / 200
    tic = time.perf_counter()
    for _ in range(200):
        grammar.processor()
    new_processor = (time.perf_counter() - tic) / 200
    return {"first_json_object_ms_incl_tokenizer": _ms(first),
            "schema_cold_ms_median": _ms(statistics.median(cold)),
            "schema_cached_us": _us(cached), "new_processor_us": _us(new_processor)}


def bench_mask(tokenizer, vocab: int, repeats: int) -> dict:
    """The processor alone, stepped through a valid document's tokens."""
    grammar = compile_response_format(person(), tokenizer)
    prompt = tokenizer.encode("hi")
    doc = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")))
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    best_total = best_mask = best_apply = float("inf")
    for _ in range(repeats):
        proc = grammar.processor()
        proc(mx.array(prompt), logits)
        total = mask = apply = 0.0
        for i in range(len(doc)):
            tokens = mx.array(prompt + doc[: i + 1])
            mx.eval(tokens)
            tic = time.perf_counter()
            out = proc(tokens, logits)
            mx.eval(out)
            total += time.perf_counter() - tic
            matcher = proc._matcher  # the parts, on the same state
            buf = np.empty((vocab + 31) // 32, dtype=np.int32)
            tic = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
            mask += time.perf_counter() - tic
            tic = time.perf_counter()
            mx.eval(logits + proc._bias(vocab, logits.dtype))
            apply += time.perf_counter() - tic
        n = len(doc)
        best_total, best_mask = min(best_total, total / n), min(best_mask, mask / n)
        best_apply = min(best_apply, apply / n)
        assert proc.finished and proc.error is None, proc.error
    return {"tokens": len(doc), "processor_us_per_token": _us(best_total),
            "compute_mask_us": _us(best_mask), "apply_mask_us": _us(best_apply)}


def _decode(model, tokenizer, processors: Callable[[], list], max_tokens: int) -> tuple[int, float]:
    """Tokens and seconds after the first token (prefill excluded), over every prompt."""
    eos = set(tokenizer.eos_token_ids)
    count, seconds = 0, 0.0
    for text in PROMPTS:
        steps = generate_step(mx.array(tokenizer.encode(text)), model, max_tokens=max_tokens,
                              logits_processors=processors())
        next(steps)
        tic = time.perf_counter()
        for token, _ in steps:
            count += 1
            if token in eos:
                break
        seconds += time.perf_counter() - tic
    return count, seconds


def bench_decode(model, tokenizer, repeats: int, max_tokens: int) -> dict:
    grammar = compile_response_format(person(), tokenizer)
    best: dict[str, tuple[int, float]] = {}
    for _ in range(repeats):  # interleaved, best of each: the machine may be shared
        for label, make in (("free", list), ("constrained", lambda: [grammar.processor()])):
            n, s = _decode(model, tokenizer, make, max_tokens)
            if label not in best or s / n < best[label][1] / best[label][0]:
                best[label] = (n, s)
    free, constrained = (best[k][1] / best[k][0] for k in ("free", "constrained"))
    return {"free_ms_per_token": _ms(free), "constrained_ms_per_token": _ms(constrained),
            "ratio": round(constrained / free, 3), "free_tokens": best["free"][0],
            "constrained_tokens": best["constrained"][0]}


def _batch_step_seconds(model, tokenizer, constrained: int, rows: int, steps: int) -> float:
    """Seconds per decode step while all ``rows`` are generating."""
    grammar = compile_response_format(person(), tokenizer)
    gen = BatchGenerator(model, stop_tokens=[[t] for t in sorted(tokenizer.eos_token_ids)],
                         completion_batch_size=rows, prefill_batch_size=rows)
    try:
        prompts = [tokenizer.encode(PROMPTS[i % len(PROMPTS)]) for i in range(rows)]
        gen.insert(prompts, max_tokens=[steps + 8] * rows,
                   logits_processors=[[grammar.processor()] if i < constrained else []
                                      for i in range(rows)])
        timed, seconds = 0, 0.0
        while timed < steps:
            tic = time.perf_counter()
            _, responses = gen.next()
            elapsed = time.perf_counter() - tic
            if len(responses) == rows and not any(r.finish_reason for r in responses):
                timed += 1
                seconds += elapsed
            elif timed:  # a row ended early: stop timing
                break
        return seconds / max(timed, 1)
    finally:
        gen.close()


def bench_batch(model, tokenizer, rows: int, steps: int, repeats: int) -> dict:
    out: dict[str, float] = {}
    for _ in range(repeats):
        for constrained in (0, rows // 2, rows):
            s = _batch_step_seconds(model, tokenizer, constrained, rows, steps)
            key = f"{constrained}_of_{rows}_constrained_ms_per_step"
            out[key] = min(out.get(key, float("inf")), _ms(s))
    free = out[f"0_of_{rows}_constrained_ms_per_step"]
    out["ratio_all_constrained"] = round(out[f"{rows}_of_{rows}_constrained_ms_per_step"] / free,
                                         3)
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-dense", help="embedded model name")
    parser.add_argument("--home", type=Path, default=None,
                        help="where to materialize the model (default $SERVE_APP_HOME)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    parser.add_argument("--max-tokens", type=int, default=150,
                        help="tokens per free generation (constrained ones stop at EOS)")
    parser.add_argument("--rows", type=int, default=4, help="batch size of the batch bench")
    parser.add_argument("--steps", type=int, default=40, help="timed steps of the batch bench")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    model, tokenizer = mlx_lm.load(str(materialize(args.model, args.home)))
    vocab = int(model(mx.array([[0]])).shape[-1])
    result = {
        "bench": "structured",
        "model": args.model,
        "vocab": vocab,
        "library": f"llguidance {metadata.version('llguidance')}",
        "device": str(mx.default_device()),
        "json_options": structured.JSON_OPTIONS,
        "compile": bench_compile(tokenizer),
        "mask": bench_mask(tokenizer, vocab, args.repeats),
        "decode": bench_decode(model, tokenizer, args.repeats, args.max_tokens),
        "batch": bench_batch(model, tokenizer, args.rows, args.steps, args.repeats),
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
