//! Whole requests through `LoadedModel::generate` on the real SmolLM2: validation of bad input,
//! stop strings, max_tokens, seeded sampling, logprobs and the streamed text.

mod common;

use strata_worker::engine::generate::{EngineOptions, FinishReason, GenerateRequest};
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::sample::SamplingParams;
use strata_worker::engine::{DtypePolicy, EngineError};

fn model() -> LoadedModel {
    loader::open(&common::smollm2_gguf(), DtypePolicy::F32, 256).unwrap()
}

fn run(
    m: &LoadedModel,
    req: &GenerateRequest,
) -> Result<(strata_worker::engine::generate::Generation, String), EngineError> {
    let mut streamed = String::new();
    let g = m.generate(req, &EngineOptions::default(), |e| {
        streamed.push_str(&e.text);
        true
    })?;
    Ok((g, streamed))
}

fn invalid(m: &LoadedModel, req: GenerateRequest) -> String {
    match run(m, &req) {
        Err(EngineError::InvalidRequest(why)) => why,
        Err(other) => panic!("expected an invalid-request error, got {other}"),
        Ok((g, _)) => panic!("expected an error, got {:?}", g.text),
    }
}

#[test]
fn bad_requests_are_refused_before_any_work_with_the_reason() {
    let m = model();
    let prompt = m.tokenizer.encode("Hello").unwrap();
    let context = m.model.config().context_length;
    assert!(invalid(&m, GenerateRequest::greedy(vec![], 4)).contains("empty"));
    assert!(invalid(&m, GenerateRequest::greedy(prompt.clone(), 0)).contains("max_tokens"));
    let long = vec![28u32; context + 10];
    assert!(invalid(&m, GenerateRequest::greedy(long, 4)).contains("context"));
    assert!(
        invalid(&m, GenerateRequest::greedy(prompt.clone(), context))
            .contains("exceeds the context")
    );
    assert!(invalid(&m, GenerateRequest::greedy(vec![1, 999_999], 4)).contains("vocabulary"));
    let mut req = GenerateRequest::greedy(prompt, 4);
    req.sampling.top_p = 1.5;
    assert!(invalid(&m, req).contains("top_p"));
}

#[test]
fn stop_strings_end_the_text_before_them_and_max_tokens_ends_with_length() {
    let m = model();
    let prompt = m
        .tokenizer
        .encode("Once upon a time, in a small village by the sea,")
        .unwrap();
    let (full, streamed) = run(&m, &GenerateRequest::greedy(prompt.clone(), 12)).unwrap();
    assert_eq!(full.finish, FinishReason::Length);
    assert_eq!(full.tokens.len(), 12);
    assert_eq!(streamed, full.text);
    assert!(full.text.contains("wizard"), "{:?}", full.text);

    let mut req = GenerateRequest::greedy(prompt, 12);
    req.stop = vec!["wizard".into()];
    let (stopped, streamed) = run(&m, &req).unwrap();
    assert_eq!(stopped.finish, FinishReason::Stop);
    assert_eq!(streamed, stopped.text);
    let cut = full.text.find("wizard").unwrap();
    assert_eq!(stopped.text, full.text[..cut]);
}

#[test]
fn seeded_sampling_is_reproducible_and_logprobs_are_consistent() {
    let m = model();
    let prompt = m.tokenizer.encode("My favourite colour is").unwrap();
    let sampled = |seed| {
        let mut req = GenerateRequest::greedy(prompt.clone(), 8);
        req.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            ..Default::default()
        };
        run(&m, &req).unwrap().0.tokens
    };
    let first = sampled(1);
    assert_eq!(first, sampled(1));
    assert!(
        (2..5).any(|s| sampled(s) != first),
        "different seeds should differ"
    );

    let mut req = GenerateRequest::greedy(prompt.clone(), 5);
    req.sampling.logprobs = Some(3);
    let (g, _) = run(&m, &req).unwrap();
    assert_eq!(g.logprobs.len(), g.tokens.len());
    for (t, lp) in g.tokens.iter().zip(&g.logprobs) {
        // Greedy: the chosen token is the most likely one.
        assert_eq!(lp.top[0].0, *t);
        assert_eq!(lp.logprob, Some(lp.top[0].1));
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(lp.top.iter().all(|(_, l)| *l <= 0.0));
    }
}
