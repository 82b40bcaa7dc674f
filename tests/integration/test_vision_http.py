"""Images through ``serve run`` on all three APIs with the real ``openai`` and
``anthropic`` clients (issue 42): the embedded ``tiny-vl`` at temperature 0 with thinking
off gives one answer to one image whether it arrives as a chat ``image_url`` part, an
Anthropic ``image`` block or a Responses ``input_image``, streamed or not; the next turn of
the conversation restores the image's blocks; an image address the profile allows is
fetched (from a loopback site) and answers as the same image inline; after a restart the
conversation restores from SSD and answers the same; a bad image is a 400 that names the
cause and loses nothing."""

from __future__ import annotations

import base64

import anthropic
import openai
import pytest

from tests.support.clients import anthropic_client, cached, openai_client, wait_written
from tests.support.images import ImageSite, data_url, image_part, png
from tests.support.servers import serving, wait_for

MODEL = "tiny-vl"
# Image addresses are fetched from loopback only (the site below): example.com is refused.
MODELS = [{"name": MODEL, "source": "embedded:tiny-vl", "context_length": 2048,
           "max_batch_size": 4, "max_tokens": 64, "cache": {"block_size": 16},
           "vision": {"fetch_urls": True, "fetch_hosts": ["127.0.0.1"], "fetch_timeout_s": 5}}]
MODELS.append({"name": "qwen25-vl", "source": "embedded:tiny-qwen25-vl", "context_length": 2048,
               "max_batch_size": 4, "max_tokens": 64, "cache": {"block_size": 16}})
REFUSED_HOST = "only from 127.0.0.1, not from example.com"
OFF = {"chat_template_kwargs": {"enable_thinking": False}}
QUESTION = "What is in this picture?"


def question(seed: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": QUESTION},
                                         image_part(seed)]}]


def ask(client: openai.OpenAI, messages: list[dict], n: int = 12):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=n,
                                          temperature=0, extra_body=OFF)


@pytest.fixture(scope="module")
def ssd(tmp_path_factory):
    return tmp_path_factory.mktemp("vision-kv")


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_home, ssd):
    with serving(tmp_path_factory.mktemp("vision"), MODELS, model_home,
                 cache_store={"ssd_dir": str(ssd)}) as proc:
        yield proc


@pytest.fixture(scope="module")
def site():
    web = ImageSite()
    yield web
    web.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


@pytest.fixture(scope="module")
def answer(client) -> str:
    return ask(client, question()).choices[0].message.content or ""


def test_chat_streamed_and_not_agree(client, answer):
    assert answer
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=question(), max_tokens=12, temperature=0, stream=True,
        extra_body=OFF) if c.choices)
    assert streamed == answer


def test_the_next_turn_restores_the_image(client, answer):
    first = ask(client, question())
    second = ask(client, [*question(), {"role": "assistant", "content": answer},
                          {"role": "user", "content": "And its colours?"}])
    assert cached(first) > 0 and cached(second) > 0
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_anthropic_image_blocks_answer_as_chat(server, answer):
    claude: anthropic.Anthropic = anthropic_client(server)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}}
    message = claude.messages.create(model=MODEL, max_tokens=12, extra_body={"temperature": 0},
                                     messages=[
        {"role": "user", "content": [{"type": "text", "text": QUESTION}, block]}])
    assert "".join(b.text for b in message.content if b.type == "text") == answer
    with pytest.raises(anthropic.BadRequestError, match=REFUSED_HOST):
        claude.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "text", "text": "hi"}]}])


def test_image_addresses_the_profile_allows_are_fetched_on_every_api(server, client, answer,
                                                                      site):
    url = site.url("/1.png")
    chat = ask(client, [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}])
    assert chat.choices[0].message.content == answer
    claude: anthropic.Anthropic = anthropic_client(server)
    message = claude.messages.create(model=MODEL, max_tokens=12, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image", "source": {"type": "url",
                                                                         "url": url}}]}])
    assert "".join(b.text for b in message.content if b.type == "text") == answer
    response = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0,
                                       reasoning={"effort": "none"}, input=[{"role": "user",
        "content": [{"type": "input_text", "text": QUESTION},
                    {"type": "input_image", "image_url": url}]}])
    assert response.output_text == answer
    with pytest.raises(openai.BadRequestError, match="HTTP 404"):
        ask(client, [{"role": "user", "content": [
            {"type": "text", "text": "x"},
            {"type": "image_url", "image_url": {"url": site.url("/missing")}}]}])


def test_responses_input_image_answers_as_chat(client, answer):
    content = [{"type": "input_text", "text": QUESTION},
               {"type": "input_image", "image_url": data_url(1)}]
    response = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0,
                                       reasoning={"effort": "none"},
                                       input=[{"role": "user", "content": content}])
    assert response.output_text == answer
    with pytest.raises(openai.BadRequestError, match="stores no files"):
        client.responses.create(model=MODEL, max_output_tokens=4, input=[{"role": "user",
            "content": [{"type": "input_image", "file_id": "file-1"}]}])


@pytest.mark.parametrize("part, words", [
    ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}, REFUSED_HOST),
    ({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}, "base64 data URL"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}},
     "not an image"),
    ({"type": "image_url", "image_url": {"url": data_url(1), "detail": "ultra"}}, "detail"),
])
def test_a_bad_image_is_a_400_naming_it_and_the_server_goes_on(client, answer, part, words):
    with pytest.raises(openai.BadRequestError, match=words) as refused:
        ask(client, [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}])
    assert refused.value.status_code == 400
    assert ask(client, question()).choices[0].message.content == answer


def test_a_qwen25_vl_model_answers_images_and_restores_them(client):
    """The second family (Qwen2.5-VL's layout) through the same server: a repeated question
    about an image restores its blocks and answers the same."""
    def once():
        return client.chat.completions.create(model="qwen25-vl", messages=question(2),
                                              max_tokens=12, temperature=0, extra_body=OFF)
    first, again = once(), once()
    assert first.choices[0].message.content
    assert again.choices[0].message.content == first.choices[0].message.content
    assert cached(again) > 0
    assert getattr(client.models.retrieve("qwen25-vl"), "input_modalities", None) == [
        "text", "image"]


def test_the_model_says_it_takes_images(server, client):
    import httpx

    assert getattr(client.models.retrieve(MODEL), "input_modalities", None) == ["text", "image"]
    status = httpx.get(f"{server.base_url}/v1/status", timeout=60).json()["models"][MODEL]
    assert status["phase"]["input_modalities"] == ["text", "image"]
    assert status["images"]["encoded"] >= 1 and status["images"]["feature_cache_bytes"] > 0


def test_images_are_counted_by_where_their_features_came_from(server, client):
    """Through the metrics pump to the ingress's /metrics: each source counted."""
    import httpx

    ask(client, question(9))  # a new image: encoded
    ask(client, [{"role": "user", "content": [{"type": "text", "text": "Once more."},
                                             image_part(9)]}])  # other text: the feature cache

    def counts() -> dict[str, float] | None:
        out: dict[str, float] = {}
        for line in httpx.get(f"{server.base_url}/metrics", timeout=60).text.splitlines():
            if line.startswith("ray_serve_app_images_total") and f'model="{MODEL}"' in line:
                source = line.split('source="', 1)[1].split('"', 1)[0]
                out[source] = out.get(source, 0) + float(line.rsplit(" ", 1)[1])
        return out if all(out.get(s, 0) >= 1 for s in
                          ("encoded", "feature_cache", "prefix_cache")) else None

    wait_for(counts, "images counted as encoded, feature_cache and prefix_cache", 90)


def test_after_a_restart_the_image_restores_from_ssd(server, client, answer, ssd,
                                                     tmp_path, model_home):
    """The last test here: it stops the module's server (the SSD tier is what stays)."""
    ask(client, question())
    wait_written(server, MODEL)
    server.stop()
    with serving(tmp_path, MODELS, model_home, cache_store={"ssd_dir": str(ssd)}) as again:
        response = ask(openai_client(again), question())
        assert cached(response) > 0
        assert response.choices[0].message.content == answer
