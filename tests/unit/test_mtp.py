"""Loading a model's own MTP head (``serve_app/models/mtp.py``) from its checkpoint."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx_lm
import pytest

from serve_app.models.embedded import materialize
from serve_app.models.mtp import MTPUnavailable, load_mtp_head, mtp_problem, sanitize


def test_sanitize_stacks_experts_and_shifts_zero_centred_norms():
    weights = {
        **{f"layers.0.mlp.experts.{e}.up_proj.weight": mx.full((2, 3), e) for e in range(3)},
        "norm.weight": mx.zeros((4,)),
        "layers.0.input_layernorm.weight": mx.zeros((4,)),
        "fc.weight": mx.zeros((4, 8)),
    }
    out = sanitize(weights, hf_layout=True, num_experts=3)
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"].shape == (3, 2, 3)
    assert out["layers.0.mlp.switch_mlp.up_proj.weight"][2, 0, 0].item() == 2
    assert not any(".experts." in k for k in out)
    assert out["norm.weight"].tolist() == [1.0] * 4
    assert out["layers.0.input_layernorm.weight"].tolist() == [1.0] * 4
    assert out["fc.weight"].sum().item() == 0  # not a norm: untouched
    assert sanitize({"norm.weight": mx.ones((2,))}, False, 0)["norm.weight"].tolist() == [1, 1]


def test_the_embedded_checkpoint_is_in_hugging_faces_layout(tmp_path):
    """Qwen3.5 names, GDN conv axes and zero-centred norms on disk, as mlx-lm's sanitize
    expects them, and the head's norms read back at one."""
    path = materialize("tiny-hybrid-mtp", tmp_path)
    on_disk = mx.load(str(path / "model.safetensors"))
    assert "model.language_model.embed_tokens.weight" in on_disk and "lm_head.weight" in on_disk
    assert "mtp.fc.weight" in on_disk and "mtp.layers.0.self_attn.q_proj.weight" in on_disk
    conv = next(v for k, v in on_disk.items() if k.endswith("conv1d.weight"))
    assert conv.shape[1] == 1  # Hugging Face's (channels, 1, kernel)
    assert on_disk["mtp.norm.weight"].sum().item() == 0
    model, _ = mlx_lm.load(str(path))
    head, parts = load_mtp_head(model, path)
    assert head.norm.weight.tolist() == [1.0] * parts.args.hidden_size
    assert parts.inner.norm.weight.tolist() == [1.0] * parts.args.hidden_size
    assert mtp_problem(path) is None


def test_a_full_precision_head_is_quantized_like_a_quantized_trunk(tmp_path):
    """A 4-bit trunk beside full-precision ``mtp.*`` weights: the head is quantized with
    the trunk's group size and bits when it loads."""
    q4 = materialize("tiny-hybrid-mtp-q4", tmp_path)
    bf16 = materialize("tiny-hybrid-mtp-bf16", tmp_path)
    mixed = tmp_path / "mixed"
    shutil.copytree(q4, mixed)
    trunk = {k: v for k, v in mx.load(str(q4 / "model.safetensors")).items()
             if not k.startswith("mtp.")}
    head = {k: v for k, v in mx.load(str(bf16 / "model.safetensors")).items()
            if k.startswith("mtp.")}
    mx.save_safetensors(str(mixed / "model.safetensors"), {**trunk, **head},
                        metadata={"format": "mlx"})
    (mixed / "model.safetensors.index.json").unlink(missing_ok=True)
    model, _ = mlx_lm.load(str(mixed))
    loaded, _ = load_mtp_head(model, mixed)
    group = json.loads((q4 / "config.json").read_text())["quantization"]["group_size"]
    assert type(loaded.fc).__name__ == "QuantizedLinear"
    assert (loaded.fc.bits, loaded.fc.group_size) == (4, group)
    stored, _ = load_mtp_head(model, q4)  # quantized on disk: the same weights
    assert mx.array_equal(loaded.fc.weight, stored.fc.weight).item()


def test_a_checkpoint_without_an_mtp_head_is_refused_with_the_reason(tmp_path):
    path = materialize("tiny-hybrid", tmp_path)
    assert "no mtp.* weights" in (mtp_problem(path) or "")
    model, _ = mlx_lm.load(str(path))
    with pytest.raises(MTPUnavailable, match="no mtp"):
        load_mtp_head(model, path)
    assert "model type 'qwen3'" in (mtp_problem(materialize("tiny-dense", tmp_path)) or "")
