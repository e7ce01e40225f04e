#!/usr/bin/env python3
"""Strata on MLX's CUDA backend next to Hugging Face transformers (PyTorch), on one NVIDIA GPU,
with the same random-weight model of Qwen2.5-Coder-1.5B's shape (scripts/make_random_qwen.py).
Run on the GPU machine; not in CI.

    python3 bench_gpu.py ceilings --out R.json
    python3 bench_gpu.py transformers --model DIR --lengths 8192,32768,65536,131072 --out R.json
    python3 bench_gpu.py strata --model DIR --bin-dir BIN --lengths ... --out R.json
    python3 bench_gpu.py report --out FOLDER     # the tables, from the JSON files above

Prompts are random token ids (EOS never ends them: `ignore_eos` for Strata, `min_new_tokens`
for transformers), float16 on both sides.
- ceilings: the card's measured bf16/f16 matrix rate and device-to-device copy bandwidth.
- transformers: SDPA attention; TTFT = one forward pass over the prompt (logits of the last
  position only), decode = 64 tokens with the static cache, greedy.
- strata: `strata up` serving the folder; through /v1/completions, streaming: TTFT cold, with
  the prompt in the worker's cache (warm), and after a restart of all three processes (blocks
  from the cache service's disk tier); decode tok/s over 64 tokens. Then the huge-context
  stability test: a 98K-token prompt must end in an answer or a clear refusal, never a crash.
Roofline: prefill FLOPs = 2 x (non-embedding parameters + lm_head for one position) x tokens +
causal attention 2 x 2 x layers x tokens^2 / 2 x (heads x head_dim); decode bytes per token =
the weights read once (float16) plus the KV read at that context.
"""
import argparse
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 28, 1536, 12, 2, 128, 8960, 151936


def params_non_embedding():
    attn = HIDDEN * HEADS * HEAD_DIM * 2 + HIDDEN * KV_HEADS * HEAD_DIM * 2
    mlp = 3 * HIDDEN * INTER
    return LAYERS * (attn + mlp)


def prefill_flops(tokens):
    dense = 2 * params_non_embedding() * tokens + 2 * HIDDEN * VOCAB
    attention = 2 * 2 * LAYERS * HEADS * HEAD_DIM * tokens * tokens / 2
    return dense + attention


def decode_bytes(context):
    weights = 2 * (params_non_embedding() + HIDDEN * VOCAB)
    kv = 2 * LAYERS * 2 * KV_HEADS * HEAD_DIM * context
    return weights + kv


def prompt_ids(n, seed):
    import random
    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def ceilings(args):
    import torch
    out = {}
    for dtype in (torch.bfloat16, torch.float16):
        a = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        b = torch.randn(8192, 8192, device="cuda", dtype=dtype)
        for _ in range(3):
            a @ b
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a @ b
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
        times.sort()
        out[f"{dtype}".replace("torch.", "") + "_tflops"] = 2 * 8192**3 / times[5] / 1e12
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        y.copy_(x)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    out["copy_gbps"] = 2 * x.numel() / times[5] / 1e9  # bytes read plus written
    out["device"] = torch.cuda.get_device_name()
    return out


def transformers_bench(args):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16,
                                                 attn_implementation="sdpa").cuda().eval()
    results = {}
    for n in args.lengths:
        ids = torch.tensor([prompt_ids(n, seed=n)], device="cuda")
        row = {}
        try:
            with torch.no_grad():
                model(ids[:, :1024], logits_to_keep=1)  # warm-up
                torch.cuda.synchronize()
                ttfts = []
                for _ in range(args.repeat):
                    started = time.perf_counter()
                    logits = model(ids, logits_to_keep=1).logits
                    logits.argmax(-1).item()
                    ttfts.append(time.perf_counter() - started)
                row["ttft_s"] = sorted(ttfts)[len(ttfts) // 2]
                row["ttft_all"] = ttfts
                if n <= args.decode_max:
                    def generate():
                        return model.generate(ids, max_new_tokens=65, min_new_tokens=65,
                                              do_sample=False, cache_implementation="static")
                    # transformers compiles the forward pass for a static cache on first use:
                    # the first call pays that, the second is timed.
                    generate()
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    out = generate()
                    total = time.perf_counter() - started
                    assert out.shape[1] == n + 65
                    row["decode_tok_s"] = 64 / max(total - row["ttft_s"], 1e-9)
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except torch.OutOfMemoryError as e:
            row["error"] = f"out of memory: {str(e)[:200]}"
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        results[n] = row
        print(f"transformers {n}: {row}", file=sys.stderr, flush=True)
        save(args, results)
    return results


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(base, ids, max_tokens, timeout=900, as_text=False, model="m"):
    """(ttft, decode tok/s, usage, generated) of one streaming completion; raises on an HTTP
    error. `as_text`: the prompt as the stand-in tokenizer's words ("t1000 t1001 ...", one
    token each), for servers that take no token ids (mlx_lm.server)."""
    body = {"model": model, "prompt": " ".join(f"t{i}" for i in ids) if as_text else ids,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"}, method="POST")
    started = time.perf_counter()
    first = last = None
    usage, events = {}, 0
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices"):
                now = time.perf_counter() - started
                first = now if first is None else first
                last = now
                events += 1
            if event.get("usage"):
                usage = event["usage"]
    tokens = usage.get("completion_tokens") or events
    rate = (tokens - 1) / (last - first) if tokens > 1 and last > first else None
    return first, rate, usage, tokens


def cached_tokens(usage):
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


class Cluster:
    """`strata up` serving the model: gateway, cache service (RAM + disk tier), one worker."""
    name = "strata"
    as_text = False
    model_name = "m"

    def __init__(self, args, tmp):
        self.args, self.tmp = args, tmp
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log = tmp / "strata.log"

    def command(self):
        return [str(pathlib.Path(self.args.bin_dir) / "strata"), "up", "--bind",
                f"127.0.0.1:{self.port}", "--model", self.args.model, "--model-id", "m",
                "--run-dir", str(self.tmp / "run"), "--kv-dir", str(self.tmp / "kv"),
                "--kv-ram", "16GiB", "--kv-disk", "64GiB", "--worker-memory-budget", "100GiB"]

    def start(self):
        self.proc = subprocess.Popen(self.command(), stdout=open(self.log, "ab"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: " + self.log_tail())
            try:
                self.complete([1000, 1001], 1, timeout=60)
                return
            except (OSError, urllib.error.HTTPError):
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready: " + self.log_tail())

    def complete(self, ids, max_tokens, timeout=900):
        return complete(self.base, ids, max_tokens, timeout=timeout, as_text=self.as_text,
                        model=self.model_name)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=120)

    def log_tail(self, n=3000):
        return self.log.read_text(errors="replace")[-n:]

    def health(self):
        with urllib.request.urlopen(self.base + "/health", timeout=5) as r:
            return json.load(r)

    def admin_stats(self):
        """The worker's stats from /admin (prefix cache, parked caches, features)."""
        token = (self.tmp / "run" / "admin-token").read_text().strip()
        req = urllib.request.Request(self.base + "/admin/api/workers",
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            workers = json.load(r)["workers"]
        return [{k: w.get("stats", {}).get(k) for k in ("prefix_cache", "features")}
                for w in workers]

    def phases(self):
        """The worker's last "prefill phases" log line, as numbers (strata only)."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
        lines = [l for l in text.splitlines() if "prefill phases" in l]
        if not lines:
            return None
        return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", lines[-1])}


class MlxLmServer(Cluster):
    """mlx_lm.server on the same GPU and MLX library: its prompt cache lives in memory only."""
    name = "mlx_lm.server"
    as_text = True

    def __init__(self, args, tmp):
        super().__init__(args, tmp)
        self.log = tmp / "mlx_lm.log"
        self.model_name = args.model

    # transformers 5 maps model_type qwen2 to its BPE tokenizer class whatever the folder's
    # tokenizer.json holds; the stand-in word-level tokenizer is loaded as a generic fast
    # tokenizer instead, so that "t1000 t1001" is the ids [1000, 1001] as for Strata.
    LAUNCH = (
        "import pathlib, sys\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "import mlx_lm.tokenizer_utils as tu\n"
        "class Words:\n"
        "    @staticmethod\n"
        "    def from_pretrained(path, **_):\n"
        "        return PreTrainedTokenizerFast(\n"
        "            tokenizer_file=str(pathlib.Path(path) / 'tokenizer.json'),\n"
        "            eos_token='<|im_end|>')\n"
        "tu.AutoTokenizer = Words\n"
        # mlx-lm 0.32.2 passes gather_qmm a `global_scale` (None unless nvfp4 experts) that
        # MLX 0.32.2 does not take yet; dropped when None, so that quantised MoE models load.
        "import mlx.core as mx\n"
        "_gather_qmm = mx.gather_qmm\n"
        "def gather_qmm(*a, global_scale=None, **k):\n"
        "    if global_scale is not None:\n"
        "        raise ValueError('global_scale needs a newer MLX')\n"
        "    return _gather_qmm(*a, **k)\n"
        "mx.gather_qmm = gather_qmm\n"
        "from mlx_lm.server import main\n"
        "sys.argv = ['mlx_lm.server'] + sys.argv[1:]\n"
        "main()\n")

    def command(self):
        return [sys.executable, "-c", self.LAUNCH, "--model", self.args.model,
                "--port", str(self.port), "--max-tokens", "100000"]

    def health(self):
        return {}

    def admin_stats(self):
        return None

    def phases(self):
        return None


def serve_bench(args, server):
    """One server through the columns of issue 24: per length cold, warm (same prompt), same
    prefix with a new question (the last 64 tokens differ), decode tok/s; then 1 and 8
    streams; then every length again after a restart of every process."""
    tmp = pathlib.Path(args.tmp) / server.name
    tmp.mkdir(parents=True, exist_ok=True)
    c = server(args, tmp)
    c.start()
    warm_up(c, seed=1)
    results = {"server": c.name, "health": c.health()}
    try:
        for n in args.lengths:
            ids = prompt_ids(n, seed=n)
            row = {}
            try:
                row["cold_s"], _, usage, _ = c.complete(ids, 1)
                row["cold_phases"] = c.phases()
                if args.cold_only:
                    if n in args.decode_at:
                        _, row["decode_tok_s"], _, row["decode_tokens"] = c.complete(
                            ids + [1002], 65)
                    results[n] = row
                    print(f"{c.name} {n}: {row}", file=sys.stderr, flush=True)
                    save(args, results)
                    continue
                row["warm_s"], _, usage, _ = c.complete(ids, 1)
                row["warm_cached_tokens"] = cached_tokens(usage)
                question = ids[:n - 64] + prompt_ids(64, seed=n + 1)
                row["new_question_s"], _, usage, _ = c.complete(question, 1)
                row["new_question_cached_tokens"] = cached_tokens(usage)
                row["new_question_phases"] = c.phases()
                if n in args.decode_at:
                    _, row["decode_tok_s"], _, row["decode_tokens"] = c.complete(
                        ids + [1002], 65)
            except urllib.error.HTTPError as e:
                row["error"] = f"HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
            results[n] = row
            print(f"{c.name} {n}: {row}", file=sys.stderr, flush=True)
            save(args, results)
        if args.cold_only:
            return results
        results["streams"] = streams_bench(c, args)
        print(f"{c.name} streams: {results['streams']}", file=sys.stderr, flush=True)
        try:
            results["admin"] = c.admin_stats()
        except (OSError, urllib.error.HTTPError, KeyError) as e:
            results["admin"] = f"unavailable: {e}"
        save(args, results)
        # After a restart of every process: Strata's blocks come from the disk tier;
        # mlx_lm.server has no disk tier, so this is a cold run for it.
        c.stop()
        c.start()
        warm_up(c, seed=2)
        for n in args.lengths:
            if "error" in results[n]:
                continue
            s, _, usage, _ = c.complete(prompt_ids(n, seed=n), 1)
            results[n]["restart_s"] = s
            results[n]["restart_cached_tokens"] = cached_tokens(usage)
            results[n]["restart_phases"] = c.phases()
            save(args, results)
        try:
            results["admin_after_restart"] = c.admin_stats()
        except (OSError, urllib.error.HTTPError, KeyError) as e:
            results["admin_after_restart"] = f"unavailable: {e}"
        save(args, results)
        if args.stability and c.name == "strata":
            results["stability_98k"] = stability(c)
    finally:
        c.stop()
        results["log_tail"] = c.log_tail(6000)
    return results


def warm_up(c, seed):
    """A 6K-token prompt of its own first, twice: MLX compiles its CUDA kernels at their first
    use (NVRTC), which is no part of any column. The prompt takes two prefill passes and the
    second request is a one-token pass over a cached prompt: both use kernels that a single
    4K pass does not (Strata's first warm hit at 8K took 0.41-0.56 s, all of it in its
    one-token pass, after a 4K warm-up of one pass, against 0.05 s at 32K)."""
    ids = prompt_ids(int(os.environ.get("WARMUP_TOKENS", "6144")), seed=seed)
    c.complete(ids, 2)
    c.complete(ids, 2)


def streams_bench(c, args):
    """Aggregate decode tok/s with 1 and 8 concurrent requests, each its own 1K-token prompt
    and 128 generated tokens (wall time from the first request sent to the last token)."""
    import concurrent.futures
    out = {}
    for streams in (1, 8):
        prompts = [prompt_ids(1024, seed=7000 + 10 * streams + i) for i in range(streams)]
        started = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            done = list(pool.map(lambda ids: c.complete(ids, 128),
                                 prompts))
        wall = time.perf_counter() - started
        out[streams] = {"tokens": sum(d[3] for d in done), "wall_s": wall,
                        "tok_s": sum(d[3] for d in done) / wall}
    return out


def stability(c):
    """The seed's stability test: oMLX crashed 77K tokens into a 98K prompt."""
    worker_before = [ch["pid"] for ch in c.health()["children"] if ch["kind"] == "worker"]
    huge = {}
    started = time.perf_counter()
    try:
        huge["ttft_s"], _, usage, _ = c.complete(prompt_ids(98304, seed=98304), 4, timeout=1800)
        huge["outcome"] = f"served: {usage}"
    except urllib.error.HTTPError as e:
        huge["outcome"] = f"refused with HTTP {e.code}: {e.read().decode(errors='replace')[:300]}"
    huge["took_s"] = time.perf_counter() - started
    worker_after = [ch["pid"] for ch in c.health()["children"] if ch["kind"] == "worker"]
    huge["worker_survived"] = worker_before == worker_after
    print(f"strata 98K: {huge}", file=sys.stderr, flush=True)
    return huge


def strata_bench(args):
    return serve_bench(args, Cluster)


def mlx_lm_bench(args):
    return serve_bench(args, MlxLmServer)


def report(args):
    """The markdown tables of docs/BENCHMARKS.md from the JSON files the other modes wrote
    (--out names a folder holding them: transformers*, strata*, mlx_lm*, ceilings*)."""
    folder = pathlib.Path(args.out)
    load = lambda pattern: [json.loads(p.read_text()) for p in sorted(folder.glob(pattern))]

    def by_length(parts):
        rows = {}
        for part in parts:
            for n, row in part.items():
                if n.isdigit():
                    rows.setdefault(int(n), {}).update(row)
        return rows

    hf, st, lm = (by_length(load(p)) for p in ("transformers*.json", "strata*.json",
                                                "mlx_lm*.json"))
    sec = lambda v: f"{v:.3f} s" if isinstance(v, (int, float)) else "-"
    # mlx_lm.server keeps no cache across a restart: its run after one is a cold run with
    # MLX's kernels already compiled, so its cold column is the better of the two.
    lm_cold = lambda r: min((v for v in (r.get("cold_s"), r.get("restart_s")) if v), default=None)
    lines = ["| prompt tokens | Strata cold | mlx_lm cold | transformers | Strata warm | "
             "mlx_lm warm | Strata new question | mlx_lm new question | Strata after restart | "
             "decode Strata / mlx_lm / transformers (tok/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for n in sorted(set(hf) | set(st) | set(lm)):
        s_, l_, h = st.get(n, {}), lm.get(n, {}), hf.get(n, {})
        decode = " / ".join(f"{r['decode_tok_s']:.0f}" if r.get("decode_tok_s") else "-"
                            for r in (s_, l_, h))
        lines.append(f"| {n} | {sec(s_.get('cold_s'))} | {sec(lm_cold(l_))} | "
                     f"{sec(h.get('ttft_s'))} | {sec(s_.get('warm_s'))} | "
                     f"{sec(l_.get('warm_s'))} | {sec(s_.get('new_question_s'))} | "
                     f"{sec(l_.get('new_question_s'))} | {sec(s_.get('restart_s'))} | "
                     f"{decode} |")
    lines += ["", "| Strata's cold prefill, prompt tokens | passes | compute | KV read-back | "
              "to the cache | blocks |", "|---|---|---|---|---|---|"]
    for n in sorted(st):
        p = st[n].get("cold_phases") or {}
        if p:
            lines.append(f"| {n} | {p['passes']:.0f} | {p['compute_ms']:.0f} ms | "
                         f"{p['export_ms']:.0f} ms | {p['store_ms']:.0f} ms | "
                         f"{p['blocks']:.0f} |")
    for name, parts in (("Strata", load("strata*.json")), ("mlx_lm.server", load("mlx_lm*.json"))):
        for part in parts:
            if part.get("streams"):
                rates = ", ".join(f"{k} streams {v['tok_s']:.0f} tok/s"
                                  for k, v in part["streams"].items())
                lines += ["", f"{name}: {rates}."]
    text = "\n".join(lines)
    print(text)
    return {"markdown": text}


def save(args, results):
    """Results so far: a run cut off by its time limit still leaves them."""
    pathlib.Path(args.out).write_text(json.dumps(results, indent=1, default=str))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["ceilings", "transformers", "strata", "mlx_lm", "report"])
    ap.add_argument("--model")
    ap.add_argument("--bin-dir")
    ap.add_argument("--lengths", default="8192,32768,65536,131072")
    ap.add_argument("--decode-max", type=int, default=8192,
                    help="transformers: longest prompt also measured for decode speed")
    ap.add_argument("--decode-at", default="8192,65536",
                    help="strata, mlx_lm: prompt lengths also measured for decode speed")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tmp", default="/tmp/strata-gpu-bench")
    ap.add_argument("--no-stability", dest="stability", action="store_false",
                    help="skip the 98K-token stability test")
    ap.add_argument("--cold-only", action="store_true",
                    help="strata, mlx_lm: cold TTFT (and decode) per length only")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.decode_at = [int(x) for x in args.decode_at.split(",")]
    if args.what == "report":
        report(args)
        return
    run = {"ceilings": ceilings, "transformers": transformers_bench, "strata": strata_bench,
           "mlx_lm": mlx_lm_bench}
    result = run[args.what](args)
    save(args, result)
    print(json.dumps(result, default=str)[:4000])


if __name__ == "__main__":
    main()
