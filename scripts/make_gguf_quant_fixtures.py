#!/usr/bin/env python3
"""Fixtures for the GGUF block types Strata expands in Rust (Q2_K..Q6_K, Q5_0, Q5_1, IQ4_NL,
IQ4_XS, and the ones MLX reads too), with the PyPI `gguf` package's numpy dequantisers as the
reference. Run with the project venv (gguf, numpy):

    python scripts/make_gguf_quant_fixtures.py [--real FILE.gguf ...]

Writes
- services/model-files/tests/fixtures/quants/: for every type, `<TYPE>.random.blocks` (32
  blocks of random bytes whose f16 scale fields are set to finite values of several
  magnitudes, signs, zeros and subnormals included) and `<TYPE>.random.f32` (the values
  gguf.quants.dequantize gives, little-endian f32); for every `--real` file, the first and
  middle 32 blocks of the first tensor of each type it holds, as `<TYPE>.real<N>.*`; and
  manifest.json naming each pair's source.
- services/worker/tests/fixtures/qwen2_quants/: a tiny random-weight Qwen2 GGUF (hidden 256,
  2 layers, the tokenizer of the qwen2-tiny fixture) whose matrices each use another type, so
  that one model covers them all, and reference.json: logits of the last prompt position and
  greedy tokens from ../shared/reference/gguf_numpy_reference.py (independent f32 numpy
  forward pass over gguf's own dequantisation).
"""
import argparse
import hashlib
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
QUANTS = ROOT / "services/model-files/tests/fixtures/quants"
MODEL_DIR = ROOT / "services/worker/tests/fixtures/qwen2_quants"
REFERENCE = ROOT.parent / "shared/reference"
sys.path.insert(0, str(ROOT / "services/worker/tests/fixtures/qwen2_tiny"))

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

import gen_qwen2_tiny as tiny  # noqa: E402

N_BLOCKS = 32
# Byte offsets of the f16 scale fields of one block (ggml's block structs).
SCALE_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
    Q.IQ4_NL: [0], Q.IQ4_XS: [0],
}
TYPES = [Q.F32, Q.F16, Q.BF16, *SCALE_FIELDS]
# Mean of a quant code, so that a minimum of dmin = d * mean keeps random weights near zero.
MEAN_CODE = {Q.Q4_1: 7.5, Q.Q5_1: 15.5, Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}


def f16_bytes(values):
    return np.asarray(values, dtype=np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(rng, ty, n):
    """n blocks of `ty`: random bytes, finite scales of many magnitudes."""
    block, size = gguf.GGML_QUANT_SIZES[ty]
    if ty == Q.F32:
        return rng.standard_normal(n).astype(np.float32).view(np.uint8)
    if ty == Q.F16:
        return f16_bytes(rng.standard_normal(n) * 10.0 ** rng.integers(-6, 4, n)).reshape(-1)
    if ty == Q.BF16:
        v = (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(np.float32)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for at in SCALE_FIELDS[ty]:
        scale = rng.standard_normal(n) * 10.0 ** rng.integers(-7, 2, n)
        scale[0], scale[1], scale[2] = 0.0, -0.0, 3e-7  # zero, negative zero, subnormal
        blocks[:, at:at + 2] = f16_bytes(scale)
    return blocks.reshape(-1)


def write_pair(name, ty, data):
    values = dequantize(np.asarray(data, dtype=np.uint8), ty).astype(np.float32).reshape(-1)
    (QUANTS / f"{name}.blocks").write_bytes(np.asarray(data, dtype=np.uint8).tobytes())
    (QUANTS / f"{name}.f32").write_bytes(values.astype("<f4").tobytes())
    return values.size


def real_blocks(path):
    """(type, tensor name, first and middle N_BLOCKS blocks) of each type a real file holds."""
    reader = gguf.GGUFReader(path)
    seen = {}
    for t in reader.tensors:
        ty = Q(t.tensor_type)
        if ty in seen or ty not in TYPES:
            continue
        size = gguf.GGML_QUANT_SIZES[ty][1]
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        n = raw.size // size
        mid = (n // 2) * size
        take = np.concatenate([raw[:N_BLOCKS * size], raw[mid:mid + N_BLOCKS * size]])
        seen[ty] = (t.name, take)
    return seen


def write_quant_fixtures(real_files):
    QUANTS.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261203)
    manifest = {"generator": "scripts/make_gguf_quant_fixtures.py",
                "reference": f"gguf {tiny.gguf_version()} gguf.quants.dequantize, numpy {np.__version__}",
                "pairs": []}
    for ty in TYPES:
        name = f"{ty.name}.random"
        values = write_pair(name, ty, random_blocks(rng, ty, N_BLOCKS))
        manifest["pairs"].append({"name": name, "type": ty.name, "values": values,
                                  "source": "random bytes, finite f16 scales"})
    for i, path in enumerate(real_files):
        for ty, (tensor, data) in real_blocks(path).items():
            name = f"{ty.name}.real{i}"
            values = write_pair(name, ty, data)
            manifest["pairs"].append({
                "name": name, "type": ty.name, "values": values,
                "source": f"{pathlib.Path(path).name} ({sha256(path)[:16]}), tensor {tensor}, "
                          f"first and middle {N_BLOCKS} blocks"})
    (QUANTS / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --- the tiny model ---------------------------------------------------------------------
N_LAYER, N_EMBD, N_HEAD, N_KV, N_FF = 2, 256, 4, 2, 512
HEAD_DIM = N_EMBD // N_HEAD
# One type per matrix: every type Strata reads appears at least once.
MATRIX_TYPES = {
    "token_embd": Q.Q6_K, "output": Q.Q4_K,
    "blk.0.attn_q": Q.Q4_K, "blk.0.attn_k": Q.Q5_K, "blk.0.attn_v": Q.Q6_K,
    "blk.0.attn_output": Q.Q3_K, "blk.0.ffn_gate": Q.Q2_K, "blk.0.ffn_up": Q.IQ4_XS,
    "blk.0.ffn_down": Q.Q5_0,
    "blk.1.attn_q": Q.Q5_1, "blk.1.attn_k": Q.IQ4_NL, "blk.1.attn_v": Q.Q4_0,
    "blk.1.attn_output": Q.Q4_1, "blk.1.ffn_gate": Q.Q8_0, "blk.1.ffn_up": Q.F16,
    "blk.1.ffn_down": Q.BF16,
}


def random_matrix(rng, ty, rows, cols, std):
    """A [rows, cols] matrix of `ty` whose values have about `std`: real quantisation where
    gguf can quantise the type, random codes with scaled scales where it cannot (K-quants,
    IQ4)."""
    if ty in (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
        a = (rng.standard_normal((rows, cols)) * std).astype(np.float32)
        return quantize(a, ty) if ty != Q.F16 else a.astype(np.float16)
    block, size = gguf.GGML_QUANT_SIZES[ty]
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    fields = SCALE_FIELDS[ty]
    for at in fields:
        blocks[:, at:at + 2] = f16_bytes(np.ones(n))
    unit = dequantize(blocks.reshape(-1), ty)
    spread = float(np.std(unit))
    d = std / spread * rng.uniform(0.5, 1.5, n)
    blocks[:, fields[0]:fields[0] + 2] = f16_bytes(d)
    if len(fields) == 2:  # a minimum: centre the values
        blocks[:, fields[1]:fields[1] + 2] = f16_bytes(d * MEAN_CODE[ty])
    return blocks.reshape(rows, -1)


def write_model(path):
    from gguf import GGUFWriter

    rng = np.random.default_rng(7)
    b2u = tiny.bytes_to_unicode()
    merges = tiny.learn_merges(tiny.BPE_TEXT, tiny.N_MERGES)
    tokens = [b2u[b] for b in range(256)] + [a + b for a, b in merges] + tiny.SPECIALS
    ttypes = [1] * (tiny.N_VOCAB - len(tiny.SPECIALS)) + [3] * len(tiny.SPECIALS)

    w = GGUFWriter(str(path), "qwen2")
    w.add_name("qwen2-quants-random")
    w.add_block_count(N_LAYER)
    w.add_context_length(tiny.N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_freq_base(tiny.ROPE_THETA)
    w.add_layer_norm_rms_eps(tiny.RMS_EPS)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(ttypes)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_bos_token_id(tiny.BOS_ID)
    w.add_eos_token_id(tiny.EOS_ID)
    w.add_pad_token_id(tiny.BOS_ID)
    w.add_add_bos_token(False)
    w.add_chat_template(tiny.CHAT_TEMPLATE)

    def matrix(name, rows, cols, std):
        ty = MATRIX_TYPES[name]
        data = random_matrix(rng, ty, rows, cols, std)
        if ty == Q.F16:
            w.add_tensor(name + ".weight", data)
        else:
            w.add_tensor(name + ".weight", data, raw_dtype=ty)

    def vector(name, n, mean, std):
        w.add_tensor(name, (mean + rng.standard_normal(n) * std).astype(np.float32))

    q_dim, kv_dim = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM
    matrix("token_embd", tiny.N_VOCAB, N_EMBD, 1.0)
    for layer in range(N_LAYER):
        p = f"blk.{layer}."
        vector(p + "attn_norm.weight", N_EMBD, 1.0, 0.1)
        matrix(p + "attn_q", q_dim, N_EMBD, 0.12)
        vector(p + "attn_q.bias", q_dim, 0.0, 0.5)
        matrix(p + "attn_k", kv_dim, N_EMBD, 0.12)
        vector(p + "attn_k.bias", kv_dim, 0.0, 0.5)
        matrix(p + "attn_v", kv_dim, N_EMBD, 0.1)
        vector(p + "attn_v.bias", kv_dim, 0.0, 0.2)
        matrix(p + "attn_output", N_EMBD, q_dim, 0.08)
        vector(p + "ffn_norm.weight", N_EMBD, 1.0, 0.1)
        matrix(p + "ffn_gate", N_FF, N_EMBD, 0.1)
        matrix(p + "ffn_up", N_FF, N_EMBD, 0.1)
        matrix(p + "ffn_down", N_EMBD, N_FF, 0.06)
    vector("output_norm.weight", N_EMBD, 1.0, 0.1)
    matrix("output", tiny.N_VOCAB, N_EMBD, 0.15)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_reference(path, out):
    sys.path.insert(0, str(REFERENCE))
    from gguf_numpy_reference import Model

    cases = []
    for ids in tiny.prompts()[:3]:
        m = Model(str(path))
        logits = m.forward(ids)
        first = logits
        greedy, margins = [], []
        for step in range(16):
            top2 = np.sort(logits)[-2:]
            nxt = int(np.argmax(logits))
            greedy.append(nxt)
            margins.append(tiny.f32(top2[1] - top2[0]))
            if nxt == tiny.EOS_ID or step == 15:
                break
            logits = m.forward([nxt])
        cases.append({"input_ids": ids, "greedy_ids": greedy, "greedy_top1_top2_margin": margins,
                      "first_logits": [tiny.f32(v) for v in first]})
    doc = {
        "model": path.name, "model_sha256": sha256(path),
        "generator": "scripts/make_gguf_quant_fixtures.py",
        "reference": "gguf_numpy_reference.py (f32 numpy over gguf.quants.dequantize)",
        "gguf_version": tiny.gguf_version(), "numpy_version": np.__version__,
        "matrix_types": {k: v.name for k, v in MATRIX_TYPES.items()},
        "cases": cases,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real", nargs="*", default=[], help="real GGUF files to take blocks from")
    args = ap.parse_args()
    write_quant_fixtures(args.real)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    model = MODEL_DIR / "qwen2_quants.gguf"
    write_model(model)
    write_reference(model, MODEL_DIR / "reference.json")


if __name__ == "__main__":
    main()
