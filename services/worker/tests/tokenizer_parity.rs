//! Our tokenizer, built from the GGUF's metadata, against two independent references over a
//! corpus of 300+ strings (fixtures/tokenizer: the Hugging Face `tokenizers` library set up
//! like SmolLM2's own tokenizer.json, and llama.cpp's tokenizer).

mod common;

use strata_worker::engine::gguf;
use strata_worker::tokenizer::{StreamDecoder, Tokenizer};

fn smollm2_tokenizer() -> Tokenizer {
    let model = gguf::load(&common::smollm2_gguf(), false).expect("load the GGUF");
    Tokenizer::from_gguf(&model.tokenizer).expect("build the tokenizer")
}

#[test]
fn smollm2_ids_match_hf_tokenizers_and_llama_cpp_on_the_corpus() {
    let tok = smollm2_tokenizer();
    let fixture = common::fixture("tokenizer/smollm2.json");
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 200, "corpus too small: {}", cases.len());
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let ours = tok.encode(text).unwrap();
        let hf = common::ids(&case["ids"]);
        let llama = common::ids(&case["llama_cpp_ids"]);
        if ours != hf || ours != llama {
            failures.push(format!(
                "{text:?}\n  ours  {ours:?}\n  hf    {hf:?}\n  llama {llama:?}"
            ));
        }
        assert_eq!(tok.decode(&ours, false).unwrap(), text, "round trip");
    }
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn streaming_never_splits_a_character() {
    let tok = smollm2_tokenizer();
    for text in [
        "héllo wörld 你好，世界 👩‍👩‍👧 🇫🇷 ∑x²",
        "日本語のテキスト",
        "emoji: 🦀🦀🦀",
    ] {
        let ids = tok.encode(text).unwrap();
        let mut decoder = StreamDecoder::new(false);
        let mut streamed = String::new();
        let mut pieces = 0;
        for &id in &ids {
            if let Some(delta) = decoder.push(&tok, id).unwrap() {
                assert!(!delta.contains('\u{FFFD}'), "split character in {delta:?}");
                streamed.push_str(&delta);
                pieces += 1;
            }
        }
        if let Some(rest) = decoder.flush(&tok).unwrap() {
            streamed.push_str(&rest);
        }
        assert_eq!(streamed, text);
        assert!(pieces > 1, "expected several deltas for {text:?}");
    }
}

#[test]
fn special_tokens_are_known_by_name() {
    let tok = smollm2_tokenizer();
    assert_eq!(tok.special_id("<|im_start|>"), Some(1));
    assert_eq!(tok.special_id("<|im_end|>"), Some(2));
    assert_eq!(tok.eos_token(), Some(2));
    assert!(tok.is_special(0));
    assert!(!tok.is_special(4093));
}
