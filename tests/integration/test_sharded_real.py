"""The real embedded model split over three ranks: ``configs/smollm2-tensor3.yaml`` as
shipped (SmolLM2-135M has 9 attention heads and 3 key-value heads: tensor parallel over
2 cannot split them, over 3 can), under ``serve run``. It answers a real question, and
its second turn restores its prefix and answers as a cold prefill does."""

from __future__ import annotations

import uuid

import pytest
import yaml

from bench.devserver import ServerProcess, free_port
from tests.support import REPO
from tests.support.clients import cached, openai_client, text
from tests.support.servers import running
from tests.support.sharded import ask

pytestmark = pytest.mark.slow  # the real embedded model, SmolLM2-135M, on three ranks


def test_the_shipped_three_rank_profile_answers_and_restores(tmp_path, model_home):
    config = yaml.safe_load((REPO / "configs" / "smollm2-tensor3.yaml").read_text())
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["cache_store"] = {"ssd_dir": str(tmp_path / "kv")}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    name = config["applications"][0]["args"]["models"][0]["name"]
    with running(ServerProcess.serve_run(path, port, tmp_path / "serve.log",
                                         env={"SERVE_APP_HOME": str(model_home)}),
                 [name], timeout=600) as proc:
        client = openai_client(proc, "k", timeout=300)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        first = ask(client, name, question, n=16)
        assert "Paris" in text(first), text(first)
        turn = [*question, {"role": "assistant", "content": text(first)},
                {"role": "user", "content": "And of Italy?"}]
        warm = ask(client, name, turn, n=12)
        assert cached(warm) > 0, warm.usage
        assert text(warm) == text(ask(client, name, turn, n=12, salt=uuid.uuid4().hex))
