//! GGUF (versions 2 and 3): the header, metadata and tensor table, checked against the file's
//! length and against what MLX's GGUF reader can load. Written by hand because no maintained
//! crate validates GGUF without also loading it, and loading is MLX's job.

use std::collections::HashSet;
use std::io::Read;
use std::path::Path;

use crate::reader::Bounded;
use crate::{FileError, FormatError, MLX_MAX_DIM};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml tensors have at most four dimensions.
const MAX_DIMS: u32 = 4;
const ALIGNMENT_KEY: &str = "general.alignment";
/// Longest string read (a key, a name, a value such as a chat template): real ones are well
/// under a megabyte, and a corrupt length must not make the check allocate gigabytes of a
/// large file.
const MAX_STRING: u64 = 16 << 20;

/// What a GGUF file holds, once it passed the checks.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufSummary {
    pub version: u32,
    pub metadata_keys: usize,
    /// Tensor names with their ggml type name and dimensions (ggml order, fastest first).
    pub tensors: Vec<(String, &'static str, Vec<u64>)>,
}

pub fn check_gguf(path: &Path) -> Result<GgufSummary, FileError> {
    let (reader, len) = crate::open(path)?;
    check_gguf_reader(reader, len).map_err(|source| FileError {
        path: path.display().to_string(),
        source,
    })
}

/// Checks a GGUF file of `len` bytes read from `reader`.
pub fn check_gguf_reader<R: Read>(reader: R, len: u64) -> Result<GgufSummary, FormatError> {
    let mut r = Bounded::new(reader, len);
    let magic: [u8; 4] = r.array("magic")?;
    if &magic != MAGIC {
        return Err(FormatError::invalid(format!(
            "not a GGUF file (it starts with {magic:02x?}, not \"GGUF\")"
        )));
    }
    let version = r.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(FormatError::invalid(format!(
            "GGUF version {version} is not supported (versions 2 and 3 are)"
        )));
    }
    let tensor_count = r.u64("tensor count")?;
    let kv_count = r.u64("metadata count")?;

    let mut alignment = DEFAULT_ALIGNMENT;
    let mut keys = HashSet::new();
    for i in 0..kv_count {
        let key = string(&mut r, &format!("metadata key #{i}"))?;
        let ty = r.u32(&format!("type of metadata '{key}'"))?;
        if key == ALIGNMENT_KEY {
            if ty != ValueType::U32 as u32 {
                return Err(FormatError::invalid(format!(
                    "{ALIGNMENT_KEY} has type {ty}, not uint32"
                )));
            }
            let value = r.u32(ALIGNMENT_KEY)?;
            if value == 0 || !value.is_power_of_two() {
                return Err(FormatError::invalid(format!(
                    "{ALIGNMENT_KEY} is {value}, not a power of two"
                )));
            }
            alignment = u64::from(value);
        } else {
            skip_value(&mut r, ty, &key)?;
        }
        if !keys.insert(key.clone()) {
            return Err(FormatError::invalid(format!(
                "metadata key '{key}' appears twice"
            )));
        }
    }

    let mut tensors = Vec::new();
    let mut spans = Vec::new();
    let mut names = HashSet::new();
    for i in 0..tensor_count {
        let name = string(&mut r, &format!("name of tensor #{i}"))?;
        let n_dims = r.u32(&format!("dimension count of tensor '{name}'"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})"
            )));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = r.u64(&format!("dimensions of tensor '{name}'"))?;
            if d == 0 || d > MLX_MAX_DIM {
                return Err(FormatError::invalid(format!(
                    "tensor '{name}' has a dimension of {d} (MLX allows 1 to {MLX_MAX_DIM})"
                )));
            }
            dims.push(d);
        }
        let ty = r.u32(&format!("type of tensor '{name}'"))?;
        let offset = r.u64(&format!("offset of tensor '{name}'"))?;
        let ty = TensorType::of(ty).ok_or_else(|| {
            FormatError::invalid(format!(
                "tensor '{name}' has type {} that MLX cannot read (it reads F32, F16, BF16, \
                 Q4_0, Q4_1 and Q8_0; re-quantise other types, e.g. K-quants or Q5_0, to Q8_0 \
                 or Q4_0 first)",
                ggml_type_name(ty)
            ))
        })?;
        if dims[0] % ty.block != 0 {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' of type {}: its first dimension {} is not a multiple of {}",
                ty.name, dims[0], ty.block
            )));
        }
        let size = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| (n / ty.block).checked_mul(ty.block_bytes))
            .ok_or_else(|| FormatError::invalid(format!("tensor '{name}' is impossibly large")))?;
        if offset % alignment != 0 {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' starts at offset {offset}, not a multiple of the alignment {alignment}"
            )));
        }
        if !names.insert(name.clone()) {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' appears twice"
            )));
        }
        spans.push((offset, size, name.clone()));
        tensors.push((name, ty.name, dims));
    }

    // Tensor data starts at the first aligned offset after the table.
    let data_start = r
        .pos()
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| FormatError::invalid("tensor table ends past any aligned offset"))?;
    spans.sort();
    let mut previous_end = 0u64;
    let mut previous_name = "";
    for (offset, size, name) in &spans {
        if *offset < previous_end {
            return Err(FormatError::invalid(format!(
                "tensors '{previous_name}' and '{name}' overlap"
            )));
        }
        let end = offset
            .checked_add(*size)
            .and_then(|e| e.checked_add(data_start))
            .filter(|&e| e <= r.len())
            .ok_or_else(|| FormatError::Truncated {
                what: format!("data of tensor '{name}' ({size} bytes)"),
                at: data_start.saturating_add(*offset),
                len: r.len(),
            })?;
        previous_end = end - data_start;
        previous_name = name;
    }

    Ok(GgufSummary {
        version,
        metadata_keys: keys.len(),
        tensors,
    })
}

/// A length-prefixed UTF-8 string.
fn string<R: Read>(r: &mut Bounded<R>, what: &str) -> Result<String, FormatError> {
    let n = r.u64(&format!("length of {what}"))?;
    if n > MAX_STRING {
        return Err(FormatError::invalid(format!(
            "{what} claims {n} bytes (at most {MAX_STRING} are allowed): corrupt"
        )));
    }
    let bytes = r.bytes(n, what)?;
    String::from_utf8(bytes).map_err(|_| FormatError::invalid(format!("{what} is not UTF-8")))
}

#[repr(u32)]
enum ValueType {
    U32 = 4,
    String = 8,
    Array = 9,
}

/// Bytes of a fixed-size metadata value type; `None` for strings, arrays and unknown types.
fn fixed_size(ty: u32) -> Option<u64> {
    match ty {
        0 | 1 | 7 => Some(1), // u8, i8, bool
        2 | 3 => Some(2),     // u16, i16
        4..=6 => Some(4),     // u32, i32, f32
        10..=12 => Some(8),   // u64, i64, f64
        _ => None,
    }
}

fn skip_value<R: Read>(r: &mut Bounded<R>, ty: u32, key: &str) -> Result<(), FormatError> {
    if let Some(size) = fixed_size(ty) {
        return r.skip(size, &format!("value of '{key}'"));
    }
    if ty == ValueType::String as u32 {
        string(r, &format!("value of '{key}'"))?;
        return Ok(());
    }
    if ty != ValueType::Array as u32 {
        return Err(FormatError::invalid(format!(
            "metadata '{key}' has unknown type {ty}"
        )));
    }
    let elem = r.u32(&format!("element type of '{key}'"))?;
    let count = r.u64(&format!("length of '{key}'"))?;
    if let Some(size) = fixed_size(elem) {
        let bytes = count
            .checked_mul(size)
            .ok_or_else(|| FormatError::Truncated {
                what: format!("array '{key}' of {count} elements"),
                at: r.pos(),
                len: r.len(),
            })?;
        return r.skip(bytes, &format!("array '{key}'"));
    }
    if elem == ValueType::String as u32 {
        // Every string takes at least its 8-byte length: refuse an impossible count at once
        // rather than after looping over it.
        r.ensure(
            count.saturating_mul(8),
            &format!("array '{key}' of {count} strings"),
        )?;
        for i in 0..count {
            string(r, &format!("element {i} of '{key}'"))?;
        }
        return Ok(());
    }
    Err(FormatError::invalid(format!(
        "metadata '{key}' is an array of type {elem}, which GGUF models do not use"
    )))
}

/// A ggml tensor type MLX's GGUF reader converts.
struct TensorType {
    name: &'static str,
    /// Values per block, and the bytes of one block.
    block: u64,
    block_bytes: u64,
}

impl TensorType {
    fn of(ty: u32) -> Option<Self> {
        let (name, block, block_bytes) = match ty {
            0 => ("F32", 1, 4),
            1 => ("F16", 1, 2),
            2 => ("Q4_0", 32, 18),
            3 => ("Q4_1", 32, 20),
            8 => ("Q8_0", 32, 34),
            30 => ("BF16", 1, 2),
            _ => return None,
        };
        Some(Self {
            name,
            block,
            block_bytes,
        })
    }
}

/// ggml's names for the types MLX does not read, for the error message.
fn ggml_type_name(ty: u32) -> String {
    let name = match ty {
        6 => "Q5_0",
        7 => "Q5_1",
        9 => "Q8_1",
        10 => "Q2_K",
        11 => "Q3_K",
        12 => "Q4_K",
        13 => "Q5_K",
        14 => "Q6_K",
        15 => "Q8_K",
        16..=23 | 29 => "an IQ quant",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        _ => return format!("#{ty}"),
    };
    name.to_string()
}
