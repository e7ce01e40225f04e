"""The accelerators, end to end through the real cluster: speculative decoding with a draft
model (SmolLM2 as its own draft in CI: greedy output must not change), a draft with another
tokenizer refused at load, and no silent fallbacks: every feature asked for that does not
apply says so in the response, the metrics, the log and /admin."""
import json
import threading
import time
import urllib.request

import pytest

# The SDK clients, bound to this module's cluster.
from test_api import claude, config_cluster, oai, pick_port, raw_post  # noqa: F401

PROMPTS = [
    "Write a short poem about the sea.",
    "List three uses of a paperclip.",
    "Explain what a hash map is in two sentences.",
]


@pytest.fixture(scope="module")
def tiny_qwen(default_model):
    # Written by scripts/setup next to the default model: a random Qwen2 with its own
    # tokenizer, so a draft that cannot draft for SmolLM2.
    path = default_model.parent.parent / "qwen2-tiny/qwen2_tiny.gguf"
    assert path.is_file(), f"{path} missing: run scripts/setup"
    return path


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tiny_qwen, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("accel")
    port = pick_port()
    text = f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp / 'run'}"

[cache]
dir = "{tmp / 'kv'}"
ram = "64MiB"
disk = "256MiB"

[[models]]
id = "plain"
path = "{default_model}"
pinned = true
memory_budget = "2GiB"

[[models]]
id = "spec"
path = "{default_model}"
pinned = true
memory_budget = "2GiB"
draft_model = "{default_model}"
draft_tokens = 4

[[models]]
id = "q8"
path = "{default_model}"
pinned = true
memory_budget = "1GiB"
kv_cache_bits = 8

[[models]]
id = "q8b"
path = "{default_model}"
pinned = true
memory_budget = "1GiB"
kv_cache_bits = 8

[[models]]
id = "bf16"
path = "{default_model}"
memory_budget = "2GiB"
cpu_products = "bf16"

[[models]]
id = "mismatch"
path = "{default_model}"
memory_budget = "2GiB"
draft_model = "{tiny_qwen}"
"""
    with config_cluster(bin_dir, tmp, port, text) as c:
        yield c


def chat(oai, model, prompt, **extra):
    r = oai.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=48, **extra)
    return r.headers, r.parse()


def admin(cluster, path):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + path, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def admin_features(cluster, model):
    workers = {w["name"]: w for w in admin(cluster, "/admin/api/workers")["workers"]}
    return workers[f"worker-{model}"]["stats"]["features"]


def metric(cluster, name, **labels):
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_greedy_output_is_the_same_with_the_draft_and_the_draft_is_used(oai, claude):
    drafted = accepted = 0
    for prompt in PROMPTS:
        _, plain = chat(oai, "plain", prompt, extra_body={"cache_salt": "p"})
        _, spec = chat(oai, "spec", prompt, extra_body={"cache_salt": "s"})
        assert spec.choices[0].message.content == plain.choices[0].message.content
        assert spec.usage.completion_tokens == plain.usage.completion_tokens
        stats = spec.model_extra["strata_speculative"]
        assert stats["steps"] > 0 and stats["drafted_tokens"] > 0
        assert stats["batched_steps"] == 0
        drafted += stats["drafted_tokens"]
        accepted += stats["accepted_tokens"]
        assert "strata_speculative" not in (plain.model_extra or {})
        assert "strata_warnings" not in (spec.model_extra or {})
    # The draft is the target itself: (almost) every drafted token is kept.
    assert accepted >= 0.9 * drafted, (accepted, drafted)

    # The same through the Anthropic API, streamed and whole; and opting out per request.
    def text(model, **extra):
        m = claude.messages.create(model=model, max_tokens=40,
                                   messages=[{"role": "user", "content": PROMPTS[0]}],
                                   extra_body={"temperature": 0, **extra})
        return m.content[0].text, m.model_extra or {}
    spec_text, spec_extra = text("spec")
    plain_text, _ = text("plain")
    off_text, off_extra = text("spec", speculative_decoding=False)
    assert spec_text == plain_text == off_text
    assert spec_extra["strata_speculative"]["accepted_tokens"] > 0
    assert "strata_speculative" not in off_extra and "strata_warnings" not in off_extra
    with claude.messages.stream(model="spec", max_tokens=40,
                                messages=[{"role": "user", "content": PROMPTS[0]}],
                                extra_body={"temperature": 0}) as s:
        streamed = s.get_final_text()
    assert streamed == plain_text


def test_sampling_with_the_draft_runs_and_is_seeded(oai):
    # Temperature 0.8 through exact rejection sampling: same seed, same text.
    a = oai.chat.completions.create(model="spec", temperature=0.8, seed=5, max_tokens=32,
                                    messages=[{"role": "user", "content": PROMPTS[1]}])
    b = oai.chat.completions.create(model="spec", temperature=0.8, seed=5, max_tokens=32,
                                    messages=[{"role": "user", "content": PROMPTS[1]}])
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.model_extra["strata_speculative"]["drafted_tokens"] > 0
    assert a.choices[0].message.content


def test_a_feature_asked_for_and_not_applied_says_so_everywhere(cluster, oai):
    before = metric(cluster, "strata_feature_not_applied_total", model="spec",
                    feature="speculative_decoding")
    # logprobs need the target's own distribution at every token: no draft.
    headers, r = chat(oai, "spec", PROMPTS[0], logprobs=True)
    warnings = r.model_extra["strata_warnings"]
    assert warnings[0]["feature"] == "speculative_decoding"
    assert "logprobs" in warnings[0]["message"]
    assert "speculative_decoding: not applied" in headers["x-strata-warnings"]
    assert "strata_speculative" not in r.model_extra
    # Structured output: same, and the answer still follows its schema.
    _, r = chat(oai, "spec", "Give a JSON object with a name.",
                response_format={"type": "json_object"})
    assert "structured output" in r.model_extra["strata_warnings"][0]["message"]
    assert r.choices[0].message.content.startswith("{")
    # Asked for on a model without a draft.
    headers, r = chat(oai, "plain", PROMPTS[0], extra_body={"speculative_decoding": True})
    assert "no draft model" in r.model_extra["strata_warnings"][0]["message"]
    assert "x-strata-warnings" in headers
    # Streamed: the last chunk carries the warnings.
    stream = oai.chat.completions.create(model="spec", messages=[{"role": "user", "content": "hi"}],
                                         max_tokens=8, stream=True, logprobs=True)
    last = [c for c in stream][-1]
    assert last.model_extra["strata_warnings"][0]["feature"] == "speculative_decoding"
    # Counted in the metrics, per model and feature.
    after = metric(cluster, "strata_feature_not_applied_total", model="spec",
                   feature="speculative_decoding")
    assert after - before == 3
    assert metric(cluster, "strata_feature_not_applied_total", model="plain",
                  feature="speculative_decoding") >= 1
    assert metric(cluster, "strata_speculative_accepted_tokens_total", model="spec") > 0
    # The log says why at info level.
    log = cluster.log_path.read_text()
    assert "feature not applied" in log and "logprobs were asked for" in log
    # /admin shows what is on per model, and what it did so far.
    chat(oai, "spec", PROMPTS[1])
    spec_feature = admin_features(cluster, "spec")["speculative_decoding"]
    assert spec_feature.startswith("on (draft ") and "accepted" in spec_feature, spec_feature
    assert admin_features(cluster, "plain")["speculative_decoding"].startswith("off (no draft")


def test_a_request_sharing_decode_steps_says_the_draft_sat_out(cluster, oai):
    # A long stream decodes; a second request joins its batch: its steps run without the
    # draft, and its response says for how many.
    first_token = threading.Event()
    long_result = {}

    def long_stream():
        stream = oai.chat.completions.create(
            model="spec", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=160,
            stream=True, temperature=0, extra_body={"ignore_eos": True})
        chunks = []
        for c in stream:
            chunks.append(c)
            first_token.set()
        long_result["last"] = chunks[-1]

    t = threading.Thread(target=long_stream)
    t.start()
    assert first_token.wait(60)
    time.sleep(0.5)
    _, r = chat(oai, "spec", PROMPTS[0])
    t.join(120)
    warning = r.model_extra["strata_warnings"][0]
    assert warning["feature"] == "speculative_decoding"
    assert "decode steps" in warning["message"] and "batch" in warning["message"]
    assert r.model_extra["strata_speculative"]["batched_steps"] > 0
    assert "strata_warnings" in long_result["last"].model_extra


def test_a_draft_with_another_tokenizer_is_refused_at_load(cluster):
    status, _, body = raw_post(cluster, "/v1/chat/completions", {
        "model": "mismatch", "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}]})
    assert status in (500, 503), (status, body)
    assert "tokenizers differ" in body["error"]["message"], body
    # The other models serve on.
    status, _, body = raw_post(cluster, "/v1/chat/completions", {
        "model": "spec", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200


LONG = ("The lighthouse keeper wrote in his log every evening. " * 60
        + "What did the keeper do every evening?")


def cached(oai, model, salt="kvq"):
    # A salt of its own: the namespaces then hold exactly this prompt's blocks.
    r = oai.chat.completions.create(model=model, temperature=0, max_tokens=16,
                                    messages=[{"role": "user", "content": LONG}],
                                    extra_body={"cache_salt": salt})
    return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content


def test_quantised_kv_blocks_never_mix_with_full_precision_ones(cluster, oai):
    # Full-precision blocks of this prompt exist (same weights, same fingerprint)...
    cached(oai, "plain")
    assert cached(oai, "plain")[0] > 0
    # ...but the 8-bit model cannot use them: its blocks live under their own namespace.
    n, _ = cached(oai, "q8")
    assert n == 0
    # Its own blocks it reuses, and so does another 8-bit worker of the same model, through
    # the cache service (whose header checks know the scheme).
    n, text = cached(oai, "q8")
    assert n > 0 and text
    n, _ = cached(oai, "q8b")
    assert n > 0
    stats = admin(cluster, "/admin/api/cache/stats")
    spaces = {ns["namespace"]: ns for ns in stats["namespaces"]}
    quantised = [k for k in spaces if "~kv-affine-q8-g64+" in k]
    assert len(quantised) == 1, list(spaces)
    full = quantised[0].replace("~kv-affine-q8-g64", "")
    assert spaces[full]["ram"]["blocks"] == spaces[quantised[0]]["ram"]["blocks"] > 0
    # The same blocks: float32 KV in groups of 64 values takes 256 bytes a group, 8-bit 72.
    ratio = spaces[full]["ram"]["bytes"] / spaces[quantised[0]]["ram"]["bytes"]
    assert abs(ratio - 256 / 72) < 0.01, ratio
    assert "affine-q8-g64" in admin_features(cluster, "q8")["kv_quantization"]
    assert admin_features(cluster, "plain")["kv_quantization"].startswith("off")


def document(fact_at=20, sentences=70):
    filler = ["The weather was calm and the sea was quiet.",
              "Birds flew over the old harbour walls.",
              "A merchant counted coins in the market square.",
              "The bells rang twice at noon."]
    out = []
    for i in range(sentences):
        out.append(filler[(i * 7) % len(filler)])
        if i == fact_at:
            out.append("The vault code is 4821.")
    return " ".join(out) + "\n\nWhat is the vault code?"


def test_prompt_pruning_is_opt_in_reported_and_refused_when_it_cannot_apply(cluster, oai, claude):
    before = metric(cluster, "strata_pruned_prompt_tokens_total", model="spec")
    full = oai.chat.completions.create(model="spec", temperature=0, max_tokens=12,
                                       messages=[{"role": "user", "content": document()}])
    assert "strata_prompt_pruning" not in full.model_extra
    r = oai.chat.completions.with_raw_response.create(
        model="spec", temperature=0, max_tokens=12,
        messages=[{"role": "user", "content": document()}],
        extra_body={"prompt_pruning": {"keep_ratio": 0.3}, "cache_salt": "prune"})
    pruned = r.parse()
    report = pruned.model_extra["strata_prompt_pruning"]
    prompt = pruned.usage.prompt_tokens
    assert report["pruned_tokens"] + report["prefilled_tokens"] == prompt
    # 30% kept, in chunks of 32, with the first chunk and the last 64 tokens always in.
    assert 0.3 * prompt <= report["prefilled_tokens"] <= 0.3 * prompt + 32 + 64
    # The pruned prompt's KV is not the prompt's: nothing cached is used or stored for it.
    assert pruned.usage.prompt_tokens_details.cached_tokens == 0
    assert pruned.choices[0].message.content
    assert metric(cluster, "strata_pruned_prompt_tokens_total", model="spec") - before \
        == report["pruned_tokens"]
    # The Anthropic API takes it too.
    m = claude.messages.create(model="spec", max_tokens=8,
                               messages=[{"role": "user", "content": document()}],
                               extra_body={"temperature": 0,
                                           "prompt_pruning": {"keep_ratio": 0.5}})
    assert m.model_extra["strata_prompt_pruning"]["pruned_tokens"] > 0

    # Asked for where it cannot apply: said so, never silently ignored.
    _, r = chat(oai, "plain", document(), extra_body={"prompt_pruning": {"keep_ratio": 0.3}})
    w = {x["feature"]: x["message"] for x in r.model_extra["strata_warnings"]}
    assert "no draft model" in w["prompt_pruning"]
    _, r = chat(oai, "spec", "A short question?",
                extra_body={"prompt_pruning": {"keep_ratio": 0.3}})
    w = {x["feature"]: x["message"] for x in r.model_extra["strata_warnings"]}
    assert "pruning starts at 512" in w["prompt_pruning"]
    assert metric(cluster, "strata_feature_not_applied_total", model="spec",
                  feature="prompt_pruning") >= 1
    pruning_feature = admin_features(cluster, "spec")["prompt_pruning"]
    assert pruning_feature.startswith("on request") and "prompts pruned" in pruning_feature
    assert admin_features(cluster, "plain")["prompt_pruning"].startswith("off")

    # A ratio outside (0, 1] is the request's error, in each API's shape.
    for bad in (0, 1.5, "half"):
        status, _, body = raw_post(cluster, "/v1/chat/completions", {
            "model": "spec", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "prompt_pruning": {"keep_ratio": bad}})
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    status, _, body = raw_post(cluster, "/v1/messages", {
        "model": "spec", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "prompt_pruning": {"keep_ratio": 2}})
    assert status == 400 and body["type"] == "error", body


def test_a_cache_service_that_does_not_answer_is_reported_not_hidden(cluster, oai):
    import os
    import signal
    status, health = cluster.health()
    kv = {c["name"]: c for c in health["children"]}["kvcache"]
    os.kill(kv["pid"], signal.SIGSTOP)
    try:
        headers, r = chat(oai, "plain", "Tell me about lighthouses.",
                          extra_body={"cache_salt": f"stopped-{time.time()}"})
    finally:
        os.kill(kv["pid"], signal.SIGCONT)
    assert r.choices[0].message.content
    w = {x["feature"]: x["message"] for x in r.model_extra["strata_warnings"]}
    assert "did not answer the lookup" in w["prefix_cache"], w
    assert "prefix_cache: " in headers["x-strata-warnings"]
    assert metric(cluster, "strata_feature_not_applied_total", model="plain",
                  feature="prefix_cache") >= 1


def cpu_has_bf16():
    with open("/proc/cpuinfo") as f:
        return "avx512_bf16" in f.read()


def test_bf16_products_are_reported_and_their_blocks_named_apart(cluster, oai):
    # f32 blocks of this prompt exist (the worker reuses them itself)...
    cached(oai, "plain", salt="bf16")
    assert cached(oai, "plain", salt="bf16")[0] > 0
    first, text = cached(oai, "bf16", salt="bf16")
    # Loaded by that first request.
    feature = admin_features(cluster, "bf16")["cpu_products"]
    assert text.strip()
    if cpu_has_bf16():
        # ...and a worker computing chunks in bf16 does not take them: its KV differs
        # within bf16 rounding, so its blocks have a fingerprint of their own.
        assert feature.startswith("bf16"), feature
        assert first == 0
    else:
        # Not applied, and said so: the worker computes in f32 like the others.
        assert "NOT APPLIED" in feature, feature
    again, _ = cached(oai, "bf16", salt="bf16")
    assert again > 0
    # A new question after the cached prefix: a chunk of 8-48 rows, the one computed in bf16.
    r = oai.chat.completions.create(
        model="bf16", temperature=0, max_tokens=16,
        messages=[{"role": "user", "content": LONG + " Answer in one sentence, and name the "
                   "place where the keeper lived and worked every single day."}],
        extra_body={"cache_salt": "bf16"})
    new_rows = r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens
    assert 8 <= new_rows <= 48, r.usage
    assert r.choices[0].message.content.strip()
