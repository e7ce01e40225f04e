//! The LLaVA engine against an independent implementation: a tiny random-weight LLaVA-1.5 in
//! the published llava-hf file layout, and mlx-vlm 0.7.10's outputs for it
//! (scripts/make_vlm_fixtures.py, which also checks mlx-vlm against a float64 numpy pipeline).
//! From mlx-vlm's pixels: our vision features, projected features, last-position logits and
//! greedy tokens; the tokenizer's expansion of `<image>`; and that two images differ.
//!
//! Tolerances: mlx-vlm and the numpy float64 pipeline agree to 1.5e-7 on logits of about 0.5;
//! we compute in f32 with other op orders (matmul for the patch convolution, our own decoder),
//! so 1e-5 absolute on features and logits leaves two orders of magnitude for rounding and
//! still catches any wrong weight, layout or activation (those move values by 1e-2 or more).

mod common;

use std::path::PathBuf;

use mlx_rs::Array;
use strata_worker::engine::image::ClipPreprocess;
use strata_worker::engine::llava::Llava;

const TOLERANCE: f32 = 1e-5;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vlm")
}

fn array(v: &serde_json::Value) -> Array {
    let shape: Vec<i32> = v["shape"]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_i64().expect("dim") as i32)
        .collect();
    let data = floats(&v["data"]);
    Array::from_slice(&data, &shape)
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("a list")
        .iter()
        .map(|x| x.as_f64().expect("a number") as f32)
        .collect()
}

fn max_diff(got: &Array, want: &[f32]) -> f32 {
    got.eval().expect("eval");
    let got = got.as_slice::<f32>();
    assert_eq!(got.len(), want.len(), "sizes differ");
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max)
}

fn argmax(logits: &Array) -> u32 {
    logits.eval().expect("eval");
    let v = logits.as_slice::<f32>();
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy tokens after `ids`, with the KV cache (one token per step after the prompt).
fn greedy(model: &Llava, ids: &[u32], features: Option<&Array>, n: usize) -> (Array, Vec<u32>) {
    let mut cache = model.text.new_cache(256);
    let first = model.forward(ids, features, &mut cache).expect("prompt");
    let mut tokens = vec![argmax(&first)];
    while tokens.len() < n {
        let last = [*tokens.last().expect("a token")];
        let logits = model.forward(&last, None, &mut cache).expect("step");
        tokens.push(argmax(&logits));
    }
    (first, tokens)
}

#[test]
fn tiny_llava_matches_mlx_vlm_from_pixels_to_greedy_tokens() {
    let reference = common::fixture("vlm/reference.json");
    let model = Llava::load(&fixture_dir().join("tiny-llava")).expect("the real layout loads");
    assert_eq!(model.vision.image_token, 512);
    assert_eq!(model.vision.image_tokens, 16);
    let mut last_logits = Vec::new();
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["image"].as_str().expect("name");
        let pixels = array(&case["pixel_values"]);
        let vision = model.vision.vision_features(&pixels).expect("vision tower");
        let d = max_diff(&vision, &floats(&case["vision_features_selected"]["data"]));
        assert!(d < TOLERANCE, "{name}: vision features differ by {d}");
        let features = model.vision.image_features(&pixels).expect("projector");
        let d = max_diff(
            &features,
            &floats(&case["image_features_projected"]["data"]),
        );
        assert!(d < TOLERANCE, "{name}: projected features differ by {d}");

        let ids = common::ids(&case["input_ids"]);
        let (logits, tokens) = greedy(&model, &ids, Some(&features), 5);
        let d = max_diff(&logits, &floats(&case["last_logits"]));
        eprintln!("{name}: last logits within {d:e} of mlx-vlm's");
        assert!(d < TOLERANCE, "{name}: last logits differ by {d}");
        assert_eq!(
            tokens,
            common::ids(&case["greedy_tokens"]),
            "{name}: greedy tokens"
        );
        last_logits.push(logits);
    }
    // Two images, same prompt: different answers (mlx-vlm's differ by 0.07).
    let a = last_logits[0].as_slice::<f32>();
    let b = last_logits[1].as_slice::<f32>();
    let apart = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(
        apart > 0.01,
        "the two images give the same logits ({apart})"
    );

    let text = &reference["text_only"];
    let ids = common::ids(&text["input_ids"]);
    let (logits, tokens) = greedy(&model, &ids, None, 5);
    let d = max_diff(&logits, &floats(&text["last_logits"]));
    assert!(d < TOLERANCE, "text only: last logits differ by {d}");
    assert_eq!(tokens, common::ids(&text["greedy_tokens"]));
}

#[test]
fn the_tokenizer_expands_the_image_token_as_the_processor_does() {
    let reference = common::fixture("vlm/reference.json");
    let tokenizer =
        tokenizers::Tokenizer::from_file(fixture_dir().join("tiny-llava/tokenizer.json"))
            .expect("tokenizer.json");
    for case in reference["cases"].as_array().expect("cases") {
        let n = case["num_image_tokens"].as_u64().expect("count") as usize;
        let prompt = case["prompt"]
            .as_str()
            .expect("prompt")
            .replace("<image>", &"<image>".repeat(n));
        let ids = tokenizer.encode(prompt, true).expect("encode");
        assert_eq!(ids.get_ids(), common::ids(&case["input_ids"]).as_slice());
    }
}

#[test]
fn a_prompt_whose_image_tokens_do_not_match_the_features_is_refused() {
    let model = Llava::load(&fixture_dir().join("tiny-llava")).expect("load");
    let mut cache = model.text.new_cache(256);
    // Two image positions, no image.
    let err = model
        .forward(&[1, 512, 512, 5], None, &mut cache)
        .expect_err("mismatch");
    assert!(err.to_string().contains("image token positions"), "{err}");
    let wrong = Array::zeros::<f32>(&[1, 3, 32, 32]).expect("zeros");
    assert!(model.vision.vision_features(&wrong).is_err());
}

/// From the PNG file to greedy tokens: our decoding, resize (Pillow's fixed-point bicubic,
/// reproduced) and crop against transformers' CLIP processor, whose pixels we match exactly
/// (1e-6 covers f32 rounding in the normalisation), then the whole model.
#[test]
fn png_to_greedy_tokens_matches_the_clip_processor_and_mlx_vlm() {
    let reference = common::fixture("vlm/reference.json");
    let dir = fixture_dir().join("tiny-llava");
    let pre = ClipPreprocess::load(&dir).expect("config");
    let model = Llava::load(&dir).expect("load");
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["image"].as_str().expect("name");
        let bytes = std::fs::read(fixture_dir().join(name)).expect("image file");
        let pixels = pre.pixels(&bytes).expect("preprocess");
        assert_eq!(pixels.shape(), [1, 3, 56, 56]);
        let d = max_diff(&pixels, &floats(&case["pixel_values"]["data"]));
        assert!(d < 1e-6, "{name}: pixels differ by {d}");
        let features = model.vision.image_features(&pixels).expect("features");
        let (_, tokens) = greedy(&model, &common::ids(&case["input_ids"]), Some(&features), 5);
        assert_eq!(tokens, common::ids(&case["greedy_tokens"]), "{name}");
    }
    let err = pre.pixels(b"not an image").expect_err("garbage");
    assert!(err.to_string().contains("cannot decode"), "{err}");
}

/// The served path: the loader recognises the llava layout, the folder's chat_template.json
/// renders the processor's prompt, the worker's expansion gives mlx-vlm's ids, and a
/// generation through `Sequence` (prefill chunks that cut through the image span) gives
/// mlx-vlm's greedy tokens. Then the cache rules: a run that imports the first run's blocks
/// gives the same tokens, and another image changes the cache keys of exactly its span.
#[test]
fn served_vlm_generation_matches_mlx_vlm_and_keys_blocks_by_image() {
    use strata_worker::engine::generate::{EngineOptions, GenerateRequest, Prefix};
    use strata_worker::engine::multimodal::cache_tokens;
    use strata_worker::engine::sequence::{CachedKv, FinishedBlock};
    use strata_worker::engine::{DtypePolicy, loader};
    use strata_worker::template::ChatMessage;

    let reference = common::fixture("vlm/reference.json");
    let block = 4;
    let loaded = loader::open(&fixture_dir().join("tiny-llava"), DtypePolicy::F32, block)
        .expect("the loader opens the llava layout");
    let vision = loaded.vision.as_ref().expect("a vision tower");
    let input = &vision.input;
    let options = EngineOptions {
        prefill_chunk_tokens: 8,
        ..EngineOptions::default()
    };
    let mut key_spans = Vec::new();
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["image"].as_str().expect("name");
        let messages = vec![ChatMessage {
            role: "user".into(),
            content: serde_json::json!([
                {"type": "image"},
                {"type": "text", "text": "What is shown in this image?"},
            ]),
            extra: Default::default(),
        }];
        let text = loaded
            .template
            .render(&messages, true, None)
            .expect("template");
        assert_eq!(text, case["prompt"].as_str().expect("prompt"), "{name}");
        let ids = loaded.tokenizer.encode(&text).expect("encode");
        let image = input
            .image(&std::fs::read(fixture_dir().join(name)).expect("png"))
            .expect("image");
        let ids = input.expand(&ids, 1).expect("one placeholder");
        assert_eq!(ids, common::ids(&case["input_ids"]), "{name}: ids");
        assert!(
            input.expand(&ids, 2).is_err(),
            "placeholders must match images"
        );

        let req = GenerateRequest {
            images: vec![image.clone()],
            ..GenerateRequest::greedy(ids.clone(), 5)
        };
        let mut blocks: Vec<FinishedBlock> = Vec::new();
        let mut sink = |b: FinishedBlock| blocks.push(b);
        let cold = loaded
            .generate_with_prefix(
                &req,
                &options,
                Prefix {
                    cached: &[],
                    on_block: Some(&mut sink),
                    resume: None,
                },
                |_| true,
            )
            .expect("cold");
        assert_eq!(cold.tokens, common::ids(&case["greedy_tokens"]), "{name}");

        // The blocks carry the cache's ids, not the image token.
        let keys =
            cache_tokens(&ids, input.image_token, input.image_tokens, &[image]).expect("keys");
        for b in &blocks {
            let at = b.index * block;
            assert_eq!(
                b.tokens[..],
                keys[at..at + b.tokens.len()],
                "{name}: block ids"
            );
            assert!(!b.tokens.contains(&input.image_token), "{name}");
        }

        let cached: Vec<CachedKv<'_>> = blocks
            .iter()
            .map(|b| CachedKv {
                bytes: &b.bytes,
                tokens: b.tokens.len(),
            })
            .collect();
        let warm = loaded
            .generate_with_prefix(
                &req,
                &options,
                Prefix {
                    cached: &cached,
                    on_block: None,
                    resume: None,
                },
                |_| true,
            )
            .expect("warm");
        assert_eq!(
            warm.cached_tokens,
            ids.len() - 1,
            "{name}: all but the last"
        );
        assert_eq!(warm.tokens, cold.tokens, "{name}: a hit changes nothing");
        key_spans.push(keys);
    }
    // Same text, other image: the keys agree before the image and differ across its span,
    // so the chain of block keys parts there and no block after it is shared.
    let (a, b) = (&key_spans[0], &key_spans[1]);
    assert_eq!(a[..3], b[..3]);
    assert!((3..19).all(|i| a[i] != b[i]));

    // An image for a prompt without a placeholder, and images for a text-only model, are
    // refused.
    let req = GenerateRequest {
        images: vec![
            input
                .image(&std::fs::read(fixture_dir().join("image_a.png")).expect("png"))
                .expect("image"),
        ],
        ..GenerateRequest::greedy(vec![1, 5, 6], 2)
    };
    let err = loaded
        .generate(&req, &options, |_| true)
        .expect_err("no image positions");
    assert!(err.to_string().contains("image token positions"), "{err}");
}
