//! The accelerators on the real SmolLM2, in the engine: speculative decoding with SmolLM2 as
//! its own draft must give the normal greedy tokens and keep (almost) every drafted token; a
//! draft with another tokenizer is refused at load; SpecPrefill keeps the positions of the
//! full prompt, and with everything kept it is a full prefill.

mod common;

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::generate::{EngineOptions, GenerateRequest};
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::spec_prefill;
use strata_worker::engine::speculative::{self, Draft};

fn with_draft(tokens: usize) -> LoadedModel {
    let path = common::smollm2_gguf();
    let mut m = loader::open(&path, DtypePolicy::F32, 256).unwrap();
    m.draft = Some(Draft::open(&path, DtypePolicy::F32, tokens, &m).unwrap());
    m
}

fn prompts(m: &LoadedModel) -> Vec<Vec<u32>> {
    [
        "The three laws of motion are",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "Once upon a time, in a village by the sea,",
    ]
    .iter()
    .map(|t| m.tokenizer.encode(t).unwrap())
    .collect()
}

#[test]
fn greedy_tokens_are_the_same_with_and_without_the_draft() {
    let m = with_draft(4);
    let options = EngineOptions::default();
    for prompt in prompts(&m) {
        let normal = GenerateRequest {
            speculative: Some(false),
            ignore_eos: true,
            ..GenerateRequest::greedy(prompt.clone(), 40)
        };
        let spec = GenerateRequest {
            speculative: None,
            ..normal.clone()
        };
        let a = m.generate(&normal, &options, |_| true).unwrap();
        let b = m.generate(&spec, &options, |_| true).unwrap();
        assert_eq!(a.tokens, b.tokens);
        assert_eq!(a.text, b.text);
        assert!(a.speculation.is_none());
        let s = b.speculation.expect("speculation ran");
        assert!(s.steps > 0 && s.steps < 40, "{s:?}");
        assert!(s.accepted * 10 >= s.drafted * 9, "{s:?}");
        assert!(b.notices.is_empty(), "{:?}", b.notices);
    }
}

#[test]
fn max_tokens_and_stop_strings_cut_a_speculative_step_exactly() {
    let m = with_draft(6);
    let options = EngineOptions::default();
    let prompt = prompts(&m).remove(0);
    for max_tokens in [1, 2, 5, 7, 13] {
        let req = |speculative| GenerateRequest {
            speculative: Some(speculative),
            ignore_eos: true,
            ..GenerateRequest::greedy(prompt.clone(), max_tokens)
        };
        let a = m.generate(&req(false), &options, |_| true).unwrap();
        let b = m.generate(&req(true), &options, |_| true).unwrap();
        assert_eq!(a.tokens, b.tokens, "max_tokens {max_tokens}");
        assert_eq!(b.tokens.len(), max_tokens);
    }
    // A stop string part-way through a drafted run ends the answer where it would anyway.
    let full = m
        .generate(
            &GenerateRequest::greedy(prompt.clone(), 30),
            &options,
            |_| true,
        )
        .unwrap();
    let words: Vec<&str> = full.text.split_whitespace().collect();
    let stop = words[words.len() / 2].to_string();
    let req = |speculative| GenerateRequest {
        speculative: Some(speculative),
        stop: vec![stop.clone()],
        ..GenerateRequest::greedy(prompt.clone(), 30)
    };
    let a = m.generate(&req(false), &options, |_| true).unwrap();
    let b = m.generate(&req(true), &options, |_| true).unwrap();
    assert_eq!(a.text, b.text);
    assert_eq!(a.tokens, b.tokens);
}

#[test]
fn requests_the_draft_cannot_serve_say_why() {
    let m = with_draft(4);
    let prompt = prompts(&m).remove(0);
    let mut req = GenerateRequest::greedy(prompt, 8);
    req.sampling.logprobs = Some(0);
    let g = m
        .generate(&req, &EngineOptions::default(), |_| true)
        .unwrap();
    assert!(g.speculation.is_none());
    assert_eq!(g.notices.len(), 1);
    assert_eq!(g.notices[0].feature, speculative::FEATURE);
    assert!(g.notices[0].message.contains("logprobs"));
}

#[test]
fn a_draft_with_another_tokenizer_is_refused_at_load() {
    let target = loader::open(&common::smollm2_gguf(), DtypePolicy::F32, 256).unwrap();
    let other = common::derived_model("qwen2-tiny/qwen2_tiny.gguf");
    let err = match Draft::open(&other, DtypePolicy::F32, 4, &target) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("a Qwen2 draft was accepted for SmolLM2"),
    };
    assert!(err.contains("tokenizers differ"), "{err}");
    assert!(err.contains("qwen2_tiny.gguf"), "{err}");
    // The same tokenizer from another file format is accepted.
    let folder = common::derived_model("smollm2-135m-instruct-f32");
    assert!(Draft::open(&folder, DtypePolicy::F32, 4, &target).is_ok());
}

#[test]
fn pruning_keeps_positions_and_everything_kept_is_a_full_prefill() {
    let m = with_draft(4);
    let text = (0..60)
        .map(|i| format!("Note {i}: harbour {} holds {} boats.", i % 7, i * 3 % 11))
        .collect::<Vec<_>>()
        .join(" ")
        + " Which harbour holds the most boats?";
    let prompt = m.tokenizer.encode(&text).unwrap();
    assert!(
        prompt.len() >= spec_prefill::MIN_PROMPT_TOKENS,
        "{}",
        prompt.len()
    );
    let options = EngineOptions::default();
    let req = |ratio| GenerateRequest {
        prune_keep_ratio: ratio,
        speculative: Some(false),
        ..GenerateRequest::greedy(prompt.clone(), 12)
    };
    let full = m.generate(&req(None), &options, |_| true).unwrap();
    // Keeping every chunk through the pruned path (positions skipped: none) is exactly the
    // full prefill's arithmetic when chunks end where the full prefill's do.
    let all = m
        .generate(&req(Some(0.999_999)), &options, |_| true)
        .unwrap();
    assert_eq!(all.pruned_tokens, 0);
    assert_eq!(all.tokens, full.tokens);
    let pruned = m.generate(&req(Some(0.4)), &options, |_| true).unwrap();
    let kept = prompt.len() - pruned.pruned_tokens;
    assert!(kept as f64 >= 0.4 * prompt.len() as f64, "{kept}");
    assert!(kept < prompt.len() / 2 + spec_prefill::QUERY_TOKENS + 2 * spec_prefill::CHUNK_TOKENS);
    assert_eq!(pruned.tokens.len(), 12);
    assert_eq!(pruned.cached_tokens, 0);
}
