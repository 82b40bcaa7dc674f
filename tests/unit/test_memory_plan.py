"""The memory plan (no Ray): cache bytes against real mlx-lm caches, the budget and hot-tier
arithmetic, the profile keys, and ``check`` refusing what cannot fit."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import yaml

from serve_app.config.profile import ModelProfile, Profile, ProfileError, load_serve_config
from serve_app.memory.facts import FactsUnavailable, facts_from_dir, model_facts
from serve_app.memory.machine import MachineMemory
from serve_app.memory.plan import (
    HOT_AUTO_MAX_BYTES,
    HOT_AUTO_MIN_BYTES,
    GiB,
    MiB,
    ModelFootprint,
    auto_budget,
    plan_memory,
)
from serve_app.memory.shapes import CacheShape, cache_shape_from_config, cache_shape_from_layout
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


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid", "tiny-hybrid-bf16",
                                  "tiny-hybrid-q4", "tiny-dense-fp16"])
def test_cache_bytes_from_config_match_a_real_mlx_lm_cache(home, name):
    """Two sequences of 300 tokens: the plan's bytes are the cache's bytes exactly, with
    the buffers mlx-lm rounds up to 256 tokens, and without them; the config arithmetic
    agrees with the layout a replica probes from the loaded model."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    from serve_app.cache.layout import probe_layout
    from serve_app.models.embedded import materialize

    path = materialize(name, home)
    facts = facts_from_dir(path)
    shape = facts.cache_shape()
    model, _ = mlx_lm.load(str(path))  # type: ignore[misc]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((2, 300), dtype=mx.int32), cache=cache))
    assert shape.bytes_for(2, 300) == cache_nbytes(cache)  # 512-token buffers
    assert shape.bytes_for(2, 300, step=1) == cache_nbytes(cache, valid_only=True)
    assert shape.recurrent_layers == (2 if "hybrid" in name else 0)
    probed = cache_shape_from_layout(probe_layout(model))
    assert (probed.kv_bytes_per_token, probed.state_bytes_per_sequence) == \
        (shape.kv_bytes_per_token, shape.state_bytes_per_sequence)


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid-bf16", "tiny-hybrid-q4"])
def test_weight_bytes_on_disk_are_the_loaded_weights(home, name):
    """The files' bytes are the parameters' bytes (dtype and quantization included), plus
    only the safetensors headers."""
    import mlx_lm
    from mlx.utils import tree_flatten

    from serve_app.models.embedded import materialize

    path = materialize(name, home)
    model, _ = mlx_lm.load(str(path))  # type: ignore[misc]
    params = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    on_disk = facts_from_dir(path).weights_bytes
    assert 0 <= on_disk - params < 32 * 1024, (on_disk, params)


def test_nested_qwen35_config_matches_its_mlx_lm_cache():
    """A Qwen3.5-style config (``text_config`` nested, no head_dim, every third layer full
    attention) against the cache of the mlx-lm model it builds."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from serve_app.models.compat import model_classes

    config = {"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 64, "full_attention_interval": 3, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
        "linear_conv_kernel_dim": 4, "tie_word_embeddings": False}}
    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.zeros((3, 10), dtype=mx.int32), cache=cache))
    shape = cache_shape_from_config(config, "float32")
    assert (shape.attention_layers, shape.recurrent_layers) == (2, 4)
    assert shape.bytes_for(3, 10) == cache_nbytes(cache)


def test_a_config_without_what_kv_needs_is_unavailable(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen3", "num_hidden_layers": 2}')
    (tmp_path / "model.safetensors").write_bytes(EMPTY_SAFETENSORS)
    with pytest.raises(FactsUnavailable, match="num_attention_heads"):
        facts_from_dir(tmp_path).cache_shape()


def test_an_incomplete_download_is_not_planned(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"b": "model-00002-of-00002.safetensors"}}')
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(EMPTY_SAFETENSORS)
    with pytest.raises(FactsUnavailable, match="incomplete download"):
        facts_from_dir(tmp_path)


def test_a_hub_model_not_in_the_local_cache_is_unknown_without_network(tmp_path,
                                                                        monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FactsUnavailable, match="check --hub"):
        model_facts(ModelProfile(name="m", source="mlx-community/Qwen3-4B-4bit"))


def test_a_known_hub_checkpoint_is_planned_before_its_download(tmp_path, monkeypatch):
    """The sizing table's mlx-community checkpoints: their shape is known offline."""
    from serve_app.memory.sizing import QWEN3_8B, quantized_weight_bytes

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    facts = model_facts(ModelProfile(name="m", source="mlx-community/Qwen3-8B-4bit"))
    assert facts.config == QWEN3_8B and facts.weights_bytes == quantized_weight_bytes(QWEN3_8B)
    with pytest.raises(FactsUnavailable):  # another revision: not the shape we know
        model_facts(ModelProfile(name="m", source="mlx-community/Qwen3-8B-4bit",
                                 revision="abc123"))


# ---- the budget, the hot tier and what is refused ------------------------------------


@pytest.mark.parametrize("gb, budget_gib", [(8, 4), (16, 12), (32, 24), (64, 48), (128, 96)])
def test_auto_budget_leaves_a_quarter_and_at_least_4_gib(gb, budget_gib):
    assert auto_budget(MachineMemory(gb * GiB)) == budget_gib * GiB


def test_auto_budget_floor_and_metal_working_set():
    assert auto_budget(MachineMemory(2 * GiB)) == 1 * GiB  # a floor, not a negative budget
    assert auto_budget(MachineMemory(64 * GiB, gpu_working_set_bytes=40 * GiB)) == 40 * GiB


def fp(name: str, weights: int, kv: int = 0, pinned: bool = False) -> ModelFootprint:
    return ModelFootprint(name, weights, kv, 1, 1, CacheShape(kv), pinned=pinned)


def profile(models: list[dict], **sections) -> Profile:
    return Profile.model_validate({"models": models, **sections})


def named(*names: str, pinned: tuple[str, ...] = ()) -> list[dict]:
    return [{"name": n, "source": "org/model", "pinned": n in pinned} for n in names]


def test_hot_auto_takes_what_the_models_leave_within_bounds():
    p = profile(named("a"), cache_store={"hot_budget": "auto", "ssd": False},
                memory={"budget": 10 * GiB})
    plan = plan_memory(p, [fp("a", 4 * GiB, 1 * GiB)], MachineMemory(64 * GiB))
    assert plan.hot_bytes == 5 * GiB and plan.fits
    assert plan.models[0].hot_share_bytes == 5 * GiB
    assert plan.planned_bytes == 10 * GiB and plan.reserve_bytes == 54 * GiB
    roomy = plan_memory(p.model_copy(update={"memory": p.memory.model_copy(
        update={"budget": 100 * GiB})}), [fp("a", 4 * GiB)], MachineMemory(128 * GiB))
    assert roomy.hot_bytes == HOT_AUTO_MAX_BYTES
    tight = plan_memory(p, [fp("a", 9 * GiB + 900 * MiB)], MachineMemory(64 * GiB))
    assert tight.hot_bytes == HOT_AUTO_MIN_BYTES and not tight.fits


def test_hot_auto_counts_the_ssd_write_buffer_and_unknown_models_get_the_floor():
    p = profile(named("a", "b"), cache_store={"hot_budget": "auto",
                                              "gdn_ssd_pending_max_size": 1 * GiB},
                memory={"budget": 10 * GiB})
    plan = plan_memory(p, [fp("a", 4 * GiB), fp("b", 1 * GiB)], MachineMemory(64 * GiB))
    assert plan.staging_bytes == 1 * GiB and plan.hot_bytes == 4 * GiB
    assert plan.models[0].hot_share_bytes == 2 * GiB  # shared by the two loaded models
    partial = plan_memory(p, [fp("a", 4 * GiB)], MachineMemory(64 * GiB),
                          unknown=[("b", "not downloaded")])
    assert partial.hot_bytes == HOT_AUTO_MIN_BYTES and partial.unknown == (("b", "not downloaded"),)


def test_pinned_models_that_cannot_fit_together_are_refused_naming_memory():
    p = profile(named("a", "b", pinned=("a", "b")), cache_store={"hot_budget": 1 * GiB,
                                                                "ssd": False},
                memory={"budget": 8 * GiB})
    plan = plan_memory(p, [fp("a", 4 * GiB), fp("b", 3 * GiB + 512 * MiB)],
                       MachineMemory(64 * GiB))
    assert not plan.fits
    (problem,) = plan.problems
    assert "pinned models need 7.50 GiB of memory" in problem
    assert "'a'" in problem and "'b'" in problem and "hot tier 1.00 GiB" in problem
    assert "8.50 GiB" in problem and "memory budget 8.00 GiB (8589934592 bytes" in problem


def test_a_model_that_cannot_fit_beside_the_pinned_ones_is_refused():
    p = profile(named("a", "b", "c", pinned=("a",)), cache_store={"hot_budget": 1 * GiB,
                                                                 "ssd": False},
                memory={"budget": 8 * GiB})
    plan = plan_memory(p, [fp("a", 3 * GiB), fp("b", 2 * GiB, 1 * GiB), fp("c", 5 * GiB)],
                       MachineMemory(64 * GiB))
    (problem,) = plan.problems
    assert problem.startswith("model 'c' needs 5.00 GiB of memory")
    assert "the pinned models' 3.00 GiB" in problem and "9.00 GiB" in problem


def test_a_model_with_several_replicas_is_always_loaded_like_a_pinned_one():
    """The model pool never unloads it (an unload reaches one replica): the plan counts
    it beside every other model, like a pinned one."""
    models = [{"name": "a", "source": "org/model", "num_replicas": 2},
              {"name": "c", "source": "org/model"}]
    p = profile(models, cache_store={"hot_budget": 1 * GiB, "ssd": False},
                memory={"budget": 8 * GiB})
    plan = plan_memory(p, [fp("a", 3 * GiB), fp("c", 5 * GiB)], MachineMemory(64 * GiB))
    assert plan.models[0].pinned and not plan.models[1].pinned
    (problem,) = plan.problems
    assert problem.startswith("model 'c' needs 5.00 GiB of memory")


def test_models_that_fit_one_by_one_but_not_together_are_a_note():
    p = profile(named("a", "b", "c"), cache_store={"hot_budget": "auto", "ssd": False},
                memory={"budget": 8 * GiB, "max_loaded_models": 2})
    plan = plan_memory(p, [fp("a", 3 * GiB), fp("b", 5 * GiB), fp("c", 4 * GiB)],
                       MachineMemory(64 * GiB))
    assert plan.fits and plan.problems == ()
    assert any("do not fit in memory all at once" in n for n in plan.notes)
    assert plan.loaded == ("b", "c")  # at worst the two largest stay loaded together


def test_a_budget_above_physical_memory_is_noted():
    p = profile(named("a"), memory={"budget": "200GB"})
    plan = plan_memory(p, [fp("a", 1 * GiB)], MachineMemory(16 * GiB))
    assert plan.budget_bytes == 200 * 10**9
    assert any("more than this machine's 16.0 GiB" in n for n in plan.notes)


# ---- profile keys ----------------------------------------------------------------------


def write(tmp_path: Path, args: dict) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump({"applications": [
        {"name": "llm", "import_path": "serve_app.app:build_app", "args": args}]}))
    return path


@pytest.mark.parametrize("args, key, words", [
    ({"memory": {"budget": "lots"}}, "memory.budget", "'lots' is not a size"),
    ({"memory": {"budget": 0}}, "memory.budget", "at least 1 byte"),
    ({"memory": {"budget": -5}}, "memory.budget", "at least 1 byte"),
    ({"memory": {"budget": True}}, "memory.budget", "not a size"),
    ({"memory": {"max_loaded_models": 0}}, "memory.max_loaded_models",
     "greater than or equal to 1"),
    ({"memory": {"max_loaded_modles": 2}}, "memory.max_loaded_modles", "unknown key"),
    ({"memory": {"budget": "8GB", "reserve": 1}}, "memory.reserve", "unknown key"),
    ({"models": [{**TINY, "pinned": "yes"}]}, "models[0].pinned", "valid boolean"),
    ({"models": [{**TINY, "idle_unload_s": 0}]}, "models[0].idle_unload_s",
     "greater than 0"),
    ({"models": [{**TINY, "pinned": True, "idle_unload_s": 5}]}, "models[0].idle_unload_s",
     "a pinned model is never unloaded"),
    ({"models": [{**TINY, "pinned": True}, {**TINY, "name": "n", "pinned": True}],
      "memory": {"max_loaded_models": 1}}, "memory.max_loaded_models",
     "fewer than the 2 models that always stay loaded"),
    ({"models": [{**TINY, "idle_unload_s": 5, "num_replicas": 2}]},
     "models[0].idle_unload_s", "one replica only"),
    ({"models": [{**TINY, "idle_unload_s": 5}], "ingress": {"num_replicas": 2}},
     "models[0].idle_unload_s", "the model pool runs in the ingress"),
    ({"models": [TINY], "memory": {"max_loaded_models": 1}, "ingress": {"num_replicas": 2}},
     "memory.max_loaded_models", "the model pool runs in the ingress"),
    ({"cache_store": {"hot_budget": "most"}}, "cache_store.hot_budget", "not a size"),
    ({"cache_store": {"ssd_write_budget_per_hour": "1 TB/h"}},
     "cache_store.ssd_write_budget_per_hour", "not a size"),
])
def test_bad_memory_keys_name_file_and_key(tmp_path, args, key, words):
    path = write(tmp_path, {"models": [TINY], **args})
    with pytest.raises(ProfileError) as info:
        load_serve_config(path)
    message = str(info.value)
    assert f"{path}: applications[0].args.{key}:" in message, message
    assert words in message, message
    assert message.count("\n") == 0, "one line per mistake"


@pytest.mark.parametrize("value, expected", [("auto", "auto"), (24_000_000_000, 24 * 10**9),
                                             ("24GB", 24 * 10**9), ("512MiB", 512 * MiB),
                                             ("1MB", 10**6)])
def test_sizes_are_bytes_or_auto(tmp_path, value, expected):
    path = write(tmp_path, {"models": [{**TINY, "pinned": True}, {**TINY, "name": "n",
                                                                  "idle_unload_s": 5.5}],
                            "memory": {"budget": value, "max_loaded_models": 1},
                            "cache_store": {"hot_budget": value,
                                            "ssd_write_budget_per_hour": value}})
    ((_, p),) = load_serve_config(path)
    assert p.memory.budget == p.cache_store.hot_budget == expected
    assert p.cache_store.ssd_write_budget_per_hour == expected
    assert p.models[0].pinned and p.models[1].idle_unload_s == 5.5


# ---- check -----------------------------------------------------------------------------


def test_the_builder_resolves_an_auto_hot_budget(home, monkeypatch):
    from serve_app.memory.planning import with_planned_hot_budget

    monkeypatch.setenv("SERVE_APP_HOME", str(home))
    p = profile([TINY], cache_store={"hot_budget": "auto"}, memory={"budget": "2GiB"})
    resolved = with_planned_hot_budget(p)
    hot = resolved.cache_store.hot_budget
    assert isinstance(hot, int) and HOT_AUTO_MIN_BYTES < hot < 2 * GiB
    assert with_planned_hot_budget(profile([TINY])) .cache_store.hot_budget == 1 * GiB


# ---- the docs' sizing table (docs/mac.md) ----------------------------------------------


def test_docs_sizing_table_is_the_plans_own():
    from serve_app.memory.sizing import sizing_table

    page = (REPO / "docs" / "mac.md").read_text()
    start = page.index("<!-- sizing-table:start -->\n") + len("<!-- sizing-table:start -->\n")
    end = page.index("<!-- sizing-table:end -->")
    assert page[start:end] == sizing_table(), (
        "docs/mac.md's sizing table is stale: paste `python -m serve_app sizing-table`")


def test_sizing_shapes_are_the_real_models():
    """The table's two models have the sizes their names promise: ~8.2B and ~26.9B
    parameters at 4.5 bits a weight, Qwen3-8B's 144 KiB of KV a token."""
    from serve_app.memory.sizing import shapes

    qwen3, qwen35 = shapes()
    assert 4.2 * GiB < qwen3.weights_bytes < 4.4 * GiB  # mlx-community's is 4.62 GB
    assert 13.5 * GiB < qwen35.weights_bytes < 14.5 * GiB
    assert qwen3.cache.kv_bytes_per_token == 36 * 2 * 8 * 128 * 2
    assert qwen35.cache.kv_bytes_per_token == 16 * 2 * 4 * 256 * 2
    assert qwen35.cache.state_bytes_per_sequence == 48 * (3 * (2 * 16 * 128 + 48 * 128) * 2
                                                          + 48 * 128 * 128 * 4)
