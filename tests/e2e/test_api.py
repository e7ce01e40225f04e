"""The OpenAI and Anthropic APIs of `strata up`, driven by the official Python SDKs against the
real binaries and the real SmolLM2 model: chat, streaming, completions, count_tokens, errors in
each API's own shape, API keys, a client that disconnects mid-stream, and kill -9 of the worker
mid-stream."""
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

MODEL = "smollm2"
QUESTION = "What is the capital of France?"


class Cluster:
    def __init__(self, proc, port, run_dir, log_path):
        self.proc, self.port, self.run_dir, self.log_path = proc, port, run_dir, log_path
        self.url = f"http://127.0.0.1:{port}"

    def health(self):
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)
        except OSError:
            return None, None

    def wait_ready(self, timeout_s=90):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, "strata up exited:\n" + self.log()
            status, body = self.health()
            if status == 200:
                return body
            time.sleep(0.1)
        pytest.fail("cluster not ready:\n" + self.log())

    def worker(self):
        return {c["name"]: c for c in self.health()[1]["children"]}[f"worker-{MODEL}"]

    def log(self):
        return self.log_path.read_text(errors="replace")


def start_cluster(bin_dir, model, port, tmp, *extra):
    run_dir = tmp / "run"
    log_path = tmp / "strata.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [bin_dir / "strata", "up", "--bind", f"127.0.0.1:{port}", "--model", str(model),
         "--model-id", MODEL, "--run-dir", str(run_dir), "--kv-dir", str(tmp / "kv"),
         "--kv-ram", "64MiB", "--kv-disk", "256MiB", *extra],
        stdout=log, stderr=subprocess.STDOUT,
    )
    cluster = Cluster(proc, port, run_dir, log_path)
    cluster.wait_ready()
    return cluster


def pick_port():
    """A free TCP port on loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_cluster(bin_dir, model, tmp, *extra):
    """`strata up` on a free port for the duration of the block, stopped after it."""
    c = start_cluster(bin_dir, model, pick_port(), tmp, *extra)
    try:
        yield c
    finally:
        stop_cluster(c)


@contextlib.contextmanager
def config_cluster(bin_dir, tmp, port, config_text, env=None):
    """`strata up --config` with `config_text` as tmp/strata.toml (its bind must use `port` and
    its run_dir tmp/run), stopped after the block."""
    config = tmp / "strata.toml"
    config.write_text(config_text)
    log = tmp / "strata.log"
    proc = subprocess.Popen([bin_dir / "strata", "up", "--config", str(config)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    c = Cluster(proc, port, tmp / "run", log)
    try:
        c.wait_ready()
        yield c
    finally:
        stop_cluster(c)


def one_model_config(tmp, port, model_id, path, top="", model=""):
    """strata.toml text for one pinned model on `port`, run_dir tmp/run and the cache in
    tmp/kv: `top` adds top-level settings, `model` settings of the model."""
    return f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp / 'run'}"
{top}

[cache]
dir = "{tmp / 'kv'}"

[[models]]
id = "{model_id}"
path = "{path}"
pinned = true
{model}
"""


def stop_cluster(cluster):
    if cluster.proc.poll() is None:
        cluster.proc.send_signal(signal.SIGTERM)
        try:
            cluster.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            cluster.proc.kill()
            cluster.proc.wait()


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = start_cluster(bin_dir, default_model, port, tmp_path_factory.mktemp("api"))
    yield c
    stop_cluster(c)


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0)


def test_models_lists_the_configured_model(oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]


def test_openai_chat_answers_and_streams_the_same_greedy_text(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert "Paris" in text, text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0

    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24, temperature=0, stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(pieces) == text
    assert finish == r.choices[0].finish_reason
    assert usage.completion_tokens == r.usage.completion_tokens


def test_openai_sampling_parameters_and_logprobs_are_applied(oai):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}],
              max_tokens=12)
    a = oai.chat.completions.create(**kw, temperature=0.9, top_p=0.9, seed=7)
    b = oai.chat.completions.create(**kw, temperature=0.9, top_p=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content  # seeded
    stop = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=24, temperature=0, stop=["Paris"])
    assert "Paris" not in stop.choices[0].message.content
    assert stop.choices[0].finish_reason == "stop"
    lp = oai.chat.completions.create(**kw, temperature=0, logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-4 for c in content)


def test_openai_completions_continue_raw_text(oai):
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                               temperature=0)
    assert r.choices[0].text.strip(), r
    assert r.usage.prompt_tokens == 5
    chunks = list(oai.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_anthropic_messages_with_system_and_multi_turn_blocks(claude):
    r = claude.messages.create(
        model=MODEL, max_tokens=24, extra_body={"temperature": 0}, system="You are a geography teacher.",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hello!"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello! Ask me anything."}]},
            {"role": "user", "content": QUESTION},
        ])
    assert r.type == "message" and r.role == "assistant"
    assert r.content[0].type == "text" and "Paris" in r.content[0].text, r
    assert r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.input_tokens > 20 and r.usage.output_tokens > 0

    events = []
    with claude.messages.stream(model=MODEL, max_tokens=24, extra_body={"temperature": 0},
                                system="You are a geography teacher.",
                                messages=[
                                    {"role": "user", "content": [{"type": "text", "text": "Hello!"}]},
                                    {"role": "assistant", "content": "Hello! Ask me anything."},
                                    {"role": "user", "content": QUESTION},
                                ]) as stream:
        for event in stream:
            events.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == r.content[0].text
    # The repeat reads the prompt from the cache: Anthropic counts those tokens apart.
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)
    assert total(final.usage) == total(r.usage)
    assert final.usage.cache_read_input_tokens == total(r.usage) - 1
    assert final.usage.output_tokens == r.usage.output_tokens
    order = [e for e in events if e in ("message_start", "content_block_start", "content_block_delta",
                                        "content_block_stop", "message_delta", "message_stop")]
    assert order[0] == "message_start" and order[1] == "content_block_start"
    assert order[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "content_block_delta" in order


def test_anthropic_count_tokens_matches_the_usage_of_a_request(claude):
    messages = [{"role": "user", "content": QUESTION}]
    counted = claude.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    r = claude.messages.create(model=MODEL, max_tokens=2, messages=messages, system="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) > 0


def raw_post(cluster, path, body, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(cluster.url + path, data=data, method="POST",
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.load(e)


def test_bad_requests_get_clear_errors_in_each_apis_shape(cluster, oai, claude):
    ok = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="no-such-model", messages=ok)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="no-such-model", max_tokens=5, messages=ok)
    assert e.value.body["error"]["type"] == "not_found_error"

    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ok, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[])
    assert "messages" in e.value.body["message"]
    # A prompt that alone fills the context is refused in each API's shape (a max_tokens
    # past the context is clamped instead: tests/e2e/test_agent_requests.py).
    too_long = [{"role": "user", "content": "hello " * 9000}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=too_long, max_tokens=5)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, messages=too_long)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert e.value.body["error"]["message"].startswith("prompt is too long: "), e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ok, n=2)
    assert e.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert e.value.body["type"] == "error"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5,
                               messages=[{"role": "wizard", "content": "x"}])

    # Not JSON, missing fields, too large: raw requests, each API's shape.
    status, _, body = raw_post(cluster, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, _, body = raw_post(cluster, "/v1/messages", b"{not json")
    assert status == 400 and body["type"] == "error"
    status, _, body = raw_post(cluster, "/v1/chat/completions", {"model": MODEL})
    assert status == 400 and "messages" in body["error"]["message"]
    status, _, body = raw_post(cluster, "/v1/messages", {"model": MODEL, "messages": ok})
    assert status == 400 and "max_tokens" in body["error"]["message"]
    status, _, body = raw_post(cluster, "/v1/chat/completions",
                               {"model": MODEL, "messages": [{"role": "user", "content": "x" * (17 << 20)}]})
    assert status == 413 and body["error"]["type"] == "invalid_request_error"
    status, _, body = raw_post(cluster, "/v1/nothing-here", {})
    assert status == 404
    # The worker and the gateway are still fine.
    r = oai.chat.completions.create(model=MODEL, messages=ok, max_tokens=3)
    assert r.choices[0].message.content is not None


def test_a_client_that_disconnects_mid_stream_cancels_its_generation(cluster, oai):
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        max_tokens=2000, temperature=0, stream=True)
    got = 0
    for chunk in stream:
        got += 1
        if got == 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while "generation cancelled" not in cluster.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "generation cancelled" in cluster.log()
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                    max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def test_kill_9_of_the_worker_mid_stream_ends_the_stream_with_an_error(cluster, oai, claude):
    gateway_pid = cluster.proc.pid
    for client in ("openai", "anthropic"):
        worker = cluster.worker()
        if client == "openai":
            stream = oai.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
                max_tokens=2000, temperature=0, stream=True)
            it = iter(stream)
            next(it)
            os.kill(worker["pid"], signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(openai.APIError) as e:
                for _ in it:
                    pass
        else:
            with claude.messages.stream(
                    model=MODEL, max_tokens=2000, extra_body={"temperature": 0},
                    messages=[{"role": "user", "content": "Write a very long story about a dragon."}]) as s:
                it = iter(s)
                next(it)
                os.kill(worker["pid"], signal.SIGKILL)
                started = time.monotonic()
                with pytest.raises(anthropic.APIStatusError) as e:
                    for _ in it:
                        pass
        elapsed = time.monotonic() - started
        print(f"{client}: stream ended {elapsed * 1000:.0f} ms after the kill: {e.value}")
        assert "worker" in str(e.value)
        # The worker comes back, the gateway is the same process, and requests succeed again.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            status, body = cluster.health()
            w = {c["name"]: c for c in body["children"]}[f"worker-{MODEL}"] if body else None
            if status == 200 and w and w["pid"] != worker["pid"]:
                break
            time.sleep(0.1)
        else:
            pytest.fail("worker not restarted:\n" + cluster.log())
        assert cluster.proc.pid == gateway_pid and cluster.proc.poll() is None
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                        max_tokens=8, temperature=0)
        assert r.choices[0].message.content


def test_api_keys_are_required_when_configured(bin_dir, default_model, tmp_path, free_port):
    c = start_cluster(bin_dir, default_model, free_port, tmp_path, "--api-key", "sk-test-123")
    try:
        msgs = [{"role": "user", "content": "hi"}]
        # No key at all (the SDKs refuse to send none, so a raw request).
        status, _, body = raw_post(c, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        status, _, body = raw_post(c, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": msgs})
        assert status == 401 and body["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=c.url + "/v1", api_key="wrong", max_retries=0) \
                .chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=c.url, api_key="wrong", max_retries=0) \
                .messages.create(model=MODEL, max_tokens=2, messages=msgs)
        assert e.value.body["error"]["type"] == "authentication_error"
        r = openai.OpenAI(base_url=c.url + "/v1", api_key="sk-test-123", max_retries=0) \
            .chat.completions.create(model=MODEL, messages=msgs, max_tokens=2)
        assert r.choices[0].message.content is not None
        m = anthropic.Anthropic(base_url=c.url, api_key="sk-test-123", max_retries=0) \
            .messages.create(model=MODEL, max_tokens=2, messages=msgs)
        assert m.content[0].type == "text"
        # /health stays open for liveness probes.
        assert c.health()[0] == 200
    finally:
        stop_cluster(c)


def test_admin_api_and_cli_restart_a_worker_and_show_cache_stats(cluster, bin_dir):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    assert oct(os.stat(cluster.run_dir / "admin-token").st_mode & 0o777) == "0o600"
    try:
        urllib.request.urlopen(cluster.url + "/admin/api/workers", timeout=5)
        pytest.fail("the admin API answered without a token")
    except urllib.error.HTTPError as e:
        assert e.code == 401
    env = {**os.environ, "STRATA_URL": cluster.url, "STRATA_RUN_DIR": str(cluster.run_dir)}
    out = subprocess.run([bin_dir / "strata", "workers"], capture_output=True, text=True, env=env,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    workers = {w["name"]: w for w in json.loads(out.stdout)["workers"]}
    before = workers[f"worker-{MODEL}"]
    assert before["model"]["model"] == MODEL and before["phase"] == "ready"

    out = subprocess.run([bin_dir / "strata", "restart", MODEL], capture_output=True, text=True,
                         env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        w = cluster.worker()
        if w["phase"] == "ready" and w["pid"] != before["pid"]:
            break
        time.sleep(0.1)
    else:
        pytest.fail("worker not restarted by the admin API")
    assert w["last_error"] == "restarted on request"

    req = urllib.request.Request(cluster.url + "/admin/api/cache/stats",
                                 headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        stats = json.load(r)
    assert stats["ram_limit_bytes"] == 64 << 20 and "namespaces" in stats
    out = subprocess.run([bin_dir / "strata", "cache", "clear", "--model", MODEL],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["namespace"]) == 64  # the model's fingerprint


def test_models_load_unload_pin_and_unpin_act_on_the_worker_process(cluster, bin_dir, oai):
    env = {**os.environ, "STRATA_URL": cluster.url, "STRATA_RUN_DIR": str(cluster.run_dir)}

    def cli(*args):
        return subprocess.run([bin_dir / "strata", *args], capture_output=True, text=True,
                              env=env, timeout=60)

    pid = cluster.worker()["pid"]
    out = cli("pin", MODEL)
    assert out.returncode == 0 and json.loads(out.stdout)["pinned"] is True, out
    out = cli("unload", MODEL)
    assert out.returncode != 0 and "pinned" in out.stdout, out
    os.kill(pid, 0)  # still running

    assert cli("unpin", MODEL).returncode == 0
    out = cli("unload", MODEL)
    assert out.returncode == 0 and json.loads(out.stdout)["loaded"] is False, out
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    workers = json.loads(cli("workers").stdout)["workers"]
    assert {w["name"]: w for w in workers}[f"worker-{MODEL}"]["phase"] == "unloaded"

    # `strata load` waits for the worker and says when it is ready.
    out = cli("load", MODEL)
    assert out.returncode == 0 and f"{MODEL} is ready" in out.stdout, out
    assert cluster.worker()["phase"] == "ready"
    loaded_pid = cluster.worker()["pid"]
    assert loaded_pid != pid

    # Unloaded again, a request loads it by itself and waits for it.
    assert cli("unload", MODEL).returncode == 0
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": QUESTION}],
                                    max_tokens=8, temperature=0)
    assert r.choices[0].message.content
    assert cluster.worker()["pid"] not in (pid, loaded_pid)


def test_a_request_that_cannot_fit_the_workers_memory_budget_is_refused_and_the_worker_lives(
        bin_dir, default_model, tmp_path, free_port):
    # A budget below the loaded model itself: every request is refused before any work.
    c = start_cluster(bin_dir, default_model, free_port, tmp_path, "--worker-memory-budget", "1MiB")
    try:
        pid = c.worker()["pid"]
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=4000,
                                           messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 413
        assert e.value.body["code"] == "memory_budget_exceeded"
        assert "memory budget of 1 MiB" in e.value.body["message"], e.value.body
        claude = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as e:
            claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 413
        # The worker did not die of it.
        assert c.worker()["pid"] == pid and c.health()[0] == 200
    finally:
        stop_cluster(c)


def test_cache_clear_for_a_model_reaches_its_salted_blocks_and_the_workers_memory(
        cluster, bin_dir, oai):
    env = {**os.environ, "STRATA_URL": cluster.url, "STRATA_RUN_DIR": str(cluster.run_dir)}
    prompt = " ".join(f"Entry {i}: a cleared cache forgets this." for i in range(60))

    def cached():
        r = oai.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                        messages=[{"role": "user", "content": prompt}],
                                        extra_body={"cache_salt": "tenant-x"})
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() >= 256
    out = subprocess.run([bin_dir / "strata", "cache", "clear", "--model", MODEL],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    cleared = json.loads(out.stdout)
    assert cleared["blocks_removed"] >= 1 and cleared["l0_blocks_removed"] >= 1, cleared
    # Nothing of it is served afterwards: not from the cache service's salted namespace, not
    # from the worker's L0.
    assert cached() == 0
