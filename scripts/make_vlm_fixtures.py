#!/usr/bin/env python3
"""Writes a tiny random-weight LLaVA-1.5 model and reference outputs for a Rust VLM path.

    python3 -m venv $STRATA_CACHE/vlmvenv
    $STRATA_CACHE/vlmvenv/bin/pip install --no-deps -r services/worker/tests/fixtures/vlm/requirements.txt
    # (requirements.txt holds mlx-vlm==0.7.10 installed with --no-deps, plus only what its
    #  llava path imports: mlx[cpu], transformers, tokenizers, Pillow, numpy, safetensors, ...;
    #  no torch, no datasets, no opencv, no fastapi.)
    OPENBLAS_NUM_THREADS=1 HF_HUB_OFFLINE=1 $STRATA_CACHE/vlmvenv/bin/python scripts/make_vlm_fixtures.py

What it does (every step is seeded; two runs give byte-identical files):
  1. builds a Llama-2 style SentencePiece-BPE tokenizer (tokenizer.json, byte fallback, "<s>"
     prepended) over a small corpus, with "<image>" and "<pad>" appended after the base vocab,
     the way llava-hf/llava-1.5-7b-hf has them at 32000 and 32001;
  2. writes a tiny LLaVA-1.5 checkpoint in the Hugging Face layout of the published llava-hf
     checkpoints (config.json, model.safetensors with the on-disk tensor names, i.e. the
     "legacy" names that transformers 5 still writes on save_pretrained,
     preprocessor_config.json, processor_config.json, chat_template.json, tokenizer files)
     to services/worker/tests/fixtures/vlm/tiny-llava/ with numpy weights;
  3. draws two small RGB PNG test images with numpy patterns (48x40 and 64x64);
  4. loads that folder with mlx-vlm's own `load` (from the local path: no hub), runs its
     processor and forward pass on the CPU, and writes what a Rust implementation should
     reproduce to services/worker/tests/fixtures/vlm/reference.json;
  5. checks mlx-vlm's numbers against an independent float64 numpy version of the whole
     pipeline (numpy_check below: preprocessing bit-exact, logits within 1e-4, same greedy
     tokens), which doubles as a readable spec for the Rust side.

Not run in CI (needs the venv above); its outputs are meant to be committed.
"""
import hashlib
import json
import os
import pathlib
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never touch a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "services/worker/tests/fixtures/vlm"
MODEL_DIR = FIXTURES / "tiny-llava"

SEED = 20240611

# ---------------------------------------------------------------------------------------------
# Sizes. Real llava-1.5-7b-hf: CLIP ViT-L/14-336 (1024 hidden, 24 layers, 16 heads, 336 px,
# patch 14, 577 positions) + 2-layer GELU projector + Vicuna-7B (Llama-2, 4096 hidden).
# Here: same structure, tiny sizes. patch 14 and image 56 give a 4x4 grid = 16 image tokens.
# The vision tower has 3 layers so that feature layer -2 (the output of encoder layer 2 of 3)
# runs two encoder layers; with vision_feature_layer = -2 the last layer and post_layernorm
# never touch the output (exactly as in the real model).
# ---------------------------------------------------------------------------------------------
VISION = dict(hidden=32, layers=3, heads=2, inter=128, image=56, patch=14, proj_dim=32)
TEXT = dict(hidden=64, layers=2, heads=4, kv_heads=2, inter=176)
TRAINED_VOCAB = 256  # BPE-trained pieces incl. <unk>, <s>, </s>; the 256 byte tokens are added

PROMPT = "USER: <image>\nWhat is shown in this image? ASSISTANT:"
TEXT_ONLY_PROMPT = "USER: What is the color of the sky? ASSISTANT:"
N_GREEDY = 5


# ------------------------------------------------------------------------------ tokenizer ----
def build_tokenizer():
    """A Llama-2 style tokenizer.json (the layout of llava-1.5's Vicuna tokenizer):
    normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer, BPE with byte_fallback,
    "<unk>"=0 "<s>"=1 "</s>"=2, "<0x00>".."<0xFF>"=3..258, then merged pieces; post-processor
    prepends "<s>"; decoder Replace("▁"," ") + ByteFallback + Fuse + Strip(1 left)."""
    words = (
        "the a an of in on is are was what who where which this that these those image picture "
        "photo shown show describe color colour red green blue yellow black white gray orange "
        "purple pink brown sky sea grass tree house car dog cat bird man woman child table chair "
        "window door street road sun moon cloud light dark left right top bottom center middle "
        "square circle stripe stripes pattern gradient corner edge large small big little two "
        "three one four many some and or with without there here it its has have see can you "
        "please answer question user assistant system hello yes no").split()
    rng = np.random.default_rng(SEED)
    lines = []
    for _ in range(400):  # deterministic pseudo-sentences
        n = int(rng.integers(4, 12))
        sent = " ".join(words[int(i)] for i in rng.integers(0, len(words), n))
        lines.append(sent.capitalize() + rng.choice([".", "?", "!", ","]))
    lines += ["USER: What is shown in this image? ASSISTANT: A picture.",
              "USER: Describe the image.\nASSISTANT: It shows stripes and a circle."] * 20

    # Train on Metaspace-split words (so pieces never hold an inner "▁"), then rebuild the
    # tokenizer in the SentencePiece-BPE layout that HF Llama tokenizer.json files use.
    trainer_tok = Tokenizer(BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = BpeTrainer(vocab_size=TRAINED_VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                         show_progress=False, min_frequency=2)
    trainer_tok.train_from_iterator(lines, trainer=trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    trained_vocab = sorted(trained["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, list) else m.split(" ") for m in trained["merges"]]

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece, _ in trained_vocab:
        if piece not in vocab:
            vocab[piece] = len(vocab)
    assert len(vocab) == 3 + 256 + TRAINED_VOCAB - 3, len(vocab)

    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m) for m in merges], unk_token="<unk>",
                        byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])  # already in vocab: ids 0, 1, 2
    tok.add_special_tokens(["<image>", "<pad>"])      # appended: ids len(vocab), +1
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


# -------------------------------------------------------------------------------- weights ----
def build_weights(rng, vocab_size):
    """Random weights under the tensor names of the published llava-hf checkpoints.
    Linear weights are [out, in] (PyTorch), the patch conv is [out, in_ch, kH, kW] (PyTorch
    OIHW). Matrices ~ N(0, 0.02); norm scales 1 + N(0, 0.1) and biases N(0, 0.02) so that a
    swapped weight/bias or a skipped norm shows up in the outputs."""
    w = {}

    def mat(name, *shape, std=0.02):
        w[name] = (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(prefix, dim, bias=True):
        w[prefix + ".weight"] = (1.0 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
        if bias:
            w[prefix + ".bias"] = (0.02 * rng.standard_normal(dim)).astype(np.float32)

    vh, vi, p = VISION["hidden"], VISION["inter"], VISION["patch"]
    n_pos = (VISION["image"] // p) ** 2 + 1  # + CLS
    v = "vision_tower.vision_model."
    mat(v + "embeddings.class_embedding", vh, std=1.0)
    mat(v + "embeddings.patch_embedding.weight", vh, 3, p, p)  # CLIP conv has no bias
    mat(v + "embeddings.position_embedding.weight", n_pos, vh, std=1.0)
    norm(v + "pre_layrnorm", vh)  # sic: the CLIP checkpoints spell it "pre_layrnorm"
    for i in range(VISION["layers"]):
        l = f"{v}encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            mat(l + f"self_attn.{proj}.weight", vh, vh)
            mat(l + f"self_attn.{proj}.bias", vh)
        norm(l + "layer_norm1", vh)
        mat(l + "mlp.fc1.weight", vi, vh)
        mat(l + "mlp.fc1.bias", vi)
        mat(l + "mlp.fc2.weight", vh, vi)
        mat(l + "mlp.fc2.bias", vh)
        norm(l + "layer_norm2", vh)
    norm(v + "post_layernorm", vh)

    th, ti = TEXT["hidden"], TEXT["inter"]
    hd = th // TEXT["heads"]
    mat("multi_modal_projector.linear_1.weight", th, vh)
    mat("multi_modal_projector.linear_1.bias", th)
    mat("multi_modal_projector.linear_2.weight", th, th)
    mat("multi_modal_projector.linear_2.bias", th)

    t = "language_model.model."
    mat(t + "embed_tokens.weight", vocab_size, th)
    for i in range(TEXT["layers"]):
        l = f"{t}layers.{i}."
        mat(l + "self_attn.q_proj.weight", TEXT["heads"] * hd, th)
        mat(l + "self_attn.k_proj.weight", TEXT["kv_heads"] * hd, th)
        mat(l + "self_attn.v_proj.weight", TEXT["kv_heads"] * hd, th)
        mat(l + "self_attn.o_proj.weight", th, TEXT["heads"] * hd)
        mat(l + "mlp.gate_proj.weight", ti, th)
        mat(l + "mlp.up_proj.weight", ti, th)
        mat(l + "mlp.down_proj.weight", th, ti)
        norm(l + "input_layernorm", th, bias=False)
        norm(l + "post_attention_layernorm", th, bias=False)
    norm(t + "norm", th, bias=False)
    mat("language_model.lm_head.weight", vocab_size, th)  # untied, as in llava-1.5
    return w


# ---------------------------------------------------------------------------- json files -----
def model_config(vocab_size, image_token_index, pad_token_id):
    hd = TEXT["hidden"] // TEXT["heads"]
    n_img = (VISION["image"] // VISION["patch"]) ** 2
    return {
        "architectures": ["LlavaForConditionalGeneration"],
        "model_type": "llava",
        "ignore_index": -100,
        "image_token_index": image_token_index,
        "image_seq_length": n_img,
        "pad_token_id": pad_token_id,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": True,
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "dtype": "float32",
        "text_config": {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": TEXT["hidden"],
            "intermediate_size": TEXT["inter"],
            "num_hidden_layers": TEXT["layers"],
            "num_attention_heads": TEXT["heads"],
            "num_key_value_heads": TEXT["kv_heads"],
            "head_dim": hd,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": pad_token_id,
            "dtype": "float32",
        },
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": VISION["hidden"],
            "intermediate_size": VISION["inter"],
            "num_hidden_layers": VISION["layers"],
            "num_attention_heads": VISION["heads"],
            "image_size": VISION["image"],
            "patch_size": VISION["patch"],
            "num_channels": 3,
            "projection_dim": VISION["proj_dim"],
            "hidden_act": "quick_gelu",
            "layer_norm_eps": 1e-05,
            "attention_dropout": 0.0,
        },
    }


def preprocessor_config():
    # As llava-hf/llava-1.5-7b-hf, with 336 -> 56.
    return {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": VISION["image"]},
        "resample": 3,  # PIL BICUBIC
        "do_center_crop": True,
        "crop_size": {"height": VISION["image"], "width": VISION["image"]},
        "do_rescale": True,
        "rescale_factor": 0.00392156862745098,  # 1/255
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],  # OPENAI_CLIP_MEAN
        "image_std": [0.26862954, 0.26130258, 0.27577711],  # OPENAI_CLIP_STD
    }


def processor_config():
    # As llava-hf/llava-1.5-7b-hf: mlx-vlm's LlavaProcessor reads patch_size etc. from here
    # and would fail (patch_size None) without it.
    return {
        "processor_class": "LlavaProcessor",
        "image_token": "<image>",
        "patch_size": VISION["patch"],
        "num_additional_image_tokens": 1,  # the CLS token
        "vision_feature_select_strategy": "default",
    }


# llava-1.5-hf's template, minus the {% generation %} tags.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}"
    "{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def tokenizer_config(tok):
    added = {}
    for tid in sorted(tok.get_added_tokens_decoder()):
        t = tok.get_added_tokens_decoder()[tid]
        added[str(tid)] = {"content": t.content, "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": True}
    return {
        "tokenizer_class": "LlamaTokenizer",
        "processor_class": "LlavaProcessor",
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "extra_special_tokens": {"image_token": "<image>"},
        "added_tokens_decoder": added,
        "clean_up_tokenization_spaces": False,
        "legacy": False,
        "model_max_length": 4096,
        "padding_side": "left",
    }


def write_json(path, obj):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


# --------------------------------------------------------------------------------- images ----
def make_images():
    """Two deterministic RGB images of different sizes and aspect ratios.
    A: 48 wide x 40 high (upscaled and cropped by the processor), B: 64x64 (downscaled)."""
    y, x = np.mgrid[0:40, 0:48]
    a = np.stack([x * 255 // 47,                              # R: left-right ramp
                  y * 255 // 39,                              # G: top-down ramp
                  np.where(((x // 8) + (y // 8)) % 2 == 0, 220, 30)],  # B: 8px checkerboard
                 axis=-1).astype(np.uint8)
    y, x = np.mgrid[0:64, 0:64]
    r = np.sqrt((x - 40.0) ** 2 + (y - 24.0) ** 2)
    b = np.stack([np.where(r < 14, 250, 20),                  # R: a disc off-centre
                  ((x + y) % 16 < 8) * 200 + 30,              # G: diagonal stripes
                  (255 - y * 4).clip(0, 255)],                # B: bottom-up ramp
                 axis=-1).astype(np.uint8)
    return {"image_a.png": a, "image_b.png": b}


# ------------------------------------------------------------------------------- run mlx -----
def flat(a):
    a = np.asarray(a, dtype=np.float32)
    return {"shape": list(a.shape), "data": [float(v) for v in a.reshape(-1)]}


def run_mlx_vlm(image_paths):
    import mlx.core as mx
    import mlx_vlm
    import transformers
    from mlx_vlm import load
    from mlx_vlm.generate import generate_step
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_image, prepare_inputs

    mx.random.seed(SEED)
    mx.set_default_device(mx.cpu)
    model, processor = load(str(MODEL_DIR))  # local folder: mlx_vlm.utils.load
    cfg = model.config
    tok = processor.tokenizer

    # Sanity: mlx-vlm's own LlavaProcessor + the PIL CLIP image processor (no torch) were
    # picked; the patched AutoProcessor silently falls back to HF's class on any error.
    assert type(processor).__module__.startswith("mlx_vlm.models.llava"), type(processor)
    ip_cls = type(processor.image_processor).__name__
    assert ip_cls == "CLIPImageProcessorPil", ip_cls

    # The chat template renders the fixed prompt exactly.
    templ = apply_chat_template(processor, cfg, "What is shown in this image?", num_images=1)
    assert templ == PROMPT, repr(templ)

    def forward(input_ids, pixel_values):
        out = model(input_ids, pixel_values, mask=None)
        return out.logits

    def vision_features(pixel_values):
        # Same steps as mlx_vlm/models/llava/llava.py Model.get_input_embeddings.
        *_, hs = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True)
        sel = hs[cfg.vision_feature_layer][:, 1:]  # drop CLS ("default" strategy)
        return sel, model.multi_modal_projector(sel)

    def greedy_cached(inputs):
        # mlx-vlm's generate loop (KV cache, temperature 0 = argmax).
        toks = []
        for tok_id, _ in generate_step(inputs["input_ids"], model, inputs.get("pixel_values"),
                                       inputs.get("attention_mask"), max_tokens=N_GREEDY,
                                       temperature=0.0):
            toks.append(int(tok_id))
            if len(toks) == N_GREEDY:
                break
        return toks

    def greedy_recompute(input_ids, pixel_values):
        # Cross-check without cache: rerun the full sequence each step.
        ids = np.array(input_ids)
        toks = []
        for _ in range(N_GREEDY):
            lg = forward(mx.array(ids), pixel_values)[0, -1]
            nxt = int(mx.argmax(lg).item())
            toks.append(nxt)
            ids = np.concatenate([ids, [[nxt]]], axis=1)
        return toks

    cases = []
    for name in image_paths:
        img = load_image(str(FIXTURES / name))
        # mlx-vlm's LlavaProcessor (mlx_vlm/models/llava/processing_llava.py), called directly.
        # mlx_vlm.utils.prepare_inputs (what mlx_vlm.generate uses) would call it with
        # padding=True, which LlavaProcessor.__call__ forwards to the image processor, and
        # transformers 5.24's strict ImagesKwargs check rejects it ("unexpected keyword
        # argument 'padding'"). For one prompt, padding changes nothing; the tokenizer adds
        # "<s>" either way (its default add_special_tokens=True, as mlx_vlm.generate asks).
        inputs = processor(text=[PROMPT], images=[img])
        ids = inputs["input_ids"]
        pv = inputs["pixel_values"]
        logits = forward(ids, pv)
        sel, feats = vision_features(pv)
        mx.eval(logits, sel, feats)
        g1 = greedy_cached(inputs)
        g2 = greedy_recompute(ids, pv)
        assert g1 == g2, (g1, g2)
        ids_list = [int(v) for v in np.array(ids)[0]]
        cases.append({
            "image": name,
            "image_size_wh": list(img.size),
            "prompt": PROMPT,
            "input_ids": ids_list,
            "input_ids_are_expanded": True,
            "num_image_tokens": ids_list.count(cfg.image_token_index),
            "image_token_positions": [i for i, v in enumerate(ids_list)
                                      if v == cfg.image_token_index],
            "pixel_values": flat(np.array(pv)),
            "vision_features_selected": flat(np.array(sel)[0]),
            "image_features_projected": flat(np.array(feats)[0]),
            "last_logits": [float(v) for v in np.array(logits[0, -1], dtype=np.float32)],
            "greedy_tokens": g1,
            "greedy_text": tok.decode(g1),
        })

    # Cross-image check: the same prompt with the OTHER image gives different logits.
    la, lb = (np.array(c["last_logits"]) for c in cases)
    cross = {"images": [c["image"] for c in cases],
             "max_abs_diff_last_logits": float(np.abs(la - lb).max())}
    assert cross["max_abs_diff_last_logits"] > 1e-3, cross

    # Text-only (no pixel_values): the language model alone.
    t_inputs = prepare_inputs(processor, prompts=[TEXT_ONLY_PROMPT], add_special_tokens=True)
    t_ids = t_inputs["input_ids"]
    t_logits = forward(t_ids, None)
    t_greedy = greedy_recompute(t_ids, None)
    text_only = {
        "prompt": TEXT_ONLY_PROMPT,
        "input_ids": [int(v) for v in np.array(t_ids)[0]],
        "last_logits": [float(v) for v in np.array(t_logits[0, -1], dtype=np.float32)],
        "greedy_tokens": t_greedy,
    }

    import tokenizers
    made_by = {
        "script": "scripts/make_vlm_fixtures.py",
        "seed": SEED,
        "python": sys.version.split()[0],
        "mlx": mx.__version__,
        "mlx_vlm": mlx_vlm.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "numpy": np.__version__,
        "device": str(mx.default_device()),
        "dtype": "float32",
    }
    return made_by, cases, cross, text_only


# ------------------------------------------------------------------- numpy cross-check -------
# An independent float64 numpy version of the whole pipeline, written from the description
# of mlx_vlm/models/llava/*.py and transformers' CLIPImageProcessorPil. It is the spec a Rust
# implementation follows; the script fails if it and mlx-vlm disagree.
def numpy_check(ref):
    import math

    from safetensors.numpy import load_file

    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    pp = json.loads((MODEL_DIR / "preprocessor_config.json").read_text())
    W = {k: v.astype(np.float64) for k, v in load_file(str(MODEL_DIR / "model.safetensors")).items()}
    vc, tc = cfg["vision_config"], cfg["text_config"]

    def preprocess(path):
        im = Image.open(path).convert("RGB")
        w, h = im.size
        s = pp["size"]["shortest_edge"]  # shortest edge -> s, long edge int(s * long / short)
        nw, nh = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
        im = im.resize((nw, nh), resample=Image.BICUBIC)  # on uint8, result rounded to uint8
        a = np.asarray(im).transpose(2, 0, 1)  # HWC RGB -> CHW
        c = pp["crop_size"]["height"]
        top, left = (nh - c) // 2, (nw - c) // 2
        a = a[:, top:top + c, left:left + c]
        a = (a.astype(np.float64) * pp["rescale_factor"]).astype(np.float32)
        mean = np.array(pp["image_mean"], np.float32)[:, None, None]
        std = np.array(pp["image_std"], np.float32)[:, None, None]
        return (a - mean) / std  # float32 [3, H, W]

    def layer_norm(x, p, eps):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * W[p + ".weight"] + W[p + ".bias"]

    def linear(x, p, bias=True):
        y = x @ W[p + ".weight"].T
        return y + W[p + ".bias"] if bias else y

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    def vision(px):
        P, v = vc["patch_size"], "vision_tower.vision_model."
        g = vc["image_size"] // P
        conv = W[v + "embeddings.patch_embedding.weight"].reshape(vc["hidden_size"], -1)
        patches = px.reshape(3, g, P, g, P).transpose(1, 3, 0, 2, 4).reshape(g * g, -1)
        x = np.concatenate([W[v + "embeddings.class_embedding"][None], patches @ conv.T])
        x = x + W[v + "embeddings.position_embedding.weight"]  # positions 0..g*g (CLS first)
        x = layer_norm(x, v + "pre_layrnorm", 1e-5)
        hs = [x]  # hidden_states[0] = pre_layrnorm output
        H = vc["num_attention_heads"]
        hd = vc["hidden_size"] // H
        for i in range(vc["num_hidden_layers"]):
            l = f"{v}encoder.layers.{i}."
            y = layer_norm(x, l + "layer_norm1", vc["layer_norm_eps"])
            q, k, vv = (linear(y, l + f"self_attn.{n}_proj").reshape(-1, H, hd).transpose(1, 0, 2)
                        for n in "qkv")
            a = softmax(q @ k.transpose(0, 2, 1) / math.sqrt(hd)) @ vv  # no mask
            x = x + linear(a.transpose(1, 0, 2).reshape(-1, H * hd), l + "self_attn.out_proj")
            y = linear(layer_norm(x, l + "layer_norm2", vc["layer_norm_eps"]), l + "mlp.fc1")
            y = y / (1 + np.exp(-1.702 * y))  # quick_gelu
            x = x + linear(y, l + "mlp.fc2")
            hs.append(x)
        sel = hs[cfg["vision_feature_layer"]][1:]  # layer -2, CLS dropped
        y = linear(sel, "multi_modal_projector.linear_1")
        y = 0.5 * y * (1 + np.vectorize(math.erf)(y / math.sqrt(2)))  # exact (erf) GELU
        return sel, linear(y, "multi_modal_projector.linear_2")

    def rms_norm(x, p):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + tc["rms_norm_eps"]) * W[p + ".weight"]

    def rope(x):  # [heads, L, hd]; rotate-half pairing (i, i + hd/2), positions 0..L-1
        hd, L = x.shape[-1], x.shape[1]
        ang = np.arange(L)[:, None] * tc["rope_theta"] ** (-np.arange(0, hd, 2) / hd)[None]
        ang = np.concatenate([ang, ang], -1)
        rot = np.concatenate([-x[..., hd // 2:], x[..., :hd // 2]], -1)
        return x * np.cos(ang) + rot * np.sin(ang)

    def language(ids, img=None):
        t = "language_model.model."
        x = W[t + "embed_tokens.weight"][ids].copy()
        if img is not None:  # image features replace the <image> rows, in order
            pos = [i for i, v in enumerate(ids) if v == cfg["image_token_index"]]
            assert len(pos) == len(img)
            x[pos] = img
        H, KV = tc["num_attention_heads"], tc["num_key_value_heads"]
        hd, L = tc["hidden_size"] // H, len(ids)
        causal = np.triu(np.full((L, L), -np.inf), 1)
        for i in range(tc["num_hidden_layers"]):
            l = f"{t}layers.{i}."
            y = rms_norm(x, l + "input_layernorm")
            q = linear(y, l + "self_attn.q_proj", False).reshape(L, H, hd).transpose(1, 0, 2)
            k = linear(y, l + "self_attn.k_proj", False).reshape(L, KV, hd).transpose(1, 0, 2)
            v = linear(y, l + "self_attn.v_proj", False).reshape(L, KV, hd).transpose(1, 0, 2)
            k, v = np.repeat(rope(k), H // KV, 0), np.repeat(v, H // KV, 0)  # GQA
            a = softmax(rope(q) @ k.transpose(0, 2, 1) / math.sqrt(hd) + causal) @ v
            x = x + linear(a.transpose(1, 0, 2).reshape(L, -1), l + "self_attn.o_proj", False)
            y = rms_norm(x, l + "post_attention_layernorm")
            gate = linear(y, l + "mlp.gate_proj", False)
            x = x + linear(gate / (1 + np.exp(-gate)) * linear(y, l + "mlp.up_proj", False),
                           l + "mlp.down_proj", False)
        return linear(rms_norm(x, t + "norm"), "language_model.lm_head", False)

    worst = {}
    for c in ref["cases"]:
        pv = np.array(c["pixel_values"]["data"], np.float32).reshape(c["pixel_values"]["shape"])
        assert np.array_equal(preprocess(FIXTURES / c["image"]), pv[0]), c["image"]
        sel, img = vision(pv[0].astype(np.float64))
        ids = list(c["input_ids"])
        d = np.abs(language(ids, img)[-1] - np.array(c["last_logits"])).max()
        worst[c["image"]] = float(d)
        greedy = []
        for _ in range(N_GREEDY):
            greedy.append(int(np.argmax(language(ids + greedy, img)[-1])))
        assert greedy == c["greedy_tokens"], (greedy, c["greedy_tokens"])
    t = ref["text_only"]
    worst["text_only"] = float(np.abs(language(t["input_ids"])[-1] - np.array(t["last_logits"])).max())
    assert max(worst.values()) < 1e-4, worst
    return worst


# ----------------------------------------------------------------------------------- main ----
def main():
    FIXTURES.mkdir(parents=True, exist_ok=True)
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)

    tok = build_tokenizer()
    image_token_index = tok.token_to_id("<image>")
    pad_token_id = tok.token_to_id("<pad>")
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    assert (image_token_index, pad_token_id) == (vocab_size - 2, vocab_size - 1)

    tok.save(str(MODEL_DIR / "tokenizer.json"))
    write_json(MODEL_DIR / "tokenizer_config.json", tokenizer_config(tok))
    write_json(MODEL_DIR / "special_tokens_map.json",
               {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "<pad>", "image_token": "<image>"})
    write_json(MODEL_DIR / "config.json",
               model_config(vocab_size, image_token_index, pad_token_id))
    write_json(MODEL_DIR / "generation_config.json",
               {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": pad_token_id})
    write_json(MODEL_DIR / "preprocessor_config.json", preprocessor_config())
    write_json(MODEL_DIR / "processor_config.json", processor_config())
    write_json(MODEL_DIR / "chat_template.json", {"chat_template": CHAT_TEMPLATE})

    weights = build_weights(rng, vocab_size)
    save_file(dict(sorted(weights.items())), str(MODEL_DIR / "model.safetensors"),
              metadata={"format": "pt"})

    images = make_images()
    for name, arr in images.items():
        Image.fromarray(arr, "RGB").save(FIXTURES / name)

    made_by, cases, cross, text_only = run_mlx_vlm(list(images))
    files = sorted(p for p in MODEL_DIR.iterdir()) + [FIXTURES / n for n in images]
    ref = {
        "made_by": made_by,
        "model_dir": "tiny-llava",
        "notes": (
            "input_ids are AFTER image-token expansion: mlx-vlm's LlavaProcessor replaces each "
            "<image> with (image_size/patch_size)^2 + num_additional_image_tokens - 1 (CLS "
            "dropped by the 'default' strategy) copies of <image>; the model then overwrites "
            "those positions' embeddings with the projected image features, in order. "
            "pixel_values are NCHW float32 after resize(shortest edge, bicubic) -> center crop "
            "-> /255 -> (x-mean)/std. last_logits: full vocab at the last prompt position. "
            "greedy_tokens: argmax decoding, checked equal with and without KV cache. "
            "vision_features_selected: encoder hidden state vision_feature_layer (-2, where "
            "index 0 is the pre_layrnorm output) without CLS, [num_patches, vision_hidden]; "
            "image_features_projected: after the projector, [num_patches, text_hidden]."),
        "image_token_index": image_token_index,
        "pad_token_id": pad_token_id,
        "vocab_size": vocab_size,
        "cases": cases,
        "cross_image": cross,
        "text_only": text_only,
        "file_sha256": {str(p.relative_to(FIXTURES)): hashlib.sha256(p.read_bytes()).hexdigest()
                        for p in files},
    }
    (FIXTURES / "reference.json").write_text(json.dumps(ref, indent=1) + "\n")

    for c in cases:
        lg = np.array(c["last_logits"])
        print(f"{c['image']}: {len(c['input_ids'])} ids ({c['num_image_tokens']} image), "
              f"pixel_values {c['pixel_values']['shape']}, logits |max| {np.abs(lg).max():.4f} "
              f"std {lg.std():.4f}, greedy {c['greedy_tokens']} {c['greedy_text']!r}")
    print(f"cross-image max |diff| of last logits: {cross['max_abs_diff_last_logits']:.4f}")
    print(f"text-only greedy {text_only['greedy_tokens']}")
    print("numpy float64 re-implementation, max |diff| of last logits:", numpy_check(ref))
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file())
    print(f"fixture folder: {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
