//! Helpers shared by the worker's integration tests: where the real models are.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn cache_dir() -> PathBuf {
    std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/strata")
        })
}

/// The default model, fetched by scripts/setup; a missing file is a failure, not a skip.
pub fn smollm2_gguf() -> PathBuf {
    let path = cache_dir().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.is_file(),
        "{} missing: run scripts/setup",
        path.display()
    );
    path
}

pub fn fixture(rel: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(rel);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// A model folder or file that scripts/setup derives from the default model.
pub fn derived_model(rel: &str) -> PathBuf {
    let path = cache_dir().join("models").join(rel);
    assert!(
        path.exists(),
        "{} missing: run scripts/setup",
        path.display()
    );
    path
}

/// all-MiniLM-L6-v2, fetched by scripts/setup; a missing folder is a failure, not a skip.
pub fn minilm_dir() -> PathBuf {
    let path = cache_dir().join("models/all-minilm-l6-v2");
    assert!(
        path.join("model.safetensors").is_file(),
        "{} missing: run scripts/setup",
        path.display()
    );
    path
}
