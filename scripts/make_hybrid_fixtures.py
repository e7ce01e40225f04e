#!/usr/bin/env python3
"""Tiny random-weight hybrid models (Gated DeltaNet layers with full attention every fourth
layer) and mlx-lm's outputs on them.

    $STRATA_CACHE/familyvenv/bin/python scripts/make_hybrid_fixtures.py

The venv is make_family_fixtures.py's (mlx[cpu] and mlx-lm 0.32.2). It writes
services/worker/tests/fixtures/families/<name>/ for each family below, laid out as Hugging Face
publishes the family (a vision-language wrapper config.json whose `text_config` is the decoder,
its tensors under `model.language_model.`, the vision tower's and the multi-token-prediction
head's tensors beside them, PyTorch's conv1d layout [channels, 1, kernel], RMSNorm weights
stored as offsets from 1, the experts' fused `gate_up_proj`), and families/hybrid_reference.json
with mlx-lm's last-position logits and greedy tokens for fixed prompts, as
make_family_fixtures.py does for the attention-only families. A file of its own, with its own
seed, so that adding these families leaves every earlier fixture byte for byte as it was.
"""
import json
import math

import numpy as np
from safetensors.numpy import save_file

from make_family_fixtures import OUT, PROMPT_LENGTHS, SPECIALS, VOCAB, reference, write_tokenizer

# Qwen3.5-35B-A3B / Qwen3.6-35B-A3B (model_type qwen3_5_moe): 40 layers, three Gated DeltaNet
# layers then one of full attention (full_attention_interval 4); attention with 16 query heads
# over 2 KV heads of head_dim 256 (hidden 2048), an output gate in q_proj, q/k norms and RoPE
# on a quarter of each head (partial_rotary_factor 0.25, theta 1e7); linear attention with 16
# key heads and 32 value heads of 128, a causal conv1d of kernel 4; 256 experts of width 512,
# 8 per token (renormalised) and a shared expert of width 512 behind a sigmoid gate; untied
# head. Scaled: hidden 64, 8 layers (two of attention), 8 query heads over 1 KV head of 16,
# linear attention 2 key heads and 4 value heads of 16, 8 experts of 32, 2 per token.
FAMILIES = {
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe_text", hidden_size=64, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        attention_bias=False, hidden_act="silu", attn_output_gate=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                             partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                             mrope_interleaved=True),
    ),
    # Qwen3.5-27B (model_type qwen3_5): the same layers with a dense SwiGLU MLP. Scaled
    # as above, 4 layers.
    "qwen3_5": dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
        rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
        attention_bias=False, hidden_act="silu", attn_output_gate=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000000.0,
                             partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                             mrope_interleaved=True),
    ),
}


def weights(c, rng, vocab=VOCAB):
    """The decoder's tensors under Hugging Face's names (without the wrapper's prefix): linear
    weights N(0, 1/in), output projections twice that, RMSNorms as offsets from 1 (noise
    around 0) but the gated norm of linear attention (a plain weight around 1)."""
    d = c["hidden_size"]
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    kernel = c["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv

    def linear(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(np.float32)

    def norm(n, centre=0.0):
        return (centre + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"embed_tokens.weight": (0.3 * rng.standard_normal((vocab, d))).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if (i + 1) % c["full_attention_interval"] != 0:
            a = p + "linear_attn."
            t[a + "in_proj_qkv.weight"] = linear(conv, d)
            t[a + "in_proj_z.weight"] = linear(nv * dv, d)
            t[a + "in_proj_b.weight"] = linear(nv, d)
            t[a + "in_proj_a.weight"] = linear(nv, d)
            t[a + "conv1d.weight"] = (
                rng.standard_normal((conv, 1, kernel)) / math.sqrt(kernel)).astype(np.float32)
            # Decay rates spread as the published initialisation spreads them (A in (0, 16]).
            t[a + "A_log"] = np.log(rng.uniform(0.5, 16.0, nv)).astype(np.float32)
            t[a + "dt_bias"] = (1.0 + 0.5 * rng.standard_normal(nv)).astype(np.float32)
            t[a + "norm.weight"] = norm(dv, 1.0)
            t[a + "out_proj.weight"] = 2.0 * linear(d, nv * dv)
        else:
            s = p + "self_attn."
            t[s + "q_proj.weight"] = linear(2 * h * hd, d)
            t[s + "k_proj.weight"] = linear(kv * hd, d)
            t[s + "v_proj.weight"] = linear(kv * hd, d)
            t[s + "o_proj.weight"] = 2.0 * linear(d, h * hd)
            t[s + "q_norm.weight"] = norm(hd)
            t[s + "k_norm.weight"] = norm(hd)
        m = p + "mlp."
        if c.get("num_experts"):
            e, width = c["num_experts"], c["moe_intermediate_size"]
            shared = c["shared_expert_intermediate_size"]
            t[m + "gate.weight"] = 4.0 * linear(e, d)
            t[m + "experts.gate_up_proj"] = np.stack([linear(2 * width, d) for _ in range(e)])
            t[m + "experts.down_proj"] = np.stack([2.0 * linear(d, width) for _ in range(e)])
            t[m + "shared_expert.gate_proj.weight"] = linear(shared, d)
            t[m + "shared_expert.up_proj.weight"] = linear(shared, d)
            t[m + "shared_expert.down_proj.weight"] = 2.0 * linear(d, shared)
            t[m + "shared_expert_gate.weight"] = linear(1, d)
        else:
            ff = c["intermediate_size"]
            t[m + "gate_proj.weight"] = linear(ff, d)
            t[m + "up_proj.weight"] = linear(ff, d)
            t[m + "down_proj.weight"] = 2.0 * linear(d, ff)
    t["norm.weight"] = norm(d)
    return t


def write_family(name, text, rng):
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    text = dict(text, vocab_size=VOCAB, bos_token_id=VOCAB - 3, eos_token_id=VOCAB - 1)
    wrapper = "Qwen3_5MoeForConditionalGeneration" if "moe" in name else \
        "Qwen3_5ForConditionalGeneration"
    config = dict(architectures=[wrapper], model_type=name, text_config=text,
                  tie_word_embeddings=False, image_token_id=VOCAB - 2,
                  vision_config=dict(model_type="qwen3_5", hidden_size=32, depth=1,
                                     patch_size=16, out_hidden_size=text["hidden_size"]))
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    d = text["hidden_size"]
    tensors = {"model.language_model." + k: v for k, v in weights(text, rng).items()}
    tensors["lm_head.weight"] = (3.0 * rng.standard_normal((VOCAB, d)) / math.sqrt(d)).astype(
        np.float32)
    # What the served decoder leaves out: the vision tower and the multi-token-prediction head.
    tensors["model.visual.patch_embed.proj.weight"] = (
        rng.standard_normal((32, 3, 2, 16, 16)).astype(np.float32))
    tensors["mtp.fc.weight"] = linear_like(rng, d, 2 * d)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder)
    return folder, config


def linear_like(rng, out_dim, in_dim):
    return (rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(np.float32)


def main():
    import mlx.core as mx
    import mlx_lm

    rng = np.random.default_rng(20261205)
    prompts = [rng.integers(0, VOCAB - len(SPECIALS), n).tolist() for n in PROMPT_LENGTHS]
    out = dict(
        generator="scripts/make_hybrid_fixtures.py",
        reference=f"mlx-lm {mlx_lm.__version__} on mlx {mx.__version__} (cpu, float32)",
        families={},
    )
    for name, text in FAMILIES.items():
        folder, written = write_family(name, text, rng)
        cases = reference(folder, prompts)
        low = min(m for case in cases for m in case["greedy_margins"])
        print(f"{name}: smallest greedy margin {low:.4f}")
        out["families"][name] = dict(model_type=written["model_type"], cases=cases)
    (OUT / "hybrid_reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
