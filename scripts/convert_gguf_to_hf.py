#!/usr/bin/env python3
"""Converts a Llama / Qwen2 GGUF into a Hugging Face / MLX safetensors folder, so that the same
weights can be served through our safetensors loader and by mlx_lm (which cannot read GGUF).

Writes config.json, tokenizer.json (byte-level BPE from the GGUF vocabulary and merges, with
the pre-tokenizer the GGUF names), tokenizer_config.json (chat template, bos/eos) and
model.safetensors with Hugging Face tensor names:

  --format f32  dequantised float32 weights (what our CPU policy computes with anyway);
  --format mlx  mlx-lm's quantised layout (uint32-packed `weight`, `scales`, `biases`,
                group size 32), converted losslessly from GGUF's Q4_0 / Q4_1 / Q8_0 blocks.

llama.cpp's converter permutes the rows of Llama's q/k projections (adjacent-pair RoPE); they are
permuted back here to the rotate-half layout that Hugging Face checkpoints use.

usage: convert_gguf_to_hf.py MODEL.gguf OUT_DIR [--format f32|mlx]
needs: gguf numpy safetensors tokenizers
"""
import argparse
import json
import os
import sys

import numpy as np
from gguf import GGUFReader
from gguf.constants import GGMLQuantizationType as T
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def field(r, key, default=None):
    if key not in r.fields:
        return default
    f = r.fields[key]
    if f.types[0].name == "ARRAY":
        if f.types[1].name == "STRING":
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    v = f.parts[f.data[0]]
    return bytes(v).decode("utf-8") if f.types[0].name == "STRING" else v.tolist()[0]


def hf_name(gguf_name):
    """blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight (None: not a weight we map)."""
    if gguf_name.startswith("blk."):
        _, layer, rest = gguf_name.split(".", 2)
        for src, dst in LAYER_NAMES.items():
            if rest == src:
                return f"model.layers.{layer}.{dst}"
            if rest.startswith(src + "."):
                return f"model.layers.{layer}.{dst}{rest[len(src):]}"
        return None
    return {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}.get(gguf_name)


def unpermute(w, n_head):
    """Inverse of llama.cpp's LlamaModel.permute for q/k rows (adjacent pairs -> rotate-half)."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def to_mlx_quantized(t, shape):
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks of 32 -> MLX affine (w = scale * q + bias), exactly."""
    raw = np.asarray(t.data).reshape(-1).view(np.uint8)
    rows, cols = shape
    groups = cols // 32
    if t.tensor_type == T.Q4_1:
        blk = raw.reshape(rows * groups, 20)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
        m = blk[:, 2:4].copy().view(np.float16).astype(np.float32).reshape(-1)
        qs = blk[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # element j: low nibble j, high j-16
        bits, scales, biases = 4, d, m
    elif t.tensor_type == T.Q4_0:
        blk = raw.reshape(rows * groups, 18)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
        qs = blk[:, 2:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)
        bits, scales, biases = 4, d, -8.0 * d
    elif t.tensor_type == T.Q8_0:
        blk = raw.reshape(rows * groups, 34)
        d = blk[:, 0:2].copy().view(np.float16).astype(np.float32).reshape(-1)
        q = (blk[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, scales, biases = 8, d, -128.0 * d
    else:
        return None
    q = q.reshape(rows, cols).astype(np.uint32)
    per_word = 32 // bits
    q = q.reshape(rows, cols // per_word, per_word)
    packed = np.zeros((rows, cols // per_word), dtype=np.uint32)
    for i in range(per_word):
        packed |= q[:, :, i] << np.uint32(bits * i)
    return (packed, scales.reshape(rows, groups).astype(np.float16),
            biases.reshape(rows, groups).astype(np.float16), bits)


def tokenizer_json(r, out_dir):
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges", [])]
    pre = field(r, "tokenizer.ggml.pre", "default")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    elif pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        sys.exit(f"unsupported pre-tokenizer {pre!r}")
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty in (3, 4)])
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    bos, eos = field(r, "tokenizer.ggml.bos_token_id"), field(r, "tokenizer.ggml.eos_token_id")
    config = {"bos_token": tokens[bos] if bos is not None else None,
              "eos_token": tokens[eos] if eos is not None else None,
              "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
              "chat_template": field(r, "tokenizer.chat_template")}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=1, ensure_ascii=False)
    return len(tokens), bos, eos


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--format", choices=["f32", "mlx"], default="f32")
    a = ap.parse_args()
    r = GGUFReader(a.gguf)
    arch = field(r, "general.architecture")
    if arch not in ("llama", "qwen2"):
        sys.exit(f"unsupported architecture {arch!r}")
    k = lambda name, default=None: field(r, f"{arch}.{name}", default)  # noqa: E731
    n_head, n_kv = k("attention.head_count"), k("attention.head_count_kv")
    os.makedirs(a.out_dir, exist_ok=True)
    vocab, bos, eos = tokenizer_json(r, a.out_dir)

    tensors, bits_of = {}, {}
    for t in r.tensors:
        name = hf_name(t.name)
        if name is None:
            sys.exit(f"unexpected tensor {t.name}")
        shape = [int(x) for x in reversed(t.shape)]
        permute_heads = None
        if arch == "llama" and ".self_attn.q_proj." in name:
            permute_heads = n_head
        elif arch == "llama" and ".self_attn.k_proj." in name:
            permute_heads = n_kv
        q = to_mlx_quantized(t, shape) if a.format == "mlx" and len(shape) == 2 else None
        if q is not None:
            base = name[: -len(".weight")]
            packed, scales, biases, bits = q
            if permute_heads is not None:  # rows move whole, with their scales and biases
                packed, scales, biases = (unpermute(x, permute_heads) for x in (packed, scales, biases))
            tensors[base + ".weight"] = np.ascontiguousarray(packed)
            tensors[base + ".scales"] = np.ascontiguousarray(scales)
            tensors[base + ".biases"] = np.ascontiguousarray(biases)
            bits_of[base] = bits
            continue
        w = (np.asarray(t.data) if t.tensor_type in (T.F32, T.F16) else dequantize(t.data, t.tensor_type))
        w = w.reshape(shape).astype(np.float32)
        if permute_heads is not None:
            w = unpermute(w, permute_heads)
        tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(a.out_dir, "model.safetensors"))

    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "hidden_size": k("embedding_length"),
        "intermediate_size": k("feed_forward_length"),
        "num_hidden_layers": k("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "rms_norm_eps": k("attention.layer_norm_rms_epsilon"),
        "rope_theta": k("rope.freq_base", 10000.0),
        "max_position_embeddings": k("context_length"),
        "vocab_size": vocab,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "hidden_act": "silu",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if bits_of:
        # The most common width is the default; modules that differ (GGUF files often keep the
        # embeddings in Q8_0) get per-module entries, which mlx-lm reads the same way.
        default_bits = max(set(bits_of.values()), key=list(bits_of.values()).count)
        quant = {"group_size": 32, "bits": default_bits}
        for base, bits in sorted(bits_of.items()):
            if bits != default_bits:
                quant[base] = {"group_size": 32, "bits": bits}
        config["quantization"] = quant
    with open(os.path.join(a.out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    print(f"wrote {a.out_dir} ({arch}, {len(tensors)} tensors, format {a.format})")


if __name__ == "__main__":
    main()
