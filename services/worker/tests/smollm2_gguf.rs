//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF, fetched by scripts/setup) loads
//! through MLX's GGUF reader with the tensors, shapes and tokenizer metadata we rely on.

use std::path::PathBuf;

use mlx_rs::io::GgufFile;
use mlx_rs::{Device, Dtype};

fn model_path() -> PathBuf {
    let cache = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/strata"));
    let path = cache.join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup",
        path.display()
    );
    path
}

fn meta_u32(file: &GgufFile, key: &str) -> u32 {
    let value = file
        .get_metadata_array(key)
        .unwrap()
        .unwrap_or_else(|| panic!("metadata {key} missing"));
    assert_eq!(value.dtype(), Dtype::Uint32, "{key}");
    value.item_exact::<u32>()
}

#[test]
fn smollm2_gguf_has_the_expected_tensors_shapes_and_tokenizer() {
    Device::set_default(&Device::cpu());
    let file = GgufFile::load(model_path()).unwrap();

    // Hyper-parameters (MODELS.md): llama, 30 layers, hidden 576, FFN 1536, 9/3 heads.
    assert_eq!(
        file.get_metadata_string("general.architecture")
            .unwrap()
            .as_deref(),
        Some("llama")
    );
    assert_eq!(meta_u32(&file, "llama.block_count"), 30);
    assert_eq!(meta_u32(&file, "llama.embedding_length"), 576);
    assert_eq!(meta_u32(&file, "llama.feed_forward_length"), 1536);
    assert_eq!(meta_u32(&file, "llama.attention.head_count"), 9);
    assert_eq!(meta_u32(&file, "llama.attention.head_count_kv"), 3);
    assert_eq!(meta_u32(&file, "llama.context_length"), 8192);
    let theta = file
        .get_metadata_array("llama.rope.freq_base")
        .unwrap()
        .unwrap();
    assert_eq!(theta.item_exact::<f32>(), 100_000.0);

    // Tokenizer: GPT-2 byte-level BPE with the `smollm` pre-tokenizer, ChatML template.
    assert_eq!(
        file.get_metadata_string("tokenizer.ggml.model")
            .unwrap()
            .as_deref(),
        Some("gpt2")
    );
    assert_eq!(
        file.get_metadata_string("tokenizer.ggml.pre")
            .unwrap()
            .as_deref(),
        Some("smollm")
    );
    let tokens = file
        .get_metadata_strings("tokenizer.ggml.tokens")
        .unwrap()
        .unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        &tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    let merges = file
        .get_metadata_strings("tokenizer.ggml.merges")
        .unwrap()
        .unwrap();
    assert_eq!(merges.len(), 48900);
    assert_eq!(merges[0], "Ġ t");
    assert_eq!(meta_u32(&file, "tokenizer.ggml.bos_token_id"), 1);
    assert_eq!(meta_u32(&file, "tokenizer.ggml.eos_token_id"), 2);
    let template = file
        .get_metadata_string("tokenizer.chat_template")
        .unwrap()
        .unwrap();
    assert!(template.contains("<|im_start|>"), "not ChatML: {template}");

    // Tensors: 30 blocks of 9 weights, plus embeddings and the final norm. MLX turns each
    // GGUF-quantised tensor into its own affine layout: packed `weight`, `scales`, `biases`.
    let keys = file.array_keys().unwrap();
    let per_block = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ];
    for layer in 0..30 {
        for name in per_block {
            for part in ["weight", "scales", "biases"] {
                let key = format!("blk.{layer}.{name}.{part}");
                assert!(keys.contains(&key), "missing tensor {key}");
            }
        }
        for norm in ["attn_norm", "ffn_norm"] {
            assert!(keys.contains(&format!("blk.{layer}.{norm}.weight")));
        }
    }
    assert!(keys.contains(&"output_norm.weight".to_string()));
    assert!(
        !keys.iter().any(|k| k.starts_with("output.")),
        "embeddings should be tied"
    );
    let shape = |k: &str| file.get_array(k).unwrap().unwrap().shape().to_vec();
    // Q4_1 (4-bit, groups of 32): 576 inputs -> 72 u32 words and 18 groups per row.
    assert_eq!(shape("blk.0.attn_q.weight"), [576, 72]);
    assert_eq!(shape("blk.0.attn_k.weight"), [192, 72]);
    assert_eq!(shape("blk.0.attn_q.scales"), [576, 18]);
    assert_eq!(shape("blk.0.ffn_down.weight"), [576, 192]);
    // The embedding table is Q8_0: 8 bits -> 144 words per row of 576.
    assert_eq!(shape("token_embd.weight"), [49152, 144]);
    assert_eq!(shape("output_norm.weight"), [576]);

    // Dequantised to f32, as the CPU policy does at load: right shape, finite, not all zero.
    let q = file.get_array("blk.0.attn_q.weight").unwrap().unwrap();
    let s = file.get_array("blk.0.attn_q.scales").unwrap().unwrap();
    let b = file.get_array("blk.0.attn_q.biases").unwrap().unwrap();
    let w = mlx_rs::ops::dequantize(&q, &s, &b, 32, 4)
        .unwrap()
        .as_dtype(Dtype::Float32)
        .unwrap();
    w.eval().unwrap();
    assert_eq!(w.shape(), [576, 576]);
    let values = w.as_slice::<f32>();
    assert!(values.iter().all(|v| v.is_finite()));
    let mean_abs = values.iter().map(|v| v.abs() as f64).sum::<f64>() / values.len() as f64;
    assert!(
        mean_abs > 1e-3 && mean_abs < 1.0,
        "implausible weights: mean |w| = {mean_abs}"
    );
}
