//! The model families beyond Llama and Qwen2, each a random-weight model in its family's
//! published Hugging Face layout (scripts/make_family_fixtures.py), against mlx-lm 0.32.2 run
//! on the same files: Qwen3 (q/k norms), Llama 3.2 (tied, llama3 RoPE scaling), Llama 3.1
//! (untied), Mistral, Phi-3 (fused projections, partial rotary, longrope), SmolLM3 (NoPE
//! layers), Gemma 3 (sliding-window layers), and the hybrid Qwen3.5 and Qwen3.5-MoE (Gated
//! DeltaNet layers; scripts/make_hybrid_fixtures.py). For each: the last position's logits, the
//! greedy tokens, and a run resumed from the cold run's KV blocks giving the same tokens.

mod common;

use std::path::PathBuf;

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::generate::{EngineOptions, GenerateRequest, Generation, Prefix};
use strata_worker::engine::llama::SeqChunk;
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::sample::argmax;
use strata_worker::engine::sequence::{CachedKv, FinishedBlock};

/// Small blocks, so that the 130-token prompt spans several and resumes from a partial one.
const BLOCK: usize = 16;

/// Both sides compute in f32 with MLX's CPU kernels, but not in the same order (our batched
/// projections, our few-query attention kernel, MLX's fused ops in mlx-lm): a few ulps per
/// op, summed over 2-4 layers and a 256-wide head on logits of magnitude ~1-10. 1e-4 relative
/// to the largest logit is two orders above what we measure and two below the smallest
/// greedy margin in the fixtures (mistral's 2.5e-3 on logits of ~1).
const RELATIVE_TOLERANCE: f32 = 1e-4;

/// The largest |ours - theirs| and what it may be: `RELATIVE_TOLERANCE` of the largest
/// magnitude in `theirs` (at least 1).
fn difference(ours: &[f32], theirs: &[f32]) -> (f32, f32) {
    assert_eq!(ours.len(), theirs.len(), "lengths differ");
    let largest = theirs.iter().fold(1f32, |m, &x| m.max(x.abs()));
    let worst = ours
        .iter()
        .zip(theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    (worst, RELATIVE_TOLERANCE * largest)
}

fn family_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(name)
}

struct Case {
    input: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
}

fn cases(family: &str) -> (String, Vec<Case>) {
    // The hybrid families have their own generator and file (scripts/make_hybrid_fixtures.py).
    let file = if family.starts_with("qwen3_5") {
        "families/hybrid_reference.json"
    } else if family == "qwen3_next" {
        "families/qwen3_next_reference.json"
    } else if family.starts_with("gpt_oss") {
        "families/gpt_oss_reference.json"
    } else {
        "families/reference.json"
    };
    let reference = common::fixture(file);
    let entry = &reference["families"][family];
    let cases = entry["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .map(|c| Case {
            input: common::ids(&c["input_ids"]),
            logits: c["logits"]
                .as_array()
                .expect("logits")
                .iter()
                .map(|x| x.as_f64().expect("a logit") as f32)
                .collect(),
            greedy: common::ids(&c["greedy_ids"]),
        })
        .collect();
    (
        entry["model_type"]
            .as_str()
            .expect("model_type")
            .to_string(),
        cases,
    )
}

/// Greedy tokens by hand: prefill, then one forward per token. Returns them and the logits
/// after the prompt.
fn greedy(m: &LoadedModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    let mut cache = m.model.new_cache(64);
    let mut logits = m
        .prefill(&mut cache, prompt, &EngineOptions::default(), |_| Ok(()))
        .unwrap();
    let first = logits.clone();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = argmax(&logits) as u32;
        out.push(next);
        let l = m
            .model
            .forward(&mut [SeqChunk {
                tokens: &[next],
                cache: &mut cache,
            }])
            .unwrap();
        l.eval().unwrap();
        logits = l.as_slice::<f32>().to_vec();
    }
    (out, first)
}

/// The last position's logits of one pass over `tokens` from an empty cache.
fn one_pass(m: &LoadedModel, tokens: &[u32]) -> Vec<f32> {
    let mut cache = m.model.new_cache(64);
    let l = m
        .model
        .forward(&mut [SeqChunk {
            tokens,
            cache: &mut cache,
        }])
        .unwrap();
    l.eval().unwrap();
    l.as_slice::<f32>().to_vec()
}

fn generate(
    m: &LoadedModel,
    req: &GenerateRequest,
    cached: &[CachedKv<'_>],
) -> (Generation, Vec<FinishedBlock>) {
    generate_with(m, req, cached, &EngineOptions::default())
}

fn generate_with(
    m: &LoadedModel,
    req: &GenerateRequest,
    cached: &[CachedKv<'_>],
    options: &EngineOptions,
) -> (Generation, Vec<FinishedBlock>) {
    let mut blocks = Vec::new();
    let mut sink = |b: FinishedBlock| blocks.push(b);
    let g = m
        .generate_with_prefix(
            req,
            options,
            Prefix {
                cached,
                on_block: Some(&mut sink),
                resume: None,
            },
            |_| true,
        )
        .unwrap();
    (g, blocks)
}

fn check_family(family: &str, arch: &str) {
    check_family_at(family, &family_dir(family), arch);
}

/// `family`'s reference cases on the model at `path`.
fn check_family_at(family: &str, path: &std::path::Path, arch: &str) {
    let m = loader::open(path, DtypePolicy::F32, BLOCK).unwrap_or_else(|e| panic!("{family}: {e}"));
    check_family_on(family, &m, arch);
}

fn check_family_on(family: &str, m: &LoadedModel, arch: &str) {
    let (model_type, cases) = cases(family);
    assert_eq!(
        m.model.config().arch.name(),
        arch,
        "{family} ({model_type})"
    );
    for (i, case) in cases.iter().enumerate() {
        let (tokens, logits) = greedy(m, &case.input, case.greedy.len());
        let (worst, tolerance) = difference(&logits, &case.logits);
        eprintln!("{family} case {i}: max |Δlogit| {worst:.3e} (tolerance {tolerance:.2e})");
        assert!(
            worst <= tolerance,
            "{family} case {i}: logits differ by {worst} (tolerance {tolerance})"
        );
        assert_eq!(tokens, case.greedy, "{family} case {i}: greedy tokens");

        // Through the serving path, cold and then resumed from every cached prefix length.
        // mlx-lm's greedy tokens go on past the end-of-sequence id (the random models emit it).
        let req = GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::greedy(case.input.clone(), case.greedy.len())
        };
        let (cold, blocks) = generate(m, &req, &[]);
        assert_eq!(cold.tokens, case.greedy, "{family} case {i}: served cold");
        for n in 1..=blocks.len() {
            let cached: Vec<CachedKv<'_>> = blocks[..n]
                .iter()
                .map(|b| CachedKv {
                    bytes: &b.bytes,
                    tokens: b.tokens.len(),
                })
                .collect();
            let (warm, _) = generate(m, &req, &cached);
            let held: usize = blocks[..n].iter().map(|b| b.tokens.len()).sum();
            assert_eq!(
                warm.cached_tokens, held,
                "{family} case {i}: {n} blocks reused"
            );
            assert_eq!(
                warm.tokens, cold.tokens,
                "{family} case {i}: warm from {n} blocks"
            );
        }
    }
}

/// Decode steps (one token, and three or twenty at once) computed by the host kernels against the
/// same steps through MLX's operations, on the same cache contents: logits within the
/// tolerance above, at every step.
fn check_host_steps(family: &str) {
    let (_, cases) = cases(family);
    let open = |host: bool| {
        let mut m = loader::open(&family_dir(family), DtypePolicy::F32, BLOCK)
            .unwrap_or_else(|e| panic!("{family}: {e}"));
        assert_eq!(m.model.set_host_steps(host).unwrap(), host, "{family}");
        m
    };
    let (host, mlx) = (open(true), open(false));
    let step = |m: &LoadedModel, cache: &mut strata_worker::engine::KvCache, tokens: &[u32]| {
        let l = m.model.forward(&mut [SeqChunk { tokens, cache }]).unwrap();
        l.eval().unwrap();
        l.as_slice::<f32>().to_vec()
    };
    for (i, case) in cases.iter().enumerate() {
        let mut caches = [host.model.new_cache(64), mlx.model.new_cache(64)];
        for (m, cache) in [&host, &mlx].into_iter().zip(caches.iter_mut()) {
            m.prefill(cache, &case.input, &EngineOptions::default(), |_| Ok(()))
                .unwrap();
        }
        let mut next = vec![case.greedy[0]];
        for n in 0..6 {
            let [a, b] = &mut caches;
            let (ours, theirs) = (step(&host, a, &next), step(&mlx, b, &next));
            let (worst, tolerance) = difference(&ours, &theirs);
            eprintln!("{family} case {i} step {n}: host vs MLX max |Δlogit| {worst:.3e}");
            assert!(
                worst <= tolerance,
                "{family} case {i} step {n}: host and MLX logits differ by {worst}"
            );
            // Steps of three and of twenty tokens at once too (short chunks after a cache
            // hit, through the tiled attention kernels).
            let t = argmax(&theirs) as u32;
            next = match n % 3 {
                0 => vec![t; 3],
                1 => vec![t; 20],
                _ => vec![t],
            };
        }
    }
}

#[test]
fn host_steps_compute_what_mlx_computes_in_every_family() {
    for family in [
        "qwen3",
        "llama3_2",
        "llama3_1",
        "mistral",
        "phi3",
        "smollm3",
        "gemma3",
        "gemma3_vlm",
    ] {
        check_host_steps(family);
    }
}

/// Gemma 3: windowed layers (window 16, so the 33- and 130-token prompts and the cached
/// resumptions cross it), global layers with linear RoPE scaling, sandwich norms, GELU.
#[test]
fn gemma3_matches_mlx_lm() {
    check_family("gemma3", "gemma3");
}

/// Gemma 3 4B-27B as published: model_type "gemma3", the decoder under `language_model.`
/// beside a vision tower (not loaded), a sparse text_config completed with mlx-lm's defaults
/// (8 query and 4 KV heads, RoPE bases, epsilon).
#[test]
fn gemma3_vision_language_checkpoints_serve_their_text_decoder_as_mlx_lm_does() {
    check_family("gemma3_vlm", "gemma3");
}

/// The same Gemma 3 converted as llama.cpp converts it (architecture "gemma3", norms with the
/// 1 folded in, window in metadata, the rest llama.cpp's defaults, a SentencePiece
/// vocabulary): mlx-lm's outputs on the Hugging Face folder.
#[test]
fn gemma3_from_gguf_matches_mlx_lm_on_the_same_weights() {
    let path = family_dir("gemma3_gguf").join("gemma3.gguf");
    check_family_at("gemma3", &path, "gemma3");
    let m = loader::open(&path, DtypePolicy::F32, BLOCK).unwrap();
    let w = m.model.config().sliding_window.clone().unwrap();
    assert_eq!(
        (w.tokens, w.layers, w.rope_theta),
        (16, vec![0, 1, 2, 3, 4, 6], Some(1e4))
    );
    assert_eq!(m.tokenizer.special_id("<|im_end|>"), Some(255));
}

/// Phi-4-mini's layout converted as llama.cpp converts Phi-3 (fused attn_qkv and ffn_up,
/// partial rotary from metadata, longrope factors as tensors): mlx-lm's outputs on the Hugging
/// Face folder.
#[test]
fn phi3_from_gguf_matches_mlx_lm_on_the_same_weights() {
    let path = family_dir("phi3_gguf").join("phi3.gguf");
    check_family_at("phi3", &path, "phi3");
    let m = loader::open(&path, DtypePolicy::F32, BLOCK).unwrap();
    assert_eq!(
        (m.model.config().head_dim, m.model.config().rope_dims),
        (16, 12)
    );
}

/// SmolLM3 converted as llama.cpp converts it (a Llama with q/k rows permuted, NoPE layers
/// by llama.cpp's every-4th rule): mlx-lm's outputs on the Hugging Face folder.
#[test]
fn smollm3_from_gguf_matches_mlx_lm_on_the_same_weights() {
    let path = family_dir("smollm3_gguf").join("smollm3.gguf");
    check_family_at("smollm3", &path, "smollm3");
    let m = loader::open(&path, DtypePolicy::F32, BLOCK).unwrap();
    assert_eq!(m.model.config().no_rope_layers, [3]);
}

/// Ministral 3's decoder: YaRN RoPE (periods ramped, rotated part scaled) and queries scaled
/// with their position past the original context (32 here, so the prompts cross it).
#[test]
fn ministral3_matches_mlx_lm() {
    check_family("ministral3", "ministral3");
}

/// Mistral's 2512 models as published: model_type "mistral3", the decoder under
/// `model.language_model.`, `lm_head` at the top (untied), a vision tower not loaded.
#[test]
fn mistral3_vision_language_checkpoints_serve_their_text_decoder_as_mlx_lm_does() {
    check_family("mistral3_vlm", "ministral3");
}

/// Qwen3-MoE: a router choosing 2 of 8 experts per token (probabilities renormalised over
/// the chosen), the experts applied with `gather_mm`, one dense layer among them.
#[test]
fn qwen3_moe_matches_mlx_lm() {
    check_family("qwen3_moe", "qwen3_moe");
}

/// mlx-community's Qwen3-MoE layout: experts stacked (`switch_mlp`) and packed 4-bit by
/// mlx-lm's own `quantize_model`, the router 8-bit; against mlx-lm on the same weights
/// dequantised by MLX (its quantised SwitchGLU does not run on mlx 0.32.2).
#[test]
fn qwen3_moe_with_packed_experts_matches_mlx_lm() {
    check_family("qwen3_moe_q4", "qwen3_moe");
}

/// The same packed experts kept packed (the Metal/CUDA policy's `gather_qmm`), here on the
/// CPU in f32: the logits of the dequantised reference.
#[test]
fn packed_experts_kept_packed_compute_what_the_dequantised_ones_do() {
    let policy = DtypePolicy {
        quantized_weights: true,
        ..DtypePolicy::F32
    };
    let (_, cases) = cases("qwen3_moe_q4");
    let m = loader::open(&family_dir("qwen3_moe_q4"), policy, BLOCK).unwrap();
    for case in &cases {
        let (_, logits) = greedy(&m, &case.input, 0);
        let (worst, tolerance) = difference(&logits, &case.logits);
        assert!(
            worst <= tolerance,
            "packed experts: logits differ by {worst}"
        );
    }
    // A chunk of 4,200 tokens (8,400 token-expert pairs): the codes are expanded to floats
    // for the products (`EXPAND_FROM_ROWS`), the same arithmetic as the dense model's.
    let long: Vec<u32> = cases[0].input.iter().copied().cycle().take(4200).collect();
    let dense = loader::open(&family_dir("qwen3_moe_q4"), DtypePolicy::F32, BLOCK).unwrap();
    let (packed_logits, dense_logits) = (one_pass(&m, &long), one_pass(&dense, &long));
    let (worst, tolerance) = difference(&packed_logits, &dense_logits);
    assert!(
        worst <= tolerance,
        "expanded packed experts: logits differ by {worst}"
    );
}

/// Qwen2-MoE (Qwen1.5-MoE): 2 of 6 experts per token without renormalising, plus the
/// shared expert scaled by its sigmoid gate; Qwen2's q/k/v biases.
#[test]
fn qwen2_moe_matches_mlx_lm() {
    check_family("qwen2_moe", "qwen2_moe");
}

/// Qwen3.5 (dense): three Gated DeltaNet layers, then one of gated full attention. The
/// served runs resume from blocks whose payloads end with the recurrent states' snapshots.
#[test]
fn qwen3_5_hybrid_matches_mlx_lm() {
    check_family("qwen3_5", "qwen3_5");
}

/// The recurrence as MLX operations, what a GPU runs (`delta_rule_device`: the chunked form
/// with its snapshots at every block end, token by token for decode steps), on a CPU against
/// the same mlx-lm references: cold, greedy, and resumed from every block.
#[test]
fn hybrid_families_with_the_recurrence_on_the_device_match_mlx_lm() {
    for family in ["qwen3_5", "qwen3_5_moe"] {
        let mut m = loader::open(&family_dir(family), DtypePolicy::F32, BLOCK).unwrap();
        assert!(m.model.set_device_recurrence(true).unwrap() > 0, "{family}");
        check_family_on(family, &m, family);
    }
}

/// Qwen3.5-MoE / Qwen3.6-35B-A3B's layer pattern: the hybrid layers with a routed mixture of
/// experts and a gated shared expert in every layer, the experts fused as published.
#[test]
fn qwen3_5_moe_hybrid_matches_mlx_lm() {
    check_family("qwen3_5_moe", "qwen3_5_moe");
}

/// gpt-oss: windowed layers alternating with full attention, a sink logit per query head,
/// YaRN, q/k/v/o biases, experts with biases and a clamped SwiGLU behind a biased router.
/// Hugging Face's unquantised layout (interleaved `gate_up_proj`) and mlx-lm's (stacked
/// `experts.gate_proj`), the same weights, against mlx-lm on the latter
/// (scripts/make_gpt_oss_fixtures.py).
#[test]
fn gpt_oss_matches_mlx_lm_in_both_layouts() {
    check_family("gpt_oss", "gpt_oss");
    check_family_at("gpt_oss", &family_dir("gpt_oss_mlx"), "gpt_oss");
}

/// gpt-oss's experts in MXFP4: as OpenAI publishes them (`gate_up_proj_blocks` of bytes, gate
/// and up rows interleaved) and as mlx-lm converts them (uint32 codes in `quantization`'s mxfp4
/// mode), the same codes, against mlx-lm on their expansion by MLX.
#[test]
fn gpt_oss_with_mxfp4_experts_matches_mlx_lm_in_both_layouts() {
    check_family("gpt_oss_mxfp4", "gpt_oss");
    check_family_at("gpt_oss_mxfp4", &family_dir("gpt_oss_mxfp4_mlx"), "gpt_oss");
}

/// The same MXFP4 experts kept packed, as a GPU or Metal keeps them (MLX's `gather_qmm` in
/// mxfp4 mode, both layouts), here on the CPU in f32: the reference's logits and greedy tokens.
#[test]
fn gpt_oss_mxfp4_experts_kept_packed_match_mlx_lm() {
    let policy = DtypePolicy {
        quantized_weights: true,
        ..DtypePolicy::F32
    };
    let (_, cases) = cases("gpt_oss_mxfp4");
    for folder in ["gpt_oss_mxfp4", "gpt_oss_mxfp4_mlx"] {
        let m = loader::open(&family_dir(folder), policy, BLOCK).unwrap();
        for case in &cases {
            let (tokens, logits) = greedy(&m, &case.input, case.greedy.len());
            let (worst, tolerance) = difference(&logits, &case.logits);
            eprintln!("{folder} packed: max |Δlogit| {worst:.3e} (tolerance {tolerance:.2e})");
            assert!(worst <= tolerance, "{folder}: logits differ by {worst}");
            assert_eq!(tokens, case.greedy, "{folder}: greedy tokens");
        }
    }
    // A chunk of 4,200 tokens (8,400 token-expert pairs): the codes are expanded in MXFP4
    // mode for the products (`EXPAND_FROM_ROWS`), the expanded model's arithmetic.
    let long: Vec<u32> = cases[0].input.iter().copied().cycle().take(4200).collect();
    let packed = loader::open(&family_dir("gpt_oss_mxfp4"), policy, BLOCK).unwrap();
    let expanded = loader::open(&family_dir("gpt_oss_mxfp4"), DtypePolicy::F32, BLOCK).unwrap();
    let (worst, tolerance) = difference(&one_pass(&packed, &long), &one_pass(&expanded, &long));
    assert!(
        worst <= tolerance,
        "expanded MXFP4 experts: logits differ by {worst}"
    );
}

/// The same on MLX's kernels (attention with sinks through `fast::scaled_dot_product_attention`
/// as on a GPU or Metal) and with the experts' products run as a GPU runs them.
#[test]
fn gpt_oss_on_mlx_kernels_matches_mlx_lm() {
    let mut m = loader::open(&family_dir("gpt_oss"), DtypePolicy::F32, BLOCK).unwrap();
    m.model.use_mlx_kernels();
    check_family_on("gpt_oss", &m, "gpt_oss");
}

/// Qwen3-Next: Qwen3.5-MoE's layers with the Gated DeltaNet's projections fused per key head
/// (`in_proj_qkvz`, `in_proj_ba`), experts one tensor each, a layer kept dense by
/// `mlp_only_layers` (scripts/make_qwen3_next_fixtures.py); on the host recurrence and on the
/// device's.
#[test]
fn qwen3_next_matches_mlx_lm() {
    check_family("qwen3_next", "qwen3_next");
    let mut m = loader::open(&family_dir("qwen3_next"), DtypePolicy::F32, BLOCK).unwrap();
    assert!(m.model.set_device_recurrence(true).unwrap() > 0);
    check_family_on("qwen3_next", &m, "qwen3_next");
}

#[test]
fn qwen3_matches_mlx_lm() {
    check_family("qwen3", "qwen3");
}

#[test]
fn llama_3_2_matches_mlx_lm() {
    check_family("llama3_2", "llama");
}

#[test]
fn llama_3_1_matches_mlx_lm() {
    check_family("llama3_1", "llama");
}

#[test]
fn mistral_matches_mlx_lm() {
    check_family("mistral", "mistral");
}

#[test]
fn phi3_matches_mlx_lm() {
    check_family("phi3", "phi3");
}

#[test]
fn smollm3_matches_mlx_lm() {
    check_family("smollm3", "smollm3");
}

/// An mlx-community layout: mlx-lm's own quantiser gave each kind of layer another width
/// (2, 3, 4, 5, 6, 8 bits) and group size (32, 64), and left one layer dense; config.json
/// says so per module. mlx-lm computed the reference on those quantised weights.
#[test]
fn qwen3_with_per_layer_affine_quantisation_matches_mlx_lm() {
    check_family("qwen3_mixed", "qwen3");
}

/// MXFP4 (microscaled 4-bit floats, e8m0 scales per 32, no biases), as mlx-lm writes it.
#[test]
fn llama_3_1_in_mxfp4_matches_mlx_lm() {
    check_family("llama3_1_mxfp4", "llama");
}

/// Gemma 3's windowed layers keep only their window (and a step of slack) of rows once they
/// are released, whatever the context, and compute what a cache holding every row computes:
/// a 300-token prompt in chunks through both attention paths (host passes up to 64 rows, MLX's
/// operations above), then decode steps, logits compared at every step.
#[test]
fn gemma3_windowed_layers_stay_bounded_and_compute_the_same() {
    const STEP: usize = 16;
    let m = loader::open(&family_dir("gemma3"), DtypePolicy::F32, BLOCK).unwrap();
    let config = m.model.config().clone();
    let window = config.sliding_window.clone().expect("gemma3 has windows");
    let (_, cases) = cases("gemma3");
    let prompt: Vec<u32> = cases
        .iter()
        .flat_map(|c| c.input.iter().copied())
        .cycle()
        .take(300)
        .collect();
    let (mut full, mut bounded) = (m.model.new_cache(STEP), m.model.new_cache(STEP));
    let step = |cache: &mut strata_worker::engine::KvCache, tokens: &[u32]| {
        let l = m.model.forward(&mut [SeqChunk { tokens, cache }]).unwrap();
        l.eval().unwrap();
        l.as_slice::<f32>().to_vec()
    };
    let mut at = 0;
    let mut next = Vec::new();
    for chunk in [100, 7, 50, 1, 90, 52]
        .into_iter()
        .chain(std::iter::repeat_n(1, 40))
    {
        if at < prompt.len() {
            next = prompt[at..at + chunk].to_vec();
            at += chunk;
        }
        let (ours, theirs) = (step(&mut bounded, &next), step(&mut full, &next));
        bounded.release_window_rows(usize::MAX).unwrap();
        let (worst, tolerance) = difference(&ours, &theirs);
        assert!(
            worst <= tolerance,
            "after {} tokens: bounded and full caches differ by {worst}",
            full.len()
        );
        if at >= prompt.len() {
            next = vec![argmax(&theirs) as u32];
        }
    }
    let held = full.len();
    assert_eq!(bounded.len(), held);
    for layer in 0..config.num_layers {
        let first = bounded.first_held(layer);
        if window.layers.contains(&layer) {
            // The window and at most two steps of slack behind the end.
            assert!(
                held - first <= window.tokens + 2 * STEP,
                "layer {layer} holds {} rows",
                held - first
            );
            assert!(bounded.export(0, STEP).is_err(), "released rows exported");
        } else {
            assert_eq!(first, 0, "global layer {layer} released rows");
        }
    }
    assert!(bounded.rows_allocated() * 2 < full.rows_allocated());
    // The last window's rows, still held, export as the full cache's rows of those tokens
    // (within the rounding of attention over fewer rows in earlier layers).
    let from = held - window.tokens;
    let floats = |bytes: Vec<u8>| -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    };
    let a = floats(bounded.export(from, held).unwrap());
    let b = floats(full.export(from, held).unwrap());
    let (worst, tolerance) = difference(&a, &b);
    assert!(worst <= tolerance, "exported rows differ by {worst}");
}

/// The serving path releases windowed rows as it goes (KV grown 16 tokens at a time, so a
/// 300-token prompt releases many times) and still stores every block, prompt and answer:
/// the answer equals a cache that keeps every row, and runs resumed from the stored blocks
/// (whole and partial) give it again.
#[test]
fn gemma3_served_with_released_rows_stores_blocks_and_resumes_from_them() {
    let m = loader::open(&family_dir("gemma3"), DtypePolicy::F32, BLOCK).unwrap();
    let (_, cases) = cases("gemma3");
    let prompt: Vec<u32> = cases
        .iter()
        .rev()
        .flat_map(|c| c.input.iter().copied())
        .cycle()
        .take(300)
        .collect();
    // An answer long enough that rows of its first block are released before it is stored.
    let (want, _) = greedy(&m, &prompt, 64);
    let options = EngineOptions {
        kv_step_tokens: 16,
        store_decode_kv: true,
        ..EngineOptions::default()
    };
    let req = GenerateRequest::greedy(prompt.clone(), 64);
    let (cold, blocks) = generate_with(&m, &req, &[], &options);
    assert_eq!(cold.tokens, want, "served cold");
    // Each index's newest block (the answer's blocks rewrite the prompt's partial tail).
    let mut chain: Vec<&FinishedBlock> = Vec::new();
    for b in &blocks {
        chain.truncate(b.index);
        chain.push(b);
    }
    // 18 whole prompt blocks, the prompt's 11-token tail, then the answer's blocks (from
    // 18 on, rewritten with the answer) stored at the end from rows of released layers.
    let stored: Vec<(usize, usize)> = blocks.iter().map(|b| (b.index, b.tokens.len())).collect();
    assert_eq!(
        stored[18..],
        [(18, 11), (18, 16), (19, 16), (20, 16), (21, 16), (22, 11)]
    );
    assert_eq!(chain.len(), 23);
    // n whole blocks, or 18 and the leading 11 rows of the next (token-granular reuse).
    for (n, partial) in [(1, 0), (2, 0), (5, 0), (10, 0), (18, 0), (18, 11)] {
        let mut cached: Vec<CachedKv<'_>> = chain[..n]
            .iter()
            .map(|b| CachedKv {
                bytes: &b.bytes,
                tokens: b.tokens.len(),
            })
            .collect();
        if partial > 0 {
            cached.push(CachedKv {
                bytes: &chain[n].bytes,
                tokens: partial,
            });
        }
        let resumed = GenerateRequest::greedy(prompt.clone(), 64);
        let (warm, _) = generate_with(&m, &resumed, &cached, &options);
        assert_eq!(
            warm.cached_tokens,
            n * BLOCK + partial,
            "{n} blocks + {partial}"
        );
        assert_eq!(warm.tokens, want, "warm from {n} blocks + {partial}");
    }
}

/// A hybrid model stores a partial block at each message end it is told of, carrying the
/// recurrent states there: a prompt that shares the conversation up to that message end and
/// then asks something else resumes exactly there (not at the block end before it), and
/// answers as a cold run does.
#[test]
fn qwen3_5_resumes_at_a_message_end_inside_a_block() {
    let m = loader::open(&family_dir("qwen3_5"), DtypePolicy::F32, BLOCK).unwrap();
    let (_, cases) = cases("qwen3_5");
    let prompt = cases[2].input.clone();
    let ends = [20, 45];
    let first = GenerateRequest {
        ignore_eos: true,
        message_ends: ends.to_vec(),
        ..GenerateRequest::greedy(prompt.clone(), 6)
    };
    let (_, blocks) = generate(&m, &first, &[]);
    for end in ends {
        let partial = blocks
            .iter()
            .find(|b| b.tokens.len() < BLOCK && b.index * BLOCK + b.tokens.len() == end)
            .unwrap_or_else(|| panic!("no partial block at the message end {end}"));
        let mut cached: Vec<CachedKv<'_>> = blocks
            .iter()
            .filter(|b| b.tokens.len() == BLOCK && b.index < end / BLOCK)
            .map(|b| CachedKv {
                bytes: &b.bytes,
                tokens: BLOCK,
            })
            .collect();
        cached.push(CachedKv {
            bytes: &partial.bytes,
            tokens: partial.tokens.len(),
        });
        // The same conversation up to `end`, then another question.
        let mut other = prompt[..end].to_vec();
        other.extend(prompt[end..].iter().map(|t| (t + 7) % 250));
        let req = GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::greedy(other, 6)
        };
        let (cold, _) = generate(&m, &req, &[]);
        let (warm, _) = generate(&m, &req, &cached);
        assert_eq!(warm.cached_tokens, end, "resumed at the message end");
        assert_eq!(warm.tokens, cold.tokens, "warm from the message end {end}");
    }
}
