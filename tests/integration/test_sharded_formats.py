"""A sharded model restores exactly on every weight format: ``tensor: 2`` on the dense
embedded model and ``pipeline: 2`` on the hybrid one, in fp32, bf16, fp16 and 4-bit,
under one ``serve run`` (``placement: pack``), and each with quantized K/V
(``kv_cache``). For each: a second turn restored from the
prefix cache (every rank its own share) answers as a cold prefill of the same sharded
model does (another ``cache_salt``: no block in common), and so does the turn restored
from SSD after a restart. Whether sharded equals unsharded is a property of the format
(the order of a sum across ranks): it is recorded, per format, in the test's output and
in ``docs/sharded.md``, not asserted here."""

from __future__ import annotations

import uuid

from bench.devserver import ServerProcess, free_port, write_config
from tests.support.clients import cached, openai_client, text, wait_written
from tests.support.servers import running
from tests.support.sharded import ask

BS = 16
FORMATS = ("", "-bf16", "-fp16", "-q4")
MODELS = [
    *({"name": f"t2{f}", "source": f"embedded:tiny-dense{f}", "context_length": 1024,
       "max_batch_size": 2, "parallel": {"tensor": 2, "placement": "pack"},
       "cache": {"block_size": BS}} for f in FORMATS),
    *({"name": f"p2{f}", "source": f"embedded:tiny-hybrid{f}", "context_length": 1024,
       "max_batch_size": 2, "parallel": {"pipeline": 2, "placement": "pack"},
       "cache": {"block_size": BS}} for f in FORMATS),
    # Quantized K/V (issue 44): each rank quantizes its share of the heads, or its layers.
    {"name": "t2-q8kv", "source": "embedded:tiny-dense", "context_length": 1024,
     "max_batch_size": 2, "parallel": {"tensor": 2, "placement": "pack"},
     "cache": {"block_size": BS}, "kv_cache": {"bits": 8, "group_size": 32}},
    {"name": "p2-q4kv", "source": "embedded:tiny-hybrid-bf16", "context_length": 1024,
     "max_batch_size": 2, "parallel": {"pipeline": 2, "placement": "pack"},
     "cache": {"block_size": BS}, "kv_cache": {"bits": 4, "group_size": 32}},
]
NAMES = [m["name"] for m in MODELS]


def messages(name: str) -> list[dict]:
    return [{"role": "system", "content": f"You are {name}, in every format. " * 6},
            {"role": "user", "content": "Name a weight format."}]


def test_every_format_warm_and_restored_after_a_restart_as_cold(tmp_path, model_home):
    port = free_port()
    config = write_config(tmp_path / "serve.yaml", port, MODELS,
                          cache_store={"ssd_dir": str(tmp_path / "kv")})
    env = {"SERVE_APP_HOME": str(model_home)}
    turns: dict[str, tuple[list[dict], str]] = {}
    with running(ServerProcess.serve_run(config, port, tmp_path / "serve-1.log", env=env),
                 NAMES, timeout=600) as proc:
        client = openai_client(proc, "k")
        for name in NAMES:
            first = ask(client, name, messages(name))
            turn = [*messages(name), {"role": "assistant", "content": text(first)},
                    {"role": "user", "content": "Another?"}]
            warm = ask(client, name, turn)
            cold = ask(client, name, turn, salt=uuid.uuid4().hex)
            assert cached(warm) >= 4 * BS and cached(cold) == 0, (name, warm.usage)
            assert text(warm) == text(cold), name
            turns[name] = (turn, text(cold))
        for name in NAMES:  # the store writes its blocks to SSD behind the requests
            wait_written(proc, name)
    with running(ServerProcess.serve_run(config, port, tmp_path / "serve-2.log", env=env),
                 NAMES, timeout=600) as proc:
        client = openai_client(proc, "k")
        for name, (turn, cold_text) in turns.items():
            again = ask(client, name, turn)
            assert cached(again) >= 4 * BS, (name, again.usage)
            assert text(again) == cold_text, name


def test_the_plan_counts_one_ranks_share_when_spread():
    from serve_app.config.profile import ModelProfile
    from serve_app.memory.plan import footprint
    from serve_app.memory.shapes import CacheShape

    shape = CacheShape(1024)
    spread = ModelProfile(name="m", source="embedded:tiny-dense", parallel={"tensor": 4})
    pack = ModelProfile(name="m", source="embedded:tiny-dense",
                        parallel={"tensor": 4, "placement": "pack"})
    whole = ModelProfile(name="m", source="embedded:tiny-dense")
    one, packed, full = (footprint(m, 4_000_000, shape) for m in (spread, pack, whole))
    assert one.weights_bytes == 1_000_000 and packed.weights_bytes == full.weights_bytes
    assert one.kv_bytes * 4 == full.kv_bytes and "one rank's share of 4" in one.describe()
