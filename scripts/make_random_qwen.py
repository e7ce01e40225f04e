#!/usr/bin/env python3
"""A random-weight model of Qwen2.5-Coder-1.5B's exact shape, as a Hugging Face folder, for
GPU benchmarks where the real 1.1 GB weights cannot be sent (scripts/bench_gpu.py).

    python3 make_random_qwen.py OUT_DIR [--rope-factor 4]

Weights: transformers' own Qwen2 initialisation (normal, std 0.02; norms 1) in float16,
saved with `save_pretrained`, so that Strata and transformers load the very same tensors.
`--rope-factor F` adds linear RoPE scaling (context 32768 * F), for prompts past 32K.
The tokenizer is a word-level stand-in with the real vocabulary size and Qwen's special tokens
at their real ids; benchmarks send token ids, so only its size and specials matter.
"""
import argparse
import json
import pathlib

QWEN25_CODER_15B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536,
    intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
    num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_theta=1000000.0, vocab_size=151936, tie_word_embeddings=True, hidden_act="silu",
    bos_token_id=151643, eos_token_id=151645, initializer_range=0.02, use_sliding_window=False,
)
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rope-factor", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true",
                    help="2 layers of width 256 (same vocabulary): to try the scripts on a CPU")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    config = dict(QWEN25_CODER_15B)
    if args.small:
        config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    if args.rope_factor != 1.0:
        config["rope_scaling"] = {"type": "linear", "factor": args.rope_factor}
        config["max_position_embeddings"] = int(32768 * args.rope_factor)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None:
        # No PyTorch (a CPU machine's bench venv): the same layout from numpy.
        write_numpy(out, config, args.seed)
        write_tokenizer(out, config)
        return
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**config)).to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    # save_pretrained writes transformers' view of the config; ours is the plain one above,
    # with the dtype the weights have.
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}, indent=1))

    write_tokenizer(out, config)
    print(f"wrote {out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")


def write_numpy(out, config, seed):
    """Qwen2's tensors under Hugging Face's names, normal(0, 0.02) in float16, norms 1."""
    import numpy as np
    from safetensors.numpy import save_file
    rng = np.random.default_rng(seed)
    h, i = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    normal = lambda *shape: (rng.standard_normal(shape) * 0.02).astype(np.float16)
    t = {"model.embed_tokens.weight": normal(config["vocab_size"], h),
         "model.norm.weight": np.ones(h, np.float16)}
    for l in range(config["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t.update({p + "input_layernorm.weight": np.ones(h, np.float16),
                  p + "post_attention_layernorm.weight": np.ones(h, np.float16),
                  p + "self_attn.q_proj.weight": normal(h, h), p + "self_attn.q_proj.bias": normal(h),
                  p + "self_attn.k_proj.weight": normal(kv, h), p + "self_attn.k_proj.bias": normal(kv),
                  p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.v_proj.bias": normal(kv),
                  p + "self_attn.o_proj.weight": normal(h, h),
                  p + "mlp.gate_proj.weight": normal(i, h), p + "mlp.up_proj.weight": normal(i, h),
                  p + "mlp.down_proj.weight": normal(h, i)})
    save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}, indent=1))
    print(f"wrote {out} (numpy)")


def write_tokenizer(out, config):
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    for name, i in SPECIALS.items():
        vocab.pop(f"t{i}")
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}))


if __name__ == "__main__":
    main()
