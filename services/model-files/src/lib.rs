//! Structural checks of model weight files, run before MLX's C++ readers see them.
//!
//! MLX parses GGUF with gguflib and safetensors with its own reader, both trusting the file:
//! fuzzing showed a GGUF with a corrupted length field crashes the process (SIGSEGV) and a
//! safetensors header whose shape product overflows 64 bits, or whose dimension exceeds MLX's
//! 32-bit limit, is accepted with a wrong shape. A model folder is user input, so every file is
//! checked here first: everything a reader would index by is bounds-checked against the file's
//! length with checked arithmetic, and whatever fails is a clear error naming the file and the
//! field. The checks read only the headers; tensor data is read only to expand the GGUF types
//! MLX cannot load (`dequant`).

mod codes;
mod dequant;
mod gguf;
mod reader;
mod safetensors_file;

use std::path::Path;

pub use codes::{AffineCodes, affine_codes};
pub use dequant::dequantize;
pub use gguf::{
    GgmlType, GgufFile, GgufSummary, GgufTensor, MetaValue, check_gguf, check_gguf_reader,
};
pub use safetensors_file::{SafetensorsSummary, check_safetensors, check_safetensors_reader};

/// Largest dimension MLX can hold: its shapes are 32-bit signed integers.
pub const MLX_MAX_DIM: u64 = i32::MAX as u64;

/// Why a model file was refused.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("cannot read: {0}")]
    Io(#[from] std::io::Error),
    #[error(
        "{what} at byte {at} runs past the end of the file ({len} bytes): truncated or corrupt"
    )]
    Truncated { what: String, at: u64, len: u64 },
    #[error("{0}")]
    Invalid(String),
}

impl FormatError {
    pub(crate) fn invalid(why: impl Into<String>) -> Self {
        Self::Invalid(why.into())
    }
}

/// A refusal with the file it is about.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct FileError {
    pub path: String,
    #[source]
    pub source: FormatError,
}

pub(crate) fn open(path: &Path) -> Result<(std::io::BufReader<std::fs::File>, u64), FileError> {
    let wrap = |e: std::io::Error| FileError {
        path: path.display().to_string(),
        source: FormatError::Io(e),
    };
    let file = std::fs::File::open(path).map_err(wrap)?;
    let len = file.metadata().map_err(wrap)?.len();
    Ok((std::io::BufReader::with_capacity(1 << 16, file), len))
}
