"""Embedding and rerank models in a profile (issue 43): the task's default from the
checkpoint, what such a model may not have, the memory plan, the command line's --task."""

from __future__ import annotations

import argparse

import pytest

from serve_app.cli.quickstart import add_model_flags, build_config
from serve_app.config.catalog import default_task
from serve_app.config.profile import ProfileError, parse_profile


@pytest.mark.parametrize("source, task", [
    ("embedded:tiny-bert", "embed"), ("embedded:tiny-bert-q4", "embed"),
    ("embedded:tiny-bert-rerank-bf16", "rerank"), ("embedded:all-minilm-l6-v2-fp16", "embed"),
    ("embedded:tiny-dense", "generate"), ("Qwen/Qwen3-Embedding-0.6B", "generate"),
    ("embedded:tiny-xlmr-fp16", "embed"), ("embedded:tiny-xlmr-rerank", "rerank"),
])
def test_the_task_defaults_to_the_checkpoints(source, task):
    assert default_task(source) == task
    profile = parse_profile({"models": [{"name": "m", "source": source}]})
    assert profile.models[0].task == task


def test_a_local_encoder_directory_embeds(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "bert", "architectures": '
                                          '["BertForSequenceClassification"]}')
    assert default_task(str(tmp_path)) == "rerank"


def test_an_embedding_model_generates_nothing():
    profile = parse_profile({"models": [{"name": "e", "source": "embedded:tiny-dense",
                                         "task": "embed", "num_replicas": 2}]})
    assert not profile.models[0].prefix_routing  # no prefixes to route on
    for key, value in (("speculative", {"method": "mtp"}), ("parallel", {"tensor": 2})):
        with pytest.raises(ProfileError, match=f"models\\[0\\].{key}: task rerank generates "
                                               f"nothing"):
            parse_profile({"models": [{"name": "e", "source": "embedded:tiny-bert-rerank",
                                       key: value}]}, where="x.yaml")


def test_the_memory_plan_counts_a_batch_and_no_hot_share(model_home):
    from serve_app.memory.planning import planned

    profile = parse_profile({"models": [
        {"name": "e", "source": "embedded:tiny-bert", "pooling": {"max_batch_tokens": 4096}},
        {"name": "g", "source": "embedded:tiny-dense"}]})
    _, plan = planned(profile)
    embed, generate = plan.models
    assert (embed.tokens, embed.sequences, embed.hot_share_bytes) == (4096, 1, 0)
    assert generate.hot_share_bytes == plan.hot_bytes  # the whole hot tier is the other's
    assert "activations" in embed.describe()


def test_serve_model_takes_a_task():
    parser = argparse.ArgumentParser()
    add_model_flags(parser)
    config = build_config("tiny-dense", parser.parse_args(["--task", "embed"]))
    assert config["applications"][0]["args"]["models"][0]["task"] == "embed"
