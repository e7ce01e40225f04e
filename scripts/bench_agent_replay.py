#!/usr/bin/env python3
"""A scripted 20-turn coding-agent session replayed against Strata (cache on, cache off),
mlx_lm.server, llama-server and vllm-mlx, one server at a time on the same cores, in one run (not in CI).

    scripts/bench-setup
    cargo build --release --bins
    scripts/mlx-env $STRATA_CACHE/benchvenv/bin/python scripts/bench_agent_replay.py \
        --bin-dir target/release --out docs/bench/agent

The session: a system prompt of about 3,000 tokens (agent instructions and the definitions of
six tools), then per turn a user message, the assistant's tool call and the tool's result
(about 230 tokens together), as an agent resends its whole, growing conversation each turn.
The tool definitions and calls are written into the messages as text (SmolLM2's template has
no tools), so that every server sees exactly the same prompt. Each turn's request streams 8
tokens at temperature 0 through /v1/chat/completions; the scripted call and result are then
appended, whatever the model said. Between turns 10 and 11 every server is restarted (for
Strata: the gateway, its worker and its cache service).

- strata: prefix cache on (worker L0, cache service RAM and disk).
- strata, cache off: each request carries its own `cache_salt`, so no block is ever reused
  (blocks are still stored: the cost of storing is included). Every turn is then a cold
  prefill of the whole prompt, independent of the other turns, so it is measured at turns
  1, 5, 10, 11, 15 and 20 only (--off-turns).
- mlx_lm.server, vllm-mlx: their own prompt caches (vllm-mlx with its SSD tier).
- llama-server: its prompt cache in one slot of 16K tokens (the session reaches ~8K), the slot
  saved before the restart and restored after it (the restore is counted in turn 11).

Reports TTFT per turn, the total, and the cached prompt tokens each server reports per turn
(`usage.prompt_tokens_details.cached_tokens`, where it reports them).
"""
import argparse
import json
import pathlib
import random
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_peers  # noqa: E402  (the servers, the streaming client, the tokenizer)

TOOLS = [
    ("read_file", "Read a file of the repository", {"path": "string", "start_line": "integer",
                                                     "end_line": "integer"}),
    ("write_file", "Write a whole file", {"path": "string", "content": "string"}),
    ("edit_file", "Replace an exact string in a file", {"path": "string", "old": "string",
                                                        "new": "string"}),
    ("run_command", "Run a shell command in the repository", {"command": "string",
                                                              "timeout_s": "integer"}),
    ("search_code", "Search the repository for a regular expression", {"pattern": "string",
                                                                       "glob": "string"}),
    ("list_dir", "List a directory", {"path": "string"}),
]
RULES = ("Read the relevant files before editing them. Keep changes small and focused. Run the "
         "tests after every change and read their output. Never invent file contents. Prefer "
         "the project's existing helpers over new code. Explain each change in one sentence. "
         "When a command fails, read the error before retrying. Do not touch generated files. "
         "Keep functions short and names explicit. Write a test for every bug you fix.")
FILES = ["src/lib.rs", "src/http/server.rs", "src/store/blocks.rs", "src/engine/sampler.rs",
         "tests/api.rs", "Cargo.toml", "src/config.rs", "src/cache/tier.rs"]


def system_prompt(tokens, target):
    """Agent instructions and tool definitions, padded with numbered rules to ~target tokens."""
    tools = "\n".join(json.dumps({"type": "function", "function": {
        "name": n, "description": d, "parameters": {
            "type": "object", "properties": {k: {"type": t} for k, t in p.items()},
            "required": list(p)}}}) for n, d, p in TOOLS)
    head = ("You are a coding agent working in a Rust repository.\n\n# Tools\n\n<tools>\n"
            f"{tools}\n</tools>\n\nCall a tool with <tool_call>{{\"name\": ..., \"arguments\": "
            "{...}}</tool_call>.\n\n# Rules\n")
    text, n = head, 0
    while tokens.count(text) < target:
        n += 1
        text += f"{n}. {RULES}\n"
    return text


def turn_messages(t, rng):
    """The user message of turn t, then the scripted call and its result (~230 tokens)."""
    path = FILES[t % len(FILES)]
    user = {"role": "user", "content": f"Step {t}: look at {path} and fix the failing test "
                                        f"number {t}; tell me what you changed."}
    call = {"role": "assistant", "content": "<tool_call>" + json.dumps(
        {"name": "read_file", "arguments": {"path": path, "start_line": 1, "end_line": 40}})
        + "</tool_call>"}
    lines = [f"{i:3}  " + " ".join(rng.choice(bench_peers.WORDS) for _ in range(9))
             for i in range(1, 13)]
    result = {"role": "user", "content": "<tool_response>\n" + "\n".join(lines)
              + "\n</tool_response>"}
    return user, [call, result]


def replay(server, system, turns, measure_turns, salted, log):
    """[(turn, ttft_s, prompt_tokens, cached_tokens)] for the measured turns."""
    rng = random.Random(7)
    messages = [{"role": "system", "content": system}]
    rows = []
    for t in range(1, turns + 1):
        user, rest = turn_messages(t, rng)
        messages.append(user)
        if t == turns // 2 + 1:
            server.before_restart()
            server.stop()
            server.start()
            restore = server.after_restart()
        else:
            restore = 0.0
        if t in measure_turns:
            extra = dict(server.extra)
            if salted:
                extra["cache_salt"] = uuid.uuid4().hex
            ttft, cached, prompt = chat(server, messages, extra)
            rows.append((t, restore + ttft, prompt, cached))
            log(f"{server.name}{' (cache off)' if salted else ''} turn {t}: "
                f"{restore + ttft:.2f} s, prompt {prompt}, cached {cached}")
        messages.extend(rest)
    return rows


class LlamaServer(bench_peers.LlamaServer):
    """One slot that holds the whole session (bench_peers splits 40K over 8 streams)."""

    def command(self):
        cmd = super().command()
        cmd[cmd.index("-np") + 1] = "1"
        cmd[cmd.index("-c") + 1] = "16384"
        return cmd


def chat(server, messages, extra):
    """TTFT, cached tokens (None when the server does not say) and prompt tokens."""
    usage = {}
    ttft, _, _, prompt, _ = bench_peers.stream_chat(server.base, server.model, messages, 8,
                                                    extra, usage_out=usage)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return ttft, cached, prompt


def write_report(args, results, machine, out):
    lines = []
    say = lines.append
    say(f"Run of {machine['date']}: {machine['cpu']}, {bench_peers.THREADS} threads for every "
        f"server, {machine['mem']}; load average before {machine['load_before']}, after "
        f"{machine['load_after']}. One run. Restart of every server between turns "
        f"{args.turns // 2} and {args.turns // 2 + 1}.")
    say("")
    names = list(results)
    say("TTFT per turn in seconds (cached prompt tokens in brackets, where the server reports "
        "them):")
    say("")
    say("| turn | prompt tokens | " + " | ".join(names) + " |")
    say("|---" * (2 + len(names)) + "|")
    for t in range(1, args.turns + 1):
        cells, prompt = [], None
        for name in names:
            row = next((r for r in results[name] if r[0] == t), None)
            if row is None:
                cells.append("-")
                continue
            prompt = prompt or row[2]
            cached = "" if row[3] is None else f" ({row[3]})"
            cells.append(f"{row[1]:.2f}{cached}")
        say(f"| {t}{' (after restart)' if t == args.turns // 2 + 1 else ''} | {prompt or ''} | "
            + " | ".join(cells) + " |")
    say("")
    say("| | " + " | ".join(names) + " |")
    say("|---" * (1 + len(names)) + "|")
    say("| total TTFT, measured turns | " + " | ".join(
        f"{sum(r[1] for r in results[n]):.1f} s ({len(results[n])} turns)" for n in names) + " |")
    say("| median TTFT, turns 2-10 and 12-20 | " + " | ".join(
        (lambda xs: f"{statistics.median(xs):.2f} s" if xs else "-")(
            [r[1] for r in results[n] if r[0] not in (1, args.turns // 2 + 1)]) for n in names)
        + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "agent_replay.md").write_text(text)
    (out / "agent_replay.json").write_text(json.dumps(
        {"machine": machine, "results": results}, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--servers", default="strata,strata-off,mlx_lm.server,llama-server,vllm-mlx")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--off-turns", default="1,5,10,11,15,20")
    ap.add_argument("--vllm-mlx", default=str(bench_peers.PEERS / "vllmmlxvenv/bin/vllm-mlx"))
    ap.add_argument("--llama-server", default=None, help="[default: from $STRATA_CACHE/peers]")
    ap.add_argument("--out", default="docs/bench/agent")
    args = ap.parse_args()
    args.model = bench_peers.MODELS["smollm2"]
    if args.llama_server is None:
        args.llama_server = bench_peers.llama_server_path()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-agent-"))
    tokens = bench_peers.Tokens(args.model)
    system = system_prompt(tokens, args.system_tokens)
    machine = bench_peers.machine_facts()
    kinds = {"strata": bench_peers.Strata, "strata-off": bench_peers.Strata,
             "mlx_lm.server": bench_peers.MlxLm, "llama-server": LlamaServer,
             "vllm-mlx": bench_peers.VllmMlx}
    all_turns = set(range(1, args.turns + 1))
    off_turns = {int(t) for t in args.off_turns.split(",")}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    results = {}
    for name in args.servers.split(","):
        server = kinds[name](args, tmp / name)
        server.start()
        try:
            salted = name == "strata-off"
            results[name] = replay(server, system, args.turns,
                                   off_turns if salted else all_turns, salted, log)
        finally:
            server.stop()
    machine["load_after"] = " / ".join(f"{x:.2f}" for x in bench_peers.os.getloadavg())
    write_report(args, results, machine, out)


if __name__ == "__main__":
    main()
