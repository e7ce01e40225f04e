#!/usr/bin/env python3
"""A real Claude Code session against Strata, llama-server and vllm-mlx, one server at a time
on the same cores, in one run (not in CI).

    scripts/bench-setup qwen1.5b
    cargo build --release --bins
    scripts/mlx-env $STRATA_CACHE/benchvenv/bin/python scripts/bench_agent_clients.py \
        --bin-dir target/release --model qwen1.5b --out docs/bench/agent-clients

The session: Claude Code 2.1.332 (`$STRATA_CACHE/clients`, installed by scripts/setup) in
`-p` mode, one process per turn, `--continue` from the second turn, in a scratch project with
one file, with its Bash, Read and Edit tools allowed. Six turns: read a file, run a command,
edit the file, (every server restarted), read it again, run it again, answer. Claude Code runs
in its simple mode (`CLAUDE_CODE_SIMPLE=1`: 3 tools, a ~1.2K-token system prompt): its full
first turn (~12K tokens) would take minutes per cold prefill of a 1.5B model on 2 cores.

Between Claude Code and the server sits a timing proxy that forwards every byte unchanged and
records, per API request, the time to the first streamed content event and the usage the
server reports (input tokens, cache_read_input_tokens). The table lists, per turn, the
requests Claude Code made (a tool call is one more request), the first request's TTFT, the
turn's wall time and the cached prompt tokens of each request.
"""
import argparse
import http.client
import http.server
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_peers  # noqa: E402  (the servers and the models)

CLIENTS = bench_peers.CACHE / "clients"
CLAUDE = CLIENTS / "node_modules/.bin/claude"
APP = 'def greet(name):\n    return "hello " + name\n\n\nprint(greet("world"))\n'
TURNS = [
    "Read the file app.py and tell me in one sentence what it does.",
    "Run the command `python3 app.py` and tell me what it printed.",
    "Edit app.py so that greet returns \"goodbye \" + name instead of \"hello \" + name.",
    "Read app.py again and confirm that the change is there.",
    "Run `python3 app.py` again and tell me what it printed now.",
    "In one sentence: what did we change in this session?",
]
RESTART_AFTER = 3


class Recorder:
    """What the proxy saw, per request."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = []

    def add(self, entry):
        with self.lock:
            self.requests.append(entry)

    def since(self, n):
        with self.lock:
            return self.requests[n:]


def proxy(upstream_port, recorder):
    """A threaded HTTP proxy to 127.0.0.1:upstream_port; returns (server, its port)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_):
            pass

        def do_HEAD(self):
            self.forward()

        def do_GET(self):
            self.forward()

        def do_POST(self):
            self.forward()

        def forward(self):
            started = time.monotonic()
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else None
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port[0], timeout=3600)
            headers = {k: v for k, v in self.headers.items()
                       if k.lower() not in ("host", "connection", "accept-encoding")}
            conn.request(self.command, self.path, body=body, headers=headers)
            r = conn.getresponse()
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("transfer-encoding", "chunked")
            self.send_header("connection", "close")
            self.end_headers()
            entry = {"path": self.path, "status": r.status, "ttft_s": None, "usage": {},
                     "client_left": False}
            buffer = b""
            try:
                while True:
                    chunk = r.read1(65536)
                    if not chunk:
                        break
                    if entry["ttft_s"] is None and b"content_block_delta" in chunk:
                        entry["ttft_s"] = time.monotonic() - started
                    buffer += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                # Claude Code gave up on the request (its own timeout, or the turn's).
                entry["client_left"] = True
            finally:
                conn.close()
            entry["total_s"] = time.monotonic() - started
            for line in buffer.decode("utf-8", "replace").splitlines():
                if line.startswith("data:") and '"usage"' in line:
                    try:
                        event = json.loads(line[5:])
                    except ValueError:
                        continue
                    usage = event.get("usage") or event.get("message", {}).get("usage") or {}
                    entry["usage"].update({k: v for k, v in usage.items() if v is not None})
            if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
                recorder.add(entry)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


def claude_turn(prompt, first, proxy_port, work, home, turn_timeout_s):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(HOME=str(home), ANTHROPIC_BASE_URL=f"http://127.0.0.1:{proxy_port}",
               ANTHROPIC_API_KEY="sk-bench", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               CLAUDE_CODE_SIMPLE="1")
    cmd = [str(CLAUDE), "-p", prompt, "--output-format", "json", "--model", "m",
           "--allowedTools", "Bash(python3:*)", "Read", "Edit"]
    if not first:
        cmd.insert(2, "--continue")
    started = time.monotonic()
    try:
        out = subprocess.run(cmd, env=env, cwd=work, capture_output=True, text=True,
                             timeout=turn_timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return time.monotonic() - started, {"is_error": True, "result": "turn timed out"}
    wall = time.monotonic() - started
    try:
        result = json.loads(out.stdout)
    except ValueError:
        result = {"is_error": True, "result": (out.stdout + out.stderr)[-300:]}
    return wall, result


def session(server, tmp, log):
    work = tmp / "project"
    work.mkdir(parents=True)
    (work / "app.py").write_text(APP)
    home = tmp / "home"
    home.mkdir()
    recorder = Recorder()
    upstream = [server.port]
    prox, proxy_port = proxy(upstream, recorder)
    turns = []
    try:
        for i, prompt in enumerate(TURNS, start=1):
            if i == RESTART_AFTER + 1:
                log(f"{server.name}: restarting")
                server.before_restart()
                server.stop()
                server.start()
                restore = server.after_restart()
            else:
                restore = 0.0
            seen = len(recorder.requests)
            wall, result = claude_turn(prompt, i == 1, proxy_port, work, home,
                                       server.args.turn_timeout)
            requests = recorder.since(seen)
            first = requests[0] if requests else {}
            turns.append({
                "turn": i, "wall_s": wall + restore, "requests": len(requests),
                "first_ttft_s": (first.get("ttft_s") or 0) + restore if requests else None,
                "cached": [r["usage"].get("cache_read_input_tokens", 0) for r in requests],
                "input": [r["usage"].get("input_tokens", 0) for r in requests],
                "statuses": [r["status"] for r in requests],
                "is_error": bool(result.get("is_error")),
                "answer": str(result.get("result", ""))[:160],
            })
            log(f"{server.name} turn {i}: {turns[-1]['requests']} requests, first TTFT "
                f"{turns[-1]['first_ttft_s']}, wall {wall:.1f} s, error {turns[-1]['is_error']}")
    finally:
        prox.shutdown()
    return turns


def write_report(args, results, out):
    lines = [f"Claude Code 2.1.332 `-p --continue` session, {args.model['label']} "
             f"({args.model['quant']}), restart of every server between turns {RESTART_AFTER} "
             f"and {RESTART_AFTER + 1}. First TTFT: time to the first content event of the "
             "turn's first API request (after a restart, plus any state restore). Cached: "
             "cache_read_input_tokens per request, as the server reported it.", ""]
    names = list(results)
    lines.append("| turn | " + " | ".join(f"{n} first TTFT | {n} wall | {n} requests (cached)"
                                           for n in names) + " |")
    lines.append("|---" * (1 + 3 * len(names)) + "|")
    for i in range(len(TURNS)):
        cells = []
        for n in names:
            t = results[n][i]
            ttft = "-" if t["first_ttft_s"] is None else f"{t['first_ttft_s']:.2f} s"
            err = " (error)" if t["is_error"] else ""
            cells += [ttft, f"{t['wall_s']:.1f} s{err}",
                      f"{t['requests']} ({', '.join(map(str, t['cached']))})"]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    (out / "results.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--model", default="qwen1.5b", choices=sorted(bench_peers.MODELS))
    ap.add_argument("--servers", default="strata,llama-server,vllm-mlx")
    ap.add_argument("--llama-server", default="")
    ap.add_argument("--vllm-mlx", default=str(bench_peers.PEERS / "vllmmlxvenv/bin/vllm-mlx"))
    ap.add_argument("--cpu-products", choices=["f32", "bf16"], default="f32",
                    help="Strata's products of prompt chunks (bf16: AVX-512 BF16 CPUs)")
    ap.add_argument("--out", default="docs/bench/agent-clients")
    ap.add_argument("--turn-timeout", type=float, default=900,
                    help="seconds a turn may take before it counts as failed")
    args = ap.parse_args()
    args.model = bench_peers.MODELS[args.model]
    if "llama-server" in args.servers and not args.llama_server:
        args.llama_server = bench_peers.llama_server_path()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-agent-clients-"))
    kinds = {"strata": bench_peers.Strata, "llama-server": bench_peers.LlamaServer,
             "vllm-mlx": bench_peers.VllmMlx}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    results = {}
    for name in args.servers.split(","):
        server = kinds[name](args, tmp / name)
        server.start()
        try:
            results[name] = session(server, tmp / name / "session", log)
        finally:
            server.stop()
        # After each server, so that a long run leaves what it measured so far.
        write_report(args, results, out)


if __name__ == "__main__":
    main()
