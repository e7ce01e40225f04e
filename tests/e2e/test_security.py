"""Security of a running cluster: private sockets, run directory and block files, the admin
token, API keys, tenant isolation of the cache by API key, the browser guard (hosts, origins,
content types), and no secret in the logs (traces: test_traces.py). The cluster is configured
from a strata.toml with two API keys (tenants by default), a configured admin token and one
allowed browser origin."""
import http.client
import json
import os
import pathlib
import stat
import subprocess
import time
import urllib.error
import urllib.request

import openai
import pytest

from test_api import config_cluster, pick_port, running_cluster

KEY_A, KEY_B = "sk-tenant-a-5d1e0c", "sk-tenant-b-93b7aa"
WRONG_KEY = "sk-wrong-key-41c2"
ADMIN = "admin-secret-c0ffee-11"
ALLOWED_ORIGIN = "https://chat.example.com"


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("security")
    port = pick_port()
    text = f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp / 'run'}"
api_keys = ["{KEY_A}", "{KEY_B}"]
admin_token = "{ADMIN}"
allowed_origins = ["{ALLOWED_ORIGIN}"]

[cache]
dir = "{tmp / 'kv'}"
ram = "64MiB"
disk = "256MiB"

[[models]]
id = "m"
path = "{default_model}"
pinned = true
"""
    # Debug level: the most a user would turn on when chasing a problem.
    with config_cluster(bin_dir, tmp, port, text, env=dict(os.environ, RUST_LOG="debug")) as c:
        yield c


def call(cluster, path, token=None, method="GET"):
    headers = {"authorization": f"Bearer {token}"} if token else {}
    if method == "POST":
        headers["content-type"] = "application/json"
    req = urllib.request.Request(cluster.url + path, method=method, headers=headers,
                                 data=b"{}" if method == "POST" else None)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_sockets_and_the_admin_token_file_are_private(cluster):
    run = cluster.run_dir
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    sockets = [p for p in run.iterdir() if stat.S_ISSOCK(p.stat().st_mode)]
    assert {p.name for p in sockets} >= {"kvcache.sock", "worker-0.sock"}, sockets
    for p in sockets:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p
    assert stat.S_IMODE((run / "admin-token").stat().st_mode) == 0o600
    assert (run / "admin-token").read_text() == ADMIN


def test_admin_needs_the_admin_token_and_names_only_configured_models(cluster):
    assert call(cluster, "/admin/api/workers")[0] == 401
    assert call(cluster, "/admin/api/workers", "not-the-token")[0] == 401
    # An API key is not an admin token.
    assert call(cluster, "/admin/api/workers", KEY_A)[0] == 401
    status, body = call(cluster, "/admin/api/workers", ADMIN)
    assert status == 200, body
    # Model actions take configured ids only: no path reaches the file system.
    for bad in ("..%2F..%2Fetc%2Fpasswd", "%2Ftmp%2Fmodel.gguf", "nope"):
        status, body = call(cluster, f"/admin/api/models/{bad}/load", ADMIN, "POST")
        assert status == 404, (bad, body)


def test_api_keys_are_checked_and_each_key_is_its_own_cache_namespace(cluster):
    question = " ".join(f"Fact {i}: tenants never share cached blocks." for i in range(60))

    def ask(key):
        r = openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0) \
            .chat.completions.create(model="m", max_tokens=4, temperature=0,
                                     messages=[{"role": "user", "content": question}])
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].message.content

    with pytest.raises(openai.AuthenticationError):
        ask(WRONG_KEY)
    cached, answer = ask(KEY_A)
    assert cached == 0
    again, same = ask(KEY_A)
    assert again >= 256 and same == answer
    # Tenant B sends the same prompt: nothing of A's is served to it (keys are tenants by
    # default once configured).
    other, b_answer = ask(KEY_B)
    assert other == 0 and b_answer == answer
    assert ask(KEY_B)[0] >= 256
    # What tells namespaces apart is a keyed hash: no key appears in what the admin API or the
    # metrics show of the cache.
    shown = json.dumps(call(cluster, "/admin/api/cache/stats", ADMIN)[1])
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=30) as r:
        shown += r.read().decode()
    assert KEY_A not in shown and KEY_B not in shown
    assert stat.S_IMODE((cluster.run_dir.parent / "kv" / "tenant-secret").stat().st_mode) == 0o600


def test_block_files_and_every_directory_are_private_whatever_the_umask(cluster):
    # The tenant test above stored blocks; the background writer puts them on disk. This
    # pytest process (and so the cluster it started) runs under a umask that would leave
    # files 0644.
    kv = cluster.run_dir.parent / "kv"
    deadline = time.monotonic() + 30
    blocks = []
    while time.monotonic() < deadline and not blocks:
        blocks = [p for p in (kv / "blocks").rglob("*") if p.is_file()]
        time.sleep(0.5)
    assert blocks, "no block reached the disk tier"
    entries = [kv, cluster.run_dir, *kv.rglob("*"), *cluster.run_dir.rglob("*")]
    for p in entries:
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_symlink():
            continue
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_no_secret_reaches_the_logs(cluster):
    # Requests with every secret (valid, invalid, admin) have been made by the tests above;
    # make sure of it, then read everything the gateway, workers and cache service logged.
    call(cluster, "/admin/api/workers", ADMIN)
    call(cluster, "/v1/models", WRONG_KEY)
    log = cluster.log()
    # The requests were logged (at debug level), so the check reads real request logs.
    assert "/v1/chat/completions" in log and "/admin/api/workers" in log
    for secret in (KEY_A, KEY_B, WRONG_KEY, ADMIN):
        assert secret not in log, f"{secret} appears in the log"


def raw(cluster, method, path, headers, body=None):
    """(status, headers, parsed body) of one request with exactly these headers (Host too)."""
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        data = r.read()
        try:
            parsed = json.loads(data) if data else None
        except ValueError:
            parsed = data.decode(errors="replace")
        return r.status, {k.lower(): v for k, v in r.getheaders()}, parsed
    finally:
        conn.close()


def chat_body():
    return json.dumps({"model": "m", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hi"}]}).encode()


def test_requests_addressed_to_a_foreign_host_are_refused(cluster):
    # DNS rebinding: a page of attacker.example re-points its name at 127.0.0.1; its requests
    # then carry that name. Refused before any route, even with a valid key.
    auth = {"authorization": f"Bearer {KEY_A}"}
    for host in ("attacker.example", f"attacker.example:{cluster.port}", "localhost.evil.example"):
        status, _, body = raw(cluster, "GET", "/v1/models", {"Host": host, **auth})
        assert status == 403, (host, body)
        assert body["error"]["type"] == "permission_error" and "allowed_hosts" in body["error"]["message"]
    status, _, body = raw(cluster, "POST", "/v1/messages",
                          {"Host": "attacker.example", "content-type": "application/json",
                           "x-api-key": KEY_A}, b"{}")
    assert status == 403 and body["type"] == "error", body
    assert raw(cluster, "GET", "/admin", {"Host": "attacker.example"})[0] == 403
    # Loopback names and addresses, the names clients are given, pass.
    for host in (f"127.0.0.1:{cluster.port}", f"localhost:{cluster.port}", "localhost"):
        status, _, body = raw(cluster, "GET", "/v1/models", {"Host": host, **auth})
        assert status == 200, (host, body)


def test_a_web_page_of_another_origin_cannot_use_the_api(cluster):
    host = {"Host": f"127.0.0.1:{cluster.port}", "authorization": f"Bearer {KEY_A}"}
    # What any page can send without a preflight: a text/plain POST. Refused with 415 (with
    # or without an Origin), so it never generates.
    for origin in ({}, {"Origin": "https://attacker.example"}):
        status, _, body = raw(cluster, "POST", "/v1/chat/completions",
                              {**host, **origin, "content-type": "text/plain"}, chat_body())
        assert status in (403, 415), body
        assert status == (403 if origin else 415), body
    # A JSON request from a foreign page is refused by its Origin, preflight or not.
    json_ct = {**host, "content-type": "application/json"}
    for origin in ("https://attacker.example", "null", "http://chat.example.com"):
        status, _, body = raw(cluster, "POST", "/v1/chat/completions",
                              {**json_ct, "Origin": origin}, chat_body())
        assert status == 403 and "allowed_origins" in body["error"]["message"], (origin, body)
        status, headers, _ = raw(cluster, "OPTIONS", "/v1/chat/completions",
                                 {**host, "Origin": origin,
                                  "Access-Control-Request-Method": "POST"})
        assert status == 403 and "access-control-allow-origin" not in headers, origin
    # The dashboard's own origin (loopback) and a configured origin are served, with CORS.
    for origin in (f"http://127.0.0.1:{cluster.port}", ALLOWED_ORIGIN):
        status, headers, body = raw(cluster, "POST", "/v1/chat/completions",
                                    {**json_ct, "Origin": origin}, chat_body())
        assert status == 200, (origin, body)
        assert headers["access-control-allow-origin"] == origin
    status, headers, _ = raw(cluster, "OPTIONS", "/v1/chat/completions",
                             {"Host": f"127.0.0.1:{cluster.port}", "Origin": ALLOWED_ORIGIN,
                              "Access-Control-Request-Method": "POST",
                              "Access-Control-Request-Headers": "authorization, content-type"})
    assert status == 204
    assert headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert "authorization" in headers["access-control-allow-headers"]
    # Refusals are counted.
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'strata_http_refused_total{reason="403"}' in metrics
    assert 'strata_http_refused_total{reason="415"}' in metrics


def test_an_empty_api_key_is_refused_at_start(bin_dir, default_model, tmp_path):
    config = tmp_path / "strata.toml"
    config.write_text(f'bind = "127.0.0.1:{pick_port()}"\nrun_dir = "{tmp_path / "run"}"\n'
                      f'api_keys = ["sk-real", ""]\n\n[[models]]\nid = "m"\npath = "{default_model}"\n')
    done = subprocess.run([bin_dir / "strata", "up", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "API key is empty" in done.stderr + done.stdout


def test_keys_can_come_from_a_file_out_of_sight_of_ps(bin_dir, default_model, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# one per line\nsk-from-file-7a1\n\n")
    with running_cluster(bin_dir, default_model, tmp_path, "--api-key-file", str(keys)) as c:
        assert call(c, "/v1/models")[0] == 401
        assert call(c, "/v1/models", "sk-from-file-7a1")[0] == 200
        cmdline = pathlib.Path(f"/proc/{c.proc.pid}/cmdline").read_bytes()
        assert b"sk-from-file-7a1" not in cmdline
