#!/usr/bin/env python3
"""Embeddings per second at batch sizes 1, 8 and 32: Strata (through `POST /v1/embeddings`)
next to sentence-transformers (in process), same model files, same CPU, one run (not in CI).

    cargo build --release --bins
    $STRATA_CACHE/stvenv/bin/python scripts/bench_embeddings.py --bin-dir target/release

The stvenv is the one scripts/make_embedding_fixtures.py describes. Inputs are the fixture's
55 sentences (3 to 239 tokens), cycled; each batch is one request (Strata) or one `encode`
call (sentence-transformers), run one after another. Both use every core: Strata's OpenBLAS
one thread per core, torch `set_num_threads(os.cpu_count())`. Prints a markdown table of
medians over `--repeat` runs, with the range.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from bench_prefix_cache import health, wait_ready  # noqa: E402

FIXTURE = ROOT / "services/worker/tests/fixtures/minilm_embeddings.json"


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strata_rate(base, model, inputs, batch):
    started = time.monotonic()
    for i in range(0, len(inputs), batch):
        body = json.dumps({"model": model, "input": inputs[i:i + batch]}).encode()
        req = urllib.request.Request(base + "/v1/embeddings", data=body, method="POST",
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            assert len(json.load(r)["data"]) == len(inputs[i:i + batch])
    return len(inputs) / (time.monotonic() - started)


def st_rate(model, inputs, batch):
    started = time.monotonic()
    for i in range(0, len(inputs), batch):
        model.encode(inputs[i:i + batch], batch_size=batch)
    return len(inputs) / (time.monotonic() - started)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--inputs", type=int, default=160, help="inputs per measurement")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    folder = cache / "models/all-minilm-l6-v2"
    sentences = json.loads(FIXTURE.read_text())["sentences"]
    inputs = [sentences[i % len(sentences)] for i in range(args.inputs)]
    sizes = [1, 8, 32]

    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(os.cpu_count())
    st = SentenceTransformer(str(folder), device="cpu")
    st.encode(inputs[:8])  # warm-up
    st_rates = {b: [st_rate(st, inputs, b) for _ in range(args.repeat)] for b in sizes}
    del st

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-embed-bench-"))
    port = free_port()
    log = tmp / "log"
    proc = subprocess.Popen(
        [pathlib.Path(args.bin_dir) / "strata", "up", "--bind", f"127.0.0.1:{port}",
         "--run-dir", str(tmp / "run"), "--kv-dir", str(tmp / "kv"),
         "--embedding-model", str(folder)],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, proc, log)
        strata_rate(base, folder.name, inputs[:8], 8)  # warm-up
        ours = {b: [strata_rate(base, folder.name, inputs, b) for _ in range(args.repeat)]
                for b in sizes}
        _, body = health(base)
    finally:
        proc.terminate()
        proc.wait(timeout=60)

    def spread(v):
        return f"{statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f})"

    import sentence_transformers
    print(f"all-MiniLM-L6-v2, f32, {os.cpu_count()} cores; {args.inputs} inputs of 3-239 tokens "
          f"per measurement; median of {args.repeat} (min-max); sentence-transformers "
          f"{sentence_transformers.__version__}, torch {torch.__version__}")
    print("| batch | Strata embeddings/s (HTTP) | sentence-transformers embeddings/s | ratio |")
    print("|---|---|---|---|")
    for b in sizes:
        ratio = statistics.median(ours[b]) / statistics.median(st_rates[b])
        print(f"| {b} | {spread(ours[b])} | {spread(st_rates[b])} | {ratio:.2f}x |")
    print(f"(cluster at the end: {json.dumps(body)[:160]})")


if __name__ == "__main__":
    main()
