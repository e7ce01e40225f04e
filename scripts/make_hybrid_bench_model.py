#!/usr/bin/env python3
"""A random-weight Qwen3.5-MoE (model_type qwen3_5_moe, the layer pattern of Qwen3.6-35B-A3B)
big enough to time, for scripts/bench_peers.py --model hybrid (not CI):

    $STRATA_CACHE/benchvenv/bin/python scripts/make_hybrid_bench_model.py OUT_DIR

Published layout as scripts/make_hybrid_fixtures.py writes it (a vision-language config.json
with the decoder in `text_config`, tensors under `model.language_model.`, norms as offsets
from 1, PyTorch's conv1d layout, fused experts), scaled down: hidden 512, 8 layers (three
Gated DeltaNet layers to each of gated full attention), attention 8 query heads over 2 KV
heads of 64, linear attention 4 key heads and 8 value heads of 64, 16 experts of width 256
(2 per token, renormalised) and a shared expert of 256. The tokenizer and chat template are
SmolLM2's (setup's converted folder), so that every server sizes and renders prompts the same
way; its 49,152 ids are the vocabulary.
"""
import json
import math
import pathlib
import shutil
import sys

import numpy as np
from safetensors.numpy import save_file

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from make_hybrid_fixtures import weights  # noqa: E402

TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=512, num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256,
    shared_expert_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
    rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False,
    attention_bias=False, hidden_act="silu", attn_output_gate=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                         partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                         mrope_interleaved=True),
)


def main():
    out = pathlib.Path(sys.argv[1])
    tokenizer_dir = pathlib.Path(sys.argv[2]) if len(sys.argv) > 2 else (
        pathlib.Path.home() / ".cache/strata/models/smollm2-135m-instruct-f32")
    out.mkdir(parents=True, exist_ok=True)
    vocab_config = json.loads((tokenizer_dir / "config.json").read_text())
    vocab = vocab_config["vocab_size"]
    text = dict(TEXT, vocab_size=vocab, bos_token_id=vocab_config.get("bos_token_id", 1),
                eos_token_id=vocab_config.get("eos_token_id", 2))
    config = dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                  model_type="qwen3_5_moe", text_config=text, tie_word_embeddings=False)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    rng = np.random.default_rng(20261207)
    tensors = weights(text, rng, vocab)
    d = text["hidden_size"]
    tensors = {"model.language_model." + k: v for k, v in tensors.items()}
    tensors["lm_head.weight"] = (
        3.0 * rng.standard_normal((vocab, d)) / math.sqrt(d)).astype(np.float32)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    print(f"wrote {out} ({sum(t.size for t in tensors.values()) / 1e6:.0f}M parameters)")


if __name__ == "__main__":
    main()
