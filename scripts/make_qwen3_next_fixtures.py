#!/usr/bin/env python3
"""A tiny random-weight Qwen3-Next model and mlx-lm's outputs on it.

    $STRATA_CACHE/benchvenv/bin/python scripts/make_qwen3_next_fixtures.py

Any venv with `mlx[cpu]==0.32.2`, `mlx-lm==0.32.2`, numpy and safetensors will do. It writes
services/worker/tests/fixtures/families/qwen3_next/, laid out as Hugging Face publishes
Qwen3-Next-80B-A3B (a plain `Qwen3NextForCausalLM` config.json; the Gated DeltaNet's four
projections fused into two, `in_proj_qkvz` and `in_proj_ba`, grouped per key head; PyTorch's
conv1d layout `[channels, 1, kernel]`; RMSNorm weights stored as offsets from 1; one tensor per
expert), and families/qwen3_next_reference.json with mlx-lm's last-position logits and greedy
tokens for fixed prompts, as make_hybrid_fixtures.py does for Qwen3.5. A file of its own, with
its own seed, so that the earlier fixtures stay byte for byte.
"""
import json
import math

import numpy as np
from safetensors.numpy import save_file

from make_family_fixtures import OUT, PROMPT_LENGTHS, SPECIALS, VOCAB, reference, write_tokenizer

# Qwen3-Next-80B-A3B: 48 layers, three Gated DeltaNet layers then one of gated full attention;
# attention with 16 query heads over 2 KV heads of 256, RoPE on a quarter of each head (theta
# 1e7); linear attention with 16 key heads and 32 value heads of 128, kernel 4; 512 experts of
# width 512, 10 per token (renormalised), a shared expert of 512 behind a sigmoid gate; untied
# head. Scaled: hidden 64, 8 layers (two of attention), 8 query heads over 2 KV heads of 16,
# linear attention 2 key heads and 4 value heads of 16, 8 experts of 32, 2 per token, and layer
# 2 listed in `mlp_only_layers` (published: none) so that its dense MLP is read too.
CONFIG = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=64,
    intermediate_size=96, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=4,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    shared_expert_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
    mlp_only_layers=[2], partial_rotary_factor=0.25, rope_theta=10000000.0, rope_scaling=None,
    rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=False,
    attention_bias=False, hidden_act="silu", torch_dtype="float32",
)


def weights(c, rng):
    d = c["hidden_size"]
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    kernel = c["linear_conv_kernel_dim"]
    conv = 2 * nk * dk + nv * dv
    per = nv // nk

    def linear(out_dim, in_dim, gain=1.0):
        return (gain * rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(
            np.float32)

    def norm(n, centre=0.0):
        return (centre + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": (0.3 * rng.standard_normal((VOCAB, d))).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if (i + 1) % c["full_attention_interval"] != 0:
            a = p + "linear_attn."
            q, k = linear(nk * dk, d), linear(nk * dk, d)
            v, z = linear(nv * dv, d), linear(nv * dv, d)
            b, dt = linear(nv, d), linear(nv, d)
            # Per key head: its q, k, then the v and z rows of its value heads (and b, a).
            t[a + "in_proj_qkvz.weight"] = np.concatenate([
                np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk],
                                v[g * per * dv:(g + 1) * per * dv],
                                z[g * per * dv:(g + 1) * per * dv]])
                for g in range(nk)])
            t[a + "in_proj_ba.weight"] = np.concatenate([
                np.concatenate([b[g * per:(g + 1) * per], dt[g * per:(g + 1) * per]])
                for g in range(nk)])
            t[a + "conv1d.weight"] = (
                rng.standard_normal((conv, 1, kernel)) / math.sqrt(kernel)).astype(np.float32)
            t[a + "A_log"] = np.log(rng.uniform(0.5, 16.0, nv)).astype(np.float32)
            t[a + "dt_bias"] = (1.0 + 0.5 * rng.standard_normal(nv)).astype(np.float32)
            t[a + "norm.weight"] = norm(dv, 1.0)
            t[a + "out_proj.weight"] = linear(d, nv * dv, 2.0)
        else:
            s = p + "self_attn."
            t[s + "q_proj.weight"] = linear(2 * h * hd, d)
            t[s + "k_proj.weight"] = linear(kv * hd, d)
            t[s + "v_proj.weight"] = linear(kv * hd, d)
            t[s + "o_proj.weight"] = linear(d, h * hd, 2.0)
            t[s + "q_norm.weight"] = norm(hd)
            t[s + "k_norm.weight"] = norm(hd)
        m = p + "mlp."
        if i in c["mlp_only_layers"]:
            ff = c["intermediate_size"]
            t[m + "gate_proj.weight"] = linear(ff, d)
            t[m + "up_proj.weight"] = linear(ff, d)
            t[m + "down_proj.weight"] = linear(d, ff, 2.0)
            continue
        e, width, shared = (c["num_experts"], c["moe_intermediate_size"],
                            c["shared_expert_intermediate_size"])
        t[m + "gate.weight"] = linear(e, d, 4.0)
        for x in range(e):
            t[m + f"experts.{x}.gate_proj.weight"] = linear(width, d)
            t[m + f"experts.{x}.up_proj.weight"] = linear(width, d)
            t[m + f"experts.{x}.down_proj.weight"] = linear(d, width, 2.0)
        t[m + "shared_expert.gate_proj.weight"] = linear(shared, d)
        t[m + "shared_expert.up_proj.weight"] = linear(shared, d)
        t[m + "shared_expert.down_proj.weight"] = linear(d, shared, 2.0)
        t[m + "shared_expert_gate.weight"] = linear(1, d)
    t["model.norm.weight"] = norm(d)
    t["lm_head.weight"] = linear(VOCAB, d, 3.0)
    return t


def main():
    import mlx.core as mx
    import mlx_lm

    rng = np.random.default_rng(20261208)
    prompts = [rng.integers(0, VOCAB - len(SPECIALS), n).tolist() for n in PROMPT_LENGTHS]
    config = dict(CONFIG, vocab_size=VOCAB, bos_token_id=VOCAB - 3, eos_token_id=VOCAB - 1)
    folder = OUT / "qwen3_next"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(weights(config, rng), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(folder)
    cases = reference(folder, prompts)
    low = min(m for case in cases for m in case["greedy_margins"])
    print(f"qwen3_next: smallest greedy margin {low:.4f}")
    out = dict(
        generator="scripts/make_qwen3_next_fixtures.py",
        reference=f"mlx-lm {mlx_lm.__version__} on mlx {mx.__version__} (cpu, float32)",
        families=dict(qwen3_next=dict(model_type="qwen3_next", cases=cases)),
    )
    (OUT / "qwen3_next_reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
