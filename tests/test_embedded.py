"""Embedded models: deterministic bytes, loadable through mlx_lm.load."""

from __future__ import annotations

import hashlib

import mlx_lm
import pytest

from serve_app.embedded import EMBEDDED_MODELS, materialize


def digests(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_materialize_is_deterministic_and_loads(tmp_path, name):
    a = materialize(name, tmp_path / "a")
    b = materialize(name, tmp_path / "b")
    assert digests(a) == digests(b)
    assert materialize(name, tmp_path / "a") == a  # built once, then reused
    model, tokenizer = mlx_lm.load(str(a))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}],
                                        add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(tokenizer.encode("héllo wörld", add_special_tokens=False)) == \
        "héllo wörld"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_hybrid_model_mixes_recurrent_and_attention_layers(tmp_path):
    from mlx_lm.models.cache import ArraysCache, KVCache

    model, _ = mlx_lm.load(str(materialize("tiny-hybrid", tmp_path)))
    kinds = {type(c) for c in model.make_cache()}
    assert kinds == {ArraysCache, KVCache}


def test_unknown_embedded_name(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded model"):
        materialize("tiny-nothing", tmp_path)
