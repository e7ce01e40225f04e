"""`strata pull org/name[@rev]` against a local stand-in for the Hugging Face Hub (no hub is
reachable here): a threaded HTTP server that serves a model folder under the hub's URL scheme
(`/api/models/{id}/revision/{rev}` for the file list, `/{id}/resolve/{rev}/{file}` with ranged
GETs, `x-repo-commit`, `etag`/`x-linked-etag` headers as the hub sends them). The folder is
SmolLM2's mlx-lm quantised one that setup makes (98 MB of safetensors: ten of hf-hub's 10 MB
chunks). Checked: the hub cache layout other tools read (blobs named by ETag, snapshot links,
refs), `HF_ENDPOINT` and `HF_TOKEN` honoured, a download cut in the middle resumed from where
it stopped, a wrong checksum refused with nothing left behind, and the pulled model served by
`--model-dir` on the cache."""
import hashlib
import http.server
import json
import os
import re
import subprocess
import threading
import time

import openai
import pytest

from test_api import running_cluster

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_localtesttoken"
CHUNK = 10_000_000  # hf-hub's chunk size


class Hub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files):
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.files = files  # repo id -> {name: (bytes, etag)}
        self.requests = []  # (path, range, authorization)
        self.fail_from = None  # fail ranged reads of a large file starting at or past this
        self.lock = threading.Lock()

    def handle_error(self, request, client_address):
        pass  # hf-hub drops connections it no longer needs after a failed chunk

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class HubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802 (http.server's naming)
        hub = self.server
        with hub.lock:
            hub.requests.append((self.path, self.headers.get("Range"),
                                 self.headers.get("Authorization")))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.reply(401, b'{"error": "Invalid credentials"}')
        m = re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", self.path)
        if m and m.group(1) in hub.files:
            body = json.dumps({"sha": COMMIT, "siblings": [
                {"rfilename": f} for f in hub.files[m.group(1)]]}).encode()
            return self.reply(200, body, {"Content-Type": "application/json"})
        m = re.fullmatch(r"/(.+?/.+?)/resolve/([^/]+)/(.+)", self.path)
        if not m or m.group(1) not in hub.files or m.group(3) not in hub.files[m.group(1)]:
            return self.reply(404, b'{"error": "Entry not found"}')
        data, etag = hub.files[m.group(1)][m.group(3)]
        headers = {"x-repo-commit": COMMIT, "Accept-Ranges": "bytes"}
        # Large files are LFS on the hub: the ETag of the content is its SHA-256.
        headers["x-linked-etag" if len(etag) == 64 else "etag"] = f'"{etag}"'
        rng = self.headers.get("Range")
        if not rng:
            return self.reply(200, data, headers)
        a, b = re.fullmatch(r"bytes=(\d+)-(\d*)", rng).groups()
        start, end = int(a), min(int(b or len(data) - 1), len(data) - 1)
        if hub.fail_from is not None and len(data) > CHUNK and start >= hub.fail_from:
            # Late, so that the chunks before it (fetched 4 at a time) are all in first.
            time.sleep(3)
            return self.reply(500, b"upstream cut")
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self.reply(206, data[start:end + 1], headers)

    def reply(self, status, body, headers=None):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def repo_files(folder):
    files = {}
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"]:
        data = (folder / name).read_bytes()
        big = len(data) > 1_000_000
        etag = hashlib.sha256(data).hexdigest() if big else hashlib.sha1(data).hexdigest()
        files[name] = (data, etag)
    files["README.md"] = (b"# SmolLM2\n", hashlib.sha1(b"x").hexdigest())
    files[".gitattributes"] = (b"*.safetensors filter=lfs\n", hashlib.sha1(b"y").hexdigest())
    return files


@pytest.fixture(scope="module")
def hub(default_model):
    folder = default_model.parent.parent / "smollm2-135m-instruct-mlx"
    files = repo_files(folder)
    data, _ = files["model.safetensors"]
    # A second repo whose large file's ETag does not match its bytes.
    broken = dict(files)
    broken["model.safetensors"] = (data, hashlib.sha256(b"something else").hexdigest())
    h = Hub({REPO: files, "acme/broken": broken})
    threading.Thread(target=h.serve_forever, daemon=True).start()
    yield h
    h.shutdown()


def pull(bin_dir, hub, cache, spec, token=TOKEN):
    env = dict(os.environ, HF_ENDPOINT=hub.url, HF_TOKEN=token)
    return subprocess.run([bin_dir / "strata", "pull", spec, "--cache-dir", str(cache)],
                          capture_output=True, text=True, env=env, timeout=300)


def large_file_ranges(hub):
    return [int(r.split("=")[1].split("-")[0]) for p, r, _ in hub.requests
            if p.endswith("/model.safetensors") and r and r != "bytes=0-0"]


def test_pull_resumes_honours_the_environment_and_lands_in_the_hub_cache(
        bin_dir, default_model, hub, tmp_path):
    cache = tmp_path / "hub"
    # First attempt: the server fails the last chunk (from 90 MB on).
    hub.fail_from = 9 * CHUNK
    first = pull(bin_dir, hub, cache, REPO)
    assert first.returncode != 0
    assert "model.safetensors" in first.stderr, first.stderr
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth in hub.requests)
    # Second attempt, the server healthy again: only what was missing is fetched.
    hub.fail_from = None
    hub.requests.clear()
    second = pull(bin_dir, hub, cache, REPO)
    assert second.returncode == 0, second.stderr
    starts = large_file_ranges(hub)
    assert starts and min(starts) == 9 * CHUNK, starts

    # The Hugging Face cache layout: refs, blobs named by ETag, snapshot links to them.
    snapshot = cache / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / COMMIT
    assert second.stdout.strip() == str(snapshot)
    assert (snapshot.parent.parent / "refs" / "main").read_text().strip() == COMMIT
    folder = default_model.parent.parent / "smollm2-135m-instruct-mlx"
    for name, (data, etag) in repo_files(folder).items():
        if name in ("README.md", ".gitattributes"):
            assert not (snapshot / name).exists(), name
            continue
        link = snapshot / name
        assert link.is_symlink(), name
        assert os.path.realpath(link) == str(snapshot.parent.parent / "blobs" / etag)
        assert link.read_bytes() == data, name
    assert not list((snapshot.parent.parent / "blobs").glob("*.part"))

    # Served from the cache as org/name.
    (tmp_path / "c").mkdir()
    with running_cluster(bin_dir, default_model, tmp_path / "c", "--model-dir", str(cache)) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        assert REPO in {m.id for m in client.models.list().data}
        r = client.chat.completions.create(model=REPO, max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "Hi"}])
        assert r.usage.completion_tokens > 0


def test_pull_refuses_a_wrong_checksum_a_bad_token_and_a_bad_name(bin_dir, hub, tmp_path):
    cache = tmp_path / "hub"
    r = pull(bin_dir, hub, cache, "acme/broken")
    assert r.returncode != 0 and "checksum mismatch" in r.stderr, r.stderr
    # Neither the blob under the claimed ETag nor the link to it is left for a later run.
    wrong = hub.files["acme/broken"]["model.safetensors"][1]
    repo = cache / "models--acme--broken"
    assert not (repo / "blobs" / wrong).exists()
    assert not (repo / "snapshots" / COMMIT / "model.safetensors").exists()

    r = pull(bin_dir, hub, tmp_path / "other", REPO, token="hf_wrong")
    assert r.returncode != 0 and "401" in r.stderr, r.stderr

    r = pull(bin_dir, hub, tmp_path / "other", "not-a-repo")
    assert r.returncode != 0 and "expected org/name" in r.stderr, r.stderr
