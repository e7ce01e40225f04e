#!/usr/bin/env python3
"""Disk use of a hybrid model's prompts (issue 26): bytes the cache service's disk tier holds
per 1K prompt tokens at several lengths, and a hit from the disk tier after a restart of every
process. Not CI; a table on stdout and JSON in --out.

    scripts/mlx-env python3 scripts/bench_hybrid_disk.py --bin-dir target/release \\
        --model $STRATA_CACHE/models/qwen3_5_moe-bench --lengths 8192,32768,65536 --out R.json

Each length is a prompt of random token ids of its own (no shared prefix), max_tokens 1. The
model folder is served through a copy whose config allows 131,072 positions (random weights:
only the shapes matter here). Expected: a flat line, attention K/V per token plus one
recurrent-state snapshot per block (256 tokens unless --block-tokens says otherwise).

On the GPU machine (issue 26's run at Qwen3.6-35B-A3B's shape, scripts/gpu-bench-seed):
`--block-tokens 2048` (a snapshot of that model is 66 MB, the K/V of 3,000 tokens),
`--ids-max 150000` (its vocabulary), `--decode 64` (decode tok/s after the restart's hit),
`--kv-ram`, `--memory-budget`. The worker's pid is compared before and after each prompt.
"""
import argparse
import json
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_gpu import complete as stream_complete  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base, path, body=None, token=None, timeout=3600):
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    req = urllib.request.Request(base + path, headers=headers, method="POST" if body else "GET",
                                 data=json.dumps(body).encode() if body else None)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.load(r)


def du(path):
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())


class Cluster:
    def __init__(self, args, model, tmp):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.cmd = [str(pathlib.Path(args.bin_dir) / "strata"), "up", "--bind",
                    f"127.0.0.1:{self.port}", "--run-dir", str(tmp / "run"),
                    "--kv-dir", str(tmp / "kv"), "--kv-ram", args.kv_ram, "--kv-disk", "64GiB"]
        if args.memory_budget:
            self.cmd += ["--worker-memory-budget", args.memory_budget]
        if args.block_tokens:
            # Blocks of another length are a model setting: served through a config file.
            (tmp / "strata.toml").write_text(
                f'[[models]]\nid = "m"\npath = "{model}"\npinned = true\n'
                f"block_tokens = {args.block_tokens}\n")
            self.cmd += ["--config", str(tmp / "strata.toml")]
        else:
            self.cmd += ["--model", str(model), "--model-id", "m"]
        self.tmp, self.proc = tmp, None

    def start(self, env=None):
        """Starts the cluster and returns once a first request was answered (on a GPU that
        is after the worker's kernel warm-up, which requests queue behind): seconds taken,
        and what /admin says the warm-up did."""
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.tmp / "strata.log", "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **(env or {})})
        for _ in range(1200):
            try:
                self.complete([100, 101])
                self.token = (self.tmp / "run" / "admin-token").read_text().strip()
                took = time.perf_counter() - started
                workers = call(self.base, "/admin/api/workers", token=self.token)["workers"]
                warmup = [w.get("stats", {}).get("features", {}).get("kernel_warmup")
                          for w in workers]
                print(f"ready after {took:.1f} s; warm-up: {warmup}", file=sys.stderr,
                      flush=True)
                return {"ready_s": took, "kernel_warmup": warmup}
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("strata did not start")

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=120)

    def complete(self, ids, max_tokens=1):
        started = time.perf_counter()
        r = call(self.base, "/v1/completions",
                 {"model": "m", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                  "ignore_eos": True})
        took = time.perf_counter() - started
        # The answer's text, so that a hit can be compared with the cold run.
        r["usage"]["text"] = r["choices"][0]["text"]
        return took, r["usage"]

    def worker_pid(self):
        health = call(self.base, "/health")
        return [ch.get("pid") for ch in health.get("children", []) if ch.get("kind") == "worker"]

    def disk(self):
        """Bytes the disk tier holds, once the stores in flight have landed."""
        last = None
        for _ in range(240):
            s = call(self.base, "/admin/api/cache/stats", token=self.token)
            now = (s["disk"]["bytes"], s["disk"]["blocks"], s["disk_bytes_written"])
            if now == last:
                return {"bytes": now[0], "blocks": now[1], "written": now[2]}
            last = now
            time.sleep(1.0)
        return {"bytes": last[0], "blocks": last[1], "written": last[2]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", default="8192,32768,65536")
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-tokens", type=int)
    ap.add_argument("--ids-max", type=int, default=49000, help="prompt ids are below this")
    ap.add_argument("--decode", type=int, default=0,
                    help="after the restart's hit, also time this many generated tokens")
    ap.add_argument("--kv-ram", default="1GiB")
    ap.add_argument("--memory-budget")
    ap.add_argument("--tmp", help="keep the cluster's folder (log, cache) here")
    ap.add_argument("--restart-env", action="append", default=[], metavar="KEY=VALUE",
                    help="restart once more with this environment and time the hits again "
                         "(repeatable: one more restart each)")
    ap.add_argument("--warmup", type=int, default=0,
                    help="a prompt of this many tokens first (a GPU compiles its kernels)")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.tmp:
        tmp = pathlib.Path(args.tmp)
        tmp.mkdir(parents=True, exist_ok=True)
    else:
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-hybrid-disk-"))
    model = tmp / "model"
    model.mkdir()
    for f in pathlib.Path(args.model).iterdir():
        (model / f.name).symlink_to(f.resolve())
    config = json.loads((pathlib.Path(args.model) / "config.json").read_text())
    text = config.get("text_config") or config
    text["max_position_embeddings"] = max(text.get("max_position_embeddings", 0), 131072)
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config, indent=1))
    c = Cluster(args, model, tmp)
    starts = [c.start()]
    if args.warmup:
        rng = random.Random(1)
        c.complete([rng.randrange(100, args.ids_max) for _ in range(args.warmup)])
    rows, prompts = [], {}
    try:
        for n in lengths:
            rng = random.Random(n)
            prompts[n] = [rng.randrange(100, args.ids_max) for _ in range(n)]
            before, pid = c.disk(), c.worker_pid()
            try:
                cold, usage = c.complete(prompts[n])
            except urllib.error.HTTPError as e:
                # A prompt that cannot fit is refused: say so, and that the worker lived.
                rows.append({"prompt_tokens": n, "refused": f"HTTP {e.code}: "
                             f"{e.read().decode(errors='replace')[:300]}",
                             "worker_survived": c.worker_pid() == pid})
                print(f"{n}: {rows[-1]}", file=sys.stderr, flush=True)
                continue
            after = c.disk()
            added = after["bytes"] - before["bytes"]
            row = {"prompt_tokens": usage["prompt_tokens"], "cold_s": cold,
                   "cold_text": usage["text"],
                   "disk_bytes_added": added, "blocks_added": after["blocks"] - before["blocks"],
                   "bytes_per_1k_tokens": added / (n / 1000),
                   "worker_survived": c.worker_pid() == pid}
            rows.append(row)
            pathlib.Path(args.out).write_text(json.dumps({"rows": rows}, indent=1))
            print(f"{n}: {row}", file=sys.stderr, flush=True)
        variants = [None] + [dict([kv.split("=", 1)]) for kv in args.restart_env]
        for variant in variants:
            c.stop()
            starts.append(c.start(variant))
            # The first restart fills the rows; each variant's gets its own keys.
            suffix = "" if variant is None else "_" + "_".join(f"{k}={v}"
                                                               for k, v in variant.items())
            for row, n in zip(rows, lengths):
                if "refused" in row:
                    continue
                t, usage = c.complete(prompts[n])
                row["after_restart_s" + suffix] = t
                row["after_restart_text" + suffix] = usage["text"]
                row["after_restart_cached_tokens" + suffix] = (
                    usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                if args.decode and variant is None:
                    # Streamed: the rate counts the tokens after the first.
                    _, row["decode_tok_s"], _, row["decode_tokens"] = stream_complete(
                        c.base, prompts[n] + [prompts[n][0]], args.decode + 1)
                print(f"{n} after restart{suffix}: {row}", file=sys.stderr, flush=True)
                pathlib.Path(args.out).write_text(json.dumps({"rows": rows, "starts": starts},
                                                             indent=1))
        rows_du = du(tmp / "kv")
        workers = call(c.base, "/admin/api/workers", token=c.token)["workers"]
        prefix = [(w.get("stats") or {}).get("prefix_cache") for w in workers]
        print(f"worker prefix cache after the restart: {prefix}", file=sys.stderr, flush=True)
    finally:
        c.stop()
    result = {"rows": rows, "starts": starts, "kv_dir_bytes_on_disk": rows_du,
              "prefix_cache_after_restart": prefix}
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    print("| prompt tokens | cold | disk bytes added | blocks | bytes per 1K tokens | "
          "after restart | cached tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "refused" in r:
            print(f"| {r['prompt_tokens']} | refused: {r['refused']} | | | | | |")
            continue
        print(f"| {r['prompt_tokens']} | {r['cold_s']:.1f} s | {r['disk_bytes_added']:,} | "
              f"{r['blocks_added']} | {r['bytes_per_1k_tokens'] / 1e6:.2f} MB | "
              f"{r['after_restart_s']:.2f} s | {r['after_restart_cached_tokens']} |")
    if not args.tmp:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
