//! safetensors headers as the worker checks them, differentially against the format's reference
//! implementation reading the whole buffer: they must agree, except that we also refuse
//! dimensions MLX cannot hold.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let ours = strata_model_files::check_safetensors_reader(data, data.len() as u64);
    let reference = safetensors::SafeTensors::deserialize(data);
    match (&ours, &reference) {
        (Ok(_), Ok(_)) | (Err(_), Err(_)) => {}
        (Err(e), Ok(r)) => assert!(
            r.iter()
                .any(|(_, t)| t.shape().iter().any(|&d| d as u64 > strata_model_files::MLX_MAX_DIM)),
            "refused what the reference reads: {e}"
        ),
        (Ok(_), Err(e)) => panic!("accepted what the reference refuses: {e}"),
    }
});
