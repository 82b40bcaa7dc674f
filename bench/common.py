"""What every benchmark here needs: one streamed chat request, timed, and the output."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx


def stream_chat(base_url: str, body: dict) -> dict:
    """POST a streaming chat request; time to first token, decode time, text and usage."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = last = None
    parts: list[str] = []
    usage = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            usage = obj.get("usage") or usage
            for choice in obj.get("choices", []):
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(content)
    end = time.perf_counter()
    usage = usage or {}
    return {
        "ttft": (first or end) - start,
        "decode_s": (last or end) - (first or end),
        "total_s": end - start,
        "text": "".join(parts),
        "tokens": usage.get("completion_tokens", len(parts)),
        "prompt_tokens": usage.get("prompt_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def emit(result: dict, out: Path | None) -> None:
    print(json.dumps(result, indent=2))
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
