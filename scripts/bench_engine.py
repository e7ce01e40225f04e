#!/usr/bin/env python3
"""Prefill and decode speed of our engine and of mlx_lm (the same MLX library) on the same
weights, the same prompt token ids and the same OpenBLAS settings, side by side in one run.

mlx_lm cannot read GGUF: it loads the Hugging Face f32 folder that scripts/convert_gguf_to_hf.py
made from the same GGUF (setup puts it in $STRATA_CACHE/models/smollm2-135m-instruct-f32), and
our engine runs the GGUF itself under the f32 policy, so both compute in f32.

usage: scripts/mlx-env BENCH_VENV/bin/python scripts/bench_engine.py [--sizes 512,2048]
needs: a venv with "mlx[cpu]==0.32.2" mlx-lm; a release build of strata-worker.
Not part of CI.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step

HERE = os.path.dirname(os.path.abspath(__file__))
CACHE = os.environ.get("STRATA_CACHE", os.path.expanduser("~/.cache/strata"))
TEXT = open(os.path.join(HERE, "..", "README.md"), encoding="utf-8").read()


def prompts(tokenizer, sizes):
    ids = tokenizer.encode(TEXT)
    while len(ids) < max(sizes):
        ids = ids + ids
    return [ids[:n] for n in sizes]


def bench_mlx_lm(model, prompt, decode_tokens, repeat):
    prefill, decode = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        steps = generate_step(mx.array(prompt), model, max_tokens=decode_tokens, prefill_step_size=2048)
        token, _ = next(steps)  # first token: prefill done
        t1 = time.perf_counter()
        n = 0
        for token, _ in steps:
            n += 1
        t2 = time.perf_counter()
        prefill.append(len(prompt) / (t1 - t0))
        decode.append(n / (t2 - t1))
    return statistics.median(prefill), statistics.median(decode), prefill, decode


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="512,2048")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gguf", default=os.path.join(CACHE, "models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--hf", default=os.path.join(CACHE, "models/smollm2-135m-instruct-f32"))
    ap.add_argument("--worker", default=os.path.join(HERE, "..", "target/release/strata-worker"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]

    model, tokenizer = load(a.hf)
    ps = prompts(tokenizer, sizes)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ps, f)
    ours = subprocess.run(
        [a.worker, "bench", "--model", a.gguf, "--dtype-policy", "f32", "--prompt-ids", f.name,
         "--decode-tokens", str(a.decode_tokens), "--repeat", str(a.repeat)],
        capture_output=True, text=True, check=True)
    ours = [json.loads(line) for line in ours.stdout.splitlines() if line.startswith("{")]

    bench_mlx_lm(model, ps[0][:64], 4, 1)  # warm-up
    peer = [bench_mlx_lm(model, p, a.decode_tokens, a.repeat) for p in ps]

    print(f"SmolLM2-135M f32 on {os.cpu_count()} cores, OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE')}"
          f" OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}; median of {a.repeat}, tok/s")
    print(f"{'prompt':>7} | {'strata prefill':>14} {'mlx_lm prefill':>14} {'ratio':>6} | "
          f"{'strata decode':>13} {'mlx_lm decode':>13} {'ratio':>6}")
    for n, o, p in zip(sizes, ours, peer):
        print(f"{n:>7} | {o['prefill_tok_s']:>14.1f} {p[0]:>14.1f} {o['prefill_tok_s'] / p[0]:>6.2f} | "
              f"{o['decode_tok_s']:>13.1f} {p[1]:>13.1f} {o['decode_tok_s'] / p[1]:>6.2f}")
    print("runs (strata prefill/decode, mlx_lm prefill/decode):")
    for n, o, p in zip(sizes, ours, peer):
        fmt = lambda xs: "/".join(f"{x:.1f}" for x in xs)  # noqa: E731
        print(f"  {n}: {fmt(o['prefill_runs'])}  {fmt(o['decode_runs'])}  {fmt(p[2])}  {fmt(p[3])}")


if __name__ == "__main__":
    sys.exit(main())
