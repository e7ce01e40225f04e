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
    assert_eq!(model.image_token, 512);
    assert_eq!(model.image_tokens, 16);
    let mut last_logits = Vec::new();
    for case in reference["cases"].as_array().expect("cases") {
        let name = case["image"].as_str().expect("name");
        let pixels = array(&case["pixel_values"]);
        let vision = model.vision_features(&pixels).expect("vision tower");
        let d = max_diff(&vision, &floats(&case["vision_features_selected"]["data"]));
        assert!(d < TOLERANCE, "{name}: vision features differ by {d}");
        let features = model.image_features(&pixels).expect("projector");
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
    assert!(model.vision_features(&wrong).is_err());
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
        let features = model.image_features(&pixels).expect("features");
        let (_, tokens) = greedy(&model, &common::ids(&case["input_ids"]), Some(&features), 5);
        assert_eq!(tokens, common::ids(&case["greedy_tokens"]), "{name}");
    }
    let err = pre.pixels(b"not an image").expect_err("garbage");
    assert!(err.to_string().contains("cannot decode"), "{err}");
}
