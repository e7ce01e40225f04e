//! The cache service's block files, as read back from disk (or written there by anyone):
//! parsing and verification must refuse every malformed file, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(block) = strata_kvcache::block::decode_file(bytes::Bytes::copy_from_slice(data)) {
        let _ = strata_kvcache::block::verify(&block);
    }
});
