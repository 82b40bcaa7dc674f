"""A sharded model's profile: what ``parse_profile`` and ``python -m serve_app check``
refuse, each naming its key."""

from __future__ import annotations

import json

import pytest

from serve_app.config.profile import ParallelProfile, ProfileError, parse_profile
from serve_app.models.embedded import materialize
from serve_app.parallel.support import parallel_problem


@pytest.mark.parametrize("extra,key,words", [
    ({"parallel": {"tensor": 2, "pipeline": 2}}, "models[0].parallel", "exactly one"),
    ({"parallel": {}}, "models[0].parallel", "exactly one"),
    ({"parallel": {"tensor": 1}}, "models[0].parallel.tensor", "2"),
    ({"parallel": {"pipeline": 2, "placement": "far"}}, "models[0].parallel.placement",
     "spread"),
    ({"parallel": {"tensor": 2, "distributed_backend": "mpi"}},
     "models[0].parallel.distributed_backend", "ring"),
    ({"parallel": {"tensor": 2}, "speculative": {"method": "ngram"}},
     "models[0].speculative", "not available on a model sharded"),
    ({"parallel": {"tensor": 2}, "num_replicas": 2}, "models[0].num_replicas",
     "runs as one replica"),
])
def test_a_bad_parallel_profile_names_its_key(extra, key, words):
    profile = {"models": [{"name": "m", "source": "embedded:tiny-dense", **extra}]}
    with pytest.raises(ProfileError) as err:
        parse_profile(profile, "configs/x.yaml")
    message = str(err.value)
    assert "configs/x.yaml" in message and key in message and words in message, message


@pytest.mark.parametrize("name,parallel,words", [
    ("tiny-dense", {"tensor": 2}, None),
    ("tiny-dense-q4", {"tensor": 2}, None),
    ("tiny-hybrid", {"pipeline": 2}, None),
    ("tiny-hybrid-mtp", {"tensor": 2}, "vocab_size (265)"),
    ("tiny-dense", {"tensor": 3}, "num_attention_heads (4)"),
    ("tiny-dense", {"pipeline": 2}, "has no pipeline()"),
    ("tiny-hybrid", {"tensor": 2}, "has no tensor-parallel shard()"),
    ("tiny-hybrid", {"pipeline": 5}, "5 ranks for 4 layers"),
])
def test_what_a_model_can_be_sharded_into(name, parallel, words, tmp_path):
    path = materialize(name, tmp_path)
    problem = parallel_problem(json.loads((path / "config.json").read_text()),
                               ParallelProfile(**parallel), path)
    if words is None:
        assert problem is None
    else:
        assert problem is not None and words in problem[1], problem
        assert problem[0] == next(iter(parallel))
