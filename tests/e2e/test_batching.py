"""Continuous batching in the real worker: concurrent streams are decoded together (the
worker's stats show forward passes of 4 or more sequences), and a short request sent while a
long prompt is being prefilled gets its first token before that long prompt does (prefill is
chunked and interleaved; an ordering check, not a timing)."""
import json
import threading
import time
import urllib.request

import openai
import pytest

from test_api import MODEL, running_cluster


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("batching")) as c:
        yield c


def worker_stats(cluster):
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + "/admin/api/workers",
                                 headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = {w["name"]: w for w in json.load(r)["workers"]}
    return workers[f"worker-{MODEL}"]["stats"]


def test_concurrent_streams_are_decoded_together(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=300)
    results, errors = {}, []

    def one(i):
        try:
            stream = client.chat.completions.create(
                model=MODEL, temperature=0, max_tokens=24, stream=True,
                messages=[{"role": "system", "content": "You are a helpful assistant."},
                          {"role": "user", "content": f"Give me fact {i} about whales."}])
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(results[i] for i in range(8)), results
    hist = {int(k): v for k, v in worker_stats(cluster)["decode_batch_histogram"].items()}
    print("decode batch histogram:", hist)
    assert any(size >= 4 and count > 0 for size, count in hist.items()), hist


def test_a_short_request_is_not_stuck_behind_a_long_prefill(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0, timeout=600)
    long_prompt = " ".join(f"Note {i}: the river flows north past the old mill." for i in range(250))
    first_token = {}
    order = []
    lock = threading.Lock()

    def run(name, messages):
        stream = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                                stream=True, messages=messages)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                with lock:
                    if name not in first_token:
                        first_token[name] = time.monotonic()
                        order.append(name)
        # drain
    long = threading.Thread(target=run, args=("long", [{"role": "user", "content": long_prompt}]))
    long.start()
    time.sleep(1.0)  # the long prompt is being prefilled now (it takes many chunks)
    short = threading.Thread(target=run, args=("short", [{"role": "user", "content": "Hi!"}]))
    short.start()
    short.join()
    long.join()
    assert order == ["short", "long"], order
