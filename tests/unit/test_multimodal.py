"""Images in, without a model: decoding and its refusals, prompt expansion and keys, the
multimodal positions seam (mlx-vlm's own computation), the splice table, the override."""

from __future__ import annotations

import base64

import mlx.nn as nn
import numpy as np
import pytest

from serve_app.models.compat import mrope_positions, override_call
from serve_app.multimodal.images import ImageError, ImageLimits, image_bytes, open_image
from serve_app.multimodal.processor import ProcessedImage
from serve_app.multimodal.prompt import KEY_BASE, expand_images, image_keys, keyed
from serve_app.multimodal.splice import SpliceTable
from serve_app.serving.request import ApiError, ChatCompletionRequest
from tests.support.images import data_url, image_part, png

LIMITS = ImageLimits()


def test_a_data_url_gives_its_bytes():
    assert image_bytes(data_url(1), LIMITS) == png(1)


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "does not fetch"),
    ("file:///etc/passwd", "base64 data URL"),
    ("/etc/passwd", "base64 data URL"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("data:image/png;base64,***", "not valid base64"),
    ("data:image/png;base64,", "empty"),
])
def test_bad_image_urls_are_refused_with_a_reason(url, words):
    with pytest.raises(ImageError, match=words):
        image_bytes(url, LIMITS)


def test_limits_are_checked_before_decoding():
    big = "data:image/png;base64," + base64.b64encode(b"x" * 2000).decode()
    with pytest.raises(ImageError, match="over"):
        image_bytes(big, ImageLimits(max_bytes=1000))
    with pytest.raises(ImageError, match="pixels, over the limit"):
        open_image(png(1, (100, 100)), ImageLimits(max_pixels=9999))
    with pytest.raises(ImageError, match="not an image"):
        open_image(b"not a picture at all", LIMITS)
    assert open_image(png(1, (100, 100)), LIMITS).size == (100, 100)


def _image(digest: str, tokens: int) -> ProcessedImage:
    return ProcessedImage(np.zeros((1, 1), np.float32), (1, 2, 2 * tokens), tokens, digest)


def test_placeholders_expand_and_image_tokens_are_keyed_by_content():
    a, b = _image("aa" * 32, 3), _image("bb" * 32, 2)
    tokens, spans = expand_images([1, 9, 2, 9, 3], [a, b], pad=9)
    assert tokens == [1, 9, 9, 9, 2, 9, 9, 3]
    assert [(s.start, s.end) for s in spans] == [(1, 4), (5, 7)]
    keys = keyed(tokens, spans)
    assert keys[0] == 1 and keys[4] == 2 and keys[-1] == 3
    assert all(KEY_BASE <= k < 2 ** 32 for k in keys[1:4] + keys[5:7])
    assert keys[1:4] == image_keys(a.digest, 3) and image_keys(b.digest, 3) != keys[1:4]
    assert len(set(keys[1:4])) == 3  # each place in the image has its own key
    with pytest.raises(ImageError, match="2 image placeholders for 1 images"):
        expand_images([9, 9], [a], pad=9)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen2_5_vl"])
def test_multimodal_positions_are_mlx_vlms(model_type):
    """The seam: mlx-vlm's get_rope_index of each family, unbound, for an image of 2x3
    merged tokens."""
    config = {"model_type": model_type, "vision_config": {"spatial_merge_size": 2},
              "image_token_id": 9, "vision_start_token_id": 8}
    tokens = [1, 2, 8, *[9] * 6, 7, 3, 4]
    positions, delta = mrope_positions(tokens, [(1, 4, 6)], config)
    assert positions.shape == (3, len(tokens))
    assert positions[:, :3].tolist() == [[0, 1, 2]] * 3
    assert positions[0, 3:9].tolist() == [3] * 6  # time
    assert positions[1, 3:9].tolist() == [3, 3, 3, 4, 4, 4]  # rows
    assert positions[2, 3:9].tolist() == [3, 4, 5, 3, 4, 5]  # columns
    assert positions[:, 9:].tolist() == [[6, 7, 8]] * 3  # after the image: max + 1
    assert delta == 8 - (len(tokens) - 1)


def test_the_splice_table_fits_entries_first_fit_and_frees_them():
    table = SpliceTable(vocab=100)
    pos = np.zeros((3, 4), np.int32)
    a = table.add("a", np.arange(4), pos, [])
    b = table.add("b", np.arange(3), pos[:, :3], [])
    assert (a, b) == (100, 104)
    table.remove("a")
    assert table.add("c", np.arange(2), pos[:, :2], []) == 100  # into the freed room
    ids, positions, rows, feats = table.arrays()
    assert ids.shape == (7,) and positions.shape == (3, 7) and feats is None
    table.clear()
    assert table.empty


def test_an_override_keeps_parameters_and_happens_once():
    layer = nn.Linear(2, 2)
    before = [k for k, _ in nn.utils.tree_flatten(layer.parameters())] \
        if hasattr(nn, "utils") else None
    calls = []
    override_call(layer, lambda m, call, x: calls.append(1) or call(m, x), "Seen")
    import mlx.core as mx
    layer(mx.zeros((1, 2)))
    assert calls == [1] and "weight" in layer.parameters()
    assert before is None or before == [k for k, _ in nn.utils.tree_flatten(layer.parameters())]
    with pytest.raises(RuntimeError, match="already overridden"):
        override_call(layer, lambda m, call, x: call(m, x), "Again")


def test_only_user_messages_carry_images():
    request = ChatCompletionRequest(model="m", messages=[
        {"role": "system", "content": [image_part(1)]}, {"role": "user", "content": "hi"}])
    with pytest.raises(ApiError, match="only user messages carry images"):
        request.check_supported()
    ok = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, image_part(1)]}])
    ok.check_supported()
    assert ok.messages[0].to_template()["content"] == [{"type": "text", "text": "a"},
                                                       {"type": "image"}]
    assert ok.messages[0].text() == "a"


def test_a_prefix_keyed_by_its_images_gives_them_back(tmp_path):
    """keys_of then from_keys: a next-turn prefix's keys carry its images' places."""
    from serve_app.multimodal.prompt import ImagePrompts

    prompts = ImagePrompts.__new__(ImagePrompts)  # no processor needed for keys
    prompts.pad = 9
    prompts.config = {"model_type": "qwen3_5", "vision_config": {"spatial_merge_size": 2},
                      "image_token_id": 9, "vision_start_token_id": 8}
    a, b = _image("aa" * 32, 6), _image("bb" * 32, 2)
    a = ProcessedImage(a.pixel_values, (1, 4, 6), 6, a.digest)
    b = ProcessedImage(b.pixel_values, (1, 2, 4), 2, b.digest)
    keys = prompts.keys_of([1, 8, 9, 7, 2, 8, 9, 7, 3], [a, b])
    vision = prompts.from_keys(keys, [a, b])
    assert vision.keys == keys and [s.start for s in vision.spans] == [2, 11]
    assert vision.tokens == [1, 8, *[9] * 6, 7, 2, 8, 9, 9, 7, 3]
    with pytest.raises(ImageError, match="do not match"):
        prompts.from_keys(keys, [b, a])


def test_a_vision_models_feature_cache_is_in_its_memory_plan():
    from serve_app.config.profile import ModelProfile
    from serve_app.memory.plan import footprint
    from serve_app.memory.shapes import CacheShape

    shape = CacheShape(kv_bytes_per_token=1024, state_bytes_per_sequence=0)
    model = ModelProfile(name="m", source="embedded:tiny-vl", vision={"feature_cache_mb": 64})
    seen = footprint(model, 1000, shape, vision=True)
    assert seen.vision_cache_bytes == 64 << 20
    assert seen.resident_bytes == 1000 + seen.kv_bytes + (64 << 20)
    assert "image features" in seen.describe()
    assert footprint(model, 1000, shape).vision_cache_bytes == 0  # a text checkpoint
    off = ModelProfile(name="m", source="embedded:tiny-vl", vision={"enabled": False})
    assert footprint(off, 1000, shape, vision=True).vision_cache_bytes == 0
