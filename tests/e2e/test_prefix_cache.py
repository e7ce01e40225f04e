"""Prefix caching through the real processes: a long prompt's blocks are kept by the worker
(L0) and stored in the cache service, and reused by the next request with the same prefix:
from L0, from the service's RAM after the worker restarts (L1), and from its disk after the
cache service is killed too (L2). The greedy tokens are identical to the cold run's each time. A cache service that hangs costs a bounded wait, never a failed
request; a corrupted block file is never used."""
import json
import os
import pathlib
import urllib.request
import signal
import subprocess
import time

import openai
import pytest

from test_api import MODEL, pick_port, running_cluster, stop_cluster

BLOCK = 256
SYSTEM = " ".join(f"Rule {i}: always answer politely and mention the number {i}." for i in range(60))


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("prefix")) as c:
        yield c


def ask(cluster, question="What is the capital of France?", salt=None):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=16, logprobs=True,
        extra_body={"cache_salt": salt} if salt else None,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}])
    tokens = [t.token for t in r.choices[0].logprobs.content]
    return tokens, r.usage


def kvcache_pid(cluster):
    return {c["name"]: c for c in cluster.health()[1]["children"]}["kvcache"]["pid"]


def wait_kvcache_back(cluster, old_pid):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        status, body = cluster.health()
        k = {c["name"]: c for c in (body or {}).get("children", [])}.get("kvcache")
        if status == 200 and k and k["pid"] != old_pid:
            return
        time.sleep(0.1)
    pytest.fail("cache service not restarted:\n" + cluster.log())


def restart_worker(cluster):
    """Through the admin API: the new worker starts with an empty L0."""
    old = cluster.worker()["pid"]
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + f"/admin/api/workers/{MODEL}/restart", data=b"{}",
                                 method="POST", headers={"authorization": f"Bearer {token}",
                                                        "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.load(r)["restarting"] == f"worker-{MODEL}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        w = cluster.worker()
        if w["phase"] == "ready" and w["pid"] != old:
            return
        time.sleep(0.1)
    pytest.fail("worker not restarted:\n" + cluster.log())


def admin(cluster, path, body=None):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + path,
                                 data=None if body is None else json.dumps(body).encode(),
                                 method="GET" if body is None else "POST",
                                 headers={"authorization": f"Bearer {token}",
                                          "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def probe(cluster, question="What is the capital of France?"):
    """Where each full block is, and the partial tail after them: (blocks, partial tier)."""
    r = admin(cluster, "/admin/api/cache/probe",
              {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM},
                                            {"role": "user", "content": question}]})
    return r["blocks"], (r["partial"] or {}).get("tier")


def complete(cluster, ids, salt, breaks=None):
    """A completion from token ids: (generated tokens, usage)."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    extra = {"cache_salt": salt, "ignore_eos": True}
    if breaks:
        extra["prefill_breaks"] = breaks
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16,
                                  logprobs=1, extra_body=extra)
    return r.choices[0].logprobs.tokens, r.usage


def tiers(usage):
    t = usage.model_extra["strata_cached_tokens_by_tier"]
    return t["l0"], t["l1"], t["l2"]


def wait_stored(cluster, blocks):
    """The worker stores blocks behind the answer: wait until the service has them on disk."""
    kv = pathlib.Path(cluster.run_dir).parent / "kv" / "blocks"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if len(list(kv.glob("*/*.blk"))) >= blocks:
            return sorted(kv.glob("*/*.blk"))
        time.sleep(0.1)
    pytest.fail(f"fewer than {blocks} block files in {kv}")


def test_a_repeated_prefix_is_reused_from_ram_and_disk_with_identical_tokens(cluster):
    blocks, partial = probe(cluster)
    assert set(blocks) == {"none"} and partial is None
    cold, usage = ask(cluster)
    assert usage.prompt_tokens > 3 * BLOCK, usage
    assert usage.prompt_tokens_details.cached_tokens == 0
    # Everything but the last token is cached: the full blocks and the partial tail (the
    # last token is computed for the first token's logits).
    body = usage.prompt_tokens - 1
    assert body % BLOCK, "the prompt should end inside a block"
    full = usage.prompt_tokens // BLOCK
    wait_stored(cluster, full + 1)

    cached = body
    assert probe(cluster) == (["l0"] * full, "l0")
    warm, usage = ask(cluster)
    assert usage.prompt_tokens_details.cached_tokens == cached
    assert tiers(usage) == (cached, 0, 0)
    assert warm == cold

    # A new worker has no L0: the blocks come from the cache service's RAM.
    restart_worker(cluster)
    assert probe(cluster) == (["l1"] * full, "l1")
    from_ram, usage = ask(cluster)
    assert usage.prompt_tokens_details.cached_tokens == cached
    assert tiers(usage) == (0, cached, 0)
    assert from_ram == cold

    # kill -9 the cache service (the gateway restarts it) and restart the worker: from disk.
    pid = kvcache_pid(cluster)
    os.kill(pid, signal.SIGKILL)
    wait_kvcache_back(cluster, pid)
    restart_worker(cluster)
    assert probe(cluster) == (["l2"] * full, "l2")
    from_disk, usage = ask(cluster)
    assert usage.prompt_tokens_details.cached_tokens == cached
    assert tiers(usage) == (0, 0, cached)
    assert from_disk == cold


def test_the_partial_tail_of_an_earlier_prompt_is_reused(cluster):
    ids = [1000 + (i * 37) % 5000 for i in range(3 * BLOCK + 60)]
    salt = "partial-tail"
    # The first turn's body ends 100 tokens into its third block.
    first = ids[:2 * BLOCK + 101]
    _, usage = complete(cluster, first, salt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    # The next turn extends it and resumes from a partial block: the one its answer was stored
    # in, which also holds the first turn's last prompt token (computed, never imported).
    warm, usage = complete(cluster, ids, salt)
    resumed = 2 * BLOCK + 101
    assert usage.prompt_tokens_details.cached_tokens == resumed
    assert tiers(usage) == (resumed, 0, 0)
    # With the cache out of the way (a fresh salt) and the same chunk boundaries, the same
    # tokens. Chunk boundaries change float rounding, so this is the exact comparison.
    cold, usage = complete(cluster, ids, "partial-tail-cold", breaks=[resumed])
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert warm == cold
    # The same prompt again resumes at its own last token, the new partial tail included.
    again, usage = complete(cluster, ids, salt)
    assert usage.prompt_tokens_details.cached_tokens == len(ids) - 1
    assert again == warm
    # The worker's stats say so, and its cost model has measured its prefill speed.
    workers = {w["name"]: w for w in admin(cluster, "/admin/api/workers")["workers"]}
    stats = workers[f"worker-{MODEL}"]["stats"]["prefix_cache"]
    assert stats["partial_hits"] >= 2, stats
    assert stats["prefill_tokens_per_sec"] > 0, stats


def two_turns(cluster, salt):
    """A first turn from token ids, then a second that resends it with the generated tokens and
    a few more: the second turn's cached tokens."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    ids = [2000 + (i * 53) % 7000 for i in range(250)]
    extra = {"cache_salt": salt, "ignore_eos": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=20,
                                  logprobs=1, extra_body=extra)
    generated = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert len(generated) == 20
    r = client.completions.create(model=MODEL, prompt=ids + generated + list(range(300, 330)),
                                  temperature=0, max_tokens=4, extra_body=extra)
    return r.usage.prompt_tokens_details.cached_tokens


def test_generated_tokens_are_cached_by_default(cluster):
    # The first block (250 prompt tokens and 6 generated ones) and the partial tail after it:
    # every generated token whose KV was computed, all but the last (never fed), so the next
    # turn resumes right after the answer.
    assert two_turns(cluster, "decode-kv-on") == 250 + 20 - 1


def test_generated_tokens_are_not_cached_when_turned_off_or_exact(bin_dir, default_model,
                                                                   tmp_path):
    for name, extra in (("off", ["--store-decode-kv", "false"]), ("exact", ["--cache-exact"])):
        tmp = tmp_path / name
        tmp.mkdir()
        with running_cluster(bin_dir, default_model, tmp, *extra) as c:
            # No answer rows are reused. Exact: the first prompt's body (249 tokens, a partial
            # block). Off: its parked cache gives the whole first prompt, its last token too.
            parked = worker(c)["stats"]["features"]["parked_kv"]
            if name == "exact":
                assert two_turns(c, "decode-kv-off") == 249, extra
                assert parked.startswith("off (block-granular"), parked
            else:
                assert two_turns(c, "decode-kv-off") == 250, extra
                assert parked.startswith("on"), parked


def worker(cluster):
    workers = {w["name"]: w for w in admin(cluster, "/admin/api/workers")["workers"]}
    return workers[f"worker-{MODEL}"]


def test_the_next_turn_resumes_in_place_from_the_previous_turns_live_kv(cluster):
    """A finished request's KV cache stays in the worker (parked): the next turn, which resends
    the conversation with a new question, resumes from it in place instead of importing
    blocks, and equals a cold run within rounding."""
    before = worker(cluster)["stats"]["prefix_cache"]
    salt = "parked"
    ids = base_ids(4)[:600]
    _, _, usage = run_ids(cluster, ids, salt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    parked = worker(cluster)["stats"]["prefix_cache"]
    assert parked["parked_caches"] >= 1 and parked["parked_bytes"] > 0, parked
    # The conversation so far (its answer as token ids) and a new question.
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    r = client.completions.create(
        model=MODEL, prompt=ids, temperature=0, max_tokens=16, logprobs=1,
        extra_body={"cache_salt": salt, "ignore_eos": True,
                    "return_tokens_as_token_ids": True})
    answer = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    nxt = ids + answer + [6000 + i for i in range(40)]
    warm = run_ids(cluster, nxt, salt)
    # Every token whose KV the previous request computed: its prompt and answer but the
    # answer's last token (never fed).
    held = len(ids) + len(answer) - 1
    assert warm[2].prompt_tokens_details.cached_tokens == held, warm[2]
    assert tiers(warm[2]) == (held, 0, 0)
    same_as_cold(cluster, warm, nxt, "parked")
    after = worker(cluster)["stats"]["prefix_cache"]
    assert after["parked_resumes"] >= before["parked_resumes"] + 2, after
    assert after["parked_resumed_tokens"] >= before["parked_resumed_tokens"] + held, after
    assert worker(cluster)["stats"]["features"]["parked_kv"].startswith("on (up to 1024 MiB")


def test_two_models_never_share_blocks(bin_dir, default_model, tmp_path):
    """The same token ids to two models (the GGUF and the f32 folder converted from it: same
    tokenizer, different fingerprints) through one cache service: no hit across them."""
    from test_api import Cluster
    port = pick_port()
    f32 = default_model.parent.parent / "smollm2-135m-instruct-f32"
    config = tmp_path / "strata.toml"
    config.write_text(f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp_path / 'run'}"
[cache]
dir = "{tmp_path / 'kv'}"
ram = "64MiB"
disk = "256MiB"
[[models]]
id = "a"
path = "{default_model}"
[[models]]
id = "b"
path = "{f32}"
""")
    log = tmp_path / "strata.log"
    proc = subprocess.Popen([bin_dir / "strata", "up", "--config", str(config)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    c = Cluster(proc, port, tmp_path / "run", log)
    try:
        c.wait_ready(timeout_s=180)
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        ids = [3000 + (i * 41) % 6000 for i in range(300)]

        def cached(model):
            r = client.completions.create(model=model, prompt=ids, max_tokens=2, temperature=0)
            return r.usage.prompt_tokens_details.cached_tokens

        assert cached("a") == 0
        assert cached("a") == len(ids) - 1
        assert cached("b") == 0, "model b must not see model a's blocks"
        assert cached("b") == len(ids) - 1
    finally:
        stop_cluster(c)


def test_a_hung_cache_service_costs_a_bounded_wait_not_a_failure(cluster):
    cold, _ = ask(cluster, "Name a large ocean.")
    restart_worker(cluster)  # empty L0: the worker must ask the cache service
    pid = kvcache_pid(cluster)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        tokens, usage = ask(cluster, "Name a large ocean.")
        waited = time.monotonic() - started
        print(f"answered in {waited:.1f} s with the cache service stopped")
        assert usage.prompt_tokens_details.cached_tokens == 0
        assert tokens == cold
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # the supervisor already replaced it


def test_a_corrupted_block_file_is_never_used(cluster):
    question = "Which planet is the largest?"
    # A salt of its own: the first answer is a cold run (no other test's blocks or parked
    # cache serve it), so the answer computed after the corruption must equal it exactly.
    salt = "corrupted-blocks"
    kv = pathlib.Path(cluster.run_dir).parent / "kv" / "blocks"
    since = time.time() - 1
    cold, usage = ask(cluster, question, salt=salt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    # This prompt's block files: written after it was sent (the disk tier may have evicted
    # older ones meanwhile, so a count of all files would not tell).
    def written_since(f):
        try:
            return f.stat().st_mtime >= since
        except OSError:  # evicted while listed
            return False

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        files = [f for f in kv.glob("*/*.blk") if written_since(f)]
        if len(files) >= usage.prompt_tokens // BLOCK:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"this prompt's blocks did not reach {kv}")
    # Flip a byte in the payload of every block file: any of them may be this prompt's.
    for f in files:
        data = bytearray(f.read_bytes())
        data[-1] ^= 0x55
        f.write_bytes(bytes(data))
    restart_worker(cluster)  # empty L0: the blocks must come from the cache service
    before = admin(cluster, "/admin/api/cache/stats")["corrupt_blocks"]
    tokens, usage = ask(cluster, question, salt=salt)
    assert tokens == cold
    # The first block is corrupt, so nothing before it can be used.
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert admin(cluster, "/admin/api/cache/stats")["corrupt_blocks"] > before


def test_tenants_with_different_salts_never_share_blocks(cluster):
    question = "Tell me about the tides."
    a1, usage = ask(cluster, question, salt="tenant-a")
    assert usage.prompt_tokens_details.cached_tokens == 0
    a2, usage = ask(cluster, question, salt="tenant-a")
    assert usage.prompt_tokens_details.cached_tokens > 0
    b, usage = ask(cluster, question, salt="tenant-b")
    assert usage.prompt_tokens_details.cached_tokens == 0
    assert a1 == a2 == b


# Token-granular reuse (the default). A hit takes the longest common prefix wherever it ends,
# the leading rows of a held block included; what follows is computed in a chunk of another
# shape than the cold run's, so warm and cold agree within float32 rounding, not bit for bit.
#
# LOGPROB_TOLERANCE: the largest difference allowed between a warm and a cold run's log
# probabilities (top 5 at each of 16 greedy steps). On this model (f32 on the CPU) a different
# chunk shape changes the order of the matmul's sums, which moves the logits by ~1e-6
# relative; through 30 layers and a softmax the largest difference measured over these
# prompts was 2.9e-5 (each test prints its own). 1e-3 leaves 30x for other machines' BLAS
# kernels, and is far below what a reuse bug does: a wrong row or a shifted position moves
# the log probabilities by 0.1 or more and changes the greedy tokens.
LOGPROB_TOLERANCE = 1e-3
DIVERGE = [BLOCK + 1, BLOCK + 100, 2 * BLOCK - 1, 2 * BLOCK + 37, 3 * BLOCK + 10]


def base_ids(seed):
    return [1000 + (i * 37 + seed * 101) % 5000 for i in range(3 * BLOCK + 60)]


def diverged(ids, at):
    """`ids` up to `at`, then 40 other tokens: a prompt that parts from it inside a block."""
    return ids[:at] + [6000 + (i * 13 + at) % 900 for i in range(40)]


def run_ids(cluster, ids, salt, breaks=None):
    """(greedy tokens, top-5 log probabilities per step, usage) of a completion from ids."""
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    extra = {"cache_salt": salt, "ignore_eos": True}
    if breaks:
        extra["prefill_breaks"] = breaks
    r = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=16,
                                  logprobs=5, extra_body=extra)
    lp = r.choices[0].logprobs
    return lp.tokens, lp.top_logprobs, r.usage


def logprob_gap(a, b):
    """The largest difference between two runs' log probabilities of the tokens both list."""
    gap = 0.0
    for x, y in zip(a, b):
        for token in set(x) & set(y):
            gap = max(gap, abs(x[token] - y[token]))
    return gap


def same_as_cold(cluster, warm, ids, label):
    tokens, top, _ = warm
    cold_tokens, cold_top, usage = run_ids(cluster, ids, f"cold-{label}")
    assert usage.prompt_tokens_details.cached_tokens == 0
    gap = logprob_gap(top, cold_top)
    print(f"{label}: largest log-probability difference from the cold run {gap:.2e}")
    assert tokens == cold_tokens, label
    assert gap < LOGPROB_TOLERANCE, (label, gap)
    return gap


def test_a_prompt_that_parts_inside_a_block_reuses_every_common_token(cluster):
    ids = base_ids(1)
    salt = "granular-l0"
    _, _, usage = run_ids(cluster, ids, salt)
    assert usage.prompt_tokens_details.cached_tokens == 0
    for at in DIVERGE:
        prompt = diverged(ids, at)
        warm = run_ids(cluster, prompt, salt)
        assert warm[2].prompt_tokens_details.cached_tokens == at, (at, warm[2])
        assert tiers(warm[2]) == (at, 0, 0)
        same_as_cold(cluster, warm, prompt, f"l0-{at}")
    # Each branch was stored too: the first prompt and every branch hit in full again.
    for prompt in [ids] + [diverged(ids, at) for at in DIVERGE]:
        _, _, usage = run_ids(cluster, prompt, salt)
        assert usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def wait_on_disk(cluster, known, blocks):
    """Waits until a namespace not in `known` (a new salt's) has `blocks` blocks on disk."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = admin(cluster, "/admin/api/cache/stats")["namespaces"]
        if any(n["namespace"] not in known and n["disk"]["blocks"] >= blocks for n in stats):
            return
        time.sleep(0.1)
    pytest.fail(f"the new namespace has fewer than {blocks} blocks on disk: {stats}")


def test_token_granular_hits_come_from_ram_and_disk_after_restarts(cluster):
    ids = base_ids(2)
    salt = "granular-tiers"
    before = {n["namespace"] for n in admin(cluster, "/admin/api/cache/stats")["namespaces"]}
    run_ids(cluster, ids, salt)
    wait_on_disk(cluster, before, 4)  # 3 whole blocks and the tail
    restart_worker(cluster)
    at = 2 * BLOCK + 37
    warm = run_ids(cluster, diverged(ids, at), salt)
    assert tiers(warm[2]) == (0, at, 0), warm[2]
    same_as_cold(cluster, warm, diverged(ids, at), "l1")

    pid = kvcache_pid(cluster)
    os.kill(pid, signal.SIGKILL)
    wait_kvcache_back(cluster, pid)
    restart_worker(cluster)
    at = BLOCK + 100
    warm = run_ids(cluster, diverged(ids, at), salt)
    assert tiers(warm[2]) == (0, 0, at), warm[2]
    same_as_cold(cluster, warm, diverged(ids, at), "l2")


def test_eight_concurrent_branches_of_one_prefix_match_their_cold_runs(cluster):
    from concurrent.futures import ThreadPoolExecutor
    ids = base_ids(3)
    salt = "granular-8"
    run_ids(cluster, ids, salt)
    points = [BLOCK + 1 + i * 61 for i in range(8)]
    prompts = [diverged(ids, at) for at in points]
    with ThreadPoolExecutor(8) as pool:
        warm = list(pool.map(lambda p: run_ids(cluster, p, salt), prompts))
    for at, prompt, w in zip(points, prompts, warm):
        assert w[2].prompt_tokens_details.cached_tokens == at, (at, w[2])
        same_as_cold(cluster, w, prompt, f"8-way-{at}")


def test_cache_exact_keeps_block_granular_bit_identical_hits(bin_dir, default_model, tmp_path):
    with running_cluster(bin_dir, default_model, tmp_path, "--cache-exact") as c:
        ids = base_ids(4)
        salt = "exact"
        run_ids(c, ids, salt)
        for at in (BLOCK + 100, 2 * BLOCK + 37):
            prompt = diverged(ids, at)
            tokens, top, usage = run_ids(c, prompt, salt)
            whole = at // BLOCK * BLOCK
            assert usage.prompt_tokens_details.cached_tokens == whole, usage
            # The cold run with a chunk end where the hit ended: the same arithmetic.
            cold_tokens, cold_top, cold = run_ids(c, prompt, f"exact-cold-{at}", breaks=[whole])
            assert cold.prompt_tokens_details.cached_tokens == 0
            assert (tokens, top) == (cold_tokens, cold_top)
        workers = {w["name"]: w for w in admin(c, "/admin/api/workers")["workers"]}
        assert "cache.exact" in json.dumps(workers[f"worker-{MODEL}"])
