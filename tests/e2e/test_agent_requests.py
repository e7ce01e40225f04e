"""What coding agents send, accepted as they send it: the request shapes of Claude Code, Codex
and opencode (../shared/CLIENTS.md) as raw JSON and through the official SDKs, against the real
cluster with SmolLM2 and MiniLM. System messages in place, thinking / effort / context edits
reported as not applied, max_tokens past the context clamped and reported, Anthropic's own
"prompt is too long" wording, alias patterns and the default model, Anthropic's model list
fields, connection probes, the Responses API's namespace and hosted tools, Codex's WebSocket
probe, embeddings with `encoding_format: null`. The real clients themselves run in
test_agent_clients.py."""
import contextlib
import json
import subprocess
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from test_api import MODEL, Cluster, config_cluster, pick_port, running_cluster, stop_cluster

EMBED = "all-minilm-l6-v2"
# Answers are capped by the model's max_output_tokens, so that agents' 32000 finish quickly
# on 2 cores; the cap is itself reported.
CAP = 64


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, minilm_model, tmp_path_factory):
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("agents"),
                         "--embedding-model", str(minilm_model), "--alias", "claude-*",
                         "--max-output-tokens", str(CAP)) as c:
        yield c


@pytest.fixture
def oai(cluster):
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def claude(cluster):
    return anthropic.Anthropic(base_url=cluster.url, api_key="unused", max_retries=0)


def request(cluster, method, path, body=None, headers=None, timeout=300):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(cluster.url + path, data=data, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def sse_events(text):
    """(event name, data) pairs of a server-sent event stream."""
    out, name = [], None
    for line in text.splitlines():
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            out.append((name, json.loads(data) if data.startswith("{") else data))
            name = None
    return out


def features(warnings):
    return {w["feature"] for w in warnings or []}


CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01", "x-api-key": "sk-local",
    "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                      "context-management-2025-06-27,prompt-caching-scope-2026-01-05,"
                      "effort-2025-11-24,advanced-tool-use-2025-11-20,oauth-2025-04-20",
    "x-app": "cli", "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
}


def claude_code_body(question, environment, stream=True):
    """A first turn shaped as Claude Code 2.1.332 `-p` sends it (CLIENTS.md): three system
    blocks with cache_control, the user turn, then a system-role message, tools with
    defer_loading, adaptive thinking, effort, context edits, metadata.user_id as a JSON string,
    max_tokens 32000, no temperature."""
    return {
        "model": "claude-opus-5-5",
        "max_tokens": 32000,
        "stream": stream,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332; cc_entrypoint=sdk-cli"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Answer in one short sentence.",
             "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": question, "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": environment},
        ],
        "tools": [
            {"name": "Bash", "description": "Run a shell command.",
             "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                              "required": ["command"]}},
            {"name": "WebFetch", "description": "Fetch a page.", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {"url": {"type": "string"}}},
             "cache_control": {"type": "ephemeral"}},
        ],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "session_id": "s-1"})},
    }


def test_a_claude_code_first_turn_is_served_with_every_unapplied_feature_reported(cluster):
    body = claude_code_body("What is the capital of France?", "Working directory: /tmp/demo")
    status, headers, text = request(cluster, "POST", "/v1/messages?beta=true", body,
                                    CLAUDE_CODE_HEADERS)
    assert status == 200, text
    events = sse_events(text)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    delta = dict(events)["message_delta"]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use"), delta
    got = features(delta.get("strata_warnings"))
    assert {"thinking", "effort", "context_management", "max_tokens"} <= got, delta
    clamp = next(w for w in delta["strata_warnings"] if w["feature"] == "max_tokens")
    assert f"32000 clamped to {CAP}" in clamp["message"]
    assert delta["usage"]["output_tokens"] <= CAP
    # A stream's header carries what was known before the first token.
    assert "thinking" in headers["x-strata-warnings"] and "max_tokens" in headers["x-strata-warnings"]
    # The same turn unstreamed (Claude Code falls back to it), through the SDK's raw JSON path.
    status, headers, text = request(cluster, "POST", "/v1/messages?beta=true",
                                    claude_code_body("What is the capital of France?",
                                                     "Working directory: /tmp/demo", stream=False),
                                    CLAUDE_CODE_HEADERS)
    assert status == 200, text
    message = json.loads(text)
    assert message["type"] == "message" and message["content"], message
    assert {"thinking", "effort", "context_management"} <= features(message["strata_warnings"])
    assert "context_management" in headers["x-strata-warnings"]


def test_a_system_message_in_place_is_rendered_where_it_stands(cluster, claude, oai):
    # Long enough that whole cache blocks (256 tokens) lie before the last question.
    env = "Environment: the repository is a Rust workspace with three crates. " * 50
    msgs = [{"role": "user", "content": "Hello!"}, {"role": "system", "content": env},
            {"role": "user", "content": "What is the capital of France?"}]
    a = claude.messages.create(model=MODEL, max_tokens=12, messages=msgs, extra_body={"temperature": 0})
    # OpenAI's API renders messages as given: the same prompt, token for token, and the same
    # greedy answer, so the system message was not moved.
    o = oai.chat.completions.create(model=MODEL, max_tokens=12, messages=msgs, temperature=0)
    prompt_a = a.usage.input_tokens + a.usage.cache_read_input_tokens
    assert prompt_a == o.usage.prompt_tokens
    assert a.content[0].text == o.choices[0].message.content
    assert "system_messages" not in features(getattr(a, "strata_warnings", None))
    counted = claude.messages.count_tokens(model=MODEL, messages=msgs)
    assert counted.input_tokens == prompt_a
    # The next question after the same history reuses everything up to it from the cache,
    # the in-place system message included.
    b = claude.messages.create(model=MODEL, max_tokens=4, extra_body={"temperature": 0}, messages=[
        *msgs[:2], {"role": "user", "content": "And of Italy?"}])
    head = claude.messages.count_tokens(model=MODEL, messages=msgs[:2]).input_tokens
    assert head > 512
    assert 512 <= b.usage.cache_read_input_tokens <= head, (b.usage, head)


TINY = "tiny"
TINY_CONTEXT = 512


@contextlib.contextmanager
def tiny_cluster(bin_dir, default_model, tmp, model_settings=""):
    """A cluster serving the tiny random Qwen2 that setup writes (its own context is 512
    tokens), with extra `[[models]]` settings, for the duration of the block."""
    path = default_model.parent.parent / "qwen2-tiny/qwen2_tiny.gguf"
    assert path.is_file(), f"{path} missing: run scripts/setup"
    port = pick_port()
    with config_cluster(bin_dir, tmp, port, f"""
bind = "127.0.0.1:{port}"
run_dir = "{tmp / 'run'}"
[cache]
dir = "{tmp / 'kv'}"
ram = "256MiB"
disk = "512MiB"
[[models]]
id = "{TINY}"
path = "{path}"
pinned = true
{model_settings}
""") as c:
        yield c


@pytest.fixture(scope="module")
def tiny(bin_dir, default_model, tmp_path_factory):
    """The tiny model at its own 512-token context: a prompt filling it costs little."""
    with tiny_cluster(bin_dir, default_model, tmp_path_factory.mktemp("tiny")) as c:
        yield c


def long_prompt(claude, tokens):
    """A user message of about `tokens` tokens (counted by the server)."""
    def count(n):
        messages = [{"role": "user", "content": "ab " * n}]
        return messages, claude.messages.count_tokens(model=TINY, messages=messages).input_tokens
    n = tokens // 2
    _, got = count(n)
    per_word = got / n
    return count(int(n + (tokens - got) / per_word))


def test_max_tokens_past_the_context_is_clamped_in_every_api(tiny):
    claude = anthropic.Anthropic(base_url=tiny.url, api_key="unused", max_retries=0)
    oai = openai.OpenAI(base_url=tiny.url + "/v1", api_key="unused", max_retries=0)
    messages, prompt = long_prompt(claude, TINY_CONTEXT - 10)
    room = TINY_CONTEXT - prompt
    assert 0 < room < 32, (prompt, room)
    # (An explicit timeout: the SDK refuses a long max_tokens unstreamed without one.)
    a = claude.messages.with_raw_response.create(model=TINY, max_tokens=32000, messages=messages,
                                                 extra_body={"temperature": 0}, timeout=300)
    m = a.parse()
    warning = a.headers["x-strata-warnings"]
    assert f"clamped to {room}" in warning and f"leaves {room} of the model's context" in warning
    assert m.stop_reason in ("max_tokens", "end_turn")
    assert m.usage.output_tokens <= room
    assert "max_tokens" in features(m.model_extra["strata_warnings"])
    for field in ("max_tokens", "max_completion_tokens"):
        r = oai.chat.completions.with_raw_response.create(
            model=TINY, messages=messages, temperature=0, extra_body={"ignore_eos": True},
            **{field: 32000})
        c = r.parse()
        assert c.choices[0].finish_reason == "length"
        assert c.usage.completion_tokens == room
        assert f"{field} 32000 clamped to {room}" in r.headers["x-strata-warnings"]
    # Streamed: the header and the last chunk both say so.
    with oai.chat.completions.with_streaming_response.create(
            model=TINY, messages=messages, temperature=0, max_tokens=32000, stream=True,
            extra_body={"ignore_eos": True}) as r:
        assert f"clamped to {room}" in r.headers["x-strata-warnings"]
        chunks = [json.loads(line[5:]) for line in r.iter_lines()
                  if line.startswith("data:") and "{" in line]
    last = next(c for c in reversed(chunks) if c.get("choices"))
    assert last["choices"][0]["finish_reason"] == "length"
    assert "max_tokens" in features(last["strata_warnings"])
    resp = oai.responses.with_raw_response.create(model=TINY, input=messages, temperature=0,
                                                  max_output_tokens=32000)
    assert f"max_output_tokens 32000 clamped to {room}" in resp.headers["x-strata-warnings"]
    assert resp.parse().usage.output_tokens <= room
    # A prompt that alone fills the context stays a 400, in each API's words.
    too_long = [{"role": "user", "content": messages[0]["content"] + " ab" * 40}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=TINY, max_tokens=32000, messages=too_long, timeout=300)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    message = e.value.body["error"]["message"]
    assert message.startswith("prompt is too long: ") and f"tokens > {TINY_CONTEXT - 1} maximum" in message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=TINY, messages=too_long, max_tokens=32000)
    assert e.value.body["code"] == "context_length_exceeded"


def test_agent_model_names_route_by_pattern_and_unknown_ones_stay_404(cluster, claude, oai):
    for name in ("claude-haiku-4-5-20251001", "claude-opus-5-5"):
        m = claude.messages.create(model=name, max_tokens=3, messages=[{"role": "user", "content": "hi"}])
        assert m.model == name and m.content
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-5.1-mini", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found"
    assert "default_model" in e.value.body["message"]


def test_a_default_model_serves_every_other_name(bin_dir, default_model, tmp_path):
    with running_cluster(bin_dir, default_model, tmp_path, "--default-model", MODEL) as c:
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="gpt-5.1-codex-mini", max_tokens=3,
                                           messages=[{"role": "user", "content": "hi"}])
        assert r.model == "gpt-5.1-codex-mini" and r.choices[0].message.content is not None


def request_at(url, method, path):
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, method=method), timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except OSError:
        return None, None


def test_models_carry_anthropics_fields_and_probes_answer(cluster, claude):
    page = claude.models.list()
    ids = [m.id for m in page.data]
    assert ids == [MODEL, EMBED], ids
    first = page.data[0]
    assert first.type == "model" and first.display_name == MODEL and first.created_at.year >= 2026
    status, _, text = request(cluster, "GET", "/v1/models?limit=1000")
    listing = json.loads(text)
    assert listing["has_more"] is False and listing["first_id"] == MODEL and listing["last_id"] == EMBED
    assert "claude-*" not in text  # a pattern routes names; it is not one
    for path in ("/", "/api/hello"):
        started = time.monotonic()
        status, _ = request_at(cluster.url, "HEAD", path)
        assert status == 200 and time.monotonic() - started < 2


def test_a_codex_turn_with_namespace_and_hosted_tools_is_served(cluster, oai):
    tools = [
        {"type": "function", "name": "shell", "strict": False, "description": "Run a command.",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                        "required": ["command"]}},
        {"type": "namespace", "name": "mcp__files", "description": "File tools.",
         "tools": [{"type": "function", "name": "read", "description": "Read a file.",
                    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                   "required": ["path"]}}]},
        {"type": "web_search"},
    ]
    history = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex, a coding agent."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Read a.txt"}]},
        {"type": "function_call", "call_id": "call_1", "name": "read", "namespace": "mcp__files",
         "arguments": "{\"path\": \"a.txt\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "hello from a.txt"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What did the file say?"}]},
    ]
    common = dict(model=MODEL, input=history, tools=tools, store=False,
                  reasoning={"summary": "auto"}, include=["reasoning.encrypted_content"],
                  prompt_cache_key="session-1", temperature=0, max_output_tokens=8,
                  extra_body={"client_metadata": {"x-codex-turn": "1"}})
    raw = oai.responses.with_raw_response.create(**common)
    r = raw.parse()
    assert r.status in ("completed", "incomplete") and r.output, r
    got = features(r.model_extra.get("strata_warnings"))
    assert {"hosted_tools", "reasoning"} <= got, got
    assert "web_search" in raw.headers["x-strata-warnings"]
    # Streamed, as Codex reads it: ends with response.completed (or .incomplete at the cut).
    kinds = [e.type for e in oai.responses.create(**common, stream=True)]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    # A call to a namespaced function comes back with its namespace apart.
    forced = oai.responses.create(model=MODEL, input="Read the file a.txt", tools=tools[1:],
                                  tool_choice="required", max_output_tokens=60, temperature=0)
    calls = [o for o in forced.output if o.type == "function_call"]
    assert calls and calls[0].name == "read" and calls[0].namespace == "mcp__files", forced.output
    assert "path" in json.loads(calls[0].arguments)


def test_codexs_websocket_probe_is_told_at_once_to_use_http(cluster):
    started = time.monotonic()
    status, headers, text = request(cluster, "GET", "/v1/responses", headers={
        "connection": "Upgrade", "upgrade": "websocket", "sec-websocket-version": "13",
        "sec-websocket-key": "dGhlIHNhbXBsZSBub25jZQ==",
        "openai-beta": "responses_websockets=2026-02-06"})
    took = time.monotonic() - started
    assert status == 426, (status, text)
    assert "POST /v1/responses" in json.loads(text)["error"]["message"]
    print(f"\nWebSocket probe answered 426 in {took * 1000:.1f} ms")


def test_embeddings_accept_a_null_encoding_format(cluster):
    status, _, text = request(cluster, "POST", "/v1/embeddings",
                              {"model": EMBED, "input": ["hello"], "encoding_format": None})
    assert status == 200, text
    assert len(json.loads(text)["data"][0]["embedding"]) == 384


def test_unapplied_features_are_in_the_metrics_and_admin(cluster, claude):
    claude.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}],
                           extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert any(line.startswith("strata_feature_not_applied_total") and 'feature="thinking"' in line
               for line in metrics.splitlines()), metrics
    token = (cluster.run_dir / "admin-token").read_text().strip()
    req = urllib.request.Request(cluster.url + "/admin/api/workers",
                                 headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        workers = {w["name"]: w for w in json.load(r)["workers"]}
    thinking = workers[f"worker-{MODEL}"]["not_applied"]["thinking"]
    assert thinking["requests"] >= 1 and "no thinking mode" in thinking["last"]


# A template as strict as many published ones: a system message may only come first.
STRICT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System messages are only allowed first') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_a_template_that_refuses_a_late_system_message_gets_it_joined_and_says_so(
        bin_dir, default_model, tmp_path):
    source = default_model.parent.parent / "smollm2-135m-instruct-f32"
    assert (source / "model.safetensors").is_file(), f"{source} missing: run scripts/setup"
    folder = tmp_path / "strict-smollm2"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (folder / name).symlink_to(source / name)
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "c").mkdir()
    with running_cluster(bin_dir, folder, tmp_path / "c") as c:
        claude = anthropic.Anthropic(base_url=c.url, api_key="x", max_retries=0)
        late = [{"role": "user", "content": "Hello!"},
                {"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "What is the capital of France?"}]
        r = claude.messages.with_raw_response.create(model=MODEL, max_tokens=8, messages=late,
                                                     extra_body={"temperature": 0})
        m = r.parse()
        notice = next(w for w in m.model_extra["strata_warnings"] if w["feature"] == "system_messages")
        assert "position 1" in notice["message"] and "next user message" in notice["message"]
        assert "system_messages" in r.headers["x-strata-warnings"]
        # The prompt is what the fold says: the system text at the start of the next user turn.
        joined = [late[0], {"role": "user", "content": "Answer in French.\n\nWhat is the capital of France?"}]
        counted = claude.messages.count_tokens(model=MODEL, messages=joined).input_tokens
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted
        assert c.proc.poll() is None


def test_up_with_no_model_named_serves_the_chat_and_the_embedding_model(bin_dir, tmp_path):
    """`make run`: `strata up` with nothing but defaults serves both models setup fetched, so a
    client's first embeddings call works."""
    port = pick_port()
    log = tmp_path / "strata.log"
    proc = subprocess.Popen([bin_dir / "strata", "up", "--bind", f"127.0.0.1:{port}",
                             "--run-dir", str(tmp_path / "run"), "--kv-dir", str(tmp_path / "kv"),
                             "--kv-ram", "64MiB", "--kv-disk", "256MiB"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    c = Cluster(proc, port, tmp_path / "run", log)
    try:
        c.wait_ready()
        client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
        ids = {m.id: m.kind for m in client.models.list().data}
        assert ids == {"smollm2-135m-instruct": "llm", EMBED: "embedding"}, ids
        e = client.embeddings.create(model=EMBED, input="hello")
        assert len(e.data[0].embedding) == 384
    finally:
        stop_cluster(c)


def test_anthropic_output_config_format_is_enforced(claude):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    m = claude.messages.create(
        model=MODEL, max_tokens=60, messages=[{"role": "user", "content": "Name a city in France."}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}},
                    "temperature": 0})
    answer = json.loads(m.content[0].text)
    assert set(answer) == {"city"} and isinstance(answer["city"], str), answer
