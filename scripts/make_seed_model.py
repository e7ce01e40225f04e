#!/usr/bin/env python3
"""A random-weight model of Qwen3.6-35B-A3B's shape (mlx-lm's `qwen3_5_moe`), 4-bit affine as
mlx-lm's own conversions are, generated where it runs: 19 GB cannot be sent to the GPU
machine, so issue 26's H200 run makes it there at start (scripts/gpu-bench-seed).

    python3 make_seed_model.py OUT_DIR [--small]

Shape (scripts/make_hybrid_fixtures.py gives the published config it follows): 40 layers,
three Gated DeltaNet layers (16 key heads and 32 value heads of 128, conv kernel 4) to each
gated full-attention layer (16 query heads over 2 KV heads of 256, RoPE on a quarter), 256
experts of width 512, 8 per token, and a shared expert of 512, hidden 2048. One difference:
the vocabulary is Qwen2.5's 151,936 ids with make_random_qwen.py's word-level stand-in
tokenizer (benchmarks send token ids), not Qwen3.6's 248,320, 0.4B fewer parameters in the
embedding and head. `--small` is the same layout at hidden 256 and 4 layers, to try the
script and the loaders on a CPU.

mlx-lm builds the model with its own initialisation (uniform linears, ones for norms, A in
[0, 16)), float16, then quantises it with the model's own predicate (routers and shared
expert gates at 8 bits, everything else 4-bit, groups of 64) and saves it with save_model /
save_config: exactly the files `mlx_lm.convert -q` writes, which mlx_lm.server and Strata
both load.
"""
import argparse
import json
import pathlib
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_5_moe
from mlx_lm.utils import quantize_model, save_config, save_model

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from make_random_qwen import write_tokenizer  # noqa: E402

TEXT = dict(
    model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
    num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
    attention_bias=False, hidden_act="silu", attn_output_gate=True,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                         partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                         mrope_interleaved=True),
    vocab_size=151936, bos_token_id=151643, eos_token_id=151645,
)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, head_dim=64,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
             linear_value_head_dim=64, num_experts=16, num_experts_per_tok=4,
             moe_intermediate_size=128, shared_expert_intermediate_size=128)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    text = dict(TEXT, **(SMALL if args.small else {}))
    config = dict(architectures=["Qwen3_5MoeForConditionalGeneration"],
                  model_type="qwen3_5_moe", text_config=text, tie_word_embeddings=False)
    mx.random.seed(20261207)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    model.set_dtype(mx.float16)
    model, config = quantize_model(model, config, group_size=64, bits=4)
    # Layer by layer: the float weights of one layer's experts are 3.2 GB before quantising.
    for layer in model.language_model.model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    # make_random_qwen's stand-in tokenizer reads the vocabulary size and specials from here.
    write_tokenizer(out, dict(vocab_size=text["vocab_size"], bos_token_id=text["bos_token_id"],
                              eos_token_id=text["eos_token_id"]))
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(json.dumps({"out": str(out), "safetensors_bytes": size}))


if __name__ == "__main__":
    main()
