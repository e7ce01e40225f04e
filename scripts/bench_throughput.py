#!/usr/bin/env python3
"""Aggregate decode throughput at 1, 4 and 8 concurrent streams: Strata next to mlx_lm.server
(the same MLX library and BLAS settings), on the same CPU, one server at a time, in one run.
Also each process's peak RSS. Not part of CI.

    scripts/mlx-env $STRATA_CACHE/benchvenv/bin/python scripts/bench_throughput.py \
        --bin-dir target/release

Strata serves the SmolLM2-135M GGUF (f32 policy on CPU); mlx_lm.server serves the Hugging Face
f32 folder that scripts/convert_gguf_to_hf.py made from the same GGUF, so both compute in f32.
Every stream sends its own prompt (so no server gets a prefix-cache hit) through
/v1/completions with temperature 0 and `max_tokens`; throughput counts the completion tokens
each server reports in `usage`, over the wall time from the first request sent to the last
answer. Each configuration runs `--repeat` times; the table gives the median and the range.
"""
import argparse
import concurrent.futures
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

CACHE = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
GGUF = CACHE / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
HF_F32 = CACHE / "models/smollm2-135m-instruct-f32"
KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, f32 KV
TOPICS = ["the sea", "a lighthouse", "winter in a mountain village", "an old clock",
          "a library at night", "the first train", "a garden after rain", "a lost map"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url, body, timeout=900):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def wait_http(url, proc, log, seconds=180):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"server exited; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answers
        except OSError:
            time.sleep(0.2)
    sys.exit(f"server not ready; see {log}")


def prompt(i, words):
    topic = TOPICS[i % len(TOPICS)]
    filler = " ".join(f"Note {j} about {topic}." for j in range(words // 5))
    return f"{filler}\nStream {i}. Write a long, detailed story about {topic}.\nStory:"


def one_round(base, model, streams, max_tokens, words, extra):
    def one(i):
        body = {"model": model, "prompt": prompt(i, words), "max_tokens": max_tokens,
                "temperature": 0, **extra}
        started = time.monotonic()
        r = post(base + "/v1/completions", body)
        return r["usage"]["completion_tokens"], time.monotonic() - started

    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    wall = time.monotonic() - started
    tokens = sum(t for t, _ in results)
    return tokens / wall, tokens


def peak_rss_mb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def measure(name, base, model, args, extra):
    rows = {}
    # Warm-up: first requests pay for lazy initialisation in both servers.
    one_round(base, model, 1, 4, args.words, extra)
    for streams in args.streams:
        runs = [one_round(base, model, streams, args.max_tokens, args.words, extra)
                for _ in range(args.repeat)]
        rates = [r for r, _ in runs]
        rows[streams] = (statistics.median(rates), min(rates), max(rates),
                         statistics.median([t for _, t in runs]))
        print(f"{name} {streams} streams: {rows[streams][0]:.1f} tok/s "
              f"({min(rates):.1f}-{max(rates):.1f})", file=sys.stderr)
    return rows


def rss_mb(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def health(base):
    """(status, body): 503 with the same body while a child is not ready."""
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def children_of(base):
    return {c["name"]: c["pid"] for c in health(base)[1]["children"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--streams", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--words", type=int, default=150, help="prompt filler words (~1.3 tokens each)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-throughput-"))
    load = os.getloadavg()

    # Strata.
    port = free_port()
    log = tmp / "strata.log"
    proc = subprocess.Popen(
        [pathlib.Path(args.bin_dir) / "strata", "up", "--bind", f"127.0.0.1:{port}",
         "--model", str(GGUF), "--model-id", "m", "--run-dir", str(tmp / "run"),
         "--kv-dir", str(tmp / "kv"), "--kv-ram", "1GiB", "--kv-disk", "4GiB"],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/v1/models", proc, log)
        deadline = time.monotonic() + 180
        while health(base)[0] != 200:
            if time.monotonic() > deadline or proc.poll() is not None:
                sys.exit(f"strata not ready; see {log}")
            time.sleep(0.2)
        post(base + "/v1/completions", {"model": "m", "prompt": "Hi", "max_tokens": 1})
        worker_at_load = rss_mb(children_of(base)["worker-m"])
        strata = measure("strata", base, "m", args, {"ignore_eos": True})
        pids = children_of(base)
        rss = {"strata gateway": peak_rss_mb(proc.pid),
               "strata worker": peak_rss_mb(pids["worker-m"]),
               "strata kvcache": peak_rss_mb(pids["kvcache"])}
        end_health = health(base)[1]
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    # mlx_lm.server, from the same venv as this script.
    port = free_port()
    log = tmp / "mlx_lm.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    server = pathlib.Path(sys.executable).parent / "mlx_lm.server"
    proc = subprocess.Popen([server, "--model", str(HF_F32), "--host", "127.0.0.1",
                             "--port", str(port)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/health", proc, log)
        mlx = measure("mlx_lm.server", base, str(HF_F32), args, {})
        rss["mlx_lm.server"] = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"SmolLM2-135M f32 on {os.cpu_count()} cores; prompts of ~{int(args.words * 1.3)} "
          f"tokens, {args.max_tokens} tokens each, temperature 0; median of {args.repeat} "
          f"(min-max); load average before: {load[0]:.2f}")
    print("| streams | Strata tok/s | mlx_lm.server tok/s | Strata / mlx_lm |")
    print("|---|---|---|---|")
    for s in args.streams:
        a, b = strata[s], mlx[s]
        print(f"| {s} | {a[0]:.1f} ({a[1]:.1f}-{a[2]:.1f}) | {b[0]:.1f} ({b[1]:.1f}-{b[2]:.1f}) "
              f"| {a[0] / b[0]:.2f}x |")
    # The worker's bound: what it holds once the model is loaded (weights dequantised to f32,
    # MLX and BLAS), plus its KV budget: L0 (256 MiB by default) and the live KV of the largest
    # batch (KV grows in steps of 256 tokens), plus 10%.
    prompt_tokens = int(args.words * 1.3) + 20
    step = 256
    live_kv = max(args.streams) * ((prompt_tokens + args.max_tokens + step - 1) // step * step) \
        * KV_BYTES_PER_TOKEN / 2**20
    bound = (worker_at_load + 256 + live_kv) * 1.1
    print()
    print(f"Worker: {worker_at_load:.0f} MB resident with the model loaded; KV budget = L0 256 MB "
          f"+ live KV of {max(args.streams)} streams {live_kv:.0f} MB; bound with 10% = "
          f"{bound:.0f} MB; peak {rss['strata worker']:.0f} MB "
          f"({'within' if rss['strata worker'] <= bound else 'OVER'} the bound)")
    print()
    print("| process | peak RSS (MB) |")
    print("|---|---|")
    for name, mb in rss.items():
        print(f"| {name} | {mb:.0f} |")
    print(f"(logs in {tmp}; cluster health at the end: {json.dumps(end_health)[:200]})")


if __name__ == "__main__":
    main()
