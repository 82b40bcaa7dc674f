"""Embedded models: deterministic bytes, loadable through mlx_lm.load."""

from __future__ import annotations

import hashlib

import mlx_lm
import pytest

from serve_app.models.embedded import EMBEDDED_MODELS, SPECIAL_TOKENS, materialize


def digests(path) -> dict[str, str]:
    return {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(path.rglob("*")) if f.is_file()}


GENERATIVE = sorted(n for n, spec in EMBEDDED_MODELS.items() if not spec.encoder)
ENCODERS = sorted(n for n, spec in EMBEDDED_MODELS.items() if spec.encoder)


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_materialize_is_deterministic(tmp_path, name):
    a = materialize(name, tmp_path / "a")
    b = materialize(name, tmp_path / "b")
    assert digests(a) == digests(b)
    assert materialize(name, tmp_path / "a") == a  # built once, then reused


@pytest.mark.parametrize("name", ENCODERS)
def test_encoders_load_with_their_pooling(tmp_path, name):
    from serve_app.pooling.model import PoolingModel

    task = "rerank" if "rerank" in name else "embed"
    model = PoolingModel(materialize(name, tmp_path), task)
    assert model.encode("Hi there").ids[0] == model.tokenizer.cls_token_id
    if task == "embed":
        mode = "cls" if "xlmr" in name else "mean"
        assert (model.pooling.mode, model.pooling.normalize, model.pooling.max_length) == (
            mode, True, 128)
    else:
        assert model.net.config.num_labels == 1


@pytest.mark.parametrize("name", GENERATIVE)
def test_generative_models_load_through_mlx_lm(tmp_path, name):
    a = materialize(name, tmp_path / "a")
    model, tokenizer = mlx_lm.load(str(a))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hé"}],
                                        add_generation_prompt=True)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.decode(tokenizer.encode("héllo wörld", add_special_tokens=False)) == \
        "héllo wörld"
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    # Qwen3's special tokens: one token each, after the 256 bytes, in a fixed order.
    assert [tokenizer.encode(t, add_special_tokens=False) for t in SPECIAL_TOKENS] == \
        [[256 + i] for i in range(len(SPECIAL_TOKENS))]
    # mlx-lm reads the tool-call format and thinking from them, as for a Qwen3 checkpoint.
    assert tokenizer.has_tool_calling and tokenizer.tool_parser.__module__.endswith(".json_tools")
    assert tokenizer.tool_call_start_tokens == (tokenizer.convert_tokens_to_ids("<tool_call>"),)
    assert (tokenizer.think_start, tokenizer.think_end) == ("<think>", "</think>")


def test_hybrid_model_mixes_recurrent_and_attention_layers(tmp_path):
    from mlx_lm.models.cache import ArraysCache, KVCache

    model, _ = mlx_lm.load(str(materialize("tiny-hybrid", tmp_path)))
    kinds = {type(c) for c in model.make_cache()}
    assert kinds == {ArraysCache, KVCache}


def test_unknown_embedded_name(tmp_path):
    with pytest.raises(ValueError, match="unknown embedded model"):
        materialize("tiny-nothing", tmp_path)


def test_chat_template_is_qwen3s(tmp_path):
    """No tools: the ChatML turns as before. Thinking off: Qwen3's empty think block. An
    assistant turn after the last user turn carries its reasoning, earlier ones do not."""
    _, tokenizer = mlx_lm.load(str(materialize("tiny-dense", tmp_path)))

    def render(messages, **kwargs):
        return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)

    user = {"role": "user", "content": "hi"}
    assert render([user], add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert render([user], add_generation_prompt=True, enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    answer = {"role": "assistant", "content": "<think>\nhm\n</think>\n\nhello"}
    assert render([user, answer]) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
                                      "<think>\nhm\n</think>\n\nhello<|im_end|>\n")
    assert render([user, answer, user]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n")


def test_special_tokens_have_zero_logits(tmp_path):
    """Greedy decoding never picks one (random byte logits beat zero), so generations run to
    max_tokens: EOS and the tool-call markers come only when something forces them."""
    import mlx.core as mx

    model, tokenizer = mlx_lm.load(str(materialize("tiny-dense", tmp_path)))
    logits = model(mx.array([tokenizer.encode("hello")]))[0, -1]
    assert mx.all(logits[256:] == 0).item()
    assert logits.shape[-1] == 256 + len(SPECIAL_TOKENS)
