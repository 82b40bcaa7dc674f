"""Profile validation: every kind of bad profile fails with the file and the key."""

from __future__ import annotations

import pytest

from serve_app.config.profile import ModelProfile, ProfileError, load_serve_config, parse_profile
from serve_app.deploy.app import build_app, deployment_name
from tests.support import REPO
from tests.support.profiles import write

GOOD_MODEL = {"name": "m", "source": "embedded:tiny-dense"}


@pytest.mark.parametrize("config", sorted((REPO / "configs").glob("*.yaml")))
def test_shipped_configs_are_valid(config):
    apps = load_serve_config(config)
    assert apps and all(p.models for _, p in apps)


@pytest.mark.parametrize(
    "args,key,words",
    [
        ({"models": [{**GOOD_MODEL, "max_batch_szie": 4}]}, "models[0].max_batch_szie",
         "unknown key"),
        ({"models": [{**GOOD_MODEL, "max_batch_size": "8"}]}, "models[0].max_batch_size",
         "integer"),
        ({"models": [{**GOOD_MODEL, "max_batch_size": 0}]}, "models[0].max_batch_size",
         "greater than or equal to 1"),
        ({"models": []}, "models", "at least 1"),
        ({}, "models", "required key is missing"),
        ({"models": [{"name": "m"}]}, "models[0].source", "required key is missing"),
        ({"models": [{**GOOD_MODEL, "source": "/no/such/dir"}]}, "models[0].source",
         "does not exist"),
        ({"models": [{**GOOD_MODEL, "source": "embedded:nope"}]}, "models[0].source",
         "unknown embedded model"),
        ({"models": [{**GOOD_MODEL, "source": "not a source"}]}, "models[0].source",
         "neither"),
        ({"models": [GOOD_MODEL, GOOD_MODEL]}, "models", "more than once"),
        ({"models": [{**GOOD_MODEL, "sampling": {"temperature": -1}}]},
         "models[0].sampling.temperature", "greater than or equal to 0"),
        ({"models": [GOOD_MODEL], "ingress": {"num_cpus": "x"}}, "ingress.num_cpus", "number"),
        ({"models": [GOOD_MODEL], "ingress": {"max_request_bytes": 100}},
         "ingress.max_request_bytes", "greater than or equal to 1024"),
        ({"models": [GOOD_MODEL], "ingress": {"max_request_bytes": "huge"}},
         "ingress.max_request_bytes", "could not parse"),
        ({"models": [{**GOOD_MODEL, "max_prompt_chars": 0}]}, "models[0].max_prompt_chars",
         "greater than or equal to 1"),
        ({"models": [{**GOOD_MODEL, "max_prompt_chars": "9"}]}, "models[0].max_prompt_chars",
         "integer"),
        ({"models": [GOOD_MODEL], "extra": 1}, "extra", "unknown key"),
        ({"models": [{**GOOD_MODEL, "chat_template": "no/such.jinja"}]},
         "models[0].chat_template", "neither a builtin template nor a file"),
        ({"models": [{**GOOD_MODEL, "chat_template": 3}]}, "models[0].chat_template",
         "string"),
        ({"models": [{**GOOD_MODEL, "tool_call_format": "hermes"}]},
         "models[0].tool_call_format", "unknown tool-call format 'hermes'"),
        ({"models": [{**GOOD_MODEL, "tool_call_format": "../json_tools"}]},
         "models[0].tool_call_format", "mlx-lm's tool parsers (function_gemma"),
    ],
)
def test_bad_profiles_name_file_and_key(tmp_path, args, key, words):
    path = write(tmp_path, args)
    with pytest.raises(ProfileError) as info:
        load_serve_config(path)
    message = str(info.value)
    assert f"{path}: applications[0].args.{key}:" in message
    assert words in message


def test_a_template_file_is_read_from_the_config_files_directory(tmp_path, monkeypatch):
    """A relative path starts at the config file's directory (the working directory when
    there is no file, as in Serve's builder); it is kept absolute, and must be Jinja."""
    (tmp_path / "templates").mkdir()
    template = tmp_path / "templates" / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    model = {**GOOD_MODEL, "chat_template": "templates/mine.jinja"}
    (_, profile), = load_serve_config(write(tmp_path, {"models": [model]}))
    assert profile.models[0].chat_template == str(template)
    assert profile.models[0].tokenizer_config() == {"chat_template": template.read_text()}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(ProfileError, match="relative to the working directory"):
        parse_profile({"models": [model]})
    monkeypatch.chdir(tmp_path)
    assert parse_profile({"models": [model]}).models[0].chat_template == str(template)
    template.write_text("{% for m in messages %}")
    with pytest.raises(ProfileError, match=r"chat_template: .*mine.jinja: not a Jinja template"):
        parse_profile({"models": [model]})


def test_directory_without_config_json_is_rejected(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(ProfileError, match="has no config.json"):
        parse_profile({"models": [{**GOOD_MODEL, "source": str(tmp_path / "weights")}]})


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_serve_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_serve_config(bad)


def test_builder_rejects_bad_args_before_any_deployment():
    with pytest.raises(ProfileError, match=r"models\[0\]\.context_length"):
        build_app({"models": [{**GOOD_MODEL, "context_length": 1}]})


def test_builder_binds_one_deployment_per_model():
    app = build_app({"models": [GOOD_MODEL, {**GOOD_MODEL, "name": "org/other"}]})
    ingress = app._bound_deployment
    replicas = ingress.init_args[1]  # the ingress is handed each model's deployment by name
    assert ingress.name == "ingress" and list(replicas) == ["m", "org/other"]
    names = [r._bound_deployment.name for r in replicas.values()]
    assert names == [deployment_name("m"), deployment_name("org/other")]
    assert len(set(names)) == 2


@pytest.mark.parametrize("running, interval_ms", [(0, 25), (1, 25), (2, 25), (4, 50),
                                                  (8, 100), (200, 1000)])
def test_stream_interval_stretches_with_running_streams(running, interval_ms):
    """Chunks of all streams together stay within stream_chunks_per_second (80)."""
    from types import SimpleNamespace

    from serve_app.serving.service import ModelService

    profile = ModelProfile(name="m", source="embedded:tiny-dense")
    service = SimpleNamespace(profile=profile, engine=SimpleNamespace(
        stats=SimpleNamespace(running_batch_size=running)))
    assert ModelService.stream_interval(service) == pytest.approx(interval_ms / 1000)
