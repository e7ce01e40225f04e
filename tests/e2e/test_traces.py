"""Traces across the three processes, read back from a real Jaeger-compatible backend: the
otlp-embedded fixture (tests/otlp-fixture) takes OTLP/gRPC and answers Jaeger's JSON query API.
One chat request must be one trace holding the gateway's HTTP span, the worker's generate span
with its queue, tokenize, cache lookup, prefill and decode children, and the cache service's
spans, with the right parent links and attributes."""
import json
import subprocess
import time
import urllib.request

import openai
import pytest

from test_api import MODEL, pick_port, running_cluster

SECRET = "sk-trace-secret-7f3a9c"


@pytest.fixture(scope="module")
def jaeger(bin_dir, tmp_path_factory):
    otlp, http = pick_port(), pick_port()
    log = tmp_path_factory.mktemp("otlp") / "fixture.log"
    proc = subprocess.Popen([bin_dir / "strata-otlp-fixture", "--otlp", f"127.0.0.1:{otlp}",
                             "--http", f"127.0.0.1:{http}"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/api/services", timeout=2)
            break
        except OSError:
            time.sleep(0.1)
    yield f"http://127.0.0.1:{otlp}", f"http://127.0.0.1:{http}"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory, jaeger):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("traces"),
                         "--otlp-endpoint", jaeger[0]) as c:
        yield c


def tags(span):
    """Span attributes; numbers may arrive as strings (OTLP has no unsigned integers)."""
    out = {}
    for t in span.get("tags", []):
        v = t["value"]
        if isinstance(v, str) and v.isdigit():
            v = int(v)
        out[t["key"]] = v
    return out


def find_trace(api, predicate, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        with urllib.request.urlopen(api + "/api/traces?service=strata-gateway&limit=20",
                                    timeout=5) as r:
            last = json.load(r)["data"]
        for trace in last:
            if predicate(trace):
                return trace
        time.sleep(0.5)
    summary = [sorted((t["processes"][s["processID"]]["serviceName"], s["operationName"])
                      for s in t["spans"]) for t in last or []]
    pytest.fail(f"no matching trace; traces seen: {summary}")


def services_of(trace):
    return {trace["processes"][s["processID"]]["serviceName"] for s in trace["spans"]}


def test_one_request_is_one_trace_across_gateway_worker_and_cache_service(cluster, jaeger):
    # A key the trace must never show (this cluster is open, so any key is accepted).
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key=SECRET, max_retries=0)
    system = " ".join(f"Rule {i}: answer in one word." for i in range(70))  # > one block
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Name a fruit."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       temperature=0)
    prompt_tokens = r.usage.prompt_tokens
    worker_service = f"strata-worker-{MODEL}"
    want = {"strata-gateway", worker_service, "strata-kvcache"}

    def complete(trace):
        names = {s["operationName"] for s in trace["spans"]}
        return want <= services_of(trace) and {"worker.generate", "kvcache.lookup"} <= names

    trace = find_trace(jaeger[1], complete)
    assert SECRET not in json.dumps(trace), "the API key leaked into a span"
    spans = {s["spanID"]: s for s in trace["spans"]}
    by_name = {}
    for s in trace["spans"]:
        by_name.setdefault(s["operationName"], []).append(s)

    def parent(span):
        refs = [r for r in span.get("references") or [] if r["refType"] == "CHILD_OF"]
        assert refs, f"{span['operationName']} has no parent"
        assert refs[0]["traceID"] == trace["traceID"]
        return spans[refs[0]["spanID"]]

    def service(span):
        return trace["processes"][span["processID"]]["serviceName"]

    # The gateway's HTTP span is the root.
    (http,) = [s for s in by_name["POST /v1/chat/completions"]]
    assert service(http) == "strata-gateway"
    assert not [r for r in http.get("references") or [] if r["refType"] == "CHILD_OF"]
    assert tags(http)["http.route"] == "/v1/chat/completions"
    assert tags(http)["http.response.status_code"] == 200

    # The worker's request span hangs under it, across the gRPC hop.
    (generate,) = by_name["worker.generate"]
    assert service(generate) == worker_service
    assert parent(generate)["spanID"] == http["spanID"]
    g = tags(generate)
    assert g["model"] == MODEL
    assert g["prompt_tokens"] == prompt_tokens
    assert g["cached_tokens"] == 0 and g["cached_l0"] == 0
    assert g["completion_tokens"] >= 1
    for child in ("tokenize", "queue", "prefill", "decode", "cache.lookup"):
        (span,) = by_name[child]
        assert service(span) == worker_service
        assert parent(span)["spanID"] == generate["spanID"], child
    assert tags(by_name["prefill"][0])["tokens"] == prompt_tokens

    # The cache service's lookup hangs under the worker's, across the second hop.
    (lookup,) = by_name["kvcache.lookup"]
    assert service(lookup) == "strata-kvcache"
    assert parent(lookup)["spanID"] == by_name["cache.lookup"][0]["spanID"]
    assert tags(lookup)["held"] == 0

    # The blocks the prefill finished are stored behind the answer, in the same trace.
    def stored(trace):
        return any(s["operationName"] == "kvcache.store" for s in trace["spans"]) and \
            trace["traceID"] == generate["traceID"]

    trace = find_trace(jaeger[1], stored)
    spans = {s["spanID"]: s for s in trace["spans"]}
    stores = [s for s in trace["spans"] if s["operationName"] == "kvcache.store"]
    assert sum(tags(s)["accepted"] for s in stores) >= 1
    for store in stores:
        assert service(store) == "strata-kvcache"
        worker_side = parent(store)
        assert worker_side["operationName"] == "cache.store"
        assert tags(worker_side)["bytes"] > 0
        assert parent(worker_side)["spanID"] == generate["spanID"]
