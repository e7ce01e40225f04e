"""`POST /v1/embeddings` through the real cluster: `strata up` with SmolLM2 and
all-MiniLM-L6-v2 side by side (one worker process each), driven by the official `openai` SDK.
Vectors are checked against sentence-transformers' own (the committed fixture written by
scripts/make_embedding_fixtures.py), as floats and as base64, and bad requests get OpenAI-shaped
errors."""
import base64
import json
import math
import pathlib
import struct
import urllib.error
import urllib.request

import openai
import pytest

from test_api import MODEL, running_cluster

EMBED = "all-minilm-l6-v2"
FIXTURE = pathlib.Path(__file__).resolve().parents[2] / \
    "services/worker/tests/fixtures/minilm_embeddings.json"


def cosine(a, b):
    dot = sum(x * y for x, y in zip(a, b))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))


@pytest.fixture(scope="module")
def reference():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, minilm_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("embed"),
                         "--embedding-model", str(minilm_model)) as c:
        yield c


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


def post(cluster, body):
    req = urllib.request.Request(cluster.url + "/v1/embeddings", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_both_models_are_listed_with_their_kind_and_state(oai):
    models = {m.id: m for m in oai.models.list().data}
    assert models[MODEL].kind == "llm"
    assert models[EMBED].kind == "embedding"
    assert models[EMBED].state == "ready"


def test_embeddings_match_sentence_transformers_in_one_request(oai, reference):
    sentences = reference["sentences"]
    assert len(sentences) >= 50
    r = oai.embeddings.create(model=EMBED, input=sentences, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(sentences)))
    worst = min(cosine(d.embedding, want)
                for d, want in zip(r.data, reference["embeddings"]))
    assert worst >= 0.9999, worst
    assert all(len(d.embedding) == 384 for d in r.data)
    # Usage counts the model's tokens, special tokens included, as the reference tokenizer.
    assert r.usage.prompt_tokens == sum(reference["token_counts"])
    assert r.usage.total_tokens == r.usage.prompt_tokens
    assert r.model == EMBED


def test_base64_is_little_endian_f32_of_the_same_vectors(cluster, reference):
    inputs = reference["sentences"][:3]
    status, floats = post(cluster, {"model": EMBED, "input": inputs})
    assert status == 200, floats
    status, b64 = post(cluster, {"model": EMBED, "input": inputs, "encoding_format": "base64"})
    assert status == 200, b64
    for f, b in zip(floats["data"], b64["data"]):
        raw = base64.b64decode(b["embedding"])
        decoded = struct.unpack(f"<{len(raw) // 4}f", raw)
        assert list(decoded) == pytest.approx(f["embedding"], abs=1e-7)


def test_the_sdk_default_encoding_decodes_to_the_reference(oai, reference):
    # The SDK asks for base64 by default and decodes it itself.
    r = oai.embeddings.create(model=EMBED, input=reference["sentences"][4])
    assert cosine(r.data[0].embedding, reference["embeddings"][4]) >= 0.9999


def test_token_id_input_and_native_dimensions(oai):
    r = oai.embeddings.create(model=EMBED, input=[[7592, 2088], [2023, 2003, 1037, 3231]],
                              dimensions=384, encoding_format="float")
    assert len(r.data) == 2
    for d in r.data:
        assert len(d.embedding) == 384
        assert math.sqrt(sum(x * x for x in d.embedding)) == pytest.approx(1.0, abs=1e-4)
    # [CLS] and [SEP] frame token ids as they frame a text.
    assert r.usage.prompt_tokens == 2 + 2 + 4 + 2


@pytest.mark.parametrize("body, words", [
    ({"input": "x", "dimensions": 128}, "384 dimensions"),
    ({"input": ""}, "empty string"),
    ({"input": []}, "must not be empty"),
    ({"input": [[-1]]}, "not a token id"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"input": " ".join(["word"] * 300)}, "at most 256"),
    ({"input": [[999999]]}, "vocabulary"),
])
def test_bad_requests_get_openai_errors(cluster, body, words):
    status, err = post(cluster, {"model": EMBED, **body})
    assert status == 400, err
    assert err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"], err


def test_each_kind_refuses_the_others_endpoint(oai):
    with pytest.raises(openai.BadRequestError, match="not an embedding model"):
        oai.embeddings.create(model=MODEL, input="hello")
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4)


def test_the_llm_still_chats_next_to_the_embedding_worker(oai, cluster):
    r = oai.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                    messages=[{"role": "user", "content": "Say hello."}])
    assert r.choices[0].message.content
    names = {c["name"] for c in cluster.health()[1]["children"]}
    assert {f"worker-{MODEL}", f"worker-{EMBED}", "kvcache"} <= names
