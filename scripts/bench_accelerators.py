#!/usr/bin/env python3
"""The accelerators, measured side by side in one run (not in CI):

    scripts/bench-setup qwen1.5b     # Qwen2.5-Coder-1.5B and its 0.5B draft, GGUFs as published
    cargo build --release --bins
    scripts/mlx-env $STRATA_CACHE/benchvenv/bin/python scripts/bench_accelerators.py \
        --bin-dir target/release --model qwen1.5b --out docs/bench/accelerators

Strata clusters (`strata up --config`) serve the same weights under several model ids: `base`
(nothing optional) and `spec` (with the draft model) together; then `base`, `f16`, `q8` and
`q4` one at a time (cached KV blocks stored as computed, float32 on a CPU, or as float16,
8-bit or 4-bit codes). Every request streams through /v1/chat/completions at temperature 0.

1. Speculative decoding: decode tok/s of `base` and `spec` on coding prompts (completion tokens
   after the first / time from the first to the last token), the draft's acceptance rate, and
   whether the text is the same (greedy output must be).
2. SpecPrefill: long documents (filler sentences with one planted fact) and a question about
   the fact: TTFT with the whole prompt prefilled (`base`) and with `prompt_pruning` at
   --keep-ratio (`spec`, whose draft scores the prompt); the exact-match rate of the pruned
   answers against the full-prefill answers, and how many of each name the fact. Every
   request has its own cache_salt: nothing comes from the prefix cache.
3. KV quantisation of cached blocks: each of `base`, `f16`, `q8`, `q4` computes the same prompts
   (cold); its cluster is then restarted, so that L0 and the cache service's RAM are empty,
   and the prompts are asked again: those hits come from disk (L2). Reported: SSD bytes per
   1,000 cached tokens (the namespace's disk bytes over its tokens), L2-hit TTFT, and the
   greedy agreement of the L2-hit answers with the cold full-precision answers.

--model smollm2 runs the same with SmolLM2-135M as its own draft (a quick check that the
plumbing works: a draft as big as its target cannot speed anything up).
"""
import argparse
import json
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_peers  # noqa: E402  (models, tokenizer, machine facts)

DRAFTS = {
    "smollm2": bench_peers.MODELS["smollm2"]["gguf"],
    "qwen1.5b": bench_peers.CACHE
    / "models/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf",
}
CODING = [
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "Write a Rust function that returns the n-th Fibonacci number iteratively, with a test.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a bash script that counts the lines of every .py file under the current directory.",
    "Explain in three sentences what a hash map is and when to use one.",
]
FACTS = [
    ("the vault code", "4821"), ("the ship's name", "Aurora"), ("the meeting day", "Tuesday"),
    ("the captain's name", "Halvorsen"), ("the password", "bluefinch"),
    ("the harbour number", "17"), ("the colour of the door", "green"),
    ("the winning horse", "Starling"),
]


class Cluster:
    """`strata up --config` serving the bench model under the ids `models` names (each with its
    extra config lines), in its own run and cache folders. Each model is its own worker with
    its own copy of the weights: a section loads only the ones it compares."""

    def __init__(self, args, tmp, models):
        self.args, self.tmp = args, tmp
        self.ids = [name for name, _ in models]
        self.port = bench_peers.free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        model = args.model_files["gguf"]
        text = [f'bind = "127.0.0.1:{self.port}"', f'run_dir = "{tmp / "run"}"', "",
                "[cache]", f'dir = "{tmp / "kv"}"', 'ram = "4GiB"', 'disk = "16GiB"']
        for name, extra in models:
            text += ["", "[[models]]", f'id = "{name}"', f'path = "{model}"', "pinned = true",
                     extra]
        tmp.mkdir(parents=True, exist_ok=True)
        self.config = tmp / "strata.toml"
        self.config.write_text("\n".join(text) + "\n")
        self.proc = None

    def start(self):
        log = open(self.tmp / "strata.log", "ab")
        self.proc = subprocess.Popen(
            [str(pathlib.Path(self.args.bin_dir) / "strata"), "up", "--config", str(self.config)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"strata exited; see {self.tmp / 'strata.log'}")
            try:
                for m in self.ids:
                    chat(self, m, "Hi", 1)
                return
            except OSError:
                time.sleep(1)
        sys.exit(f"strata not ready; see {self.tmp / 'strata.log'}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)

    def admin(self, path):
        token = (self.tmp / "run/admin-token").read_text().strip()
        req = urllib.request.Request(self.base + path,
                                     headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.load(r)


def chat(cluster, model, prompt, max_tokens, **extra):
    """One streamed chat request: TTFT, decode time, usage, text and Strata's extension
    fields (from the last chunks)."""
    usage, ext = {}, {}
    ttft, decode_s, _, _, text = bench_peers.stream_chat(
        cluster.base, model, [{"role": "user", "content": prompt}], max_tokens, extra,
        usage_out=usage, ext_out=ext)
    return {"ttft": ttft, "decode_s": decode_s, "text": text, "usage": usage, **ext}


def speculative(cluster, args, log):
    rows = []
    for prompt in CODING[: args.prompts]:
        base = chat(cluster, "base", prompt, args.decode_tokens, cache_salt=str(uuid.uuid4()))
        spec = chat(cluster, "spec", prompt, args.decode_tokens, cache_salt=str(uuid.uuid4()))
        tok = lambda r: (r["usage"].get("completion_tokens", 0) - 1) / max(r["decode_s"], 1e-9)
        s = spec.get("strata_speculative", {})
        row = {"prompt": prompt[:48], "base_tok_s": tok(base), "spec_tok_s": tok(spec),
               "drafted": s.get("drafted_tokens", 0), "accepted": s.get("accepted_tokens", 0),
               "same_text": base["text"] == spec["text"],
               "tokens": base["usage"].get("completion_tokens")}
        log(f"  speculative: {row}")
        rows.append(row)
    return rows


def document(tokens, fact_index, length):
    """A long text of filler sentences with one planted fact, about `length` tokens."""
    subject, value = FACTS[fact_index % len(FACTS)]
    filler = tokens.text_of(length, seed=100 + fact_index)
    cut = len(filler) * (fact_index % 5 + 2) // 8
    cut = filler.rfind(". ", 0, cut) + 2
    body = filler[:cut] + f"Remember this: {subject} is {value}. " + filler[cut:]
    question = f"\n\nAccording to the text above, what is {subject}? Answer with the value only."
    return body + question, value


def pruning(cluster, args, tokens, log):
    rows = []
    for i in range(args.questions):
        prompt, value = document(tokens, i, args.long_tokens)
        full = chat(cluster, "base", prompt, 12, cache_salt=str(uuid.uuid4()))
        pruned = chat(cluster, "spec", prompt, 12, cache_salt=str(uuid.uuid4()),
                      speculative_decoding=False,
                      prompt_pruning={"keep_ratio": args.keep_ratio})
        p = pruned.get("strata_prompt_pruning", {})
        row = {"prompt_tokens": full["usage"].get("prompt_tokens"),
               "full_ttft": full["ttft"], "pruned_ttft": pruned["ttft"],
               "prefilled": p.get("prefilled_tokens"), "exact": full["text"] == pruned["text"],
               "full_right": value.lower() in full["text"].lower(),
               "pruned_right": value.lower() in pruned["text"].lower(),
               "full_text": full["text"], "pruned_text": pruned["text"]}
        log(f"  pruning: {row}")
        rows.append(row)
    return rows


KV_SCHEMES = [("base", "", None, "32"), ("f16", "kv_cache_bits = 16", "f16", "16"),
              ("q8", "kv_cache_bits = 8", "affine-q8-g64", "8"),
              ("q4", "kv_cache_bits = 4", "affine-q4-g64", "4")]


def quantised(args, tmp, tokens, log):
    """Per scheme, a cluster of its own: cold runs, a restart of the whole cluster (empty L0
    and RAM), then the same prompts again: hits from disk (L2)."""
    prompts = [tokens.text_of(args.kv_tokens, seed=300 + i)
               + "\n\nSummarise the text above in one sentence." for i in range(args.kv_prompts)]
    reference = None
    rows = []
    for m, extra, scheme, bits in KV_SCHEMES:
        cluster = Cluster(args, tmp / m, [(m, extra)])
        cluster.start()
        try:
            cold = [chat(cluster, m, p, args.kv_answer_tokens, cache_salt=f"kv-{i}")
                    for i, p in enumerate(prompts)]
            log(f"  cold {m}: {[round(r['ttft'], 2) for r in cold]}")
            time.sleep(5)  # the cache service writes blocks to disk behind the requests
        finally:
            cluster.stop()
        reference = reference or cold
        cluster.start()
        try:
            stats = cluster.admin("/admin/api/cache/stats")
            warm = [chat(cluster, m, p, args.kv_answer_tokens, cache_salt=f"kv-{i}")
                    for i, p in enumerate(prompts)]
            log(f"  L2 {m}: {[(round(r['ttft'], 2), r['usage'].get('strata_cached_tokens_by_tier')) for r in warm]}")
        finally:
            cluster.stop()
        # The salted namespaces hold exactly these prompts' blocks.
        disk = sum(ns["disk"]["bytes"] for ns in stats["namespaces"] if "+" in ns["namespace"])
        stored_tokens = sum(r["usage"].get("prompt_tokens", 1) - 1 for r in cold)
        rows.append({
            "bits": bits, "scheme": scheme or "as computed",
            "disk_bytes_per_1k": disk / stored_tokens * 1000,
            "cold_ttft": statistics.median(r["ttft"] for r in cold),
            "l2_ttft": statistics.median(r["ttft"] for r in warm),
            "l2_tokens": statistics.median(
                r["usage"].get("strata_cached_tokens_by_tier", {}).get("l2", 0) for r in warm),
            "agree": sum(w["text"] == c["text"] for w, c in zip(warm, reference)),
            "n": len(prompts),
        })
        log(f"  kv {rows[-1]}")
    return rows


def report(args, machine, spec_rows, prune_rows, kv_rows):
    label = args.model_files["label"]
    out = [f"### Accelerators: {label} ({machine['date']})", "",
           f"Machine: {machine['cpu']}, {machine['mem']}; load before: {machine['load_before']}.",
           f"Command: `{args.command}`", ""]
    if spec_rows:
        out += [f"**Speculative decoding** (draft `{DRAFTS[args.model].name}`, "
                f"{args.draft_tokens} tokens per step, greedy, {args.decode_tokens} tokens):", "",
                "| prompt | decode tok/s, no draft | with draft | speed-up | acceptance | same text |",
                "|---|---|---|---|---|---|"]
        for r in spec_rows:
            acc = r["accepted"] / r["drafted"] if r["drafted"] else 0
            out.append(f"| {r['prompt']}… | {r['base_tok_s']:.2f} | {r['spec_tok_s']:.2f} | "
                       f"{r['spec_tok_s'] / r['base_tok_s']:.2f}x | {acc:.0%} | "
                       f"{'yes' if r['same_text'] else 'NO'} |")
        base = statistics.median(r["base_tok_s"] for r in spec_rows)
        spec = statistics.median(r["spec_tok_s"] for r in spec_rows)
        acc = sum(r["accepted"] for r in spec_rows) / max(1, sum(r["drafted"] for r in spec_rows))
        out += [f"| **median** | **{base:.2f}** | **{spec:.2f}** | **{spec / base:.2f}x** | "
                f"**{acc:.0%}** (all) | |", ""]
    if prune_rows:
        n = len(prune_rows)
        out += [f"**SpecPrefill** (keep ratio {args.keep_ratio}; {n} documents of about "
                f"{args.long_tokens} tokens, one planted fact each; 12 answer tokens):", "",
                "| prompt tokens | TTFT full | TTFT pruned | prefilled | same answer | full right | pruned right |",
                "|---|---|---|---|---|---|---|"]
        for r in prune_rows:
            out.append(f"| {r['prompt_tokens']} | {r['full_ttft']:.2f} s | {r['pruned_ttft']:.2f} s | "
                       f"{r['prefilled']} | {'yes' if r['exact'] else 'no'} | "
                       f"{'yes' if r['full_right'] else 'no'} | {'yes' if r['pruned_right'] else 'no'} |")
        full = statistics.median(r["full_ttft"] for r in prune_rows)
        pruned = statistics.median(r["pruned_ttft"] for r in prune_rows)
        out += ["", f"Median TTFT {full:.2f} s → {pruned:.2f} s ({full / pruned:.2f}x); exact match "
                f"with the full prefill's answer: {sum(r['exact'] for r in prune_rows)}/{n}; the "
                f"fact named: full {sum(r['full_right'] for r in prune_rows)}/{n}, pruned "
                f"{sum(r['pruned_right'] for r in prune_rows)}/{n}.", ""]
    if kv_rows:
        n = kv_rows[0]["n"]
        out += [f"**KV quantisation of cached blocks** ({n} prompts of about {args.kv_tokens} tokens; "
                "L2 = after a restart of the whole cluster, blocks read from disk):", "",
                "| cached blocks | SSD bytes per 1K tokens | cold TTFT | L2-hit TTFT | tokens from L2 | same answer as full precision |",
                "|---|---|---|---|---|---|"]
        for r in kv_rows:
            out.append(f"| {r['bits']}-bit ({r['scheme']}) | {r['disk_bytes_per_1k'] / 2**20:.2f} MiB | "
                       f"{r['cold_ttft']:.2f} s | {r['l2_ttft']:.2f} s | {r['l2_tokens']:.0f} | "
                       f"{r['agree']}/{r['n']} |")
        out.append("")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--model", choices=sorted(DRAFTS), default="smollm2")
    ap.add_argument("--sections", default="speculative,pruning,kv")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=5, help="coding prompts (speculative)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--questions", type=int, default=6, help="documents (pruning)")
    ap.add_argument("--long-tokens", type=int, default=1536)
    ap.add_argument("--keep-ratio", type=float, default=0.3)
    ap.add_argument("--kv-prompts", type=int, default=3)
    ap.add_argument("--kv-tokens", type=int, default=1024)
    ap.add_argument("--kv-answer-tokens", type=int, default=24)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    args.command = "scripts/bench_accelerators.py " + " ".join(sys.argv[1:])
    args.model_files = bench_peers.MODELS[args.model]
    sections = set(args.sections.split(","))
    machine = bench_peers.machine_facts()
    tokens = bench_peers.Tokens(args.model_files)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="strata-accel-"))

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    spec_rows, prune_rows, kv_rows = [], [], []
    try:
        if sections & {"speculative", "pruning"}:
            draft = DRAFTS[args.model]
            cluster = Cluster(args, tmp / "main", [
                ("base", ""),
                ("spec", f'draft_model = "{draft}"\ndraft_tokens = {args.draft_tokens}')])
            cluster.start()
            try:
                if "speculative" in sections:
                    spec_rows = speculative(cluster, args, log)
                if "pruning" in sections:
                    prune_rows = pruning(cluster, args, tokens, log)
            finally:
                cluster.stop()
        if "kv" in sections:
            kv_rows = quantised(args, tmp / "kv", tokens, log)
    finally:
        # The KV stores and logs of the run: gigabytes on a small disk.
        shutil.rmtree(tmp, ignore_errors=True)
    text = report(args, machine, spec_rows, prune_rows, kv_rows)
    print(text)
    if args.out:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{args.model}.md").write_text(text + "\n")
        (out / f"{args.model}.json").write_text(json.dumps(
            {"machine": machine, "speculative": spec_rows, "pruning": prune_rows,
             "kv": kv_rows}, indent=1))


if __name__ == "__main__":
    main()
