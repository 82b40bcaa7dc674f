"""The status page's screenshots in the docs, made again from a real server:
``python -m bench.screenshots [--out docs/img]``.

Starts ``serve run`` with the embedded real model (SmolLM2-135M) and the tiny hybrid, has
a short conversation with each (its second turn from the prefix cache), runs the
self-benchmark, opens ``http://127.0.0.1:PORT/`` in headless Chromium and saves the page;
then unloads the hybrid from the page and saves it again. Everything it starts is stopped.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import httpx

from bench.browser import open_page
from bench.devserver import ServerProcess, free_port, write_config

REAL = "smollm2-135m"
HYBRID = "tiny-hybrid"
MODELS = [
    {"name": REAL, "source": "embedded:smollm2-135m", "context_length": 2048,
     "max_tokens": 256},
    {"name": HYBRID, "source": "embedded:tiny-hybrid", "context_length": 2048,
     "max_tokens": 64, "cache": {"block_size": 16}},
]
QUESTIONS = ["What is the capital of France?", "And what river runs through it?"]


def converse(base: str, model: str) -> None:
    """A two-turn conversation: the second turn's prompt starts with the first's."""
    messages: list[dict] = [{"role": "system", "content": "You are a concise assistant."}]
    for q in QUESTIONS:
        messages.append({"role": "user", "content": q})
        r = httpx.post(f"{base}/v1/chat/completions", timeout=300, json={
            "model": model, "messages": messages, "max_tokens": 48, "temperature": 0})
        r.raise_for_status()
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/img"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        config = write_config(Path(tmp) / "serve.yaml", port, MODELS,
                              cache_store={"ssd_dir": str(Path(tmp) / "kv")})
        with ServerProcess.serve_run(config, port, Path(tmp) / "serve.log") as server:
            server.wait_ready([REAL, HYBRID], timeout=600)
            base = server.base_url
            for model in (REAL, HYBRID):
                converse(base, model)
            httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
                "model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]})
            httpx.post(f"{base}/admin/benchmark", timeout=600,
                       json={"model": REAL}).raise_for_status()
            with open_page(f"{base}/") as bp:
                bp.page.set_viewport_size({"width": 1400, "height": 1000})
                bp.page.wait_for_selector(f'#bench tr[data-model="{REAL}"]')
                bp.page.wait_for_timeout(2500)  # one more refresh: the last minute's figures
                bp.page.screenshot(path=str(args.out / "status-page.png"), full_page=True)
                bp.page.click(f'.model[data-model="{HYBRID}"] button[data-action="unload"]')
                bp.page.wait_for_function(
                    f"""() => (document.querySelector('.model[data-model="{HYBRID}"] '
                             + '[data-role="pool-status"]') || {{}}).textContent === 'unloaded'""")
                bp.page.locator("#models-section").screenshot(
                    path=str(args.out / "status-page-unloaded.png"))
                if bp.console_errors:
                    raise SystemExit(f"the page logged errors: {bp.console_errors}")
    print(f"screenshots in {args.out}")


if __name__ == "__main__":
    main()
