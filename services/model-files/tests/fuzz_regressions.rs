//! Replays the model-file fuzz corpora (tests/fuzz/corpus/{gguf,safetensors}: the seeds, plus
//! the inputs libFuzzer kept while exploring the checks with
//! `cargo +nightly fuzz run --fuzz-dir tests/fuzz gguf|safetensors`) on stable. Every file must
//! be accepted or refused without a panic; the seeds must pass; safetensors verdicts must match
//! the format's reference implementation, as in the fuzz target.

use std::path::{Path, PathBuf};

use strata_model_files::{MLX_MAX_DIM, check_gguf_reader, check_safetensors_reader};

/// Every corpus file, with whether it is a seed (a valid file written by hand).
fn corpus(name: &str) -> Vec<(PathBuf, Vec<u8>, bool)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fuzz/corpus")
        .join(name);
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("the corpus directory") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file");
        let seed = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("seed-"));
        files.push((path, bytes, seed));
    }
    assert!(
        files.len() >= 10,
        "only {} files in {}",
        files.len(),
        dir.display()
    );
    files
}

#[test]
fn every_gguf_of_the_fuzz_corpus_is_accepted_or_refused_without_a_panic() {
    let mut accepted = 0;
    let files = corpus("gguf");
    for (path, bytes, seed) in &files {
        let verdict = check_gguf_reader(&bytes[..], bytes.len() as u64);
        if *seed {
            assert!(verdict.is_ok(), "{}: {:?}", path.display(), verdict.err());
        }
        if let Ok(summary) = verdict {
            assert!(summary.tensors.iter().all(|(_, _, dims)| {
                !dims.is_empty() && dims.iter().all(|&d| (1..=MLX_MAX_DIM).contains(&d))
            }));
            accepted += 1;
        }
    }
    eprintln!("{} corpus files, {accepted} accepted", files.len());
}

#[test]
fn every_safetensors_of_the_fuzz_corpus_gets_the_reference_verdict() {
    let mut accepted = 0;
    let files = corpus("safetensors");
    for (path, bytes, seed) in &files {
        let ours = check_safetensors_reader(&bytes[..], bytes.len() as u64);
        let reference = safetensors::SafeTensors::deserialize(bytes);
        if *seed {
            assert!(ours.is_ok(), "{}: {:?}", path.display(), ours.err());
        }
        match (&ours, &reference) {
            (Ok(_), Ok(_)) => accepted += 1,
            (Err(_), Err(_)) => {}
            (Err(e), Ok(r)) => assert!(
                r.iter()
                    .any(|(_, t)| t.shape().iter().any(|&d| d as u64 > MLX_MAX_DIM)),
                "{}: refused what the reference reads: {e}",
                path.display()
            ),
            (Ok(_), Err(e)) => panic!(
                "{}: accepted what the reference refuses: {e}",
                path.display()
            ),
        }
    }
    eprintln!("{} corpus files, {accepted} accepted", files.len());
}
