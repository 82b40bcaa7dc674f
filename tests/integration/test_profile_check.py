"""The shipped profiles and ``python -m serve_app check``: the default profile serves the
real embedded model on loopback, the shipped and Mac profiles pass ``check`` here, a bad
one fails naming its key (every kind of bad profile: tests/unit/test_profile.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serve_app.config.profile import ModelProfile, load_serve_config
from tests.support import REPO
from tests.support.profiles import write

GOOD_MODEL = {"name": "m", "source": "embedded:tiny-dense"}


def test_default_profile_serves_the_real_embedded_model_on_loopback():
    raw = yaml.safe_load((REPO / "configs/qwen.yaml").read_text())
    assert raw["http_options"]["host"] == "127.0.0.1"
    assert raw["http_options"]["port"] == 8000
    (_, profile), = load_serve_config(REPO / "configs/qwen.yaml")
    assert profile.models[0].source == "embedded:smollm2-135m"


def test_embedded_smollm2_brings_tools_unless_the_profile_says_otherwise():
    for name in ("smollm2-135m", "smollm2-135m-fp32", "smollm2-135m-bf16"):
        model = ModelProfile(name="s", source=f"embedded:{name}")
        assert (model.chat_template, model.tool_call_format) == ("smollm2-tools", "json_tools")
        assert set(model.tokenizer_config()) == {"chat_template", "tool_parser_type"}
    own = ModelProfile(name="s", source="embedded:smollm2-135m", chat_template=None,
                       tool_call_format=None)  # null: the checkpoint's own (no tools)
    assert own.tokenizer_config() == {}
    other = ModelProfile(name="s", source="embedded:smollm2-135m", chat_template="chatml-tools")
    assert (other.chat_template, other.tool_call_format) == ("chatml-tools", "json_tools")
    assert ModelProfile(name="d", source="embedded:tiny-dense").tokenizer_config() == {}
    (_, shipped), = load_serve_config(REPO / "configs/qwen.yaml")
    assert shipped.models[0].chat_template == "smollm2-tools"  # written out for users
    assert shipped.models[0].tool_call_format == "json_tools"


def test_check_command(tmp_path):
    ok = subprocess.run([sys.executable, "-m", "serve_app", "check", "configs/qwen.yaml"],
                        cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "ok" in ok.stdout
    path = write(tmp_path, {"models": [{**GOOD_MODEL, "max_tokens": -5}]})
    bad = subprocess.run([sys.executable, "-m", "serve_app", "check", str(path)],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "applications[0].args.models[0].max_tokens" in bad.stderr


def _check(config: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "serve_app", "check", str(config), *flags],
                          cwd=REPO, capture_output=True, text=True)


@pytest.mark.parametrize("config", ["qwen.yaml", "qwen-cluster.yaml"])
def test_shipped_profiles_pass_check_here(config):
    done = _check(REPO / "configs" / config)
    assert done.returncode == 0, done.stderr
    assert "footprint unknown" not in done.stdout


MAC_VARIANTS = {  # configs/qwen-mac.yaml's comments: what to change on other Macs
    16: ({"context_length": 16384, "max_batch_size": 2}, {"hot_budget": "1GiB"}),
    32: ({}, {}),
    64: ({"max_batch_size": 6}, {"hot_budget": "4GiB"}),
    128: ({"name": "qwen3.5-27b", "source": "mlx-community/Qwen3.5-27B-4bit",
           "context_length": 65536, "max_batch_size": 8,
           "cache": {"checkpoint_interval": 2048}}, {"hot_budget": "8GiB"}),
}


@pytest.mark.parametrize("gb", sorted(MAC_VARIANTS))
def test_the_mac_profile_fits_each_mac_its_comments_name(gb, tmp_path):
    text = (REPO / "configs" / "qwen-mac.yaml").read_text()
    model, store = MAC_VARIANTS[gb]
    for key, value in {**model, **store}.items():  # each change is written in the comments
        if key != "cache":
            assert f"{key}: {value}" in text, key
    raw = yaml.safe_load(text)
    args = raw["applications"][0]["args"]
    args["models"][0].update(model)
    args["cache_store"].update(store)
    path = tmp_path / "mac.yaml"
    path.write_text(yaml.safe_dump(raw))
    done = _check(path, "--mac-gb", str(gb))
    assert done.returncode == 0, done.stderr
    assert "footprint unknown" not in done.stdout and " ok: " in done.stdout
    if gb == 32:
        assert _check(path, "--mac-gb", "16").returncode == 2  # not past a 16 GB Mac
