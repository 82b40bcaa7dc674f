"""How a test talks to a running server: the OpenAI and Anthropic clients (never
retrying: a retry would hide the error or the cold start a test looks at), a greedy chat
completion and what a test reads of it, and the server's own ``/v1/stats``."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
from openai import OpenAI
from openai.types.chat import ChatCompletion

from bench.devserver import ServerProcess
from tests.support.servers import wait_for


def openai_client(server: ServerProcess, api_key: str = "unused",
                  timeout: float | None = 120.0) -> OpenAI:
    """An OpenAI client of ``server``'s ``/v1``."""
    return OpenAI(base_url=f"{server.base_url}/v1", api_key=api_key, max_retries=0,
                  timeout=timeout)


def anthropic_client(server: ServerProcess, api_key: str = "unused",
                     timeout: float = 120.0) -> anthropic.Anthropic:
    """An Anthropic client of ``server`` (its SDK adds ``/v1`` itself)."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=api_key, max_retries=0,
                               timeout=timeout)


def chat(client: OpenAI, model: str, messages: list[dict], max_tokens: int = 12,
         salt: str | None = None, **extra: Any) -> ChatCompletion:
    """A greedy chat completion (temperature 0: the same prompt, the same tokens);
    ``salt``: a ``cache_salt``, so no block of another salt is reused."""
    if salt:
        extra["extra_body"] = {**extra.get("extra_body", {}), "cache_salt": salt}
    return client.chat.completions.create(model=model, messages=messages,
                                          max_tokens=max_tokens, temperature=0, **extra)


def user(content: str) -> list[dict]:
    """A conversation of one user message."""
    return [{"role": "user", "content": content}]


def text(response: ChatCompletion) -> str:
    """A chat completion's answer."""
    return response.choices[0].message.content


def cached(response: ChatCompletion) -> int:
    """The prompt tokens a chat completion restored from the cache (0 when not said)."""
    details = response.usage.prompt_tokens_details if response.usage else None
    return (details.cached_tokens or 0) if details is not None else 0


def model_stats(server: ServerProcess, model: str) -> dict:
    """``/v1/stats`` of one model."""
    return httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"][model]


def wait_written(server: ServerProcess, model: str, timeout: float = 60.0) -> dict:
    """The model's node store once the replica's puts are all acknowledged, nothing waits
    to be written to SSD and the SSD index is read (what a restart will find)."""
    def written() -> dict | None:
        store = model_stats(server, model)["cache_store"]
        acked = store.get("publisher", {}).get("unacknowledged", 0) == 0
        settled = store["staging"]["pending_bytes"] == 0 and store["ssd"]["index_ready"]
        return store if acked and settled else None

    return wait_for(written, f"{model}'s blocks written to SSD", timeout, interval=0.1)
