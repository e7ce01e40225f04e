#!/usr/bin/env python3
"""Time to first token with the prefix cache, per tier, through the real cluster (not in CI).

    $STRATA_CACHE/venv/bin/python scripts/bench_prefix_cache.py --bin-dir target/release

For prompts of 1K, 2K and 4K tokens (token ids, so sizes are exact): TTFT cold, with the
prefix in L0 (the worker), in L1 (the cache service's RAM, after a worker restart), and in
L2 (its disk, after the cache service is killed, the worker restarted and the page cache
dropped). After each worker restart an unrelated prompt of the same length, cached in the same
tier, warms the fresh worker up, so that the hit measures the cache path. The L2 floor is the prefix's KV bytes over the cache
directory's raw cold read bandwidth (dd) plus one decode step. Every hit must return the cold
run's greedy tokens. Prints a markdown table.
"""
import argparse
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

KV_BYTES_PER_TOKEN = 46_080  # SmolLM2-135M, f32 KV: 2 * 30 layers * 3 heads * 64 * 4 bytes


def post(url, body, token=None, stream=False):
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    return urllib.request.urlopen(req, timeout=600)


def ttft(base, ids, max_tokens=4):
    """Seconds to the first streamed token, and the usage of the request (with the text and
    the seconds from the first to the last token)."""
    started = time.monotonic()
    first = None
    last = None
    usage = None
    text = ""
    with post(base + "/v1/completions", {"model": "m", "prompt": ids, "max_tokens": max_tokens,
                                          "ignore_eos": True,
                                          "temperature": 0, "stream": True,
                                          "stream_options": {"include_usage": True}}) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.monotonic() - started
            if chunk.get("choices"):
                last = time.monotonic() - started
            for c in chunk.get("choices") or []:
                text += c.get("text") or ""
            if chunk.get("usage"):
                usage = chunk["usage"]
    usage["text"] = text
    usage["decode_s"] = (last or 0) - (first or 0)
    return first, usage


def health(base):
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
    except OSError:
        return None, None


def wait_ready(base, proc, log, changed=lambda body: True):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit("strata up exited; see " + str(log))
        status, body = health(base)
        if status == 200 and changed(body):
            return body
        time.sleep(0.1)
    sys.exit("not ready; see " + str(log))


def pid_of(body, name):
    return {c["name"]: c for c in body["children"]}[name]["pid"]


def drop_caches():
    subprocess.run(["sync"])
    try:
        pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def dd_read_gbps(directory):
    path = pathlib.Path(directory) / "dd.bin"
    subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=4M", "count=256", "conv=fsync"],
                   capture_output=True, check=True)
    drop_caches()
    started = time.monotonic()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=4M"], capture_output=True, check=True)
    secs = time.monotonic() - started
    path.unlink()
    return (256 * 4 << 20) / secs / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--sizes", default="1024,2048,4096")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each hit (median reported)")
    ap.add_argument("--kv-cache-bits", type=int, default=32,
                    help="bits per cached KV value (16: float16 blocks of the f32 KV)")
    args = ap.parse_args()
    kv_bytes_per_token = KV_BYTES_PER_TOKEN * args.kv_cache_bits // 32
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    model = cache / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-prefix-bench-"))
    log = tmp / "log"
    config = tmp / "strata.toml"
    config.write_text("\n".join([
        f'bind = "127.0.0.1:{port}"', f'run_dir = "{tmp / "run"}"', "",
        "[cache]", f'dir = "{tmp / "kv"}"', 'ram = "2GiB"', 'disk = "8GiB"', "",
        "[[models]]", 'id = "m"', f'path = "{model}"', "pinned = true",
        f"kv_cache_bits = {args.kv_cache_bits}" if args.kv_cache_bits != 32 else "", ""]))
    proc = subprocess.Popen(
        [pathlib.Path(args.bin_dir) / "strata", "up", "--config", str(config)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        body = wait_ready(base, proc, log)
        token = (tmp / "run" / "admin-token").read_text().strip()
        raw_gbps = dd_read_gbps(tmp / "kv")
        rng = random.Random(7)
        # One decode step, measured on a warm prompt: (time for 17 tokens - TTFT) / 16.
        warm_ids = [rng.randrange(1000, 40000) for _ in range(64)]
        ttft(base, warm_ids)
        started = time.monotonic()
        with post(base + "/v1/completions", {"model": "m", "prompt": warm_ids, "max_tokens": 17,
                                              "temperature": 0, "ignore_eos": True}) as r:
            json.load(r)
        t17 = time.monotonic() - started
        t1, _ = ttft(base, warm_ids)
        decode_step = max(t17 - t1, 0) / 16

        for n in [int(x) for x in args.sizes.split(",")]:
            ids = [rng.randrange(1000, 40000) for _ in range(n)]
            cold, u0 = ttft(base, ids)
            time.sleep(1)  # let the worker's stores reach the cache service
            runs = [ttft(base, ids) for _ in range(args.repeat)]
            l0, u1 = [r[0] for r in runs], runs[-1][1]

            # An unrelated prompt of the same length, cached too: after a worker restart it
            # is requested first (a hit from the same tier), so that the measured hit does not
            # pay a fresh process's one-off costs (MLX and OpenBLAS set-up, the first page
            # faults of buffers this size) but measures the cache path as a running worker
            # meets it.
            other = [rng.randrange(1000, 40000) for _ in range(n)]
            ttft(base, other)
            time.sleep(1)

            def restart_worker():
                before = pid_of(health(base)[1], "worker-m")
                post(base + "/admin/api/workers/m/restart", {}, token).read()
                wait_ready(base, proc, log, lambda b: pid_of(b, "worker-m") != before)
                ttft(base, other)

            def l1_hit():
                restart_worker()
                return ttft(base, ids)

            def l2_hit():
                kv_pid = pid_of(health(base)[1], "kvcache")
                os.kill(kv_pid, 9)
                wait_ready(base, proc, log, lambda b: pid_of(b, "kvcache") != kv_pid)
                restart_worker()
                return (drop_caches(), *ttft(base, ids))

            runs = [l1_hit() for _ in range(args.repeat)]
            l1, u2 = [r[0] for r in runs], runs[-1][1]
            runs = [l2_hit() for _ in range(args.repeat)]
            dropped = all(r[0] for r in runs)
            l2, u3 = [r[1] for r in runs], runs[-1][2]
            cached = u3["prompt_tokens_details"]["cached_tokens"]
            # Greedy output with a hit equals the cold run's (4 tokens each).
            texts = [u["text"] for u in (u0, u1, u2, u3)]
            if len(set(texts)) != 1:
                sys.exit(f"outputs differ at {n} tokens: {texts}")
            floor = cached * kv_bytes_per_token / (raw_gbps * 1e9) + decode_step
            # A decode step at this prompt's context (attention reads the whole prefix): 17
            # tokens on the cached prompt, (last - first) / 16.
            step_here = statistics.median(
                ttft(base, ids, max_tokens=17)[1]["decode_s"] / 16 for _ in range(args.repeat))
            floor_here = cached * kv_bytes_per_token / (raw_gbps * 1e9) + step_here
            rows.append((n, cold, l0, l1, l2, floor, floor_here, step_here, cached, dropped,
                         [u["strata_cached_tokens_by_tier"] for u in (u1, u2, u3)]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    print(f"SmolLM2-135M (f32 KV, cached as {args.kv_cache_bits}-bit values: "
          f"{kv_bytes_per_token} B/token), {os.cpu_count()} cores; "
          f"raw cold read of the cache dir {raw_gbps:.2f} GB/s; decode step {decode_step * 1e3:.0f} ms")
    print(f"Hits: median of {args.repeat} runs (min-max); L1 and L2 runs each after a worker "
          "restart, L2 runs each after killing the cache service and dropping the page cache.")
    print("| prompt tokens | cold TTFT (s) | L0 hit (s) | L1 hit (s) | L2 hit, cold cache (s) | "
          "L2 floor (s) | cold / L2 | L2 / floor | decode step at this context (ms) | "
          "floor with it (s) | L2 / that floor | cached tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")

    def spread(v):
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    for n, cold, l0, l1, l2, floor, floor_here, step_here, cached, dropped, tiers in rows:
        m2 = statistics.median(l2)
        print(f"| {n} | {cold:.2f} | {spread(l0)} | {spread(l1)} | "
              f"{spread(l2)}{'' if dropped else ' (warm: not root)'} "
              f"| {floor:.3f} | {cold / m2:.1f}x | {m2 / floor:.2f}x | {step_here * 1e3:.0f} "
              f"| {floor_here:.3f} | {m2 / floor_here:.2f}x | {cached} |")
    for n, *_, tiers in rows:
        print(f"tiers reported for {n}: L0 run {tiers[0]}, L1 run {tiers[1]}, L2 run {tiers[2]}")


if __name__ == "__main__":
    main()
