//! The safetensors check: valid files pass; the headers MLX's reader wrongly accepts (a shape
//! whose size overflows, a dimension past 32 bits) and every truncation are refused.

use strata_model_files::{FormatError, SafetensorsSummary, check_safetensors_reader};

fn file(header: &str, data_len: usize) -> Vec<u8> {
    let mut b = (header.len() as u64).to_le_bytes().to_vec();
    b.extend(header.as_bytes());
    b.resize(b.len() + data_len, 3);
    b
}

fn valid() -> Vec<u8> {
    file(
        r#"{"__metadata__":{"format":"mlx"},
            "a":{"data_offsets":[26,74],"dtype":"F32","shape":[3,4]},
            "b":{"data_offsets":[16,26],"dtype":"F16","shape":[5]},
            "c":{"data_offsets":[0,16],"dtype":"BF16","shape":[2,2,2]}}"#,
        74,
    )
}

fn check(bytes: &[u8]) -> Result<SafetensorsSummary, FormatError> {
    check_safetensors_reader(bytes, bytes.len() as u64)
}

fn refused(bytes: &[u8]) -> String {
    match check(bytes) {
        Ok(s) => panic!("accepted: {s:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_valid_file_passes_with_its_tensors_in_data_order() {
    let s = check(&valid()).unwrap();
    let names: Vec<_> = s.tensors.iter().map(|t| t.0.as_str()).collect();
    assert_eq!(names, ["c", "b", "a"]);
    assert_eq!(s.tensors[2], ("a".into(), "F32".into(), vec![3, 4]));
}

#[test]
fn every_truncation_and_any_trailing_byte_is_refused() {
    let bytes = valid();
    for cut in 0..bytes.len() {
        refused(&bytes[..cut]);
    }
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(refused(&longer).contains("file holds 75"));
}

#[test]
fn headers_that_mlx_accepts_wrongly_are_refused() {
    // 2^30 * 2^30 * 16 f32 values is 2^66 bytes: MLX's size arithmetic wraps to 0 and it loads
    // a tensor of that shape backed by no data.
    let wraps = file(
        r#"{"a":{"data_offsets":[0,0],"dtype":"F32","shape":[1073741824,1073741824,16]}}"#,
        0,
    );
    let e = refused(&wraps);
    assert!(e.contains("invalid header"), "{e}");
    // MLX keeps dimensions in 32 bits: 2^32 + 12 became 12.
    let truncated_dim = file(
        r#"{"a":{"data_offsets":[0,17179869232],"dtype":"F32","shape":[4294967308]}}"#,
        0,
    );
    assert!(check(&truncated_dim).is_err());
    let big_dim = file(
        r#"{"a":{"data_offsets":[0,4294967308],"dtype":"U8","shape":[4294967308]}}"#,
        0,
    );
    // The data is not there either; build the header check alone with a fake length.
    let e = check_safetensors_reader(&big_dim[..], big_dim.len() as u64 + 4294967308)
        .unwrap_err()
        .to_string();
    assert!(e.contains("MLX allows at most 2147483647"), "{e}");
}

#[test]
fn header_damage_gets_a_clear_reason() {
    let mut huge = valid();
    huge[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(refused(&huge).contains("at most 100000000"));

    let mut past_end = valid();
    past_end[..8].copy_from_slice(&10_000u64.to_le_bytes());
    assert!(refused(&past_end).contains("runs past the end"));

    let not_json = file("{not json", 0);
    assert!(refused(&not_json).contains("invalid header"));

    let gap = file(
        r#"{"a":{"data_offsets":[0,4],"dtype":"F32","shape":[1]},
            "b":{"data_offsets":[8,12],"dtype":"F32","shape":[1]}}"#,
        12,
    );
    assert!(refused(&gap).contains("invalid header"));

    let size_mismatch = file(
        r#"{"a":{"data_offsets":[0,8],"dtype":"F32","shape":[3]}}"#,
        8,
    );
    assert!(refused(&size_mismatch).contains("invalid header"));

    let negative = file(
        r#"{"a":{"data_offsets":[0,8],"dtype":"F32","shape":[-2]}}"#,
        8,
    );
    assert!(refused(&negative).contains("invalid header"));

    let unknown_dtype = file(
        r#"{"a":{"data_offsets":[0,8],"dtype":"F99","shape":[2]}}"#,
        8,
    );
    assert!(refused(&unknown_dtype).contains("invalid header"));
}
