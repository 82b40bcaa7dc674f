"""``python -m serve_app check`` refuses a tensor-parallel model whose mlx-lm architecture
has no ``shard()``, naming the key, and only that model (what ``parse_profile`` refuses:
tests/unit/test_parallel_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml


def test_check_refuses_what_cannot_be_sharded_naming_the_key(tmp_path, model_home):
    models = [{"name": "a", "source": "embedded:tiny-hybrid", "parallel": {"tensor": 2}},
              {"name": "b", "source": "embedded:tiny-dense", "parallel": {"tensor": 2}}]
    path = tmp_path / "sharded.yaml"
    path.write_text(yaml.safe_dump({"applications": [{
        "name": "llm", "import_path": "serve_app.app:build_app", "args": {"models": models}}]}))
    env = {**os.environ, "SERVE_APP_HOME": str(model_home), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 2, done.stderr
    assert ("applications[0].args.models[0].parallel.tensor: mlx-lm's 'qwen3_next' model "
            "has no tensor-parallel shard()") in done.stderr
    assert "models[1]" not in done.stderr
