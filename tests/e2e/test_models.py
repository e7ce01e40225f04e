"""Model management on real worker processes: a memory budget for all workers together, load
on first request, LRU unload of unpinned models to make room, pinning, the admin load/unload
endpoints, and the idle TTL. Budgets are set per model in the config, so the accounting is
exact; the models are SmolLM2 (twice, as two ids: two workers of one file) and MiniLM."""
import hashlib
import json
import os
import pathlib
import time
import urllib.error
import urllib.request

import openai
import pytest

from test_api import MODEL, config_cluster, one_model_config, pick_port, running_cluster


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, minilm_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("models")
    port = pick_port()
    # 2 GiB for everything: the pinned embedding model (512 MiB) plus one SmolLM2 (1 GiB)
    # and the small TTL model (256 MiB), but never both SmolLM2s.
    text = f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp / 'run'}"
models_memory_budget = "2GiB"

[cache]
dir = "{tmp / 'kv'}"
ram = "64MiB"
disk = "256MiB"

[[models]]
id = "emb"
path = "{minilm_model}"
kind = "embedding"
pinned = true
memory_budget = "512MiB"

[[models]]
id = "a"
path = "{default_model}"
memory_budget = "1GiB"

[[models]]
id = "b"
path = "{default_model}"
memory_budget = "1GiB"

[[models]]
id = "ttl"
path = "{minilm_model}"
kind = "embedding"
memory_budget = "256MiB"
idle_ttl_secs = 2
"""
    with config_cluster(bin_dir, tmp, port, text) as c:
        yield c


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)


def admin(cluster, path):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + path, data=b"{}", method="POST",
                                 headers={"authorization": f"Bearer {token}",
                                          "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.load(r)


def states(oai):
    return {m.id: m.state for m in oai.models.list().data}


def pids(cluster):
    return {c["name"]: c["pid"] for c in cluster.health()[1]["children"]}


def alive(pid):
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def chat(oai, model):
    return oai.chat.completions.create(model=model, max_tokens=2, temperature=0,
                                       messages=[{"role": "user", "content": "Hi"}])


def test_only_pinned_models_start_loaded(oai):
    assert states(oai) == {"emb": "ready", "a": "unloaded", "b": "unloaded", "ttl": "unloaded"}


def test_lru_pinning_and_admin_actions_on_real_processes(oai, cluster):
    # First request loads the model, and waits for it.
    assert chat(oai, "a").choices[0].message.content is not None
    assert states(oai)["a"] == "ready"
    pid_a = pids(cluster)["worker-a"]

    # b does not fit next to a: a (least recently used, unpinned, idle) is unloaded.
    chat(oai, "b")
    s = states(oai)
    assert (s["a"], s["b"], s["emb"]) == ("unloaded", "ready", "ready")
    assert not alive(pid_a), "a's worker process must be gone"

    # Pinned b cannot make room: a is refused with a 503 that says why.
    assert admin(cluster, "/admin/api/models/b/pin")["pinned"] is True
    with pytest.raises(openai.APIStatusError) as e:
        chat(oai, "a")
    assert e.value.status_code == 503
    assert "pinned" in str(e.value) and "memory budget" in str(e.value)
    assert states(oai)["b"] == "ready"

    # Unpinned, it is the LRU victim again; the admin load acts like a request.
    admin(cluster, "/admin/api/models/b/unpin")
    r = admin(cluster, "/admin/api/models/a/load")
    assert r["changed"] is True and r["loaded"] is True
    deadline = time.monotonic() + 120
    while states(oai)["a"] != "ready" and time.monotonic() < deadline:
        time.sleep(0.2)
    s = states(oai)
    assert (s["a"], s["b"]) == ("ready", "unloaded")

    # The pinned model refuses to be unloaded; an unpinned one goes.
    with pytest.raises(urllib.error.HTTPError) as e:
        admin(cluster, "/admin/api/models/emb/unload")
    assert e.value.code == 400
    assert admin(cluster, "/admin/api/models/a/unload")["changed"] is True
    assert states(oai)["a"] == "unloaded"


def test_an_idle_model_is_unloaded_after_its_ttl(oai, cluster):
    r = oai.embeddings.create(model="ttl", input="hello", encoding_format="float")
    assert len(r.data[0].embedding) == 384
    assert states(oai)["ttl"] == "ready"
    pid = pids(cluster)["worker-ttl"]
    deadline = time.monotonic() + 20
    while states(oai)["ttl"] != "unloaded" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert states(oai)["ttl"] == "unloaded"
    # The model reads as unloaded once its worker was told to stop; the process then exits
    # within the stop grace (SIGTERM, then SIGKILL).
    deadline = time.monotonic() + 15
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pid)
    # And it comes back on the next request.
    r = oai.embeddings.create(model="ttl", input="hello again", encoding_format="float")
    assert len(r.data[0].embedding) == 384


def test_model_dir_discovery_offers_each_model_under_a_stable_id(bin_dir, default_model,
                                                                 minilm_model, tmp_path):
    # A folder laid out as users keep models: a GGUF file, an org/name safetensors folder.
    models = tmp_path / "models"
    (models / "sentence-transformers").mkdir(parents=True)
    (models / "sentence-transformers" / "all-MiniLM-L6-v2").symlink_to(minilm_model)
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").symlink_to(default_model)
    (tmp_path / "c").mkdir()
    with running_cluster(bin_dir, default_model, tmp_path / "c", "--model-dir", str(models)) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        listed = {m.id: (m.kind, m.state) for m in client.models.list().data}
        assert listed["sentence-transformers/all-MiniLM-L6-v2"] == ("embedding", "unloaded")
        assert listed["SmolLM2-135M-Instruct.Q4_1"] == ("llm", "unloaded")
        # Offered means served: the first request loads it.
        r = client.embeddings.create(model="sentence-transformers/all-MiniLM-L6-v2",
                                     input="hello", encoding_format="float")
        assert len(r.data[0].embedding) == 384


def _hub_cache_entry(hub, repo, rev, source):
    """`source`'s files as huggingface_hub caches them: blobs named by hash, a snapshot of
    relative symlinks into them, refs/main naming the revision."""
    entry = hub / ("models--" + repo.replace("/", "--"))
    (entry / "blobs").mkdir(parents=True)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(rev)
    snapshot = entry / "snapshots" / rev
    snapshot.mkdir(parents=True)
    for f in sorted(source.iterdir()):
        if f.is_file():
            blob = entry / "blobs" / hashlib.sha256(f.name.encode()).hexdigest()
            blob.symlink_to(f.resolve())
            (snapshot / f.name).symlink_to(pathlib.Path("../../blobs") / blob.name)


def _ollama_store(store, name, tag, gguf):
    """`gguf` as Ollama keeps a pulled model: a sha256-named blob and a manifest naming it."""
    (store / "blobs").mkdir(parents=True)
    digest = hashlib.sha256(gguf.name.encode()).hexdigest()
    (store / "blobs" / f"sha256-{digest}").symlink_to(gguf.resolve())
    manifest = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": "sha256:" + "0" * 64, "size": 2},
        "layers": [{"mediaType": "application/vnd.ollama.image.model",
                    "digest": f"sha256:{digest}", "size": gguf.stat().st_size}],
    }))


def test_discover_serves_models_from_the_hugging_face_cache_and_ollamas_store(
        bin_dir, default_model, tmp_path, monkeypatch):
    # SmolLM2's f32 folder in a hub cache, its GGUF in an Ollama store, where `--discover`
    # looks for them (the tools' own environment variables).
    f32 = default_model.parent.parent / "smollm2-135m-instruct-f32"
    hub, store = tmp_path / "hub", tmp_path / "ollama"
    _hub_cache_entry(hub, "HuggingFaceTB/SmolLM2-135M-Instruct", "a" * 40, f32)
    _ollama_store(store, "smollm2", "135m", default_model)
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("OLLAMA_MODELS", str(store))
    (tmp_path / "c").mkdir()
    with running_cluster(bin_dir, default_model, tmp_path / "c", "--discover") as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        listed = {m.id: (m.kind, m.state) for m in client.models.list().data}
        assert listed["HuggingFaceTB/SmolLM2-135M-Instruct"] == ("llm", "unloaded")
        assert listed["smollm2:135m"] == ("llm", "unloaded")
        ask = [{"role": "user", "content": "Name a colour."}]
        answers = {}
        for model in ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2:135m", MODEL]:
            r = client.chat.completions.create(model=model, messages=ask, max_tokens=8,
                                               temperature=0)
            assert r.usage.completion_tokens > 0, model
            answers[model] = r.choices[0].message.content
        # The Ollama blob is the default model's file, extensionless: the same answer.
        assert answers["smollm2:135m"] == answers[MODEL]
        assert answers["HuggingFaceTB/SmolLM2-135M-Instruct"]


QUANTS_DIR = pathlib.Path(__file__).resolve().parents[2] / "services/worker/tests/fixtures/qwen2_quants"


def test_a_gguf_of_k_quants_and_every_other_block_type_is_served(bin_dir, tmp_path):
    """The tiny Qwen2 whose matrices use every GGUF block type Strata reads (K-quants, Q5_0,
    Q5_1, IQ4_NL, IQ4_XS, ...; MLX cannot open it) answers through the real cluster with the
    tokens of the independent numpy reference, and a second request reuses its cached KV."""
    reference = json.loads((QUANTS_DIR / "reference.json").read_text())
    port = pick_port()
    with config_cluster(bin_dir, tmp_path, port, one_model_config(
            tmp_path, port, "kquants", QUANTS_DIR / "qwen2_quants.gguf")) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        for case in reference["cases"]:
            margins = case["greedy_top1_top2_margin"]
            # Up to the reference's first near-tie, where summation order may pick either.
            safe = next((i for i, m in enumerate(margins) if m < 0.02), len(margins))
            assert safe >= 5
            answers = []
            for _ in range(2):
                r = client.completions.create(model="kquants", prompt=case["input_ids"],
                                              temperature=0, max_tokens=safe, logprobs=1,
                                              extra_body=extra)
                answers.append(([int(t.removeprefix("token_id:"))
                                 for t in r.choices[0].logprobs.tokens],
                                r.usage.prompt_tokens_details.cached_tokens))
            (cold, _), (warm, cached) = answers
            assert cold == case["greedy_ids"][:safe]
            assert warm == cold
            assert cached > 0, case["input_ids"]
    log = (tmp_path / "strata.log").read_text(errors="replace")
    assert "expanded to f32 at load" in log and "Q4_K" in log


FAMILIES_DIR = (pathlib.Path(__file__).resolve().parents[2]
                / "services/worker/tests/fixtures/families")


@pytest.mark.parametrize("family", ["gemma3", "qwen3_moe", "ministral3", "gemma3_gguf",
                                    "qwen3_5", "qwen3_5_moe", "qwen3_next", "gpt_oss",
                                    "gpt_oss_mxfp4"])
def test_new_families_are_served_and_cached_across_restarts(bin_dir, tmp_path, family):
    """The random-weight fixtures of the families added in round 2, served by the real
    cluster: Gemma 3 (five windowed layers of 16 tokens to each global one; also as llama.cpp
    converts it to GGUF), Qwen3-MoE (2 of 8 experts per token), Ministral 3 (YaRN, query
    scaling past 32 positions), the hybrid Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers
    whose recurrent states travel in each block's snapshot; Qwen3-Next, their layers with
    the projections fused as published), gpt-oss (windows of 8 tokens
    between full layers, attention sinks, experts with biases; also with its experts in MXFP4
    as OpenAI publishes them). mlx-lm's greedy tokens for
    prompts of 7, 33 and 130 tokens, the same answer again from the cache (L0/L1), and after a
    restart of every process from the disk tier (L2)."""
    reference_family = family.removesuffix("_gguf")
    file = ("hybrid_reference.json" if family.startswith("qwen3_5")
            else "gpt_oss_reference.json" if family.startswith("gpt_oss")
            else "qwen3_next_reference.json" if family == "qwen3_next" else "reference.json")
    reference = json.loads((FAMILIES_DIR / file).read_text())
    reference = reference["families"][reference_family]
    path = FAMILIES_DIR / family
    if family.endswith("_gguf"):
        path = path / f"{reference_family}.gguf"
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def ask(client, case):
        r = client.completions.create(model=family, prompt=case["input_ids"], temperature=0,
                                      max_tokens=len(case["greedy_ids"]), logprobs=1,
                                      extra_body=extra)
        tokens = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
        return tokens, r.usage.prompt_tokens_details.cached_tokens

    port = pick_port()
    config = one_model_config(tmp_path, port, family, path)
    for restart in range(2):
        with config_cluster(bin_dir, tmp_path, port, config) as c:
            client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
            for case in reference["cases"]:
                # Margins of 1.5e-3 and up, against logit differences of ~1e-5.
                assert min(case["greedy_margins"]) > 0.001
                tokens, cached = ask(client, case)
                assert tokens == case["greedy_ids"], (restart, len(case["input_ids"]))
                if restart == 0:
                    tokens, cached = ask(client, case)
                    assert tokens == case["greedy_ids"]
                # Everything but the last prompt token, from the cache (after the restart:
                # from the disk tier, the process that stored it gone).
                assert cached == len(case["input_ids"]) - 1, (restart, cached)
    if family == "gpt_oss_mxfp4":
        # A CPU computes in f32: the expansion of the packed experts is said, not silent.
        log = (tmp_path / "strata.log").read_text(errors="replace")
        assert "OpenAI's MXFP4 experts" in log and "expanded to dense weights" in log


def test_a_hybrid_model_resumes_a_new_question_at_the_end_of_the_shared_system_prompt(
        bin_dir, tmp_path):
    """Qwen3.5's recurrent states cannot be cut at any token: the worker stores a partial
    block where the system message ends (inside a block), so a second conversation with the
    same system prompt and another question resumes exactly there, through the real chat
    API, and again after a restart from the disk tier. The fixture's stand-in tokenizer makes
    one token of each word: the system message is `<|im_start|>`, `system`, 60 words and
    `<|im_end|>`, 63 tokens."""
    words = [f"t{i % 200 + 5}" for i in range(60)]
    system = {"role": "system", "content": " ".join(words)}

    def ask(client, question):
        r = client.chat.completions.create(
            model="qwen3_5", temperature=0, max_tokens=3,
            messages=[system, {"role": "user", "content": question}],
            extra_body={"ignore_eos": True})
        return r.usage.prompt_tokens_details.cached_tokens

    port = pick_port()
    config = one_model_config(tmp_path, port, "qwen3_5", FAMILIES_DIR / "qwen3_5")
    with config_cluster(bin_dir, tmp_path, port, config) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        assert ask(client, "t7 t8 t9") == 0
        assert ask(client, "t30 t31 t32 t33") == 63
    with config_cluster(bin_dir, tmp_path, port, config) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        assert ask(client, "t50 t51") == 63


def test_a_hybrid_model_resumes_a_branch_at_any_earlier_message_end(bin_dir, tmp_path):
    """Every message end of a chat is a resume point (the last one of each block, so that a
    long chat's snapshots stay one per block at most): a second conversation that shares the
    first one up to its third message (neither its first message nor the one before its last)
    resumes exactly there, and so does a third after a restart, from the disk tier. One
    token per word, 3 per message for `<|im_start|>`, the role and `<|im_end|>`."""
    def words(start, n):
        return " ".join(f"t{(start + i) % 200 + 5}" for i in range(n))

    head = [{"role": "system", "content": words(0, 60)},
            {"role": "user", "content": words(10, 300)},
            {"role": "assistant", "content": words(20, 300)}]
    first = head + [{"role": "user", "content": words(30, 300)},
                    {"role": "assistant", "content": words(40, 20)},
                    {"role": "user", "content": words(50, 10)}]
    shared = 63 + 303 + 303

    def answer(client, messages, salt=None):
        extra = {"ignore_eos": True}
        if salt:
            extra["cache_salt"] = salt
        r = client.chat.completions.create(
            model="qwen3_5", temperature=0, max_tokens=4, messages=messages, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    def ask(client, messages):
        return answer(client, messages)[0]

    port = pick_port()
    config = one_model_config(tmp_path, port, "qwen3_5", FAMILIES_DIR / "qwen3_5")
    with config_cluster(bin_dir, tmp_path, port, config) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        assert ask(client, first) == 0
        assert ask(client, head + [{"role": "user", "content": words(60, 12)}]) == shared
    with config_cluster(bin_dir, tmp_path, port, config) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        branch = head + [{"role": "user", "content": words(70, 5)}]
        cached, text = answer(client, branch)
        assert cached == shared
        # The disk tier gave its 2 whole blocks' K/V without their recurrent snapshots (the
        # hit resumes from the message end's snapshot only), and the answer is a cold run's
        # (another cache salt: nothing cached).
        token = (tmp_path / "run" / "admin-token").read_text().strip()
        req = urllib.request.Request(c.url + "/admin/api/workers",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            workers = {w["name"]: w for w in json.load(r)["workers"]}
        stats = workers["worker-qwen3_5"]["stats"]["prefix_cache"]
        assert stats["snapshot_bytes_skipped"] > 0, stats
        assert answer(client, branch, salt="cold") == (0, text)
