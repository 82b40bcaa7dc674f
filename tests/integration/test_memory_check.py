"""``python -m serve_app check`` and the memory plan: it refuses a profile that cannot fit,
naming memory and the numbers, and prints the plan of one that fits (the plan's arithmetic:
tests/unit/test_memory_plan.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import REPO

TINY = {"name": "m", "source": "embedded:tiny-dense"}


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory_plan_home")


def write(tmp_path: Path, args: dict) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "llm", "import_path": "serve_app.app:build_app", "args": args}]}))
    return path


def run_check(path: Path, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "SERVE_APP_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)], cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=120)


def test_check_refuses_a_1mb_budget_naming_memory_and_the_numbers(tmp_path, home):
    path = write(tmp_path, {"models": [{**TINY, "pinned": True},
                                       {"name": "h", "source": "embedded:tiny-hybrid"}],
                            "memory": {"budget": "1MB"}})
    done = run_check(path, home)
    assert done.returncode == 2, done.stdout + done.stderr
    errors = done.stderr.splitlines()
    assert len(errors) == 2 and all(str(path) in e and "memory" in e for e in errors)
    assert "the pinned models need 33.4 MiB of memory" in errors[0]
    assert "weights 1.39 MiB + KV 32.0 MiB for 8 x 4096 tokens" in errors[0]
    assert "1000000 bytes, memory.budget" in errors[0]
    assert errors[1].startswith(f"error: {path}: application 'llm': memory: model 'h' needs")
    assert "recurrent state" in errors[1]
    assert "REFUSED (memory)" in done.stdout


def test_check_prints_the_plan_of_a_profile_that_fits(tmp_path, home):
    path = write(tmp_path, {"models": [{**TINY, "pinned": True, "context_length": 1024,
                                        "max_batch_size": 2}],
                            "memory": {"budget": "4GiB"},
                            "cache_store": {"hot_budget": "auto"}})
    done = run_check(path, home)
    assert done.returncode == 0, done.stderr
    assert "application 'llm' ok: m" in done.stdout
    assert "memory budget 4.00 GiB = 4294967296 bytes" in done.stdout
    assert "KV 2.00 MiB for 2 x 1024 tokens at 1.00 KiB a token" in done.stdout
    assert "hot tier: 3.5" in done.stdout  # 4 GiB - 488 MiB staging - the model's 3.4 MiB
