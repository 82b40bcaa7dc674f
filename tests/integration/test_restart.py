"""The SSD tier across a full stop and start (a new Ray cluster), and across kill -9."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest
from openai.types.chat import ChatCompletion

from bench.devserver import ServerProcess, free_port, write_config
from serve_app.cache.ssd_fs import TMP_MARK
from tests.support.clients import chat, model_stats, openai_client, wait_written
from tests.support.servers import running

BS = 16
HYBRID = "restart-hybrid"
HYBRID_BF16 = "restart-hybrid-bf16"  # as real Qwen3-Next checkpoints: bf16 conv state
DENSE_Q4 = "restart-dense-q4"
MODELS = [
    {"name": name, "source": f"embedded:{source}", "context_length": 1024,
     "cache": {"block_size": BS}}
    for name, source in ((HYBRID, "tiny-hybrid"), (HYBRID_BF16, "tiny-hybrid-bf16"),
                         (DENSE_Q4, "tiny-dense-q4"))
]


@pytest.fixture
def start(tmp_path, model_home):
    kv = tmp_path / "kv"
    started: list[ServerProcess] = []
    with ExitStack() as servers:

        def go() -> ServerProcess:
            port = free_port()
            n = len(started)
            config = write_config(tmp_path / f"serve{n}.yaml", port, MODELS,
                                  cache_store={"ssd_dir": str(kv)})
            server = ServerProcess.serve_run(config, port, tmp_path / f"serve{n}.log",
                                             env={"SERVE_APP_HOME": str(model_home)})
            started.append(server)
            return servers.enter_context(running(server, [m["name"] for m in MODELS]))

        yield go, kv


def ask(server: ServerProcess, model: str, messages: list[dict]) -> ChatCompletion:
    return chat(openai_client(server, "k"), model, messages)


def conversation(model: str) -> list[dict]:
    return [{"role": "system", "content": f"Restart test for {model}. " * 3},
            {"role": "user", "content": "First question, please answer."}]


@pytest.mark.parametrize("model", [HYBRID, HYBRID_BF16, DENSE_Q4])
def test_conversation_survives_a_restart(start, model):
    go, _ = start
    first = go()
    messages = conversation(model)
    reply = ask(first, model, messages)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "And the second one?"}]
    turn2 = ask(first, model, messages)
    store = wait_written(first, model)
    assert store["staging"]["writes_dropped"] == 0 and store["ssd"]["blocks"] > 0
    first.stop()

    second = go()
    # (The readiness probe's own short request may have restored its tail already.)
    loads_before = model_stats(second, model)["cache"]["sidecar_loads"]
    again = ask(second, model, messages)
    prompt = again.usage.prompt_tokens
    # Every full block and the tail captured at the prompt's end: one token computed.
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert again.choices[0].message.content == turn2.choices[0].message.content
    stats = model_stats(second, model)["cache"]
    assert stats["hit_tokens_by_tier"].get("ssd", 0) > 0
    assert stats["sidecar_loads"] - loads_before == (0 if model == DENSE_Q4 else 1)
    assert stats["incompatible_payloads"] == 0 and stats["restore_failures"] == 0


def test_kill_9_leaves_no_partial_file_and_later_turns_hit(start):
    go, kv = start
    first = go()
    messages = conversation(HYBRID)
    reply = ask(first, HYBRID, messages)
    for i in range(3):  # more writes in flight when the processes die
        ask(first, HYBRID, [{"role": "user", "content": f"filler {i} " * 20}])
    first.kill()
    # A write interrupted between its temporary file and the rename:
    crashed = Path(kv) / "v1" / "blocks" / "ab" / f"{'ab' * 32}.safetensors{TMP_MARK}9-9"
    crashed.parent.mkdir(parents=True, exist_ok=True)
    crashed.write_bytes(b"half a block")

    # ... and a sidecar whose block file is gone (a copy renamed to another id):
    second_layout_dirs = list((Path(kv) / "v1" / "sidecars").iterdir())
    assert second_layout_dirs
    stray = second_layout_dirs[0] / "cd" / f"{'cd' * 32}.safetensors"
    stray.parent.mkdir(parents=True, exist_ok=True)
    some_sidecar = next(second_layout_dirs[0].rglob("*.safetensors"))
    header_ok = some_sidecar.read_bytes()
    stray.write_bytes(header_ok.replace(some_sidecar.stem.encode(), ("cd" * 32).encode()))

    second = go()
    store = wait_written(second, HYBRID)
    assert store["ssd"]["temp_files_removed"] >= 1
    assert store["ssd"]["orphans"] == 0 and not stray.exists()
    assert not list(Path(kv).rglob(f"*{TMP_MARK}*"))
    again = ask(second, HYBRID, messages)
    assert again.choices[0].message.content == reply.choices[0].message.content
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Next turn."}]
    assert ask(second, HYBRID, messages).usage.prompt_tokens_details.cached_tokens > 0
