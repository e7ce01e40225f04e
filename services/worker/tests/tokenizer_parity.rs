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

/// The SentencePiece vocabulary of fixtures/tokenizer/spm.json (trained by Google's
/// `sentencepiece`, laid out as GGUF carries it) as GGUF metadata says it.
fn sentencepiece_spec() -> strata_worker::tokenizer::GgufTokenizerSpec {
    let fixture = common::fixture("tokenizer/spm.json");
    let strings = |key: &str| -> Vec<String> {
        fixture[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    strata_worker::tokenizer::GgufTokenizerSpec {
        model: "llama".into(),
        pre: "default".into(),
        tokens: strings("tokens"),
        merges: Vec::new(),
        token_types: fixture["token_types"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_i64().unwrap() as i32)
            .collect(),
        bos: Some(fixture["bos"].as_u64().unwrap() as u32),
        eos: Some(fixture["eos"].as_u64().unwrap() as u32),
        add_bos: false,
        scores: fixture["scores"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_f64().unwrap() as f32)
            .collect(),
        add_space_prefix: fixture["add_space_prefix"].as_bool().unwrap(),
        unknown: Some(fixture["unknown"].as_u64().unwrap() as u32),
    }
}

/// A GGUF SentencePiece vocabulary (Llama 2, Mistral, Gemma, Phi-3 files) gives the ids
/// `sentencepiece` itself gives on the whole corpus (merges by score, the space prefix, byte
/// fallback for characters without a piece), and decodes them back to its text.
#[test]
fn sentencepiece_vocabularies_encode_and_decode_as_sentencepiece_does() {
    let tok = Tokenizer::from_gguf(&sentencepiece_spec()).unwrap();
    let fixture = common::fixture("tokenizer/spm.json");
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() >= 300);
    let mut failures = Vec::new();
    let mut byte_fallbacks = 0;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = common::ids(&case["ids"]);
        let ours = tok.encode(text).unwrap();
        if ["<s>", "</s>"].iter().any(|s| text.contains(s)) {
            // Control tokens written in the text are matched whole (a chat template writes
            // them), as llama.cpp does; sentencepiece reads them as characters.
            assert!(ours.contains(&1) && ours.contains(&2), "{text:?}: {ours:?}");
            continue;
        }
        byte_fallbacks += ours
            .iter()
            .filter(|&&id| tok.token_text(id).is_some_and(|t| t.starts_with("<0x")))
            .count();
        if ours != want {
            failures.push(format!("{text:?}\n  ours {ours:?}\n  sp   {want:?}"));
            continue;
        }
        let decoded = tok.decode(&ours, true).unwrap();
        if decoded != case["decoded"].as_str().unwrap() {
            failures.push(format!("{text:?} decodes to {decoded:?}"));
        }
    }
    assert!(byte_fallbacks > 100, "the corpus exercises byte fallback");
    assert!(
        failures.is_empty(),
        "{} of {} differ:\n{}",
        failures.len(),
        cases.len(),
        failures
            .iter()
            .take(10)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// Scores that do not cover the vocabulary are refused, not guessed.
#[test]
fn a_sentencepiece_vocabulary_without_its_scores_is_refused() {
    let mut spec = sentencepiece_spec();
    spec.scores.truncate(10);
    let err = Tokenizer::from_gguf(&spec).err().expect("refused");
    assert!(err.to_string().contains("scores"), "{err}");
}
