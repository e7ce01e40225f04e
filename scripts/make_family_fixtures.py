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
    # Gemma-3-1B (model_type gemma3_text): five sliding-window layers (window 512, RoPE base
    # 1e4) to each global one (base 1e6, here with the 4B+ models' linear scaling), an RMSNorm
    # on each query and key head, norms stored as offsets from 1 and four per block, the
    # embedding scaled by sqrt(hidden) rounded to bfloat16 (96 -> 9.8125, not 9.798), GELU
    # (tanh) MLP, attention scaled by query_pre_attn_scalar (= head_dim but in the 27B; GGUF
    # files do not carry it, llama.cpp derives it so), tied head. The window shrinks to 16 so
    # that the prompts cross it.
    "gemma3": dict(
        architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=96,
        intermediate_size=192, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, rope_scaling=dict(factor=8.0, rope_type="linear"),
        sliding_window=16, sliding_window_pattern=6,
        layer_types=["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
        hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
        attn_logit_softcapping=None, tie_word_embeddings=True, attention_bias=False,
        torch_dtype="float32",
    ),
    # Ministral-3-3B-Instruct-2512's text decoder (model_type ministral3): a Llama whose RoPE
    # is YaRN (factor 16, beta_fast 32, beta_slow 1) and whose queries grow with the position
    # past the original context (llama_4_scaling_beta 0.1), all in `rope_parameters`, tied
    # head. The original context shrinks to 32 so that the prompts cross several multiples of
    # it; mscale_all_dim 0 (published: 1) so that YaRN's input scale is exercised too.
    "ministral3": dict(
        architectures=["Ministral3ForCausalLM"], model_type="ministral3", hidden_size=64,
        intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_type="yarn", factor=16.0, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=0.0, llama_4_scaling_beta=0.1,
                             original_max_position_embeddings=32, rope_theta=1000000.0),
        sliding_window=None, tie_word_embeddings=True, hidden_act="silu",
        torch_dtype="float32",
    ),
    # Qwen3-30B-A3B (model_type qwen3_moe): Qwen3's attention (q/k norms, head_dim apart from
    # hidden/heads, 8:1 GQA) and, in place of the MLP, a router over 128 experts of width 768
    # choosing 8 per token, probabilities renormalised over the chosen (norm_topk_prob),
    # untied head; Hugging Face's layout, one tensor per expert. Scaled to 8 experts, 2 per
    # token; layer 1 keeps a dense MLP (mlp_only_layers) so both kinds are exercised.
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_theta=1000000.0, rope_scaling=None,
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
        torch_dtype="float32",
    ),
    # Qwen1.5-MoE-A2.7B (model_type qwen2_moe): Qwen2's attention (q/k/v biases, no GQA),
    # 60 experts of width 1408 choosing 4 per token without renormalising, and a shared
    # expert of width 5632 every token takes, scaled by sigmoid(shared_expert_gate · x).
    # Scaled to 6 experts, 2 per token.
    "qwen2_moe": dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=64,
        intermediate_size=160, moe_intermediate_size=32, shared_expert_intermediate_size=96,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=8192, rms_norm_eps=1e-6,
        rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False,
        qkv_bias=True, hidden_act="silu", torch_dtype="float32",
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

    def norm(n, centre=1.0):
        # Gemma stores norms as offsets from 1 (its RMSNorm scales by 1 + weight).
        if name == "gemma3":
            centre -= 1.0
        return (centre + 0.1 * rng.standard_normal(n)).astype(np.float32)

    # Gemma scales the embedding by sqrt(hidden) and normalises each block's outputs: a
    # smaller embedding and post-norms of 3 let the blocks, not the input token, decide.
    embed_scale = 0.1 if name == "gemma3" else 0.3
    t = {"model.embed_tokens.weight":
         (embed_scale * rng.standard_normal((VOCAB, d))).astype(np.float32)}
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
        if name == "qwen2_moe":
            for part, rows in (("q", h * hd), ("k", kv * hd), ("v", kv * hd)):
                t[p + f"self_attn.{part}_proj.bias"] = (
                    0.1 * rng.standard_normal(rows)).astype(np.float32)
            shared = c["shared_expert_intermediate_size"]
            t[p + "mlp.shared_expert.gate_proj.weight"] = linear(shared, d)
            t[p + "mlp.shared_expert.up_proj.weight"] = linear(shared, d)
            t[p + "mlp.shared_expert.down_proj.weight"] = 2.0 * linear(d, shared)
            t[p + "mlp.shared_expert_gate.weight"] = linear(1, d)
        if name in ("qwen3_moe", "qwen2_moe") and i not in c["mlp_only_layers"]:
            # A router (scaled up so that its choices are clear) and each expert's MLP.
            width = c["moe_intermediate_size"]
            t[p + "mlp.gate.weight"] = 4.0 * linear(c["num_experts"], d)
            for e in range(c["num_experts"]):
                t[p + f"mlp.experts.{e}.gate_proj.weight"] = linear(width, d)
                t[p + f"mlp.experts.{e}.up_proj.weight"] = linear(width, d)
                t[p + f"mlp.experts.{e}.down_proj.weight"] = 2.0 * linear(d, width)
        elif name != "phi3":
            t[p + "mlp.gate_proj.weight"] = linear(ff, d)
            t[p + "mlp.up_proj.weight"] = linear(ff, d)
        t[p + "self_attn.o_proj.weight"] = 2.0 * linear(d, h * hd)
        if not (name in ("qwen3_moe", "qwen2_moe") and i not in c["mlp_only_layers"]):
            t[p + "mlp.down_proj.weight"] = 2.0 * linear(d, ff)
        if name in ("qwen3", "gemma3", "qwen3_moe"):
            t[p + "self_attn.q_norm.weight"] = norm(hd)
            t[p + "self_attn.k_norm.weight"] = norm(hd)
        if name == "gemma3":
            t[p + "post_attention_layernorm.weight"] = norm(d, 3.0)
            t[p + "pre_feedforward_layernorm.weight"] = norm(d)
            t[p + "post_feedforward_layernorm.weight"] = norm(d, 3.0)
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
    write_tokenizer(folder)
    return folder, c


def write_tokenizer(folder):
    """The stand-in tokenizer and a tokenizer_config.json with the ChatML template."""
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json()) + "\n")
    (folder / "tokenizer_config.json").write_text(json.dumps(dict(
        bos_token=SPECIALS[0], eos_token=SPECIALS[2], add_bos_token=False,
        chat_template=CHAT_TEMPLATE,
    ), indent=1) + "\n")


def write_mistral3_vlm(base="ministral3", name="mistral3_vlm"):
    """Mistral's 2512 models as Hugging Face publishes them (model_type "mistral3"): the
    ministral3 decoder's tensors under `model.language_model.` (transformers' newer layout)
    with `lm_head` at the top, an untied head (the wrapper's default), a vision tower and
    projector beside them."""
    from safetensors.numpy import load_file

    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261206)
    text = json.loads((OUT / base / "config.json").read_text())
    text.pop("tie_word_embeddings")
    text.pop("architectures")
    config = dict(architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3",
                  text_config=text, image_token_index=VOCAB - 1, spatial_merge_size=2,
                  torch_dtype="float32",
                  vision_config=dict(model_type="pixtral", hidden_size=32, image_size=32,
                                     patch_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64))
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    d = text["hidden_size"]
    tensors = {}
    for k, v in load_file(str(OUT / base / "model.safetensors")).items():
        tensors["model.language_model." + k.removeprefix("model.")] = v
    tensors["lm_head.weight"] = (3.0 * rng.standard_normal((VOCAB, d)) / math.sqrt(d)).astype(
        np.float32)
    tensors["model.vision_tower.patch_conv.weight"] = (
        rng.standard_normal((32, 3, 16, 16)).astype(np.float32))
    tensors["model.multi_modal_projector.linear_1.weight"] = (
        rng.standard_normal((d, 32)).astype(np.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_text((OUT / base / f).read_text())
    return folder, config


def write_gemma3_vlm(base="gemma3", name="gemma3_vlm"):
    """Gemma 3 4B-27B as Hugging Face publishes them (model_type "gemma3"): the text decoder's
    tensors under `language_model.`, beside a vision tower and projector, and a sparse
    `text_config` that leaves mlx-lm's defaults to fill (head counts, norms' epsilon, RoPE
    bases). Same weights as the `gemma3` fixture (its head counts are the defaults 8/4 here,
    so the attention tensors are drawn afresh)."""
    from safetensors.numpy import load_file

    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(20261205)
    text = json.loads((OUT / base / "config.json").read_text())
    sparse = {k: text[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                   "head_dim", "query_pre_attn_scalar", "sliding_window",
                                   "rope_scaling", "max_position_embeddings")}
    sparse["model_type"] = "gemma3_text"
    config = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3",
                  vocab_size=VOCAB, text_config=sparse, boi_token_index=VOCAB - 3,
                  eoi_token_index=VOCAB - 2, image_token_index=VOCAB - 1,
                  mm_tokens_per_image=4, torch_dtype="float32",
                  vision_config=dict(model_type="siglip_vision_model", hidden_size=32,
                                     image_size=32, patch_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=64))
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    d, hd = sparse["hidden_size"], sparse["head_dim"]
    heads, kv = 8, 4
    tensors = {}
    for k, v in load_file(str(OUT / base / "model.safetensors")).items():
        if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            rows = (heads if "q_proj" in k else kv) * hd
            v = (rng.standard_normal((rows, d)) / math.sqrt(d)).astype(np.float32)
        elif k.endswith("o_proj.weight"):
            v = (2.0 * rng.standard_normal((d, heads * hd)) / math.sqrt(heads * hd)).astype(
                np.float32)
        tensors["language_model." + k] = v
    tensors["vision_tower.vision_model.embeddings.patch_embedding.weight"] = (
        rng.standard_normal((32, 3, 16, 16)).astype(np.float32))
    tensors["multi_modal_projector.mm_input_projection_weight"] = (
        rng.standard_normal((32, d)).astype(np.float32))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_text((OUT / base / f).read_text())
    return folder, config


def gguf_writer(path, arch, c, name):
    """A GGUF writer for `arch` with the metadata every converted fixture shares: llama.cpp's
    hyper-parameter keys from the Hugging Face config `c`, f32 tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    return w


def add_vocabulary(w, base, model, space_prefix=None):
    """The fixture's vocabulary (`base`'s tokenizer.json, specials as control tokens) as
    llama.cpp writes it: "llama" (SentencePiece pieces with descending scores) or "gpt2"
    (tokens without merges; the fixtures send token ids)."""
    vocab = json.loads((OUT / base / "tokenizer.json").read_text())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_types([3 if p in SPECIALS else 1 for p in pieces])
    if model == "llama":
        w.add_token_scores([-float(i) for i in range(len(pieces))])
    else:
        w.add_token_merges([])
    w.add_bos_token_id(vocab[SPECIALS[0]])
    w.add_eos_token_id(vocab[SPECIALS[2]])
    w.add_add_bos_token(False)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_chat_template(CHAT_TEMPLATE)


def add_renamed_tensors(w, base, names, transform=None):
    """`base`'s safetensors under llama.cpp's names: `names` maps a layer's Hugging Face
    part to llama.cpp's; `transform(name, part, value)` changes a value first (norm shifts,
    q/k permutations)."""
    from safetensors.numpy import load_file

    for k, v in sorted(load_file(str(OUT / base / "model.safetensors")).items()):
        if k == "model.embed_tokens.weight":
            out, part = "token_embd.weight", None
        elif k == "model.norm.weight":
            out, part = "output_norm.weight", None
        else:
            layer, part = k.removeprefix("model.layers.").split(".", 1)
            part = part.removesuffix(".weight")
            out = f"blk.{layer}.{names[part]}.weight"
        if transform is not None:
            v = transform(k, part, v)
        w.add_tensor(out, np.ascontiguousarray(v, dtype=np.float32))


def finish_gguf(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gemma3_gguf(base="gemma3", name="gemma3_gguf"):
    """The `gemma3` fixture converted as llama.cpp's convert_hf_to_gguf.py converts Gemma 3
    (conversion/gemma.py, Gemma3Model): architecture "gemma3", llama.cpp's tensor names, every
    norm weight shifted by +1 (Gemma3RMSNorm's 1 + w folded in), the sliding window in
    metadata (pattern and local RoPE base left to llama.cpp's defaults, 6 and 1e4), f32
    tensors; a SentencePiece vocabulary ("llama", scores, no space prefix, as Gemma's)."""
    import gguf

    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    c = json.loads((OUT / base / "config.json").read_text())
    w = gguf_writer(folder / "gemma3.gguf", "gemma3", c, "gemma3-random")
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(c["rope_scaling"]["factor"])
    w.add_sliding_window(c["sliding_window"])
    add_vocabulary(w, base, "llama", space_prefix=False)
    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
        "post_feedforward_layernorm": "post_ffw_norm",
    }
    add_renamed_tensors(w, base, names, lambda k, part, v: (
        v + np.float32(1.0) if k.endswith("norm.weight") else v))
    finish_gguf(w)
    return folder


def write_phi3_gguf(base="phi3", name="phi3_gguf"):
    """The `phi3` fixture (Phi-4-mini's layout: partial rotary, longrope) converted as
    llama.cpp's converter converts Phi-3 (conversion/phi.py, Phi3MiniModel): architecture
    "phi3", the fused `attn_qkv` and `ffn_up` (gate then up) kept fused, the rotated
    dimensions, the original context and the attention factor in metadata, the long and short
    RoPE factors as tensors, sliding window 0 (Phi-4), f32 tensors, a SentencePiece vocabulary
    ("llama", space prefix)."""
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    c = json.loads((OUT / base / "config.json").read_text())
    d, heads = c["hidden_size"], c["num_attention_heads"]
    rope_dims = int(c["partial_rotary_factor"] * d) // heads
    stretch = c["max_position_embeddings"] / c["original_max_position_embeddings"]
    w = gguf_writer(folder / "phi3.gguf", "phi3", c, "phi3-random")
    w.add_rope_scaling_orig_ctx_len(c["original_max_position_embeddings"])
    w.add_rope_dimension_count(rope_dims)
    w.add_sliding_window(0)
    w.add_rope_scaling_attn_factors(
        math.sqrt(1 + math.log(stretch) / math.log(c["original_max_position_embeddings"])))
    add_vocabulary(w, base, "llama")
    names = {
        "input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    add_renamed_tensors(w, base, names)
    for kind in ("long", "short"):
        factors = np.array(c["rope_scaling"][f"{kind}_factor"], dtype=np.float32)
        w.add_tensor(f"rope_factors_{kind}.weight", factors)
    finish_gguf(w)
    return folder


def write_smollm3_gguf(base="smollm3", name="smollm3_gguf"):
    """The `smollm3` fixture converted as llama.cpp converts SmolLM3 (conversion/llama.py: a
    LlamaModel with architecture "smollm3"): q and k rows permuted for adjacent-pair RoPE, NoPE
    layers left to llama.cpp's rule (every 4th), f32 tensors, the byte-level vocabulary as
    "gpt2" tokens without merges (the fixtures send token ids)."""
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    c = json.loads((OUT / base / "config.json").read_text())
    heads, kv = c["num_attention_heads"], c["num_key_value_heads"]
    w = gguf_writer(folder / "smollm3.gguf", "smollm3", c, "smollm3-random")
    add_vocabulary(w, base, "gpt2")

    def permute(m, n_head):
        return (m.reshape(n_head, 2, m.shape[0] // n_head // 2, *m.shape[1:])
                .swapaxes(1, 2).reshape(m.shape))

    names = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }
    add_renamed_tensors(w, base, names, lambda k, part, v: (
        permute(v, heads) if part == "self_attn.q_proj"
        else permute(v, kv) if part == "self_attn.k_proj" else v))
    finish_gguf(w)
    return folder


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
    # mlx-community's Qwen3-MoE uploads: the experts stacked (switch_mlp) and packed 4-bit.
    "qwen3_moe_q4": ("qwen3_moe", "affine", 32, 4, None),
}

# Quantised folders whose reference is mlx-lm on their weights dequantised by MLX itself:
# mlx-lm 0.32.2's quantised SwitchGLU passes `global_scale` to a `gather_qmm` that mlx 0.32.2
# does not take, so it cannot run them.
DEQUANTISED_REFERENCE = {"qwen3_moe_q4"}


def dequantised_copy(folder):
    """`folder` with every packed module expanded (mx.dequantize, each module's own group
    size and bits) and no `quantization` in its config: the same weights, dense."""
    import shutil

    import mlx.core as mx

    config = json.loads((folder / "config.json").read_text())
    q = config.pop("quantization")
    config.pop("quantization_config", None)
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    dense = {}
    for k, v in weights.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k.removesuffix(".weight")
        if k.endswith(".weight") and base + ".scales" in weights:
            p = q.get(base, q)
            v = mx.dequantize(v, weights[base + ".scales"], weights[base + ".biases"],
                              group_size=p["group_size"], bits=p["bits"])
        dense[k] = v.astype(mx.float32)
    out = folder.parent / (folder.name + "_dequantised")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), dense, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / f, out / f)
    return out


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
    write_gemma3_gguf()
    write_phi3_gguf()
    write_smollm3_gguf()
    folder, written = write_gemma3_vlm()
    cases = reference(folder, prompts)
    low = min(m for case in cases for m in case["greedy_margins"])
    print(f"gemma3_vlm: smallest greedy margin {low:.4f}")
    out["families"]["gemma3_vlm"] = dict(model_type=written["model_type"], cases=cases)
    folder, written = write_mistral3_vlm()
    cases = reference(folder, prompts)
    low = min(m for case in cases for m in case["greedy_margins"])
    print(f"mistral3_vlm: smallest greedy margin {low:.4f}")
    out["families"]["mistral3_vlm"] = dict(model_type=written["model_type"], cases=cases)
    for name, (base, mode, group_size, bits, predicate) in QUANTISED.items():
        folder, written = write_quantised(name, base, mode, group_size, bits, predicate)
        if name in DEQUANTISED_REFERENCE:
            import shutil

            dense = dequantised_copy(folder)
            cases = reference(dense, prompts)
            shutil.rmtree(dense)
        else:
            cases = reference(folder, prompts)
        low = min(m for case in cases for m in case["greedy_margins"])
        print(f"{name}: smallest greedy margin {low:.4f}")
        out["families"][name] = dict(model_type=written["model_type"], cases=cases)
    (OUT / "reference.json").write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
