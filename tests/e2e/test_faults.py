"""Faults on a running cluster, each test asserting what survived: kill -9 of a worker
mid-stream, 20 times in a row, and kill -9 of the cache service under traffic, 10 times. The
restart backoff is capped at 1 s here (--restart-backoff-max-ms) so that the loops take minutes
rather than the default's half hour; the faults and the recovery paths are the real ones."""
import json
import os
import pathlib
import re
import resource
import signal
import socket
import statistics
import subprocess
import threading
import time
import urllib.request

import anthropic
import openai
import pytest

from test_api import (MODEL, Cluster, config_cluster, one_model_config, pick_port,
                      running_cluster, stop_cluster)

# About 600 tokens: two whole 256-token blocks and a tail.
PREFIX = " ".join(f"Clause {i}: the archive keeps every record it is given." for i in range(50))
# About 300 tokens (one whole block): cheap enough to compute cold many times on 2 cores.
SHORT_PREFIX = " ".join(f"Rule {i}: keep it short." for i in range(40))


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("faults"),
                         "--restart-backoff-max-ms", "1000") as c:
        yield c


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=120)


def child(cluster, name):
    status, body = cluster.health()
    if not body:
        return None
    return {c["name"]: c for c in body["children"]}.get(name)


def wait_ready(cluster, name, not_pid=None, timeout_s=60):
    """The child's state once it is ready again, with a pid other than `not_pid`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        c = child(cluster, name)
        if c and c["phase"] == "ready" and c["pid"] and c["pid"] != not_pid:
            return c
        time.sleep(0.05)
    pytest.fail(f"{name} did not come back:\n" + cluster.log()[-4000:])


def messages(question, prefix=PREFIX):
    return [{"role": "system", "content": prefix}, {"role": "user", "content": question}]


def test_kill_9_of_a_worker_mid_stream_20_times(cluster, oai):
    gateway_pid = cluster.proc.pid
    worker_name = f"worker-{MODEL}"
    ask = messages("Summarise the clauses in one sentence.")
    story = messages("Now write a very long story about the archive.")
    # The prefix's blocks reach the cache service.
    first = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
    answer = first.choices[0].message.content
    time.sleep(0.5)
    ended_after = []
    for i in range(20):
        worker = wait_ready(cluster, worker_name)
        stream = oai.chat.completions.create(model=MODEL, messages=story, max_tokens=2000,
                                             temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        time.sleep(0.3)  # mid-stream: decoding, blocks of the prompt already stored
        os.kill(worker["pid"], signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        ended_after.append(time.monotonic() - killed)
        assert "worker" in str(e.value), e.value
        # Promptly: the stream ends with the worker's death, not with a timeout.
        assert ended_after[-1] < 10, ended_after
        wait_ready(cluster, worker_name, not_pid=worker["pid"])
        assert cluster.proc.pid == gateway_pid and cluster.proc.poll() is None
        # The same prompt after the restart: the blocks stored before the kill are served
        # by the cache service (the new worker's own L0 is empty), and the answer is the same.
        r = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=8, temperature=0)
        tiers = r.usage.model_extra["strata_cached_tokens_by_tier"]
        assert tiers["l0"] == 0 and tiers["l1"] + tiers["l2"] >= 512, (i, tiers)
        assert r.choices[0].message.content == answer, i
    print(f"\n20 kills: stream ended {statistics.median(ended_after) * 1000:.0f} ms "
          f"(median), {max(ended_after) * 1000:.0f} ms (max) after kill -9")
    assert child(cluster, worker_name)["restarts"] >= 20


def test_kill_9_of_the_cache_service_under_traffic_10_times(cluster, oai):
    questions = [f"Which rule mentions the number {n}?" for n in range(6)]
    # Reference answers, computed with a fresh salt each: nothing from any cache.
    reference = {}
    for i, q in enumerate(questions):
        r = oai.chat.completions.create(model=MODEL, messages=messages(q, SHORT_PREFIX),
                                        max_tokens=8,
                                        temperature=0, extra_body={"cache_salt": f"ref-{i}"})
        reference[q] = r.choices[0].message.content
    results, errors, stop = [], [], threading.Event()

    def client(k):
        n = k
        while not stop.is_set():
            q = questions[n % len(questions)]
            n += 1
            # Every other request in a fresh namespace: computed, then stored to the cache
            # service while it is being killed; the others are hits.
            extra = {"cache_salt": f"traffic-{k}-{n}"} if n % 2 else None
            try:
                r = oai.chat.completions.create(model=MODEL, messages=messages(q, SHORT_PREFIX),
                                        max_tokens=8,
                                                temperature=0, extra_body=extra)
                tiers = r.usage.model_extra["strata_cached_tokens_by_tier"]
                results.append((q, r.choices[0].message.content, tiers))
            except Exception as e:  # noqa: BLE001 - every failure is recorded and asserted on
                errors.append(repr(e))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(10):
            time.sleep(2.5)
            kv = wait_ready(cluster, "kvcache")
            os.kill(kv["pid"], signal.SIGKILL)
            # The gateway's supervision brings it back.
            wait_ready(cluster, "kvcache", not_pid=kv["pid"])
        time.sleep(1.5)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors[:5]
    # Served throughout (about 1 s per request on 2 cores when nothing else runs).
    assert len(results) >= 10, len(results)
    # Served throughout, and never a wrong answer: a corrupt or foreign block would change
    # the greedy tokens.
    for q, answer, _ in results:
        assert answer == reference[q], q
    computed = sum(1 for _, _, t in results if sum(t.values()) == 0)
    print(f"\n{len(results)} requests during 10 kills of the cache service, 0 errors, all "
          f"answers equal to a cold run's; {computed} computed and stored")
    status, stats = cluster.health()
    assert status == 200, stats


def vm_size(pid):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmSize")


def test_a_worker_forced_past_admission_runs_out_of_memory_and_the_rest_lives(
        bin_dir, default_model, tmp_path, monkeypatch):
    # Admission would refuse this request (test_api.py checks that); the test build lets it
    # through, and the worker's address space is capped just above what it uses, so that
    # the huge context exhausts it.
    monkeypatch.setenv("STRATA_TEST_SKIP_ADMISSION", "1")
    with running_cluster(bin_dir, default_model, tmp_path,
                         "--restart-backoff-max-ms", "1000") as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=300)
        name = f"worker-{MODEL}"
        worker = wait_ready(c, name)
        kvcache = child(c, "kvcache")
        limit = vm_size(worker["pid"]) + (32 << 20)
        resource.prlimit(worker["pid"], resource.RLIMIT_AS, (limit, limit))
        huge = " ".join(f"Entry {i} of the log." for i in range(400))  # about 2,400 tokens
        started = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            oai.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                        messages=[{"role": "user", "content": huge}])
        took = time.monotonic() - started
        # The gateway and the cache service are the same processes, and answer.
        assert c.proc.poll() is None
        assert child(c, "kvcache")["pid"] == kvcache["pid"]
        died = not pathlib.Path(f"/proc/{worker['pid']}").exists() or \
            "zombie" in pathlib.Path(f"/proc/{worker['pid']}/status").read_text()
        print(f"\nout of memory: the request failed after {took:.1f} s ({e.value}); "
              f"worker {'died and was restarted' if died else 'reported the error and lives'}")
        assert died, "the worker survived a cap it must exceed"
        wait_ready(c, name, not_pid=worker["pid"])
        r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content


def test_a_corrupt_model_file_is_refused_in_its_own_words_and_the_rest_lives(
        bin_dir, default_model, tmp_path):
    # A tensor's dimension count corrupted to 2^24: MLX's own GGUF reader crashes on this
    # (SIGSEGV); the worker's structural check refuses it first, and that reason reaches the
    # client, /health and the anthropic SDK's error, while the other model keeps serving.
    src = default_model.read_bytes()
    name = b"blk.0.attn_q.weight"
    at = src.index(name) + len(name)
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(src[:at] + (1 << 24).to_bytes(4, "little") + src[at + 4:])
    port = pick_port()
    text = f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp_path / 'run'}"
restart_backoff_max_ms = 1000

[cache]
dir = "{tmp_path / 'kv'}"
ram = "64MiB"
disk = "256MiB"

[[models]]
id = "{MODEL}"
path = "{default_model}"
pinned = true

[[models]]
id = "broken"
path = "{broken}"
"""
    with config_cluster(bin_dir, tmp_path, port, text) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        reason = "tensor 'blk.0.attn_q.weight' has 16777216 dimensions (GGUF allows 1 to 4)"
        with pytest.raises(openai.APIStatusError) as e:
            oai.chat.completions.create(model="broken", max_tokens=4,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code == 503, e.value
        assert reason in e.value.message, e.value.message
        worker = child(c, "worker-broken")
        assert reason in worker["last_error"] and "exited before ready" in worker["last_error"]

        client = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as e:
            client.messages.create(model="broken", max_tokens=4,
                                   messages=[{"role": "user", "content": "Hi"}])
        assert e.value.status_code in (503, 529) and reason in str(e.value), e.value

        assert c.proc.poll() is None
        r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content
        # The worker's own log lines still reach the cluster log through the gateway.
        assert "cannot read the model" in c.log()


def test_idle_connections_cannot_use_up_the_gateways_descriptors(bin_dir, default_model,
                                                                   tmp_path):
    # The gateway may open 400 descriptors. 600 clients connect and send nothing. Before the
    # connection cap, accept took descriptors until none was left, the supervisor's health
    # probes (a new socket each) failed with EMFILE, and it killed the healthy worker.
    port = pick_port()

    def low_descriptor_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400))

    proc = subprocess.Popen(
        [bin_dir / "strata", "up", "--bind", f"127.0.0.1:{port}", "--model", str(default_model),
         "--model-id", MODEL, "--run-dir", str(tmp_path / "run"), "--kv-dir", str(tmp_path / "kv"),
         "--kv-ram", "64MiB", "--kv-disk", "256MiB"],
        stdout=open(tmp_path / "strata.log", "wb"), stderr=subprocess.STDOUT,
        preexec_fn=low_descriptor_limit)
    c = Cluster(proc, port, tmp_path / "run", tmp_path / "strata.log")
    idle = []
    try:
        c.wait_ready()
        pid = c.worker()["pid"]
        for _ in range(600):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            idle.append(s)
        # Four health checks' time (one every 2 s, three failures in a row kill).
        time.sleep(8)
        assert proc.poll() is None
        for s in idle:
            s.close()
        idle.clear()
        deadline = time.monotonic() + 30
        while c.health()[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        worker = c.worker()
        assert worker["pid"] == pid and worker["phase"] == "ready", worker
        log = re.sub(r"\x1b\[[0-9;]*m", "", c.log())
        assert "health check failed" not in log, log[-3000:]
        # 400 descriptors less the reserve of 256.
        assert "accepting connections connections=144" in log
    finally:
        for s in idle:
            s.close()
        stop_cluster(c)


def test_request_timeout_bounds_the_whole_generation(bin_dir, default_model, tmp_path):
    # request_timeout_secs = 3 and a generation of 3000 tokens (minutes on this CPU): cut at
    # 3 s in both shapes, the worker cancels it and serves the next request.
    port = pick_port()
    text = one_model_config(tmp_path, port, MODEL, default_model,
                            top="request_timeout_secs = 3")
    with config_cluster(bin_dir, tmp_path, port, text) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=60)
        long = dict(model=MODEL, max_tokens=3000, temperature=0, extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": "Count to a million."}])
        started = time.monotonic()
        with pytest.raises(openai.APIStatusError) as e:
            oai.chat.completions.create(**long)
        assert e.value.status_code == 504 and "request_timeout_secs" in str(e.value.body)
        assert time.monotonic() - started < 15
        started = time.monotonic()
        with pytest.raises(openai.APIError) as e:
            for _ in oai.chat.completions.create(**long, stream=True):
                pass
        assert "request_timeout_secs" in str(e.value), e.value
        assert time.monotonic() - started < 15
        r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content


def test_a_stopping_cluster_stores_the_blocks_its_workers_still_hold(bin_dir, default_model,
                                                                     tmp_path):
    # Every Store call of the worker is held back 1.5 s (a debug-build fault switch), so the
    # prompt's blocks are still queued in the worker when the gateway gets SIGTERM. Before the
    # ordered shutdown the cache service stopped together with the worker and they were lost:
    # the next start had nothing. Now the worker drains its queue into the service, and only
    # then does the gateway stop the service. A prompt's blocks can take two Store calls (the
    # first pass's block goes alone while the others are computed): with 3 s a call, a prefill
    # faster than the first call left the second still running at the worker's 5 s drain.
    text_for = lambda port: one_model_config(tmp_path, port, MODEL, default_model)
    ask = messages("Summarise the clauses in one sentence.")
    env = dict(os.environ, STRATA_TEST_STORE_DELAY_MS="1500")
    port = pick_port()
    with config_cluster(bin_dir, tmp_path, port, text_for(port), env=env) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        first = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        assert first.usage.prompt_tokens >= 512
        stopping = time.monotonic()
        c.proc.send_signal(signal.SIGTERM)
        assert c.proc.wait(timeout=30) == 0
        stopped_after = time.monotonic() - stopping
        log = re.sub(r"\x1b\[[0-9;]*m", "", c.log())
    assert "queued blocks stored before exit" in log, log[-3000:]
    assert "still queued for the cache service at exit" not in log, log[-3000:]
    # Bounded: the store delay plus the drains, well inside the 10 s stop grace.
    assert stopped_after < 15, stopped_after
    port = pick_port()
    with config_cluster(bin_dir, tmp_path, port, text_for(port)) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        again = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        tiers = again.usage.model_extra["strata_cached_tokens_by_tier"]
        assert tiers["l2"] + tiers["l1"] >= 512, tiers
        assert again.choices[0].message.content == first.choices[0].message.content


def admin_json(c, tmp_path, path, body=None):
    """An admin API answer (GET, or POST of `body`) with the cluster's admin token."""
    token = (tmp_path / "run" / "admin-token").read_text().strip()
    req = urllib.request.Request(c.url + path,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}",
                                          "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def worker_features(c, tmp_path):
    """The default model's worker's features, as /admin reports them."""
    workers = {w["name"]: w for w in admin_json(c, tmp_path, "/admin/api/workers")["workers"]}
    return workers[f"worker-{MODEL}"]["stats"]["features"]


def test_blocks_still_on_their_way_to_the_cache_service_serve_the_next_prompt(
        bin_dir, default_model, tmp_path):
    # L0 is off and every Store call is held back 6 s (a debug-build fault switch): the same
    # prompt sent again at once finds its blocks neither in L0 nor in the cache service yet.
    # They are in the worker's store queue, and a lookup takes them from there: before, such
    # a prompt was computed again whole.
    port = pick_port()
    text = one_model_config(tmp_path, port, MODEL, default_model,
                            model='l0_bytes = "0"\nparked_bytes = "0"\n'
                                  'prefill_chunk_tokens = 512')
    ask = messages("Name the parties in one line.")
    env = dict(os.environ, STRATA_TEST_STORE_DELAY_MS="6000")
    with config_cluster(bin_dir, tmp_path, port, text, env=env) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        first = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        assert first.usage.prompt_tokens >= 512
        again = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        # Every whole block of the prompt, from this worker's memory (nothing had landed in
        # the service yet).
        tiers = again.usage.model_extra["strata_cached_tokens_by_tier"]
        body = first.usage.prompt_tokens - 1
        assert tiers["l0"] == body // 256 * 256, tiers
        assert tiers["l1"] + tiers["l2"] == 0, tiers
        assert again.choices[0].message.content == first.choices[0].message.content
        # strata.toml's settings reached the worker, and /admin says how it runs.
        features = worker_features(c, tmp_path)
        assert features["prefill_chunks"].startswith("512 tokens per pass on the cpu"), features
        assert "L0 off" in features["prefix_cache"], features
        assert features["kv_readback"].startswith("direct read"), features
        # Parking off: the first request's live KV did not serve the second.
        assert features["parked_kv"].startswith("off (parked_bytes is 0"), features


def test_block_tokens_and_warmup_tokens_in_strata_toml_reach_the_worker(
        bin_dir, default_model, tmp_path):
    # block_tokens = 128 reaches the worker (`--block-tokens`): the prompt is kept in
    # 128-token blocks and served back from L0 (parking off, so that it reads blocks); and
    # warmup_tokens (`--warmup-tokens`, off by default on the CPU) runs a pass at load.
    port = pick_port()
    text = one_model_config(tmp_path, port, MODEL, default_model,
                            model='parked_bytes = "0"\nblock_tokens = 128\n'
                                  'warmup_tokens = 300')
    ask = messages("Name the parties in one line.")
    with config_cluster(bin_dir, tmp_path, port, text) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        first = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        body = first.usage.prompt_tokens - 1
        assert body % 256 >= 128, f"pick a prompt whose last 128-token block is whole: {body}"
        again = oai.chat.completions.create(model=MODEL, messages=ask, max_tokens=4,
                                            temperature=0)
        assert again.usage.model_extra["strata_cached_tokens_by_tier"]["l0"] == body
        assert again.choices[0].message.content == first.choices[0].message.content
        # The probe lists the prompt's blocks: 128 tokens each, every whole one held.
        found = admin_json(c, tmp_path, "/admin/api/cache/probe",
                           {"model": MODEL, "messages": ask})
        assert found["block_tokens"] == 128, found
        assert len(found["blocks"]) == body // 128, found
        assert "none" not in found["blocks"], found
        # warmup_tokens reached it too: a pass on the engine thread before the first
        # request, and what it took, in /admin.
        warmup = worker_features(c, tmp_path)["kernel_warmup"]
        assert warmup.startswith("on: a 300-token pass and a decode step"), warmup
        assert "; took " in warmup, warmup


def test_a_trickled_body_and_a_client_that_stops_reading_are_cut_and_stall_nothing(
        bin_dir, default_model, tmp_path):
    # Both bounds are a minute in a release build; a debug-build switch makes them 2 s here.
    # One client sends headers and ten bytes of a 2,000-byte body, then nothing; another
    # starts a long stream and never reads it (a 2 KiB receive buffer, so the gateway's send
    # buffer and its 32-event queue fill). Meanwhile, and after, other requests are served.
    port = pick_port()
    text = one_model_config(tmp_path, port, MODEL, default_model)
    env = dict(os.environ, STRATA_TEST_BODY_TIMEOUT_MS="2000", STRATA_TEST_STALL_TIMEOUT_MS="2000")
    with config_cluster(bin_dir, tmp_path, port, text, env=env) as c:
        oai = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0, timeout=120)
        trickle = socket.create_connection(("127.0.0.1", port))
        trickle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        b"Content-Type: application/json\r\nContent-Length: 2000\r\n\r\n"
                        b'{"model": ')
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", port))
        # 20 top logprobs make each event about 3 KB: the 256 KiB send buffer fills in about
        # a hundred tokens.
        body = json.dumps({"model": MODEL, "max_tokens": 8000, "temperature": 0,
                           "stream": True, "ignore_eos": True, "logprobs": True,
                           "top_logprobs": 20,
                           "messages": [{"role": "user", "content": "Count for ever."}]})
        stalled.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                        f"{body}".encode())
        # Served while both are pending.
        r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content
        trickle.settimeout(30)
        answer = trickle.recv(65536).decode(errors="replace")
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "did not arrive within" in answer and '"error"' in answer, answer
        trickle.close()

        def cut():
            metrics = urllib.request.urlopen(c.url + "/metrics", timeout=5).read().decode()
            return 'strata_streams_cut_total{reason="client_stalled"} 1' in metrics
        deadline = time.monotonic() + 90
        while not cut() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert cut(), "the stalled stream was not cut:\n" + c.log()[-3000:]
        stalled.close()
        log = re.sub(r"\x1b\[[0-9;]*m", "", c.log())
        assert "its stream is cut" in log
        r = oai.chat.completions.create(model=MODEL, max_tokens=4, temperature=0,
                                        messages=[{"role": "user", "content": "Hi"}])
        assert r.choices[0].message.content
