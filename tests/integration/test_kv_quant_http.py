"""Quantized K/V through ``serve run`` with the real openai client: models with
``kv_cache`` beside one without, answering together (continuous batching on quantized
K/V), a restored turn answering as a cold prefill of the same model does, and the K/V's
format and bytes a token in /v1/stats and /metrics."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.clients import cached, openai_client, text
from tests.support.servers import serving

BS = 16
MODELS = [
    {"name": "float", "source": "embedded:tiny-hybrid", "context_length": 1024,
     "cache": {"block_size": BS}},
    {"name": "q8", "source": "embedded:tiny-hybrid", "context_length": 1024,
     "cache": {"block_size": BS}, "kv_cache": {"bits": 8, "group_size": 32}},
    {"name": "q4", "source": "embedded:tiny-dense-bf16", "context_length": 1024,
     "cache": {"block_size": BS}, "kv_cache": {"bits": 4, "group_size": 32}},
]


def ask(client, model: str, messages: list[dict], salt: str | None = None):
    return client.chat.completions.create(
        model=model, messages=messages, max_tokens=12, temperature=0,
        extra_body={"cache_salt": salt} if salt else None)


def test_quantized_kv_served_batched_restored_as_cold_and_reported(tmp_path, model_home):
    with serving(tmp_path, MODELS, model_home) as server:
        client = openai_client(server)
        base = [{"role": "system", "content": "You answer in few words. " * 8}]
        prompts = [[*base, {"role": "user", "content": f"Question {i}?"}] for i in range(6)]
        for model in ("q8", "q4"):
            with ThreadPoolExecutor(6) as pool:  # rows joining one quantized batch
                together = list(pool.map(lambda m, model=model: text(ask(client, model, m)),
                                         prompts))
            alone = [text(ask(client, model, m, salt=uuid.uuid4().hex)) for m in prompts]
            assert together == alone, model
            turn = [*prompts[0], {"role": "assistant", "content": together[0]},
                    {"role": "user", "content": "And then?"}]
            warm = ask(client, model, turn)
            cold = ask(client, model, turn, salt=uuid.uuid4().hex)
            assert cached(warm) >= 4 * BS and cached(cold) == 0, (model, warm.usage)
            assert text(warm) == text(cold), model

        stats = httpx.get(f"{server.base_url}/v1/stats", timeout=60).json()["models"]
        assert stats["float"]["kv_cache"]["kv_format"] == "float"
        assert stats["q8"]["kv_cache"]["kv_format"] == "q8g32"
        assert stats["q4"]["kv_cache"]["kv_format"] == "q4g32"
        per_token = {m: stats[m]["kv_cache"]["kv_bytes_per_token"] for m in stats}
        assert per_token["q8"] < 0.55 * per_token["float"]  # fp32 model: float K/V 4 bytes
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=60).text
        lines = [line for line in metrics.splitlines()
                 if line.startswith(("serve_app_kv_bytes_per_token",
                                     "ray_serve_app_kv_bytes_per_token"))
                 and 'format="q8g32"' in line and 'model="q8"' in line]
        assert lines and float(lines[0].rsplit(" ", 1)[1]) == per_token["q8"], lines
