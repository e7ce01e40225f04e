//! safetensors: the header is parsed and validated by the `safetensors` crate (the format's
//! reference implementation: contiguous offsets, sizes computed with checked arithmetic); here
//! it is read without loading the data, checked against the file's length, and against MLX's
//! 32-bit dimensions.

use std::io::Read;
use std::path::Path;

use safetensors::tensor::Metadata;

use crate::reader::Bounded;
use crate::{FileError, FormatError, MLX_MAX_DIM};

/// The format's own cap on the JSON header (the reference implementation refuses larger ones).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// What a safetensors file holds, once it passed the checks.
#[derive(Debug, Clone, PartialEq)]
pub struct SafetensorsSummary {
    /// Tensor names, in data order, with their dtype name and shape.
    pub tensors: Vec<(String, String, Vec<usize>)>,
}

pub fn check_safetensors(path: &Path) -> Result<SafetensorsSummary, FileError> {
    let (reader, len) = crate::open(path)?;
    check_safetensors_reader(reader, len).map_err(|source| FileError {
        path: path.display().to_string(),
        source,
    })
}

/// Checks a safetensors file of `len` bytes read from `reader`.
pub fn check_safetensors_reader<R: Read>(
    reader: R,
    len: u64,
) -> Result<SafetensorsSummary, FormatError> {
    let mut r = Bounded::new(reader, len);
    let header_len = r.u64("header length")?;
    if header_len > MAX_HEADER_BYTES {
        return Err(FormatError::invalid(format!(
            "the header claims {header_len} bytes (the format allows at most {MAX_HEADER_BYTES})"
        )));
    }
    let header = r.bytes(header_len, "header")?;
    let metadata: Metadata = serde_json::from_slice(&header)
        .map_err(|e| FormatError::invalid(format!("invalid header: {e}")))?;
    let data_len = r.remaining();
    if metadata.data_len() as u64 != data_len {
        return Err(FormatError::invalid(format!(
            "the header describes {} bytes of tensor data but the file holds {data_len}: \
             truncated or corrupt",
            metadata.data_len()
        )));
    }
    let mut tensors = Vec::new();
    for name in metadata.offset_keys() {
        let Some(info) = metadata.info(&name) else {
            continue;
        };
        if let Some(d) = info.shape.iter().find(|&&d| d as u64 > MLX_MAX_DIM) {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' has a dimension of {d} (MLX allows at most {MLX_MAX_DIM})"
            )));
        }
        tensors.push((name, format!("{:?}", info.dtype), info.shape.clone()));
    }
    Ok(SafetensorsSummary { tensors })
}
