//! Replays the block-file fuzz corpus (tests/fuzz/corpus/block_file: the seeds, plus the
//! inputs libFuzzer kept while exploring `decode_file` and `verify` with
//! `cargo +nightly fuzz run --fuzz-dir tests/fuzz block_file`) on stable. Every file must
//! come back as a block or an error, never a panic; the seeds must verify.

use std::path::PathBuf;

use prost::bytes::Bytes;
use strata_kvcache::block::{decode_file, verify};

#[test]
fn every_block_file_of_the_fuzz_corpus_is_refused_or_read_without_a_panic() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fuzz/corpus/block_file");
    let mut files = 0;
    let mut valid = 0;
    for entry in std::fs::read_dir(&dir).expect("the corpus directory") {
        let path = entry.expect("a corpus entry").path();
        let bytes = std::fs::read(&path).expect("a corpus file");
        let verified = decode_file(Bytes::from(bytes))
            .ok()
            .and_then(|b| verify(&b).ok());
        if path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
        {
            assert!(verified.is_some(), "{} must verify", path.display());
        }
        valid += usize::from(verified.is_some());
        files += 1;
    }
    assert!(
        files >= 10,
        "only {files} corpus files in {}",
        dir.display()
    );
    eprintln!("{files} corpus files, {valid} valid blocks");
}
