#!/usr/bin/env python3
"""Tiny random-weight models of the decoder families Strata runs, and mlx-lm's outputs on them.

    python3 -m venv $STRATA_CACHE/familyvenv
    $STRATA_CACHE/familyvenv/bin/pip install "mlx[cpu]==0.32.2" "mlx-lm==0.32.2"
    $STRATA_CACHE/familyvenv/bin/python scripts/make_family_fixtures.py

For each family below it writes services/worker/tests/fixtures/families/<name>/: a Hugging Face
folder laid out as the family's published checkpoints are (config.json with the family's own
fields, model.safetensors under the on-disk tensor names, tokenizer.json,
tokenizer_config.json), with float32 weights drawn from a seeded numpy generator, in the
family's published config scaled down (small widths and few layers, but the real structure:
head counts and their ratio, head_dim apart from hidden/heads where the family has it, tied or
untied head, RoPE type and its parameters, the layer pattern). Then it loads each folder with
mlx-lm 0.32.2's own `load_model` (from the local path: no hub) on the CPU and writes, to
reference.json: for fixed token-id prompts, the logits after the last prompt token (the whole
vocabulary) and the first greedy tokens, with the top-1/top-2 margin of each greedy step (so a
reader can see the greedy sequence is not decided by rounding).

Then the mlx-community layouts: some of those folders quantised by mlx-lm's own
`quantize_model` and saved by its `save_model` (QUANTISED below: affine widths and group sizes
per layer, MXFP4), with mlx-lm's outputs on the quantised weights.

Every step is seeded; two runs give the same files. Not run in CI (it needs the venv above);
its outputs are committed and services/worker/tests/family_parity.rs checks Strata on them.
"""
import json
import math
import pathlib

import numpy as np
from safetensors.numpy import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "services/worker/tests/fixtures/families"
VOCAB = 256
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PROMPT_LENGTHS = [7, 33, 130]
N_GREEDY = 12
# A ChatML template: the families' own templates are checked by the template fixtures; here the
# folder only needs one so that the worker's loader accepts it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Each published config, scaled down: widths and layer counts shrink, everything else is the
# family's (field names, head ratios, RoPE settings, tying, layer patterns).
FAMILIES = {
    # Qwen3-0.6B: q/k RMSNorm per head, head_dim 128 with hidden 1024 (heads * head_dim !=
    # hidden), 16 query heads over 8 KV heads, tied head, theta 1e6.
    "qwen3": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=64,
        intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=True,
        attention_bias=False, hidden_act="silu", torch_dtype="float32",
    ),
    # Llama-3.2-1B: tied head, "llama3" RoPE scaling (factor 32), theta 5e5, 4:1 GQA.
    "llama3_2": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="float32",
    ),
    # Llama-3.1-8B: untied head, "llama3" RoPE scaling (factor 8).
    "llama3_1": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
        intermediate_size=224, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(factor=8.0, high_freq_factor=4.0, low_freq_factor=1.0,
                          original_max_position_embeddings=8192, rope_type="llama3"),
        attention_bias=False, mlp_bias=False, hidden_act="silu", torch_dtype="float32",
    ),
    # Mistral-7B-Instruct-v0.3: model_type "mistral", 4:1 GQA, explicit head_dim, theta 1e6,
    # no sliding window, untied head.
    "mistral": dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=64,
        intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
        tie_word_embeddings=False, hidden_act="silu", torch_dtype="float32",
    ),
    # Phi-4-mini-instruct (model_type phi3): fused qkv_proj and gate_up_proj, partial rotary
    # (0.75 of head_dim), "longrope" scaling with per-frequency factors, tied head.
    "phi3": dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64,
        intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=131072,
        original_max_position_embeddings=4096, partial_rotary_factor=0.75,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
        rope_scaling="longrope", hidden_act="silu", torch_dtype="float32",
    ),
    # SmolLM3-3B: Llama with every fourth layer without RoPE (no_rope_layers), theta 5e6.
    "smollm3": dict(
        architectures=["SmolLM3ForCausalLM"], model_type="smollm3", hidden_size=64,
        intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_theta=5000000.0, rope_scaling=None, no_rope_layer_interval=4,
        no_rope_layers=[1, 1, 1, 0], tie_word_embeddings=True, attention_bias=False,
        mlp_bias=False, hidden_act="silu", torch_dtype="float32",
    ),
}


def head_dim(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def weights(name, c, rng):
    """The family's tensors under its on-disk names: linear weights N(0, 1/in), the two output
    projections of each block twice that (so that the layers, not the input embedding, decide
    the next token: with a tied head a weak stack would just echo the last token), norms
    1 + noise (so a norm that is skipped shows), embeddings N(0, 0.3^2)."""
    d, ff, hd = c["hidden_size"], c["intermediate_size"], head_dim(c)
    h, kv = c["num_attention_heads"], c["num_key_value_heads"]

    def linear(out_dim, in_dim):
        return (rng.standard_normal((out_dim, in_dim)) / math.sqrt(in_dim)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    t = {"model.embed_tokens.weight": (0.3 * rng.standard_normal((VOCAB, d))).astype(np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = norm(d)
        t[p + "post_attention_layernorm.weight"] = norm(d)
        if name == "phi3":
            t[p + "self_attn.qkv_proj.weight"] = linear((h + 2 * kv) * hd, d)
            t[p + "mlp.gate_up_proj.weight"] = linear(2 * ff, d)
        else:
            t[p + "self_attn.q_proj.weight"] = linear(h * hd, d)
            t[p + "self_attn.k_proj.weight"] = linear(kv * hd, d)
            t[p + "self_attn.v_proj.weight"] = linear(kv * hd, d)
            t[p + "mlp.gate_proj.weight"] = linear(ff, d)
            t[p + "mlp.up_proj.weight"] = linear(ff, d)
        t[p + "self_attn.o_proj.weight"] = 2.0 * linear(d, h * hd)
        t[p + "mlp.down_proj.weight"] = 2.0 * linear(d, ff)
        if name == "qwen3":
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
    t["model.norm.weight"] = norm(d)
    if not c["tie_word_embeddings"]:
        t["lm_head.weight"] = (3.0 * linear(VOCAB, d)).astype(np.float32)
    return t


def tokenizer_json():
    """A word-level stand-in ('t0'..'t255' plus ChatML specials): the fixtures send token ids."""
    vocab = {f"t{i}": i for i in range(VOCAB - len(SPECIALS))}
    added = []
    for j, s in enumerate(SPECIALS):
        vocab[s] = VOCAB - len(SPECIALS) + j
        added.append(dict(id=vocab[s], content=s, single_word=False, lstrip=False,
                          rstrip=False, normalized=False, special=True))
    return dict(
        version="1.0", truncation=None, padding=None, added_tokens=added, normalizer=None,
        pre_tokenizer=dict(type="WhitespaceSplit"), post_processor=None,
        decoder=None, model=dict(type="WordLevel", vocab=vocab, unk_token="t0"),
    )


def write_family(name, c, rng):
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    c = dict(c, vocab_size=VOCAB, bos_token_id=VOCAB - 3, eos_token_id=VOCAB - 1)
    if c.get("rope_scaling") == "longrope":
        rotated = int(head_dim(c) * c["partial_rotary_factor"])
        c["rope_scaling"] = dict(
            type="longrope",
            long_factor=[round(float(x), 4) for x in 1.0 + 3.0 * rng.random(rotated // 2)],
            short_factor=[round(float(x), 4) for x in 1.0 + 0.1 * rng.random(rotated // 2)],
        )
    (folder / "config.json").write_text(json.dumps(c, indent=1) + "\n")
    save_file(weights(name, c, rng), str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=SPECIALS[0], eos_token=SPECIALS[2], add_bos_token=False,
        chat_template=CHAT_TEMPLATE,
    ), indent=1) + "\n")
    return folder, c


def reference(folder, prompts):
    """mlx-lm's forward on the folder: last-position logits, greedy tokens and their margins."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    mx.set_default_device(mx.cpu)
    model, _ = load_model(folder)
    cases = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)[0, -1].astype(mx.float32)
        first = np.array(logits).tolist()
        greedy, margins = [], []
        for _ in range(N_GREEDY):
            row = np.array(logits)
            top = np.argsort(row)[::-1]
            greedy.append(int(top[0]))
            margins.append(float(row[top[0]] - row[top[1]]))
            logits = model(mx.array([[int(top[0])]]), cache=cache)[0, -1].astype(mx.float32)
        cases.append(dict(input_ids=prompt, logits=[round(x, 6) for x in first],
                          greedy_ids=greedy, greedy_margins=[round(m, 4) for m in margins]))
    return cases


def mixed_predicate(path, module):
    """A different width and group size per kind of layer, one left unquantised: what
    mlx-lm's mixed recipes and hand-made uploads write into config.json per module."""
    if path.endswith("layers.1.mlp.down_proj"):
        return False
    for suffix, bits, group in [("q_proj", 2, 32), ("k_proj", 3, 64), ("v_proj", 6, 32),
                                ("o_proj", 8, 64), ("gate_proj", 5, 32), ("up_proj", 4, 64),
                                ("down_proj", 3, 64), ("embed_tokens", 8, 32)]:
        if path.endswith(suffix):
            return dict(group_size=group, bits=bits, mode="affine")
    return True


# mlx-community uploads: a family fixture quantised by mlx-lm's own `quantize_model` and saved
# by its `save_model`/`save_config` (config.json's `quantization`, per module where it differs).
QUANTISED = {
    # Affine 2/3/4/5/6/8-bit with group sizes 32 and 64 per layer, and a layer kept dense.
    "qwen3_mixed": ("qwen3", "affine", 64, 4, mixed_predicate),
    # MXFP4 (MLX 0.32's microscaled 4-bit float: e8m0 scales over groups of 32, no biases).
    "llama3_1_mxfp4": ("llama3_1", "mxfp4", 32, 4, None),
}


def write_quantised(name, base, mode, group_size, bits, predicate):
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    mx.set_default_device(mx.cpu)
    model, config = load_model(OUT / base)
    model, config = quantize_model(model, config, group_size, bits, mode=mode,
                                   quant_predicate=predicate)
    folder = OUT / name
    shutil.rmtree(folder, ignore_errors=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(OUT / base / f, folder / f)
    return folder, config


def main():
    import mlx.core as mx
    import mlx_lm

    rng = np.random.default_rng(20261202)
    # Prompt ids avoid the specials, as text would.
    prompts = [rng.integers(0, VOCAB - len(SPECIALS), n).tolist() for n in PROMPT_LENGTHS]
    out = dict(
        generator="scripts/make_family_fixtures.py",
        reference=f"mlx-lm {mlx_lm.__version__} on mlx {mx.__version__} (cpu, float32)",
        families={},
    )
    for name, config in FAMILIES.items():
        folder, written = write_family(name, config, rng)
        cases = reference(folder, prompts)
        low = min(m for case in cases for m in case["greedy_margins"])
        print(f"{name}: smallest greedy margin {low:.4f}")
        out["families"][name] = dict(model_type=written["model_type"], cases=cases)
    for name, (base, mode, group_size, bits, predicate) in QUANTISED.items():
        folder, written = write_quantised(name, base, mode, group_size, bits, predicate)
        cases = reference(folder, prompts)
        low = min(m for case in cases for m in case["greedy_margins"])
        print(f"{name}: smallest greedy margin {low:.4f}")
        out["families"][name] = dict(model_type=written["model_type"], cases=cases)
    (OUT / "reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
