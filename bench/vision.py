"""Images across turns and in parallel (issue 42): our server against ``mlx_vlm.server``
on the same weights directory, each arm alone on the machine, both warmed by one request.

- ``conversation``: a 6-turn conversation about one image, streamed, temperature 0,
  thinking off; each turn sends the earlier answers back. Reports TTFT of turns 2-6 (p50,
  mean) on both sides and their ratio, whether the outputs are identical, and how often our
  vision tower ran (``serve_app_images{source="encoded"}``: once is the goal).
- ``parallel``: 8 concurrent requests, 8 different images, ``--tokens`` each: aggregate
  generated tokens a second on both sides (``mlx_vlm.server`` batches continuously too).
- ``restart``: our server stopped and started again on the same SSD directory; the
  conversation's last turn sent again: its TTFT against the same request on a fresh server
  with an empty SSD directory (cold).

Goals (issue 42): TTFT turns 2-6 <= 0.2x mlx_vlm.server's, outputs identical, the encoder
once; 8-image aggregate tok/s >= 1.5x; restart TTFT <= 0.1x cold.

Usage: python -m bench.vision [--model tiny-vl] [--tokens N] [--out FILE] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.common import (
    add_model_option,
    emit,
    start_ours,
    stream_chat,
    wait_written,
    workdir,
)
from bench.devserver import ServerProcess, free_port
from serve_app.models.embedded import materialize

QUESTIONS = ("What is in this picture?", "Which colours stand out?", "Is there any text?",
             "Where is the brightest part?", "Describe the left half.",
             "Summarize it in five words.")
GOAL_TTFT = 0.2
GOAL_THROUGHPUT = 1.5
GOAL_RESTART = 0.1


def png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB picture, ``size`` (height, width), as PNG bytes (the same for a seed)."""
    import io

    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((*size, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def image_url(seed: int, size: tuple[int, int]) -> str:
    """``png(seed, size)`` as a data URL, as a client sends it (the same on both sides)."""
    import base64

    return "data:image/png;base64," + base64.b64encode(png(seed, size)).decode()


def body(model: str, messages: list[dict], tokens: int) -> dict:
    return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}


def conversation(base_url: str, model: str, url: str, tokens: int) -> list[dict]:
    messages: list[dict] = []
    turns = []
    for n, question in enumerate(QUESTIONS):
        content: list[dict] | str = question
        if n == 0:
            content = [{"type": "text", "text": question},
                       {"type": "image_url", "image_url": {"url": url}}]
        messages.append({"role": "user", "content": content})
        turn = stream_chat(base_url, body(model, messages, tokens))
        messages.append({"role": "assistant", "content": turn["text"]})
        turns.append(turn)
    return turns


def parallel(base_url: str, model: str, urls: list[str], tokens: int) -> dict:
    def one(url: str) -> dict:
        return stream_chat(base_url, body(model, [{"role": "user", "content": [
            {"type": "text", "text": "Describe this picture."},
            {"type": "image_url", "image_url": {"url": url}}]}], tokens))

    start = time.perf_counter()
    with ThreadPoolExecutor(len(urls)) as pool:
        results = list(pool.map(one, urls))
    wall = time.perf_counter() - start
    generated = sum(r["tokens"] or 0 for r in results)
    return {"requests": len(urls), "wall_s": wall, "generated_tokens": generated,
            "tok_per_s": generated / wall, "texts": [r["text"] for r in results]}


def mlx_vlm_direct(model_dir: Path, url: str, turns: list[dict], tokens: int) -> list[str]:
    """Each turn of our conversation (its prompt: the questions and our answers before it)
    greedy through mlx-vlm's own model, in this process, in one forward: the reference
    both servers are held to."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_tokenizer
    from mlx_vlm.utils import load_model

    from serve_app.multimodal.images import ImageLimits
    from serve_app.multimodal.prompt import ImagePrompts

    tokenizer = load_tokenizer(model_dir)
    prompts = ImagePrompts(model_dir, ImageLimits())
    model = load_model(model_dir)
    messages: list[dict] = []
    out = []
    for n, (question, turn) in enumerate(zip(QUESTIONS, turns, strict=True)):
        messages.append({"role": "user", "content": [{"type": "text", "text": question},
                                                     {"type": "image"}] if n == 0
                         else question})
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                            enable_thinking=False)
        vision = prompts.prompt(list(ids), [(url, "auto")])
        image = vision.spans[0].image
        embedded = model.get_input_embeddings(mx.array([vision.tokens]),
                                              mx.array(image.pixel_values),
                                              image_grid_thw=mx.array([image.grid]))
        cache = make_prompt_cache(model.language_model)  # its own make_cache where it has one
        logits = model.language_model(mx.array([vision.tokens]),
                                      inputs_embeds=embedded.inputs_embeds, cache=cache,
                                      position_ids=embedded.position_ids,
                                      rope_deltas=embedded.rope_deltas).logits
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for _ in range(tokens):
            y = int(np.argmax(np.asarray(logits[0, -1])))
            if y in tokenizer.eos_token_ids:
                break
            detokenizer.add_token(y)
            logits = model.language_model(mx.array([[y]]), cache=cache).logits
        detokenizer.finalize()
        out.append(detokenizer.text)
        messages.append({"role": "assistant", "content": turn["text"]})
    return out


def images_encoded(base_url: str) -> float | None:
    for line in httpx.get(f"{base_url}/metrics", timeout=30).text.splitlines():
        if line.startswith("ray_serve_app_images_total") and 'source="encoded"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None


def start_mlx_vlm_server(tmp: Path, model_dir: Path, tokens: int) -> ServerProcess:
    """``mlx_vlm.server --model <dir>``, ready once a one-token chat answers."""
    port = free_port()
    server = ServerProcess([sys.executable, "-m", "mlx_vlm.server", "--model", str(model_dir),
                            "--port", str(port), "--host", "127.0.0.1", "--max-tokens",
                            str(tokens)], port, tmp / "mlx_vlm_server.log")
    deadline = time.monotonic() + 240
    while True:
        try:
            probe = body(str(model_dir), [{"role": "user", "content": "hi"}], 1)
            if httpx.post(f"{server.base_url}/v1/chat/completions", json=probe,
                          timeout=60).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or server.proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"mlx_vlm.server never answered:\n{server.log_tail()}")
        time.sleep(1)


def ttfts(turns: list[dict]) -> dict:
    later = [t["ttft"] for t in turns[1:]]
    return {"ttft_p50_s": statistics.median(later), "ttft_mean_s": statistics.fmean(later)}


def run(args: argparse.Namespace, tmp: Path) -> dict:
    model_dir = materialize(args.model)
    size = (args.image_size, args.image_size)
    url = image_url(1, size)
    urls = [image_url(100 + i, size) for i in range(args.parallel)]
    result: dict = {"model": args.model, "backend": "mlx (CPU here; Metal on a Mac)",
                    "settings": {"tokens": args.tokens, "image_size": size,
                                 "parallel": args.parallel}}
    ssd = tmp / "kv"
    ours = start_ours(tmp, "ours", args.model, cache={"block_size": 16},
                      max_tokens=args.tokens, ssd_dir=ssd)
    try:
        stream_chat(ours.base_url, body(args.model, [{"role": "user", "content": "hi"}], 4))
        before = images_encoded(ours.base_url) or 0.0
        our_turns = conversation(ours.base_url, args.model, url, args.tokens)
        time.sleep(6)  # the replica pushes its counters every few seconds
        encoded = (images_encoded(ours.base_url) or 0.0) - before
        our_parallel = parallel(ours.base_url, args.model, urls, args.tokens)
        wait_written(ours, args.model)
    finally:
        ours.stop()
    last = our_turns[-1]
    messages: list[dict] = []
    for n, (q, t) in enumerate(zip(QUESTIONS, our_turns, strict=True)):
        content: list[dict] | str = q if n else [
            {"type": "text", "text": q}, {"type": "image_url", "image_url": {"url": url}}]
        messages += [{"role": "user", "content": content}]
        if n < len(QUESTIONS) - 1:
            messages += [{"role": "assistant", "content": t["text"]}]
    again = start_ours(tmp, "ours-restarted", args.model, cache={"block_size": 16},
                       max_tokens=args.tokens, ssd_dir=ssd)
    try:
        stream_chat(again.base_url, body(args.model, [{"role": "user", "content": "hi"}], 4))
        restarted = stream_chat(again.base_url, body(args.model, messages, args.tokens))
    finally:
        again.stop()
    cold_server = start_ours(tmp, "ours-cold", args.model, cache={"block_size": 16},
                             max_tokens=args.tokens, ssd_dir=tmp / "kv-cold")
    try:
        stream_chat(cold_server.base_url, body(args.model, [{"role": "user", "content": "hi"}],
                                               4))
        cold = stream_chat(cold_server.base_url, body(args.model, messages, args.tokens))
    finally:
        cold_server.stop()
    theirs = start_mlx_vlm_server(tmp, model_dir, args.tokens)
    try:
        their_turns = conversation(theirs.base_url, str(model_dir), url, args.tokens)
        their_parallel = parallel(theirs.base_url, str(model_dir), urls, args.tokens)
    finally:
        theirs.stop()
    reference = mlx_vlm_direct(model_dir, url, our_turns, args.tokens)
    o, t = ttfts(our_turns), ttfts(their_turns)
    result["conversation"] = {
        "ours": o, "mlx_vlm_server": t,
        "ttft_mean_ratio": o["ttft_mean_s"] / t["ttft_mean_s"],
        "outputs_identical": [a["text"] for a in our_turns] == [b["text"] for b in their_turns],
        "identical_turns": sum(a["text"] == b["text"] for a, b in zip(our_turns, their_turns,
                                                                      strict=True)),
        # each turn's prompt (ours) through mlx-vlm's own model in one forward
        "ours_equal_mlx_vlm_model": [a["text"] == r for a, r in zip(our_turns, reference,
                                                                    strict=True)],
        "cached_fraction_turns_2_6": [round((x["cached_tokens"] or 0) / x["prompt_tokens"], 3)
                                      for x in our_turns[1:]],
        "images_encoded": encoded}
    result["parallel"] = {
        "ours_tok_per_s": our_parallel["tok_per_s"],
        "mlx_vlm_server_tok_per_s": their_parallel["tok_per_s"],
        "ratio": our_parallel["tok_per_s"] / their_parallel["tok_per_s"],
        "outputs_identical": our_parallel["texts"] == their_parallel["texts"]}
    result["restart"] = {"ttft_restarted_s": restarted["ttft"], "ttft_cold_s": cold["ttft"],
                         "ratio": restarted["ttft"] / cold["ttft"],
                         "cached_tokens": restarted["cached_tokens"],
                         "prompt_tokens": restarted["prompt_tokens"],
                         "same_text": restarted["text"] == cold["text"] == last["text"]}
    result["goals"] = {
        "ttft_turns_2_6": {"goal": f"<= {GOAL_TTFT}x",
                           "met": result["conversation"]["ttft_mean_ratio"] <= GOAL_TTFT},
        "encoder_once": {"goal": "1", "met": encoded == 1},
        "parallel_tok_s": {"goal": f">= {GOAL_THROUGHPUT}x",
                           "met": result["parallel"]["ratio"] >= GOAL_THROUGHPUT},
        "restart_ttft": {"goal": f"<= {GOAL_RESTART}x",
                         "met": result["restart"]["ratio"] <= GOAL_RESTART}}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_option(parser, "tiny-vl")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=128, help="pixels a side")
    parser.add_argument("--quick", action="store_true", help="fewer tokens")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = 8
    with workdir() as tmp:
        emit(run(args, tmp), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
