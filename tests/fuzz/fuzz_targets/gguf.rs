//! GGUF headers as the worker checks them before MLX's reader opens the file: any byte string
//! must be accepted or refused, never panic, loop for long or allocate more than it holds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = strata_model_files::check_gguf_reader(data, data.len() as u64);
});
