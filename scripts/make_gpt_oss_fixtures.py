#!/usr/bin/env python3
"""A tiny random-weight gpt-oss model and mlx-lm's outputs on it.

    $STRATA_CACHE/benchvenv/bin/python scripts/make_gpt_oss_fixtures.py

Any venv with `mlx[cpu]==0.32.2`, `mlx-lm==0.32.2`, numpy and safetensors will do
(make_family_fixtures.py's, or bench-setup's benchvenv). It writes, under
services/worker/tests/fixtures/families/:
- gpt_oss/: gpt-oss-20b's published config scaled down, in Hugging Face's unquantised layout
  (transformers' GptOssExperts: `mlp.experts.gate_up_proj` `[experts, hidden, 2 * width]` with
  gate and up columns interleaved, `gate_up_proj_bias`, `down_proj` `[experts, width, hidden]`,
  `down_proj_bias`; the router `mlp.router` with a bias; q/k/v/o biases; one attention sink
  per query head, `self_attn.sinks`);
- gpt_oss_mlx/: the same weights in mlx-lm's layout (what `mlx_lm.convert` writes:
  `mlp.experts.{gate,up,down}_proj.{weight,bias}` stacked `[experts, out, in]`);
- gpt_oss_mxfp4/: the experts of those weights in MXFP4 as OpenAI publishes gpt-oss
  (`gate_up_proj_blocks` `[experts, 2 * width, hidden / 32, 16]` bytes with gate and up rows
  interleaved, `gate_up_proj_scales` e8m0 bytes, `down_proj_blocks`/`_scales`; the rest dense);
- gpt_oss_mxfp4_mlx/: the same codes in mlx-lm's layout (`experts.gate_proj.weight` uint32,
  `.scales`, `.bias`; config.json's `quantization` in mxfp4 mode), as mlx-community uploads;
- gpt_oss_reference.json: mlx-lm 0.32.2's last-position logits and greedy tokens for fixed
  prompts, on the mlx-lm folder (mlx-lm's own `sanitize` cannot read the unquantised Hugging
  Face layout, so the reference runs on the converted copy of the same weights) and, for the
  MXFP4 folders, on their codes expanded by MLX (mlx-lm 0.32.2's quantised SwitchGLU passes
  `gather_qmm` a `global_scale` that mlx 0.32.2 does not take, so it cannot run them packed).
A file of its own, with its own seed, so that the earlier fixtures stay byte for byte.
"""
import json
import math

import numpy as np
from safetensors.numpy import save_file

from make_family_fixtures import OUT, PROMPT_LENGTHS, SPECIALS, VOCAB, reference, write_tokenizer

# gpt-oss-20b: 24 layers alternating a 128-token sliding window and full attention, 64 query
# heads over 8 KV heads of 64 (hidden 2880), biases on q/k/v/o, a learned sink logit per
# query head, YaRN RoPE (factor 32 over an original 4096, theta 150000), 32 experts of width
# 2880, 4 per token, softmax over the chosen four, a clamped SwiGLU (limit 7, alpha 1.702,
# `(up + 1) * gate * sigmoid(1.702 gate)`), untied head. Scaled: hidden 64, 4 layers, 8 query
# heads over 2 KV heads of 16, a window of 8 (the prompts of 33 and 130 tokens cross it many
# times), 8 experts of width 32, 2 per token, an original context of 32 for YaRN (so that the
# prompts pass it).
CONFIG = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True,
    attention_dropout=0.0, experts_per_token=2, head_dim=16, hidden_act="silu",
    hidden_size=64, initial_context_length=32, intermediate_size=32,
    layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=131072,
    num_attention_heads=8, num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=2,
    num_local_experts=8, output_router_logits=False, rms_norm_eps=1e-5,
    rope_scaling=dict(beta_fast=32.0, beta_slow=1.0, factor=32.0,
                      original_max_position_embeddings=32, rope_type="yarn", truncate=False),
    rope_theta=150000, router_aux_loss_coef=0.9, sliding_window=8, swiglu_limit=7.0,
    tie_word_embeddings=False, torch_dtype="float32", use_cache=True,
)


def weights(c, rng):
    """Both layouts of one set of weights: (Hugging Face's, mlx-lm's)."""
    d, layers = c["hidden_size"], c["num_hidden_layers"]
    h, kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    e, width = c["num_local_experts"], c["intermediate_size"]

    def linear(out_dim, in_dim, gain=1.0):
        return (gain * rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(
            np.float32)

    def vector(n, scale=0.1, centre=0.0):
        return (centre + scale * rng.standard_normal(n)).astype(np.float32)

    hf = {"model.embed_tokens.weight": (0.3 * rng.standard_normal((VOCAB, d))).astype(np.float32)}
    mlx = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        hf[p + "input_layernorm.weight"] = vector(d, centre=1.0)
        hf[p + "post_attention_layernorm.weight"] = vector(d, centre=1.0)
        s = p + "self_attn."
        for name, rows in [("q_proj", h * hd), ("k_proj", kv * hd), ("v_proj", kv * hd)]:
            hf[s + name + ".weight"] = linear(rows, d)
            hf[s + name + ".bias"] = vector(rows)
        hf[s + "o_proj.weight"] = linear(d, h * hd, 2.0)
        hf[s + "o_proj.bias"] = vector(d)
        # Sinks around 0 to 2: some heads give the sink a real share of their attention.
        hf[s + "sinks"] = vector(h, 1.0, 1.0)
        m = p + "mlp."
        hf[m + "router.weight"] = linear(e, d, 4.0)
        hf[m + "router.bias"] = vector(e, 0.5)
        # Gains of 6 push some gate and up values past the clamp at 7.
        gate = np.stack([linear(width, d, 6.0) for _ in range(e)])
        up = np.stack([linear(width, d, 6.0) for _ in range(e)])
        down = np.stack([linear(d, width, 0.5) for _ in range(e)])
        gate_bias = np.stack([vector(width, 0.5) for _ in range(e)])
        up_bias = np.stack([vector(width, 0.5) for _ in range(e)])
        down_bias = np.stack([vector(d) for _ in range(e)])
        # transformers: gate_up_proj [experts, hidden, 2 * width], gate in the even columns.
        gate_up = np.empty((e, d, 2 * width), np.float32)
        gate_up[..., ::2] = gate.transpose(0, 2, 1)
        gate_up[..., 1::2] = up.transpose(0, 2, 1)
        gate_up_bias = np.empty((e, 2 * width), np.float32)
        gate_up_bias[:, ::2] = gate_bias
        gate_up_bias[:, 1::2] = up_bias
        hf[m + "experts.gate_up_proj"] = gate_up
        hf[m + "experts.gate_up_proj_bias"] = gate_up_bias
        hf[m + "experts.down_proj"] = np.ascontiguousarray(down.transpose(0, 2, 1))
        hf[m + "experts.down_proj_bias"] = down_bias
        for name, w, b in [("gate_proj", gate, gate_bias), ("up_proj", up, up_bias),
                           ("down_proj", down, down_bias)]:
            mlx[m + f"experts.{name}.weight"] = w
            mlx[m + f"experts.{name}.bias"] = b
    hf["model.norm.weight"] = vector(d, centre=1.0)
    hf["lm_head.weight"] = linear(VOCAB, d, 3.0)
    shared = {k: v for k, v in hf.items() if ".experts." not in k}
    return hf, dict(shared, **mlx)


def mxfp4(hf, mlx):
    """The experts' matrices as MXFP4 codes: (OpenAI's layout, mlx-lm's, mlx-lm's dequantised)."""
    import mlx.core as mx

    def quantize(w):
        codes, scales = mx.quantize(mx.array(w), group_size=32, bits=4, mode="mxfp4")
        dense = mx.dequantize(codes, scales, group_size=32, bits=4, mode="mxfp4",
                              dtype=mx.float32)
        return np.array(codes), np.array(scales), np.array(dense)

    def as_blocks(codes):
        # uint32 [.., rows, in / 8] -> OpenAI's bytes [.., rows, in / 32, 16].
        b = codes.view(np.uint8)
        return b.reshape(*b.shape[:-1], b.shape[-1] // 16, 16)

    openai = {k: v for k, v in hf.items()
              if ".experts.gate_up_proj" not in k and ".experts.down_proj" not in k}
    packed, dense = dict(openai), dict(openai)
    layers = sorted({k.split(".experts.")[0] for k in mlx if ".experts." in k})
    for m in layers:
        q = {}
        for name in ["gate_proj", "up_proj", "down_proj"]:
            q[name] = quantize(mlx[f"{m}.experts.{name}.weight"])
            codes, scales, expanded = q[name]
            packed[f"{m}.experts.{name}.weight"] = codes
            packed[f"{m}.experts.{name}.scales"] = scales
            dense[f"{m}.experts.{name}.weight"] = expanded
            for t in (packed, dense):
                t[f"{m}.experts.{name}.bias"] = mlx[f"{m}.experts.{name}.bias"]
        (gc, gs, _), (uc, us, _) = q["gate_proj"], q["up_proj"]
        codes = np.empty((gc.shape[0], 2 * gc.shape[1], gc.shape[2]), gc.dtype)
        codes[:, ::2], codes[:, 1::2] = gc, uc
        scales = np.empty((gs.shape[0], 2 * gs.shape[1], gs.shape[2]), gs.dtype)
        scales[:, ::2], scales[:, 1::2] = gs, us
        openai[f"{m}.experts.gate_up_proj_blocks"] = as_blocks(codes)
        openai[f"{m}.experts.gate_up_proj_scales"] = scales
        openai[f"{m}.experts.gate_up_proj_bias"] = hf[f"{m}.experts.gate_up_proj_bias"]
        openai[f"{m}.experts.down_proj_blocks"] = as_blocks(q["down_proj"][0])
        openai[f"{m}.experts.down_proj_scales"] = q["down_proj"][1]
        openai[f"{m}.experts.down_proj_bias"] = hf[f"{m}.experts.down_proj_bias"]
    return openai, packed, dense


def write(name, config, tensors):
    return write_to(OUT / name, config, tensors)


def write_to(folder, config, tensors):
    import pathlib

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer(folder)
    return folder


def main():
    import mlx.core as mx
    import mlx_lm

    rng = np.random.default_rng(20261207)
    prompts = [rng.integers(0, VOCAB - len(SPECIALS), n).tolist() for n in PROMPT_LENGTHS]
    config = dict(CONFIG, vocab_size=VOCAB, bos_token_id=VOCAB - 3, eos_token_id=VOCAB - 1)
    hf, mlx = weights(config, rng)
    write("gpt_oss", config, hf)
    folder = write("gpt_oss_mlx", config, mlx)
    families = dict(gpt_oss=dict(model_type="gpt_oss", cases=reference(folder, prompts)))
    openai, packed, dense = mxfp4(hf, mlx)
    write("gpt_oss_mxfp4", dict(config, quantization_config=dict(
        quant_method="mxfp4", modules_to_not_convert=["model.layers.*.self_attn",
                                                      "model.layers.*.mlp.router",
                                                      "model.embed_tokens", "lm_head"])),
          openai)
    write("gpt_oss_mxfp4_mlx", dict(config, quantization=dict(group_size=32, bits=4,
                                                               mode="mxfp4")), packed)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        expanded = write_to(tmp, config, dense)
        families["gpt_oss_mxfp4"] = dict(model_type="gpt_oss",
                                         cases=reference(expanded, prompts))
    for name, entry in families.items():
        low = min(m for case in entry["cases"] for m in case["greedy_margins"])
        print(f"{name}: smallest greedy margin {low:.4f}")
    out = dict(
        generator="scripts/make_gpt_oss_fixtures.py",
        reference=f"mlx-lm {mlx_lm.__version__} on mlx {mx.__version__} (cpu, float32)",
        families=families,
    )
    (OUT / "gpt_oss_reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
