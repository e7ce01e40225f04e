#!/usr/bin/env python3
"""Load and soak (not in CI): `strata up` with the release binaries and SmolLM2, then N
concurrent streaming clients (the official openai SDK) for a fixed time, with a mix of shared
long prefixes (a chat or agent resending its history: cache hits) and unique prompts (misses).
Samples the RSS of every process of the cluster, and prints a markdown report: requests,
errors by kind (429/503 are designed refusals; anything else is a failure), TTFT percentiles per
window, and RSS after warm-up against the end.

    scripts/soak.py --minutes 30 --clients 8          # the run in docs/RELIABILITY.md
"""
import argparse
import os
import pathlib
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
MODEL = CACHE / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
WORDS = ("archive record ledger river stone lantern copper signal harbor meadow orbit "
         "thread canvas engine market garden winter summer bridge tunnel").split()


def pick_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid):
    try:
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def children(url):
    import json
    with urllib.request.urlopen(url + "/health", timeout=5) as r:
        return {c["name"]: c["pid"] for c in json.load(r)["children"]}


def percentile(values, p):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup-minutes", type=float, default=3)
    ap.add_argument("--window-minutes", type=float, default=5)
    ap.add_argument("--bin-dir", default=str(ROOT / "target/release"))
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-soak-"))
    port = pick_port()
    log = open(tmp / "strata.log", "wb")
    proc = subprocess.Popen(
        [pathlib.Path(args.bin_dir) / "strata", "up", "--bind", f"127.0.0.1:{port}",
         "--model", str(MODEL), "--model-id", "smollm2", "--run-dir", str(tmp / "run"),
         "--kv-dir", str(tmp / "kv"), "--kv-ram", "256MiB", "--kv-disk", "2GiB"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if all(children(url).values()):
                break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        sys.exit("the cluster did not start; see " + str(tmp / "strata.log"))

    # Eight shared prefixes of about 1,000 tokens (hits after their first use) and unique
    # prompts of about 150 tokens (always computed).
    shared = [" ".join(f"Rule {i}.{j}: keep the {random.Random(i * 100 + j).choice(WORDS)} "
                       "in order." for j in range(90)) for i in range(8)]
    start = time.monotonic()
    end = start + args.minutes * 60
    lock = threading.Lock()
    samples = []   # (t, ttft_s, kind)
    errors = {}    # kind -> count
    rss = []       # (t, {name: MiB})

    def client(k):
        rng = random.Random(k)
        oai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
        while time.monotonic() < end:
            if rng.random() < 0.5:
                kind, system = "shared", rng.choice(shared)
            else:
                kind = "unique"
                system = " ".join(rng.choice(WORDS) for _ in range(120))
            question = f"Question {rng.randrange(10**6)}: what comes next?"
            t0 = time.monotonic()
            try:
                stream = oai.chat.completions.create(
                    model="smollm2", max_tokens=args.max_tokens, temperature=0.7, stream=True,
                    messages=[{"role": "system", "content": system},
                              {"role": "user", "content": question}])
                ttft = None
                for chunk in stream:
                    if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                        ttft = time.monotonic() - t0
                with lock:
                    samples.append((t0 - start, ttft if ttft is not None else float("nan"), kind))
            except openai.APIStatusError as e:
                with lock:
                    errors[f"HTTP {e.status_code}"] = errors.get(f"HTTP {e.status_code}", 0) + 1
                time.sleep(0.5)
            except Exception as e:  # noqa: BLE001 - every failure is counted by type
                with lock:
                    errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                time.sleep(0.5)

    def sampler():
        while time.monotonic() < end:
            try:
                pids = children(url)
                pids["gateway"] = proc.pid
                rss.append((time.monotonic() - start,
                            {n: rss_mib(p) for n, p in pids.items() if p}))
            except OSError:
                pass
            time.sleep(10)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.clients)]
    threads.append(threading.Thread(target=sampler))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)

    load = os.getloadavg()
    print(f"## Soak: {args.clients} streaming clients, {args.minutes:g} minutes, SmolLM2-135M "
          f"(binaries in {args.bin_dir}; `scripts/soak.py --minutes {args.minutes:g} --clients "
          f"{args.clients}`), {time.strftime('%Y-%m-%d')}\n")
    designed = sum(v for k, v in errors.items() if k in ("HTTP 429", "HTTP 503"))
    other = sum(errors.values()) - designed
    print(f"- requests completed: {len(samples)} ({sum(1 for s in samples if s[2] == 'shared')} "
          f"shared-prefix, {sum(1 for s in samples if s[2] == 'unique')} unique)")
    print(f"- designed refusals (429/503): {designed}; other errors: {other} {errors or ''}")
    print(f"- load average at the end (1/5/15 min): {load[0]:.2f} / {load[1]:.2f} / "
          f"{load[2]:.2f} on {os.cpu_count()} cores\n")
    print("| window (min) | requests | TTFT p50 shared | TTFT p95 shared | TTFT p50 unique | "
          "TTFT p95 unique |")
    print("|---|---|---|---|---|---|")
    w = args.window_minutes * 60
    for i in range(int(args.minutes * 60 // w)):
        win = [s for s in samples if i * w <= s[0] < (i + 1) * w and s[1] == s[1]]
        sh = [s[1] for s in win if s[2] == "shared"]
        un = [s[1] for s in win if s[2] == "unique"]
        print(f"| {i * w / 60:g}-{(i + 1) * w / 60:g} | {len(win)} | {percentile(sh, 50):.2f} s | "
              f"{percentile(sh, 95):.2f} s | {percentile(un, 50):.2f} s | "
              f"{percentile(un, 95):.2f} s |")
    warm = [r for t, r in rss if t >= args.warmup_minutes * 60]
    if warm:
        print("\n| process | RSS after warm-up | RSS at the end | max after warm-up | "
              "end vs warm-up |")
        print("|---|---|---|---|---|")
        for name in sorted(warm[0]):
            series = [r[name] for r in warm if r.get(name)]
            if not series:
                continue
            first, last = series[0], series[-1]
            print(f"| {name} | {first:.0f} MiB | {last:.0f} MiB | {max(series):.0f} MiB | "
                  f"{(last - first) / first * 100:+.1f}% |")
    print(f"\nlogs: {tmp / 'strata.log'}")


if __name__ == "__main__":
    main()
