#!/usr/bin/env python3
"""Writes the reference embeddings that the embedding worker is checked against.

    python3 -m venv $STRATA_CACHE/stvenv
    $STRATA_CACHE/stvenv/bin/pip install sentence-transformers==6.2.0
    $STRATA_CACHE/stvenv/bin/python scripts/make_embedding_fixtures.py

Loads all-MiniLM-L6-v2 from the folder scripts/setup installed (the same files the worker
loads) with sentence-transformers on the CPU, embeds the sentences below one at a time, and
writes them with their embeddings to services/worker/tests/fixtures/minilm_embeddings.json.
Not run in CI (sentence-transformers pulls PyTorch, several GB); the fixture is committed.
"""
import json
import os
import pathlib

import sentence_transformers
import torch
from sentence_transformers import SentenceTransformer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "services/worker/tests/fixtures/minilm_embeddings.json"

SENTENCES = [
    "Hello!",
    "cat",
    "The cat sat on the mat.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "What is the capital of France?",
    "Paris is the capital and most populous city of France.",
    "How do I reverse a linked list in Rust?",
    "fn main() { println!(\"hello, world\"); }",
    "SELECT name, count(*) FROM users GROUP BY name HAVING count(*) > 1;",
    "The quick brown fox jumps over the lazy dog.",
    "Time flies like an arrow; fruit flies like a banana.",
    "I can't believe it's not butter!",
    "E = mc^2",
    "3.14159 26535 89793",
    "Call me at +1 (555) 010-9999 before 5pm.",
    "naïve café résumé — déjà vu",
    "Größe, Straße und Übermaß",
    "東京は日本の首都です。",
    "Москва — столица России.",
    "emoji test 🚀🔥 done",
    "   leading and trailing spaces   ",
    "UPPER CASE SHOUTING IS STILL THE SAME WORDS",
    "tab\tseparated\tvalues",
    "line one\nline two\nline three",
    "The stock market fell sharply on Tuesday after the central bank raised interest rates.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The mitochondria is the powerhouse of the cell.",
    "Please restart the server and clear the cache before running the tests again.",
    "A KV cache stores the keys and values of attention so that a prefix is not computed twice.",
    "Continuous batching lets requests join and leave the running batch between steps.",
    "She sells seashells by the seashore.",
    "To be, or not to be, that is the question.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "It was the best of times, it was the worst of times.",
    "In the beginning God created the heaven and the earth.",
    "The rain in Spain stays mainly in the plain.",
    "An apple a day keeps the doctor away.",
    "Where is the nearest train station?",
    "My flight was delayed by three hours because of the snow storm.",
    "The recipe calls for two cups of flour, one egg and a pinch of salt.",
    "Error: connection refused (os error 111)",
    "https://example.com/path?query=value&other=1",
]

# Longer inputs, up to the model's 256-token limit, so that batches mix very different lengths.
PARAGRAPH = (
    "Strata keeps the key and value tensors of every prompt it has seen in a tiered cache, "
    "first in the worker's memory, then in the cache service's RAM, then on an SSD, so that a "
    "coding agent that sends the same long prefix again gets its first token quickly. "
)
for words in (40, 80, 120, 160, 190):
    SENTENCES.append(" ".join((PARAGRAPH * 8).split()[:words]))


def main():
    cache = pathlib.Path(os.environ.get("STRATA_CACHE", pathlib.Path.home() / ".cache/strata"))
    folder = cache / "models/all-minilm-l6-v2"
    torch.manual_seed(0)
    model = SentenceTransformer(str(folder), device="cpu")
    limit = model.max_seq_length
    for s in SENTENCES:
        n = len(model.tokenizer(s)["input_ids"])
        assert n <= limit, f"{n} tokens > {limit}: {s[:40]}"
    # One at a time: no padding in the reference.
    vectors = [model.encode([s], convert_to_numpy=True)[0] for s in SENTENCES]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({
        "model": "all-MiniLM-L6-v2",
        "made_by": f"sentence-transformers {sentence_transformers.__version__}, "
                   f"torch {torch.__version__}, CPU, one sentence per call",
        "sentences": SENTENCES,
        "token_counts": [len(model.tokenizer(s)["input_ids"]) for s in SENTENCES],
        "embeddings": [[round(float(x), 7) for x in v] for v in vectors],
    }, ensure_ascii=False) + "\n")
    print(f"wrote {len(SENTENCES)} embeddings of {len(vectors[0])} dimensions to {OUT}")


if __name__ == "__main__":
    main()
