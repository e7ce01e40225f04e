"""All three model kinds at once through one gateway: SmolLM2 (llm), all-MiniLM-L6-v2
(embedding) and the tiny random-weight LLaVA of the VLM fixtures (vlm), one worker process
each, driven by the official `openai` and `anthropic` SDKs.

No real VLM weights are reachable here, so the VLM is the fixture model in the real llava-hf
layout, and its answers are checked against mlx-vlm's greedy tokens for the same PNG files
(services/worker/tests/fixtures/vlm/reference.json, written by scripts/make_vlm_fixtures.py).
Its text is noise by design (random weights); what matters is that it is mlx-vlm's noise, so
answers are compared as token ids (vLLM's `return_tokens_as_token_ids` extension): the
tokens are byte-fallback pieces whose streamed text cannot equal a whole-sequence decode.
Then the cache rule: an image's content hash is part of the block keys of its positions, so
another image never reuses them, while text blocks before the image are still shared."""
import base64
import functools
import http.server
import json
import math
import pathlib
import struct
import threading
import zlib

import anthropic
import openai
import pytest

from test_api import MODEL, config_cluster, one_model_config, pick_port, running_cluster

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "services/worker/tests/fixtures/vlm"
VLM = "tiny-llava"
EMBED = "all-minilm-l6-v2"
QUESTION = "What is shown in this image?"


@pytest.fixture(scope="module")
def reference():
    ref = json.loads((FIXTURES / "reference.json").read_text())
    return {c["image"]: c for c in ref["cases"]}


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, minilm_model, tmp_path_factory):
    # Remote images on; 127.0.0.1 (the image server below) is the one private host allowed.
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("vlm"),
                         "--embedding-model", str(minilm_model),
                         "--vlm-model", str(FIXTURES / VLM),
                         "--image-dir", str(FIXTURES), "--allow-remote-images",
                         "--private-image-host", "127.0.0.1") as c:
        yield c


class FixtureImages(http.server.SimpleHTTPRequestHandler):
    """The fixture images, plus /to-localhost: a redirect to the same server by another name."""

    def do_GET(self):
        if self.path == "/to-localhost":
            self.send_response(302)
            self.send_header("Location",
                             f"http://localhost:{self.server.server_address[1]}/image_a.png")
            self.end_headers()
            return
        super().do_GET()


@pytest.fixture(scope="module")
def image_server():
    """A local HTTP server for the fixture images (remote URLs, enabled for this cluster)."""
    handler = functools.partial(FixtureImages, directory=str(FIXTURES))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.url, api_key="x", max_retries=0)


def data_url(name):
    return "data:image/png;base64," + base64.b64encode((FIXTURES / name).read_bytes()).decode()


def image_chat(oai, url, prefix=None, salt=None, **kw):
    messages = []
    if prefix:
        messages += [{"role": "user", "content": prefix}, {"role": "assistant", "content": "ok"}]
    messages.append({"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": QUESTION},
    ]})
    extra = {"return_tokens_as_token_ids": True}
    if salt:
        extra["cache_salt"] = salt
    return oai.chat.completions.create(model=VLM, messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True, extra_body=extra, **kw)


def png_url(w, h, claim=None):
    """A black RGB PNG of w x h as a data: URL; `claim` rewrites the header's size."""
    def chunk(kind, data):
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))
    rows = b"".join(b"\0" + b"\0" * (3 * w) for _ in range(h))
    cw, ch = claim or (w, h)
    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", cw, ch, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
    return "data:image/png;base64," + base64.b64encode(png).decode()


def token_ids(logprobs):
    return [int(lp.token.removeprefix("token_id:")) for lp in logprobs]


def ids_of(r):
    return token_ids(r.choices[0].logprobs.content)


def test_all_three_kinds_serve_side_by_side(oai, reference):
    kinds = {m.id: m.model_extra["kind"] for m in oai.models.list().data}
    assert kinds == {MODEL: "llm", EMBED: "embedding", VLM: "vlm"}, kinds

    r = oai.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                    messages=[{"role": "user",
                                               "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content

    v = oai.embeddings.create(model=EMBED, input=["a red square", "a red square"]).data
    assert len(v[0].embedding) == 384
    assert math.isclose(sum(x * x for x in v[0].embedding), 1.0, rel_tol=1e-4)

    r = image_chat(oai, data_url("image_a.png"))
    assert ids_of(r) == reference["image_a.png"]["greedy_tokens"]
    assert r.usage.prompt_tokens == len(reference["image_a.png"]["input_ids"])


def test_openai_image_parts_give_mlx_vlms_tokens(oai, reference):
    # Inline data, and a file inside --image-dir, streamed.
    r = image_chat(oai, data_url("image_b.png"), salt="inline")
    assert ids_of(r) == reference["image_b.png"]["greedy_tokens"]
    assert r.choices[0].finish_reason == "length"
    stream = image_chat(oai, f"file://{FIXTURES / 'image_a.png'}", salt="file", stream=True)
    ids, text = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs:
                ids += token_ids(choice.logprobs.content)
    assert ids == reference["image_a.png"]["greedy_tokens"]
    assert text == image_chat(oai, data_url("image_a.png")).choices[0].message.content


def test_remote_images_are_fetched_when_enabled(oai, image_server, reference):
    r = image_chat(oai, f"{image_server}/image_b.png", salt="remote")
    assert ids_of(r) == reference["image_b.png"]["greedy_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        image_chat(oai, f"{image_server}/missing.png")
    assert "could not be fetched" in e.value.body["message"]


def test_remote_images_come_only_from_public_or_allowed_hosts(oai, image_server):
    def refusal(url):
        with pytest.raises(openai.BadRequestError) as e:
            image_chat(oai, url)
        return e.value.body["message"]

    port = image_server.rsplit(":", 1)[1]
    for url in (f"http://localhost:{port}/image_a.png",   # a name resolving to loopback
                f"http://[::1]:{port}/image_a.png",
                "http://169.254.169.254/latest/meta-data/iam",   # cloud metadata
                "http://10.0.0.1/image.png",
                f"{image_server}/to-localhost",          # an allowed host redirecting inward
                f"{image_server}/missing.png"):          # an internal status is not told
        message = refusal(url)
        assert "could not be fetched" in message, (url, message)
        assert "404" not in message and "refused" not in message.lower(), message


def test_anthropic_image_blocks_give_the_same_answer(claude, oai, reference):
    data = base64.b64encode((FIXTURES / "image_b.png").read_bytes()).decode()
    r = claude.messages.create(model=VLM, max_tokens=5, extra_body={"temperature": 0}, messages=[{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": data}},
            {"type": "text", "text": QUESTION},
        ]}])
    openai_answer = image_chat(oai, data_url("image_b.png"))
    assert ids_of(openai_answer) == reference["image_b.png"]["greedy_tokens"]
    assert r.content[0].text == openai_answer.choices[0].message.content
    assert r.stop_reason == "max_tokens"


def test_a_different_image_never_reuses_the_image_blocks(oai):
    # Enough text before the image for whole 256-token blocks of text only, then blocks
    # that hold the image's 16 positions. The tiny model's tokenizer spends about 35 tokens
    # on a line; the prompt ends with the image and 13 tokens after it.
    prefix = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(16))
    a, b = data_url("image_a.png"), data_url("image_b.png")
    cold_a = image_chat(oai, a, prefix, salt="keys")
    assert cold_a.usage.prompt_tokens_details.cached_tokens == 0
    image_start = cold_a.usage.prompt_tokens - 13 - 16
    text_blocks = image_start // 256 * 256
    assert text_blocks >= 256, cold_a.usage

    # The same image again: everything but the last token comes from the cache.
    warm_a = image_chat(oai, a, prefix, salt="keys")
    assert warm_a.usage.prompt_tokens_details.cached_tokens == warm_a.usage.prompt_tokens - 1
    assert ids_of(warm_a) == ids_of(cold_a)

    # Another image: the text before it is shared (to the token: the leading rows of the
    # block that holds the image), nothing from the image on.
    b_after_a = image_chat(oai, b, prefix, salt="keys")
    assert b_after_a.usage.prompt_tokens_details.cached_tokens == image_start, b_after_a.usage
    cold_b = image_chat(oai, b, prefix, salt="keys-cold-b")
    assert cold_b.usage.prompt_tokens_details.cached_tokens == 0
    assert ids_of(b_after_a) == ids_of(cold_b)
    # The answers' probabilities show that the model saw the other image (the random model
    # may still pick the same tokens after this much text).
    # Within float rounding of the cold run (the hit ends inside a block; see
    # test_prefix_cache.LOGPROB_TOLERANCE), and far from the other image's.
    probs = lambda r: [lp.logprob for lp in r.choices[0].logprobs.content]  # noqa: E731
    gap = max(abs(x - y) for x, y in zip(probs(b_after_a), probs(cold_b)))
    assert gap < 1e-3, gap
    assert probs(b_after_a) != probs(warm_a)


def test_image_errors_are_clear_in_each_apis_shape(oai, claude, cluster):
    def bad(**kw):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(max_tokens=4, **kw)
        return e.value.body["message"]

    def image_msg(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "hi"}]}]

    assert "reads text only" in bad(model=MODEL, messages=image_msg(data_url("image_a.png")))
    assert "outside the configured image folders" in bad(
        model=VLM, messages=image_msg(f"file://{ROOT / 'README.md'}"))
    assert "cannot decode the image" in bad(
        model=VLM, messages=image_msg("data:image/png;base64," +
                                      base64.b64encode(b"not a png").decode()))
    assert "base64" in bad(model=VLM, messages=image_msg("data:image/png;base64,@@@"))
    # A literal <image> in the text, with no image part, does not match the images.
    assert "image placeholders" in bad(
        model=VLM, messages=[{"role": "user", "content": "look: <image>"}])
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=VLM, input="hi")

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=VLM, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "%%%"}}]}])
    assert e.value.body["type"] == "error"
    assert "base64" in e.value.body["error"]["message"]
    # Decompression bombs and slivers are refused from their header, before any decode or
    # resize (a 1 x 20000 PNG once made the resize allocate gigabytes); image counts bounded.
    assert "at most 50000000 pixels" in bad(
        model=VLM, messages=image_msg(png_url(1, 1, claim=(100_000, 100_000))))
    assert "50-fold" in bad(model=VLM, messages=image_msg(png_url(1, 20_000)))
    many = [{"type": "image_url", "image_url": {"url": data_url("image_a.png")}}] * 17
    assert "at most 16" in bad(model=VLM, messages=[{"role": "user", "content": many}])
    # Every process is still up.
    status, health = cluster.health()
    assert status == 200, health


def test_decoding_an_image_is_counted_in_memory_admission(bin_dir, tmp_path):
    # A 560 MiB budget leaves about 280 MiB next to the model. A 7000 x 7000 PNG (150 KB on
    # the wire, 49 megapixels: under the pixel cap) needs ~330 MiB to decode and resize: it
    # is refused from its header with the numbers, before anything is decoded. The fixture
    # image, and the worker, are fine after it.
    port = pick_port()
    text = one_model_config(tmp_path, port, VLM, FIXTURES / VLM,
                            model='kind = "vlm"\nmemory_budget = "560MiB"')
    with config_cluster(bin_dir, tmp_path, port, text) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        pid = c.health()[1]["children"][-1]["pid"]

        def ask(url):
            return oai.chat.completions.create(
                model=VLM, max_tokens=4, temperature=0,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "hi"}]}])
        with pytest.raises(openai.APIStatusError) as e:
            ask(png_url(7000, 7000))
        assert e.value.status_code == 413, e.value
        message = str(e.value.body)
        assert "image 1 needs about" in message and "to decode" in message, message
        assert e.value.body.get("code") == "memory_budget_exceeded", e.value.body
        assert ask(data_url("image_a.png")).choices[0].message.content is not None
        assert c.health()[1]["children"][-1]["pid"] == pid
