#!/usr/bin/env python3
"""The gateway's memory: RSS idle, and peak RSS while N streams are open at once (not in CI).

    $STRATA_CACHE/venv/bin/python scripts/bench_gateway_memory.py --bin-dir target/release

Starts `strata up` with the default model, reads the gateway's VmRSS when idle, then opens N
concurrent streaming chat requests with the official OpenAI SDK (the worker runs them one
after another; the others wait in its queue, their HTTP and gRPC streams open in the gateway),
and prints a table with VmRSS idle, VmHWM under load, and the workers' and cache service's RSS
for comparison. Goals (issue [4 of 11]): under 64 MB idle, under 128 MB with 64 streams.
"""
import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import openai


def status_kb(pid, field):
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    model = cache / "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-gw-bench-"))
    proc = subprocess.Popen(
        [pathlib.Path(args.bin_dir) / "strata", "up", "--bind", f"127.0.0.1:{port}",
         "--model", str(model), "--model-id", "m", "--run-dir", str(tmp / "run"),
         "--kv-dir", str(tmp / "kv"), "--kv-ram", "256MiB", "--kv-disk", "1GiB"],
        stdout=open(tmp / "log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    health = json.load(r)
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    sys.exit("strata up did not become ready; see " + str(tmp / "log"))
                time.sleep(0.2)
        time.sleep(1)
        idle = status_kb(proc.pid, "VmRSS")
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        errors = []
        opened = threading.Barrier(args.streams + 1)

        def one(i):
            try:
                stream = client.chat.completions.create(
                    model="m", stream=True, max_tokens=args.tokens, temperature=0,
                    messages=[{"role": "user", "content": f"Tell me fact number {i} about the sea."}])
                opened.wait()
                for _ in stream:
                    pass
            except Exception as e:  # counted and printed: the run is still reported
                errors.append(repr(e))
                try:
                    opened.wait(timeout=1)
                except threading.BrokenBarrierError:
                    pass

        threads = [threading.Thread(target=one, args=(i,)) for i in range(args.streams)]
        started = time.monotonic()
        for t in threads:
            t.start()
        opened.wait(timeout=300)
        # All streams are open now: sample while they drain.
        peak_sampled = status_kb(proc.pid, "VmRSS")
        for t in threads:
            t.join()
        elapsed = time.monotonic() - started
        hwm = status_kb(proc.pid, "VmHWM")
        children = {c["name"]: c["pid"] for c in health["children"]}
        print(f"gateway memory, {args.streams} concurrent streams of {args.tokens} tokens "
              f"({elapsed:.1f} s, {len(errors)} errors)")
        print(f"| process | RSS idle (MB) | peak RSS (MB) |")
        print(f"|---|---|---|")
        print(f"| strata (gateway) | {idle / 1024:.1f} | {max(hwm, peak_sampled) / 1024:.1f} |")
        for name, pid in children.items():
            print(f"| {name} | - | {status_kb(pid, 'VmHWM') / 1024:.1f} |")
        if errors:
            print("errors:", errors[:3])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
