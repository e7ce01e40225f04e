"""GET /metrics through the real cluster, read with prometheus_client's own parser of the
Prometheus text format: request counts by route and status, TTFT and inter-token latency per
model, tokens in and out, cached tokens by tier and the hit ratio, the cache service's tiers,
SSD writes and budget, restarts and queue depth."""
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_api import MODEL, running_cluster


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("metrics")) as c:
        yield c


def scrape(cluster):
    """{(name, frozenset(labels)): value} of every sample."""
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        assert r.headers["content-type"].startswith("text/plain")
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples, name, **labels):
    return samples.get((name, frozenset(labels.items())))


def test_metrics_describe_requests_tokens_cache_and_processes(cluster):
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    system = " ".join(f"Rule {i}: be kind and precise." for i in range(80))
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": "Name a colour."}]
    for _ in range(2):  # the second request hits the cache
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True,
            stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(cluster.url + "/no/such/route", timeout=5)

    m = scrape(cluster)
    chat = "/v1/chat/completions"
    assert value(m, "strata_http_requests_total", route=chat, status="200") >= 2
    assert value(m, "strata_http_requests_total", route=chat, status="400") >= 1
    assert value(m, "strata_http_requests_total", route="unmatched", status="404") >= 1
    assert value(m, "strata_http_request_duration_seconds_count", route=chat, status="200") >= 2
    assert value(m, "strata_time_to_first_token_seconds_count", model=MODEL) >= 2
    assert value(m, "strata_inter_token_latency_seconds_count", model=MODEL) >= 2
    assert value(m, "strata_time_to_first_token_seconds_bucket", model=MODEL, le="+Inf") >= 2
    assert value(m, "strata_prompt_tokens_total", model=MODEL) >= 2 * usage.prompt_tokens
    assert value(m, "strata_completion_tokens_total", model=MODEL) >= 2
    assert value(m, "strata_cached_tokens_total", model=MODEL, tier="l0") >= \
        usage.prompt_tokens_details.cached_tokens
    assert value(m, "strata_cached_tokens_total", model=MODEL, tier="l2") is not None
    ratio = value(m, "strata_cache_hit_ratio", model=MODEL)
    assert 0 < ratio < 1
    assert value(m, "strata_generations_total", model=MODEL, outcome="ok") >= 2

    # The cache service, read at scrape time.
    assert value(m, "strata_kvcache_reachable") == 1
    assert value(m, "strata_kvcache_limit_bytes", tier="ram") == 64 << 20
    assert value(m, "strata_kvcache_limit_bytes", tier="disk") == 256 << 20
    assert value(m, "strata_kvcache_bytes", tier="ram") > 0
    assert value(m, "strata_kvcache_evictions_total", tier="ram") is not None
    assert value(m, "strata_ssd_bytes_written_total") is not None
    assert value(m, "strata_ssd_write_budget_left_bytes") is not None

    # The processes.
    assert value(m, "strata_process_up", process=f"worker-{MODEL}") == 1
    assert value(m, "strata_process_up", process="kvcache") == 1
    assert value(m, "strata_process_restarts_total", process=f"worker-{MODEL}") == 0
    assert value(m, "strata_queue_depth", model=MODEL) == 0
