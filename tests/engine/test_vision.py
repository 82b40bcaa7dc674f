"""Images through the engine on the embedded tiny-vl (Qwen3.5's vision tower over the tiny
hybrid stack) and tiny-qwen25-vl (Qwen2.5-VL's over a dense one) in every weight format: a
request restored from the prefix cache gives the cold prefill's tokens, another image at the
same place misses, a repeated image skips the encoder, and the tokens are mlx-vlm's own
model's."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from serve_app.config.catalog import FORMATS, variant_name
from serve_app.models.embedded import materialize
from serve_app.serving.events import Delta, Finish
from serve_app.serving.request import ChatCompletionRequest
from tests.support.engine import BS, make_services, run
from tests.support.images import data_url, image_part

OFF = {"enable_thinking": False}


def ask(service, messages, n: int = 12) -> dict:
    """``tests.support.engine.run`` of a greedy chat with thinking off."""
    return run(service, ChatCompletionRequest(model="m", messages=messages, max_tokens=n,
                                              temperature=0, chat_template_kwargs=OFF))


def user(seed: int, text: str = "What is in this picture?") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, image_part(seed)]}


# Qwen3.5's vision tower over its hybrid text stack, and Qwen2.5-VL's over a dense one.
FAMILIES = ("tiny-vl", "tiny-qwen25-vl")


@pytest.fixture(scope="module", params=[(m, f) for m in FAMILIES for f in FORMATS],
                ids=lambda p: variant_name(*p))
def services(request, tmp_path_factory):
    warm, cold, _ = make_services(variant_name(*request.param), tmp_path_factory.mktemp("vl"))
    yield warm, cold
    warm.shutdown()
    cold.shutdown()


def test_restored_image_conversations_match_cold(services):
    warm, cold = services
    first = [user(1)]
    answer = ask(cold, first)["text"]
    assert ask(warm, first)["text"] == answer  # cold in the warm service, captured
    again = ask(warm, first)
    assert again["text"] == answer and again["cached"] > 0
    # the next turn: the same image in history, a new question
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And its colours?"}]
    expected = ask(cold, second)
    got = ask(warm, second)
    assert got["text"] == expected["text"]
    image = warm.prepare(ChatCompletionRequest(model="m", messages=second,
                                               chat_template_kwargs=OFF)).vision.spans[0]
    assert got["cached"] >= image.end - BS  # the image's blocks restored
    assert expected["cached"] == 0


def test_another_image_at_the_same_place_misses(services):
    warm, cold = services
    ask(warm, [user(3)])
    prepared = warm.prepare(ChatCompletionRequest(model="m", messages=[user(4)],
                                                  chat_template_kwargs=OFF))
    start = prepared.vision.first_image
    got = ask(warm, [user(4)])
    assert got["cached"] <= start  # nothing past the image's first token
    assert got["text"] == ask(cold, [user(4)])["text"]


def test_a_repeated_image_skips_the_encoder(services):
    warm, _ = services
    stats = warm.engine.vision.stats
    ask(warm, [user(5)])
    encoded = stats.images
    ask(warm, [user(5, "Describe it in one word.")])  # other text, the same image
    assert stats.images == encoded and stats.cache_hits >= 1


def test_text_requests_beside_image_requests_are_unchanged(services):
    """A text row's numerics do not depend on image rows in its batch."""
    _, cold = services
    text = [{"role": "user", "content": "Count to five."}]
    alone = ask(cold, text, n=16)["text"]

    async def both():
        async def one(messages):
            out = []
            request = ChatCompletionRequest(model="m", messages=messages, max_tokens=16,
                                            temperature=0, chat_template_kwargs=OFF)
            async for events in cold.stream(cold.prepare(request)):
                out += [e.text for e in events if isinstance(e, Delta)]
            return "".join(out)
        return await asyncio.gather(one(text), one([user(6)]))

    assert asyncio.run(both())[0] == alone


@pytest.mark.parametrize("images", [[(7, (90, 70))], [(100, (128, 128))],
                                    [(7, (64, 128)), (8, (128, 96))]],
                         ids=["non-square", "square", "two-images"])
@pytest.mark.parametrize("name", FAMILIES)
def test_the_tokens_are_mlx_vlms_own(tmp_path, name, images):
    """The independent check: mlx-vlm's own model (Qwen3.5's, Qwen2.5-VL's), loaded from the
    same directory, greedy over its own embeddings and positions, gives the engine's tokens
    (non-square, square and several images: the rotary delta differs in each)."""
    from mlx_vlm.utils import load_model

    warm, cold, _ = make_services(name, tmp_path)
    try:
        content = [{"type": "text", "text": "Describe this picture."}]
        content += [{"type": "image_url", "image_url": {"url": data_url(seed, size)}}
                    for seed, size in images]
        request = ChatCompletionRequest(model="m", messages=[{"role": "user",
                                                              "content": content}],
                                        max_tokens=16, temperature=0, chat_template_kwargs=OFF)
        prepared = cold.prepare(request)
        vision = prepared.vision
        ours: list[int] = []

        async def go():
            async for events in cold.stream(prepared):
                ours.extend(e for e in events if isinstance(e, Delta))
        asyncio.run(go())
        model = load_model(materialize(name, tmp_path))
        ids = mx.array([vision.tokens])
        processed = [s.image for s in vision.spans]
        embedded = model.get_input_embeddings(
            ids, mx.array(np.concatenate([i.pixel_values for i in processed])),
            image_grid_thw=mx.array([i.grid for i in processed]))
        cache = make_prompt_cache(model.language_model)  # its own make_cache where it has one
        out = model.language_model(ids, inputs_embeds=embedded.inputs_embeds, cache=cache,
                                   position_ids=embedded.position_ids,
                                   rope_deltas=embedded.rope_deltas)  # kept for decode
        tokens = []
        for _ in range(16):
            y = mx.argmax(out.logits[:, -1, :], axis=-1)
            tokens.append(int(y.item()))
            out = model.language_model(y[None], cache=cache)
        detokenizer = cold.tokenizer.detokenizer  # as the server streams its text
        detokenizer.reset()
        for t in tokens:
            if t not in cold.eos_ids:
                detokenizer.add_token(t)
        detokenizer.finalize()
        text = detokenizer.text
        assert "".join(e.text for e in ours) == text
    finally:
        warm.shutdown()
        cold.shutdown()


def test_bad_images_and_text_models_get_a_400(services, tmp_path):
    from serve_app.serving.request import ApiError

    warm, _ = services
    bad = [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]
    with pytest.raises(ApiError) as refused:
        warm.prepare(ChatCompletionRequest(model="m", messages=bad))
    assert refused.value.status == 400 and refused.value.code == "invalid_image"
    text_only, cold, _ = make_services("tiny-dense", tmp_path)
    try:
        with pytest.raises(ApiError) as refused:
            text_only.prepare(ChatCompletionRequest(model="m", messages=[user(1)]))
        assert refused.value.status == 400 and refused.value.code == "images_not_supported"
    finally:
        text_only.shutdown()
        cold.shutdown()


def test_the_next_turn_is_prefilled_ahead_with_its_image(tmp_path):
    """Qwen3.5's template renders an earlier answer without the turn's (empty) thought
    block, so the next turn's prompt departs from what was generated at the answer's
    start: after each turn the service prefills the next turn's prefix, its image keyed
    as the next request keys it, so the next turn restores all of its history."""
    warm, cold, _ = make_services("tiny-vl", tmp_path)
    try:
        first = [user(11)]

        async def turn(messages):
            request = ChatCompletionRequest(model="m", messages=messages, max_tokens=12,
                                            temperature=0, chat_template_kwargs=OFF)
            prepared = warm.prepare(request)
            text, finish = [], None
            async for events in warm.stream(prepared):
                for e in events:
                    if isinstance(e, Delta):
                        text.append(e.text)
                    elif isinstance(e, Finish):
                        finish = e
            await warm.ahead.idle()
            return "".join(text), finish, prepared

        async def go():
            answer, _, _ = await turn(first)
            second = [*first, {"role": "assistant", "content": answer},
                      {"role": "user", "content": "And its colours?"}]
            return second, await turn(second)

        second, (got, finish, prepared) = asyncio.run(go())
        assert warm.thinking.ahead["done"] >= 1
        assert got == ask(cold, second)["text"]
        # everything but the new user message and the generation prompt
        new = len(warm.tokenizer.encode("And its colours?<|im_end|>\n<|im_start|>assistant\n"
                                        "<think>\n\n</think>\n\n", add_special_tokens=False))
        assert finish.cached_tokens >= len(prepared.prompt) - new - BS
    finally:
        warm.shutdown()
        cold.shutdown()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_after_a_restart_an_image_conversation_restores_from_ssd(family, fmt, model_home,
                                                                 tmp_path):
    """One 'process lifetime' captures the conversation to SSD (blocks and the hybrid's
    recurrent-state sidecars); the next, with an empty hot tier, restores the image's
    blocks from the files and answers as a cold prefill does."""
    from serve_app.serving.request import ChatCompletionRequest as Chat
    from tests.support.formats import Server

    name = variant_name(family, fmt)
    request = Chat(model="m", messages=[user(13)], max_tokens=10, temperature=0,
                   chat_template_kwargs=OFF)
    first = Server(name, model_home, tmp_path)
    expected = run(first.cold, request)["text"]
    assert run(first.service, request)["text"] == expected
    first.drain()
    first.close()
    again = Server(name, model_home, tmp_path)
    try:
        restored = run(again.service, request)
        image = again.service.prepare(request).vision.spans[0]
        assert restored["cached"] >= image.end and restored["text"] == expected
        assert again.service.cache_stats.hit_tokens_by_tier == {"ssd": restored["cached"]}
    finally:
        again.close()
