"""The memory plan (no Ray): cache bytes against real mlx-lm caches, the budget and hot-tier
arithmetic, the profile keys, and ``check`` refusing what cannot fit."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.config.profile import Profile
from serve_app.memory.plan import (
    ModelFootprint,
)
from serve_app.memory.shapes import CacheShape
from tests.support import REPO

TINY = {"name": "m", "source": "embedded:tiny-dense"}
EMPTY_SAFETENSORS = struct.pack("<Q", 2) + b"{}"  # a header and no tensor


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("memory_plan_home")


def cache_nbytes(cache: list, valid_only: bool = False) -> int:
    """Bytes an mlx-lm prompt cache holds: KV buffers (or their filled part) and states."""
    total = 0
    for c in cache:
        if type(c).__name__ == "KVCache":
            k, v = c.keys, c.values
            if valid_only:
                k, v = k[..., : c.offset, :], v[..., : c.offset, :]
            total += k.nbytes + v.nbytes
        else:
            total += sum(a.nbytes for a in c.cache)
    return total


# ---- cache bytes: the arithmetic against mlx-lm's own caches ---------------------------


# ---- the budget, the hot tier and what is refused ------------------------------------


def fp(name: str, weights: int, kv: int = 0, pinned: bool = False) -> ModelFootprint:
    return ModelFootprint(name, weights, kv, 1, 1, CacheShape(kv), pinned=pinned)


def profile(models: list[dict], **sections) -> Profile:
    return Profile.model_validate({"models": models, **sections})


def named(*names: str, pinned: tuple[str, ...] = ()) -> list[dict]:
    return [{"name": n, "source": "org/model", "pinned": n in pinned} for n in names]


# ---- profile keys ----------------------------------------------------------------------


def write(tmp_path: Path, args: dict) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "llm", "import_path": "serve_app.app:build_app", "args": args}]}))
    return path


# ---- check -----------------------------------------------------------------------------


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


# ---- the docs' sizing table (docs/mac.md) ----------------------------------------------
