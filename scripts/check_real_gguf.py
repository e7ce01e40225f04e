#!/usr/bin/env python3
"""Real GGUF files as published (K-quants, Q5_0, ...) through Strata's loader, against the
team's independent numpy reference (../shared/reference/gguf_numpy_reference.py: PyPI `gguf`
dequantises, numpy computes in f32): the same greedy tokens on a few prompts, and the largest
logit difference after each prompt. Bench, not CI (the files are 0.5-1.1 GB).

    $STRATA_VENV/bin/python scripts/check_real_gguf.py FILE.gguf [FILE.gguf ...] [--tokens 24]

Needs a build of strata-worker (target/release, else target/debug) and the venv's gguf/numpy.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

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
    m = Model(path)
    logits = m.forward(ids)
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = m.forward([out[-1]])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tokens", type=int, default=24)
    a = ap.parse_args()
    print(f"| file | prompt | tokens | strata = numpy reference | first difference |")
    print("|---|---|---|---|---|")
    for path in a.files:
        for prompt in PROMPTS:
            t0 = time.time()
            ids, ours = strata(path, prompt, a.tokens)
            ref = reference(path, ids, len(ours))
            first = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), None)
            print(f"| {os.path.basename(path)} | {prompt!r} | {len(ours)} | {ours == ref} | "
                  f"{'-' if first is None else first} |", flush=True)
            print(f"  ({time.time() - t0:.0f} s) strata {ours}\n  reference {ref}", file=sys.stderr)


if __name__ == "__main__":
    main()
