"""The coding agents and libraries people point at a local server, run as their real binaries
against a real cluster (SmolLM2), offline, with only the switches ../shared/CLIENTS.md names:
Claude Code `-p` (and `--continue`), Codex `exec`, opencode `run` on its OpenAI-compatible and
Anthropic providers, aider `--message`, litellm as a library and as a proxy. Each test checks
what the user sees (an answer, the exit status) and what arrived at the server.

The clients are installed, pinned, by scripts/setup into $STRATA_CACHE/clients. The model's
answers are capped by its `max_output_tokens` (a server setting: 400 tokens for SmolLM2, room
enough to end an answer, which Claude Code needs; 32 for the random model, which never ends
one), so that the 32000 tokens the agents ask for finish on 2 cores; the clients themselves get
no workaround.

Codex and opencode send 8-10K-token first turns, past SmolLM2's 8K context; they run on the tiny
random Qwen2 that setup writes, served with a 128K context (`context_length`): a protocol check,
whose answers are random text."""
import json
import os
import pathlib
import re
import subprocess
import time
import urllib.request

import pytest

from test_agent_requests import TINY, tiny_cluster
from test_api import MODEL, pick_port, running_cluster

CLIENTS = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata")) / "clients"
BIN = CLIENTS / "node_modules/.bin"
AIDER = CLIENTS / "aider/bin"
LITELLM = CLIENTS / "litellm/bin"
CAP = 160
KEY = "sk-local-test"


@pytest.fixture(scope="module")
def cluster(bin_dir, default_model, tmp_path_factory):
    for tool in (BIN / "claude", BIN / "codex", BIN / "opencode", AIDER / "aider",
                 LITELLM / "litellm"):
        assert tool.exists(), f"{tool} missing: run scripts/setup"
    with running_cluster(bin_dir, default_model, tmp_path_factory.mktemp("clients"),
                         "--alias", "claude-*", "--max-output-tokens", str(CAP)) as c:
        yield c


@pytest.fixture(scope="module")
def tiny(bin_dir, default_model, tmp_path_factory):
    with tiny_cluster(bin_dir, default_model, tmp_path_factory.mktemp("tiny-clients"),
                      'aliases = ["claude-*"]\ncontext_length = 131072\nmax_output_tokens = 32') as c:
        yield c


def requests_seen(cluster, route):
    """How many requests the gateway has answered on `route`, by status."""
    with urllib.request.urlopen(cluster.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    seen = {}
    for line in text.splitlines():
        m = re.match(r'strata_http_requests_total\{(.*)\} (\d+)', line)
        if m and f'route="{route}"' in m.group(1):
            status = re.search(r'status="(\d+)"', m.group(1)).group(1)
            seen[status] = seen.get(status, 0) + int(m.group(2))
    return seen


def clean_env(home, **extra):
    """An environment with a private HOME and nothing that reaches the internet."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               XDG_DATA_HOME=str(home / ".local/share"), XDG_CACHE_HOME=str(home / ".cache"),
               NO_COLOR="1", **extra)
    return env


def run(cmd, env, cwd, timeout=600):
    started = time.monotonic()
    out = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True,
                         timeout=timeout, stdin=subprocess.DEVNULL)
    print(f"\n$ {' '.join(map(str, cmd))[:160]}\n  exit {out.returncode} in "
          f"{time.monotonic() - started:.1f} s\n  stdout: {out.stdout[-1500:]}\n  stderr: {out.stderr[-1500:]}")
    return out


def claude_env(cluster, home, **extra):
    return clean_env(home, ANTHROPIC_BASE_URL=cluster.url, ANTHROPIC_API_KEY=KEY,
                     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", **extra)


def answered(result):
    """Claude Code's verdict on a served turn: an answer, or the output limit it hit after
    asking the model to continue (sampled text from a 135M model may not end in time)."""
    if result.get("api_error") == "max_output_tokens":
        return True
    return result["is_error"] is False and bool(result["result"].strip())


def test_claude_code_print_mode_answers_and_its_next_turn_reads_the_cache(cluster, tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    env = claude_env(cluster, tmp_path, CLAUDE_CODE_SIMPLE="1")
    before = requests_seen(cluster, "/v1/messages").get("200", 0)
    first = run([BIN / "claude", "-p", "What is the capital of France? Answer in one word.",
                 "--output-format", "json"], env, work)
    result = json.loads(first.stdout)
    assert answered(result), result
    assert requests_seen(cluster, "/v1/messages").get("200", 0) > before
    # The second turn resends the first as its prefix: read from the cache.
    second = run([BIN / "claude", "-p", "--continue", "And the capital of Italy?",
                  "--output-format", "json"], env, work)
    result = json.loads(second.stdout)
    assert answered(result), result
    assert result["usage"]["cache_read_input_tokens"] > 500, result["usage"]


def test_claude_code_full_mode_first_turn_is_served(cluster, tmp_path):
    """Full mode sends its whole system prompt, 12 tools and an in-place system message; on
    SmolLM2's 8K context the ~12K-token turn is too long, and Claude Code must be told so in
    the words it looks for (it then says the prompt is too long) instead of a protocol error."""
    work = tmp_path / "project"
    work.mkdir()
    out = run([BIN / "claude", "-p", "Say hi.", "--output-format", "json"],
              claude_env(cluster, tmp_path), work)
    text = out.stdout + out.stderr
    if out.returncode == 0 and not json.loads(out.stdout).get("is_error"):
        return  # the turn fitted and was answered
    # Claude Code read Strata's 400 as Anthropic's context error (it then compacts, or, for a
    # first turn that cannot be compacted, says the prompt is too long).
    result = json.loads(out.stdout)
    assert result["terminal_reason"] == "prompt_too_long", result
    assert result["api_error_status"] == 400 and "Prompt is too long" in result["result"], result
    assert "not user or assistant" not in text and "exceeds the context" not in text


def statuses_seen(cluster, route):
    return requests_seen(cluster, route)


def test_claude_code_full_mode_first_turn_streams_from_a_long_context_model(tiny, tmp_path):
    """The whole ~12K-token first turn (system blocks, 12 tools, the in-place system message,
    thinking, effort, context edits) on a model whose context holds it. The random model's
    answer never ends: the server's cap cuts it, Claude Code asks it to continue (a request
    each time) and finally reports the output limit. Every request must have been a 200."""
    work = tmp_path / "project"
    work.mkdir()
    before = statuses_seen(tiny, "/v1/messages")
    out = run([BIN / "claude", "-p", "Say hi.", "--output-format", "json"],
              claude_env(tiny, tmp_path), work)
    after = statuses_seen(tiny, "/v1/messages")
    assert after.get("200", 0) > before.get("200", 0), (before, after)
    assert {k for k in after if after[k] != before.get(k, 0)} == {"200"}, (before, after)
    result = json.loads(out.stdout)
    usage = result["usage"]
    # Its prompt arrived whole: far more than SmolLM2's 8K context would have held.
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] > 8192, usage
    assert result["is_error"] is False or result.get("api_error") == "max_output_tokens", result


def codex_home(cluster, home):
    codex = home / "codex"
    codex.mkdir(parents=True)
    (codex / "config.toml").write_text(f'''model = "{TINY}"
model_provider = "local"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
apps = false
remote_plugin = false

[model_providers.local]
name = "Strata"
base_url = "{cluster.url}/v1"
env_key = "LOCAL_API_KEY"
wire_api = "responses"
''')
    return codex


def test_codex_exec_answers(tiny, tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    env = clean_env(tmp_path, CODEX_HOME=str(codex_home(tiny, tmp_path)), LOCAL_API_KEY=KEY)
    before = requests_seen(tiny, "/v1/responses").get("200", 0)
    out = run([BIN / "codex", "exec", "--skip-git-repo-check",
               "What is the capital of France? Answer in one word."], env, work)
    assert requests_seen(tiny, "/v1/responses").get("200", 0) > before
    # The random model never ends its answer: the server's cap cuts it, the response is
    # `incomplete` (max_output_tokens), and Codex says so and exits 1. Anything else it
    # reports is a protocol failure.
    errors = [line for line in out.stderr.splitlines() if line.startswith("ERROR")]
    assert all("Incomplete response returned, reason: max_output_tokens" in e for e in errors), errors
    assert out.returncode in (0, 1) and "tokens used" in out.stderr, out.stderr


def test_codex_on_its_built_in_provider_falls_back_to_http_after_one_websocket_probe(tiny, tmp_path):
    """With `openai_base_url` (the built-in provider) Codex first tries the Responses API's
    WebSocket transport, 7 times over ~6.5 s against a server that answers it with a 404. A 426
    makes it post over HTTP after the first probe."""
    work = tmp_path / "project"
    work.mkdir()
    codex = tmp_path / "codex"
    codex.mkdir()
    (codex / "config.toml").write_text(f'''model = "{TINY}"
openai_base_url = "{tiny.url}/v1"
check_for_update_on_startup = false
web_search = "disabled"

[analytics]
enabled = false

[features]
plugins = false
apps = false
remote_plugin = false
''')
    before = requests_seen(tiny, "/v1/responses")
    out = run([BIN / "codex", "exec", "--skip-git-repo-check", "Hi"],
              clean_env(tmp_path, CODEX_HOME=str(codex), OPENAI_API_KEY=KEY), work)
    after = requests_seen(tiny, "/v1/responses")
    assert after.get("426", 0) - before.get("426", 0) == 1, (before, after)
    assert after.get("200", 0) > before.get("200", 0), (before, after, out.stderr)


def opencode_config(cluster, home, provider):
    if provider == "openai":
        block = {"npm": "@ai-sdk/openai-compatible", "name": "Strata",
                 "options": {"baseURL": cluster.url + "/v1", "apiKey": KEY},
                 "models": {TINY: {"name": "tiny"}}}
    else:
        block = {"npm": "@ai-sdk/anthropic", "name": "Strata",
                 "options": {"baseURL": cluster.url + "/v1", "apiKey": KEY},
                 "models": {TINY: {"name": "tiny"}}}
    cfg = home / ".config/opencode"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"strata": block},
        "model": f"strata/{TINY}", "small_model": f"strata/{TINY}",
        "share": "disabled", "autoupdate": False,
    }))


@pytest.mark.parametrize("provider,route", [("openai", "/v1/chat/completions"),
                                            ("anthropic", "/v1/messages")])
def test_opencode_run_answers_on_both_providers(tiny, tmp_path, provider, route):
    cluster = tiny
    work = tmp_path / "project"
    work.mkdir()
    opencode_config(cluster, tmp_path, provider)
    env = clean_env(tmp_path, OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1",
                    OPENCODE_DISABLE_DEFAULT_PLUGINS="1", OPENCODE_DISABLE_LSP_DOWNLOAD="1",
                    OPENCODE_DISABLE_SHARE="1")
    before = requests_seen(cluster, route).get("200", 0)
    out = run([BIN / "opencode", "run", "--pure", "What is the capital of France?"], env, work)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), out.stderr
    assert requests_seen(cluster, route).get("200", 0) > before


def test_aider_message_answers(cluster, tmp_path):
    work = tmp_path / "project"
    work.mkdir()
    env = clean_env(tmp_path, LITELLM_LOCAL_MODEL_COST_MAP="True")
    before = requests_seen(cluster, "/v1/chat/completions").get("200", 0)
    out = run([AIDER / "aider", "--model", f"openai/{MODEL}", "--openai-api-base", cluster.url + "/v1",
               "--openai-api-key", KEY, "--message", "What is the capital of France?",
               "--yes-always", "--no-git", "--no-check-update", "--analytics-disable",
               "--no-show-release-notes", "--no-pretty", "--no-stream"], env, work)
    # aider exits 0 even after an HTTP error: judge what it printed.
    assert out.returncode == 0, out.stderr
    assert "BadRequestError" not in out.stdout and "APIError" not in out.stdout, out.stdout
    assert requests_seen(cluster, "/v1/chat/completions").get("200", 0) > before


LITELLM_LIBRARY = """
import json, sys
import litellm
base = sys.argv[1]
a = litellm.completion(model="openai/{model}", api_base=base + "/v1", api_key="{key}",
                       messages=[{{"role": "user", "content": "Hi"}}], max_tokens=8)
b = litellm.completion(model="anthropic/{model}", api_base=base, api_key="{key}",
                       messages=[{{"role": "user", "content": "Hi"}}], max_tokens=8)
print(json.dumps([a.choices[0].message.content, b.choices[0].message.content]))
"""


def test_litellm_library_on_both_apis(cluster, tmp_path):
    script = tmp_path / "lib.py"
    script.write_text(LITELLM_LIBRARY.format(model=MODEL, key=KEY))
    out = run([LITELLM / "python", script, cluster.url], clean_env(tmp_path, LITELLM_LOCAL_MODEL_COST_MAP="True"),
              tmp_path)
    assert out.returncode == 0, out.stderr
    answers = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(isinstance(a, str) for a in answers), answers


def test_litellm_proxy_in_front_of_strata(cluster, tmp_path):
    port = pick_port()
    (tmp_path / "proxy.yaml").write_text(f"""model_list:
  - model_name: local
    litellm_params:
      model: openai/{MODEL}
      api_base: {cluster.url}/v1
      api_key: {KEY}
""")
    env = clean_env(tmp_path, LITELLM_LOCAL_MODEL_COST_MAP="True")
    proc = subprocess.Popen([str(LITELLM / "litellm"), "--config", str(tmp_path / "proxy.yaml"),
                             "--host", "127.0.0.1", "--port", str(port)], env=env, cwd=tmp_path,
                            stdout=open(tmp_path / "proxy.log", "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "proxy.log").read_text()
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health/liveliness", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        body = json.dumps({"model": "local", "max_tokens": 8,
                           "messages": [{"role": "user", "content": "Hi"}]}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
        assert answer["choices"][0]["message"]["content"] is not None, answer
    finally:
        proc.terminate()
        proc.wait(timeout=30)
