#!/usr/bin/env python3
"""Real GGUF files as published (K-quants, Q5_0, ...) through Strata's loader, against the
team's independent numpy reference (../shared/reference/gguf_numpy_reference.py: PyPI `gguf`
dequantises, numpy computes in f32): the same greedy tokens on a few prompts, and the largest
logit difference after each prompt; and with --llama-server, llama.cpp's own greedy tokens
for the same prompt ids (it computes K-quant products on 8-bit-quantised activations, so a
near tie may part the two late in a sequence: the first difference is printed). Bench, not CI
(the files are 0.5-1.1 GB).

    $STRATA_VENV/bin/python scripts/check_real_gguf.py FILE.gguf [FILE.gguf ...] [--tokens 24]
        [--llama-server $(bench-setup's llama-server)] [--no-reference]

Needs a build of strata-worker (target/release, else target/debug) and the venv's gguf/numpy.
"""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "shared", "reference"))
from gguf_numpy_reference import Model  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "// A function in C that reverses a string in place\n",
]


def worker():
    for build in ("release", "debug"):
        path = os.path.join(HERE, "..", "target", build, "strata-worker")
        if os.path.exists(path):
            return path
    sys.exit("build strata-worker first")


def strata(path, prompt, n):
    out = subprocess.run(
        [worker(), "generate", "--model", path, "--prompt", prompt, "--max-tokens", str(n),
         "--verbose"], capture_output=True, text=True, check=True).stdout
    tokens = json.loads(re.search(r"^tokens: (\[.*\])$", out, re.M).group(1))
    ids = subprocess.run([worker(), "tokenize", "--model", path, prompt],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(re.search(r"\[.*\]", ids).group(0)), tokens


def reference(path, ids, n):
    """The reference's greedy tokens, and its logits at each step."""
    m = Model(path)
    logits = m.forward(ids)
    out, steps = [], []
    for _ in range(n):
        steps.append(np.asarray(logits).reshape(-1))
        out.append(int(np.argmax(logits)))
        logits = m.forward([out[-1]])
    return out, steps


class LlamaServer:
    """llama-server on one file (CPU, greedy), asked through its native /completion API with
    the prompt as token ids, so that both sides start from the same ids."""

    def __init__(self, binary, path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "-m", path, "--host", "127.0.0.1", "--port", str(self.port), "-c", "4096",
             "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.close()
        sys.exit("llama-server did not start")

    def greedy(self, ids, n):
        body = json.dumps({"prompt": ids, "n_predict": n, "temperature": 0, "top_k": 1,
                           "cache_prompt": False, "return_tokens": True,
                           "ignore_eos": False}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["tokens"]

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


def first_difference(a, b):
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    return "-" if first is None else str(first)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--llama-server", default="", help="compare with llama-server's greedy tokens")
    ap.add_argument("--no-reference", action="store_true", help="skip the numpy reference")
    a = ap.parse_args()
    print("| file | prompt | tokens | = numpy reference (first difference) "
          "| = llama-server (first difference) |")
    print("|---|---|---|---|---|")
    for path in a.files:
        server = LlamaServer(a.llama_server, path) if a.llama_server else None
        try:
            for prompt in PROMPTS:
                t0 = time.time()
                ids, ours = strata(path, prompt, a.tokens)
                cells = []
                ref, steps = None, []
                if a.no_reference:
                    cells.append("not run")
                else:
                    ref, steps = reference(path, ids, len(ours))
                    cells.append(f"{ours == ref} ({first_difference(ours, ref)})")
                    print(f"  reference {ref}", file=sys.stderr)
                if server:
                    theirs = server.greedy(ids, len(ours))
                    at = first_difference(ours, theirs)
                    cell = f"{ours == theirs} ({at})"
                    # Where llama-server parts from us on the same path, how far apart the two
                    # choices are in the exact f32 reference's logits (a near tie or not).
                    if at != "-" and ref == ours and int(at) < len(theirs):
                        i = int(at)
                        gap = steps[i][ours[i]] - steps[i][theirs[i]]
                        cell += f", reference logit gap {gap:.3f}"
                    cells.append(cell)
                    print(f"  llama-server {theirs}", file=sys.stderr)
                else:
                    cells.append("not run")
                print(f"| {os.path.basename(path)} | {prompt!r} | {len(ours)} | "
                      f"{' | '.join(cells)} |", flush=True)
                print(f"  ({time.time() - t0:.0f} s) strata {ours}", file=sys.stderr)
        finally:
            if server:
                server.close()


if __name__ == "__main__":
    main()
