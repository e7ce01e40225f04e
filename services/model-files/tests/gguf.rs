//! The GGUF check on files built here byte by byte: valid ones pass, and every kind of damage
//! is a clear error, never a panic or an allocation the size of a corrupt length field.

use strata_model_files::{FormatError, GgufSummary, check_gguf_reader};

/// A metadata value as GGUF encodes it: (type id, payload bytes).
fn value_u32(v: u32) -> (u32, Vec<u8>) {
    (4, v.to_le_bytes().to_vec())
}

fn value_string(s: &str) -> (u32, Vec<u8>) {
    (8, string(s))
}

fn value_strings(items: &[&str]) -> (u32, Vec<u8>) {
    let mut b = 8u32.to_le_bytes().to_vec();
    b.extend((items.len() as u64).to_le_bytes());
    for s in items {
        b.extend(string(s));
    }
    (9, b)
}

fn string(s: &str) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s.as_bytes());
    b
}

struct Tensor {
    name: &'static str,
    dims: Vec<u64>,
    ty: u32,
    bytes: u64,
}

/// A GGUF v3 file; tensors are laid out one after another at `alignment`.
fn gguf(kvs: &[(&str, (u32, Vec<u8>))], tensors: &[Tensor], alignment: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((kvs.len() as u64).to_le_bytes());
    for (key, (ty, payload)) in kvs {
        b.extend(string(key));
        b.extend(ty.to_le_bytes());
        b.extend(payload);
    }
    let mut offset = 0u64;
    for t in tensors {
        b.extend(string(t.name));
        b.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset = (offset + t.bytes).div_ceil(alignment) * alignment;
    }
    b.resize(
        (b.len() as u64).div_ceil(alignment) as usize * alignment as usize,
        0,
    );
    b.resize(b.len() + offset as usize, 7);
    b
}

fn tensors() -> Vec<Tensor> {
    vec![
        Tensor {
            name: "token_embd.weight",
            dims: vec![64, 10],
            ty: 2, // Q4_0: 20 blocks of 18 bytes
            bytes: 20 * 18,
        },
        Tensor {
            name: "output_norm.weight",
            dims: vec![64],
            ty: 0, // F32
            bytes: 256,
        },
        Tensor {
            name: "blk.0.attn_q.weight",
            dims: vec![32, 3],
            ty: 30, // BF16
            bytes: 192,
        },
    ]
}

fn valid() -> Vec<u8> {
    gguf(
        &[
            ("general.architecture", value_string("llama")),
            ("llama.block_count", value_u32(1)),
            ("tokenizer.ggml.tokens", value_strings(&["<s>", "a", "ü"])),
        ],
        &tensors(),
        32,
    )
}

fn check(bytes: &[u8]) -> Result<GgufSummary, FormatError> {
    check_gguf_reader(bytes, bytes.len() as u64)
}

fn refused(bytes: &[u8]) -> String {
    match check(bytes) {
        Ok(s) => panic!("accepted: {s:?}"),
        Err(e) => e.to_string(),
    }
}

/// Byte offset where the tensor table starts in `valid()`.
fn tensor_table_start() -> usize {
    let needle = string("token_embd.weight");
    valid()
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
}

#[test]
fn a_valid_file_passes_with_its_tensors_listed() {
    let s = check(&valid()).unwrap();
    assert_eq!(s.version, 3);
    assert_eq!(s.metadata_keys, 3);
    assert_eq!(
        s.tensors,
        vec![
            ("token_embd.weight".into(), "Q4_0", vec![64, 10]),
            ("output_norm.weight".into(), "F32", vec![64]),
            ("blk.0.attn_q.weight".into(), "BF16", vec![32, 3]),
        ]
    );
}

#[test]
fn a_declared_alignment_is_followed() {
    let bytes = gguf(&[("general.alignment", value_u32(256))], &tensors(), 256);
    assert_eq!(check(&bytes).unwrap().tensors.len(), 3);
    // The same tensors at 32-byte offsets break a 256-byte alignment.
    let mut misaligned = gguf(&[("general.alignment", value_u32(256))], &tensors(), 32);
    misaligned.resize(bytes.len(), 0);
    assert!(refused(&misaligned).contains("not a multiple of the alignment 256"));
    let odd = gguf(&[("general.alignment", value_u32(48))], &tensors(), 48);
    assert!(refused(&odd).contains("not a power of two"));
}

#[test]
fn every_truncation_is_refused() {
    let bytes = valid();
    for cut in 0..bytes.len() {
        let e = refused(&bytes[..cut]);
        assert!(
            e.contains("runs past the end") || e.contains("truncated"),
            "cut at {cut}: {e}"
        );
    }
}

#[test]
fn corrupt_length_fields_are_refused_before_anything_is_allocated() {
    let bytes = valid();
    // Every 8-byte window of the header and tensor table set to a huge value: the kind of
    // damage that crashes MLX's reader. Whether it lands in a length, a count, a dimension, an
    // offset or in text (0xff and a lone 0x80 are not UTF-8), it must be refused.
    let table_end = tensor_table_start()
        + tensors()
            .iter()
            .map(|t| 8 + t.name.len() + 4 + 8 * t.dims.len() + 4 + 8)
            .sum::<usize>();
    for at in 0..table_end - 8 {
        for v in [u64::MAX, 1 << 63] {
            let mut b = bytes.clone();
            b[at..at + 8].copy_from_slice(&v.to_le_bytes());
            if b != bytes {
                assert!(check(&b).is_err(), "{v:#x} at byte {at} accepted");
            }
        }
    }
    let mut huge_count = valid();
    huge_count[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(check(&huge_count).is_err());
    let mut huge_kv = valid();
    huge_kv[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(check(&huge_kv).is_err());
    // The first key's length: absurd (even in a large file), or past the end of this one.
    let mut huge_string = valid();
    huge_string[24..32].copy_from_slice(&(1u64 << 62).to_le_bytes());
    let e = refused(&huge_string);
    assert!(
        e.contains("metadata key #0") && e.contains("at most 16777216"),
        "{e}"
    );
    let e = check_gguf_reader(&huge_string[..], 1 << 40)
        .unwrap_err()
        .to_string();
    assert!(e.contains("at most 16777216"), "{e}");
    huge_string[24..32].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let e = refused(&huge_string);
    assert!(
        e.contains("metadata key #0") && e.contains("runs past the end"),
        "{e}"
    );
}

#[test]
fn header_damage_gets_a_clear_reason() {
    let mut b = valid();
    b[0] = b'X';
    assert!(refused(&b).contains("not a GGUF file"));

    let mut b = valid();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert!(refused(&b).contains("GGUF version 1 is not supported"));

    let b = gguf(&[("a", value_u32(1)), ("a", value_u32(2))], &[], 32);
    assert!(refused(&b).contains("'a' appears twice"));

    let b = gguf(&[("k", (13, vec![0; 8]))], &[], 32);
    assert!(refused(&b).contains("unknown type 13"));

    let mut nested = 9u32.to_le_bytes().to_vec();
    nested.extend(1u64.to_le_bytes());
    nested.extend(value_u32(1).1);
    let b = gguf(&[("k", (9, nested))], &[], 32);
    assert!(refused(&b).contains("array of type 9"));

    let mut key = string("ab");
    key[8] = 0xff;
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(key);
    b.extend(value_u32(1).0.to_le_bytes());
    b.extend(value_u32(1).1);
    assert!(refused(&b).contains("is not UTF-8"));
}

fn with_tensor(t: Tensor) -> String {
    refused(&gguf(&[], &[t], 32))
}

#[test]
fn tensor_damage_gets_a_clear_reason() {
    let t = |dims: Vec<u64>, ty: u32, bytes: u64| Tensor {
        name: "w",
        dims,
        ty,
        bytes,
    };
    assert!(with_tensor(t(vec![1; 5], 0, 4)).contains("5 dimensions"));
    assert!(with_tensor(t(vec![4, 0], 0, 0)).contains("dimension of 0"));
    assert!(with_tensor(t(vec![1 << 31], 0, 4)).contains("MLX allows 1 to 2147483647"));
    // K-quants are read (expanded at load); IQ2_XXS is not, and the error says what is.
    let k = gguf(&[], &[t(vec![256], 12, 144)], 32);
    assert_eq!(check(&k).unwrap().tensors[0].1, "Q4_K");
    let e = with_tensor(t(vec![256], 16, 66));
    assert!(
        e.contains("tensor 'w' has type IQ2_XXS")
            && e.contains("Q4_K")
            && e.contains("re-quantise"),
        "{e}"
    );
    assert!(with_tensor(t(vec![128], 12, 72)).contains("not a multiple of 256"));
    assert!(with_tensor(t(vec![48], 8, 34)).contains("not a multiple of 32"));
    // Four dimensions that each fit in MLX but whose product overflows 64 bits.
    let e = with_tensor(t(vec![i32::MAX as u64; 4], 0, 4));
    assert!(e.contains("impossibly large"), "{e}");
    // A size past the end of the data.
    let mut b = gguf(&[], &[t(vec![64], 0, 256)], 32);
    b.truncate(b.len() - 4);
    let e = refused(&b);
    assert!(e.contains("data of tensor 'w'"), "{e}");

    let same_name = gguf(&[], &[t(vec![8], 0, 32), t(vec![8], 0, 32)], 32);
    assert!(refused(&same_name).contains("'w' appears twice"));
}

#[test]
fn overlapping_tensors_are_refused() {
    let mut b = valid();
    // Point the second tensor's offset at the first one's data.
    let start = tensor_table_start();
    let second = string("output_norm.weight");
    let at = start
        + b[start..]
            .windows(second.len())
            .position(|w| w == second)
            .unwrap();
    let offset_at = at + second.len() + 4 + 8 + 4;
    b[offset_at..offset_at + 8].copy_from_slice(&32u64.to_le_bytes());
    let e = refused(&b);
    assert!(e.contains("overlap"), "{e}");
}
