//! GGUF (versions 2 and 3): the header, metadata and tensor table, checked against the file's
//! length, and the tensors read and expanded to f32 where MLX's own reader cannot take them
//! (K-quants, Q5_0, Q5_1, IQ4_NL, IQ4_XS). Written by hand because no maintained crate reads
//! GGUF without a whole inference framework around it.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

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
/// Most elements of one metadata array: the largest vocabularies and merge lists are under a
/// million, and each element is held as a `MetaValue`.
const MAX_ARRAY: u64 = 1 << 22;

/// What a GGUF file holds, once it passed the checks.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufSummary {
    pub version: u32,
    pub metadata_keys: usize,
    /// Tensor names with their ggml type name and dimensions (ggml order, fastest first).
    pub tensors: Vec<(String, &'static str, Vec<u64>)>,
}

pub fn check_gguf(path: &Path) -> Result<GgufSummary, FileError> {
    Ok(GgufFile::open(path)?.summary())
}

/// Checks a GGUF file of `len` bytes read from `reader`.
pub fn check_gguf_reader<R: Read>(reader: R, len: u64) -> Result<GgufSummary, FormatError> {
    Ok(parse(reader, len, PathBuf::new())?.summary())
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    Int(i64),
    /// u64 values past i64's range.
    UInt(u64),
    Float(f64),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// A number (integers, floats and booleans alike).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Self::Int(v) => Some(v as f64),
            Self::UInt(v) => Some(v as f64),
            Self::Float(v) => Some(v),
            Self::Bool(v) => Some(if v { 1.0 } else { 0.0 }),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::String(s) => Some(s),
            _ => None,
        }
    }

    /// An array of strings.
    pub fn as_strings(&self) -> Option<Vec<String>> {
        let Self::Array(items) = self else {
            return None;
        };
        items
            .iter()
            .map(|v| v.as_str().map(str::to_string))
            .collect()
    }

    /// An array of integers that fit in i64.
    pub fn as_ints(&self) -> Option<Vec<i64>> {
        let Self::Array(items) = self else {
            return None;
        };
        items
            .iter()
            .map(|v| match *v {
                Self::Int(i) => Some(i),
                _ => None,
            })
            .collect()
    }
}

/// One tensor of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct GgufTensor {
    pub name: String,
    pub ty: GgmlType,
    /// ggml order: fastest-varying first (a [rows, cols] matrix is `[cols, rows]`).
    pub dims: Vec<u64>,
    /// Absolute offset of its data in the file, and its length.
    pub offset: u64,
    pub bytes: u64,
}

impl GgufTensor {
    pub fn values(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Its shape row-major, slowest first, as MLX and numpy hold it.
    pub fn shape(&self) -> Vec<i32> {
        // Every dimension was checked to fit MLX's i32 at open.
        self.dims.iter().rev().map(|&d| d as i32).collect()
    }
}

/// A checked GGUF file: its metadata, its tensor table, and where to read the data.
#[derive(Debug, Clone)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: HashMap<String, MetaValue>,
    pub tensors: Vec<GgufTensor>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, FileError> {
        let (reader, len) = crate::open(path)?;
        parse(reader, len, path.to_path_buf()).map_err(|source| FileError {
            path: path.display().to_string(),
            source,
        })
    }

    pub fn summary(&self) -> GgufSummary {
        GgufSummary {
            version: self.version,
            metadata_keys: self.metadata.len(),
            tensors: self
                .tensors
                .iter()
                .map(|t| (t.name.clone(), t.ty.name(), t.dims.clone()))
                .collect(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// Whether MLX's own GGUF reader can load every tensor (it keeps Q4_0/Q4_1/Q8_0 packed).
    pub fn mlx_reads_all(&self) -> bool {
        self.tensors.iter().all(|t| t.ty.mlx_reads())
    }

    /// A tensor's values as f32, in `shape()` order.
    /// A tensor's bytes as stored (whole blocks of its type).
    pub fn read_raw(&self, tensor: &GgufTensor) -> Result<Vec<u8>, FileError> {
        let file = std::fs::File::open(&self.path).map_err(|e| self.error(FormatError::Io(e)))?;
        // Sizes were checked against the file's length at open.
        let mut data = vec![0u8; tensor.bytes as usize];
        file.read_exact_at(&mut data, tensor.offset)
            .map_err(|e| self.error(FormatError::Io(e)))?;
        Ok(data)
    }

    fn error(&self, source: FormatError) -> FileError {
        FileError {
            path: self.path.display().to_string(),
            source,
        }
    }

    pub fn read_f32(&self, tensor: &GgufTensor) -> Result<Vec<f32>, FileError> {
        let data = self.read_raw(tensor)?;
        self.expand(tensor, &data)
    }

    /// `data` (`tensor`'s bytes, from `read_raw`) expanded to f32.
    pub fn expand(&self, tensor: &GgufTensor, data: &[u8]) -> Result<Vec<f32>, FileError> {
        let err = |source| self.error(source);
        let mut out = vec![0f32; tensor.values() as usize];
        if !crate::dequant::dequantize(tensor.ty, data, &mut out) {
            return Err(err(FormatError::invalid(format!(
                "tensor '{}' of type {} cannot be expanded to f32",
                tensor.name,
                tensor.ty.name()
            ))));
        }
        Ok(out)
    }
}

fn parse<R: Read>(reader: R, len: u64, path: PathBuf) -> Result<GgufFile, FormatError> {
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

    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = string(&mut r, &format!("metadata key #{i}"))?;
        let ty = r.u32(&format!("type of metadata '{key}'"))?;
        let value = read_value(&mut r, ty, &key)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(FormatError::invalid(format!(
                "metadata key '{key}' appears twice"
            )));
        }
    }
    let alignment = match metadata.get(ALIGNMENT_KEY) {
        None => DEFAULT_ALIGNMENT,
        Some(&MetaValue::Int(v)) if v > 0 && (v as u64).is_power_of_two() => v as u64,
        Some(other) => {
            return Err(FormatError::invalid(format!(
                "{ALIGNMENT_KEY} is {other:?}, not a power of two"
            )));
        }
    };

    let mut tensors = Vec::new();
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
        let code = r.u32(&format!("type of tensor '{name}'"))?;
        let offset = r.u64(&format!("offset of tensor '{name}'"))?;
        let ty = GgmlType::of(code).ok_or_else(|| {
            FormatError::invalid(format!(
                "tensor '{name}' has type {}, which Strata cannot read (it reads {}); \
                 re-quantise the file to one of those, e.g. Q4_K_M or Q8_0",
                ggml_type_name(code),
                GgmlType::READABLE
            ))
        })?;
        let block = ty.block_values() as u64;
        if dims[0] % block != 0 {
            return Err(FormatError::invalid(format!(
                "tensor '{name}' of type {}: its first dimension {} is not a multiple of {block}",
                ty.name(),
                dims[0]
            )));
        }
        let bytes = dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .and_then(|n| (n / block).checked_mul(ty.block_bytes() as u64))
            .filter(|&b| b <= isize::MAX as u64)
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
        tensors.push(GgufTensor {
            name,
            ty,
            dims,
            offset,
            bytes,
        });
    }

    // Tensor data starts at the first aligned offset after the table.
    let data_start = r
        .pos()
        .div_ceil(alignment)
        .checked_mul(alignment)
        .ok_or_else(|| FormatError::invalid("tensor table ends past any aligned offset"))?;
    let mut spans: Vec<(u64, u64, &str)> = tensors
        .iter()
        .map(|t| (t.offset, t.bytes, t.name.as_str()))
        .collect();
    spans.sort();
    let mut previous_end = 0u64;
    let mut previous_name = "";
    for &(offset, size, name) in &spans {
        if offset < previous_end {
            return Err(FormatError::invalid(format!(
                "tensors '{previous_name}' and '{name}' overlap"
            )));
        }
        let end = offset
            .checked_add(size)
            .and_then(|e| e.checked_add(data_start))
            .filter(|&e| e <= r.len())
            .ok_or_else(|| FormatError::Truncated {
                what: format!("data of tensor '{name}' ({size} bytes)"),
                at: data_start.saturating_add(offset),
                len: r.len(),
            })?;
        previous_end = end - data_start;
        previous_name = name;
    }
    for t in &mut tensors {
        t.offset += data_start;
    }

    Ok(GgufFile {
        path,
        version,
        metadata,
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

const TYPE_STRING: u32 = 8;
const TYPE_ARRAY: u32 = 9;

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

fn read_fixed<R: Read>(r: &mut Bounded<R>, ty: u32, what: &str) -> Result<MetaValue, FormatError> {
    let mut b = [0u8; 8];
    let n = fixed_size(ty).unwrap_or(0) as usize;
    b[..n].copy_from_slice(&r.bytes(n as u64, what)?);
    Ok(match ty {
        0 => MetaValue::Int(i64::from(b[0])),
        1 => MetaValue::Int(i64::from(b[0] as i8)),
        2 => MetaValue::Int(i64::from(u16::from_le_bytes([b[0], b[1]]))),
        3 => MetaValue::Int(i64::from(i16::from_le_bytes([b[0], b[1]]))),
        4 => MetaValue::Int(i64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        5 => MetaValue::Int(i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        6 => MetaValue::Float(f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        7 => MetaValue::Bool(b[0] != 0),
        10 => {
            let v = u64::from_le_bytes(b);
            i64::try_from(v).map_or(MetaValue::UInt(v), MetaValue::Int)
        }
        11 => MetaValue::Int(i64::from_le_bytes(b)),
        _ => MetaValue::Float(f64::from_le_bytes(b)),
    })
}

fn read_value<R: Read>(r: &mut Bounded<R>, ty: u32, key: &str) -> Result<MetaValue, FormatError> {
    if fixed_size(ty).is_some() {
        return read_fixed(r, ty, &format!("value of '{key}'"));
    }
    if ty == TYPE_STRING {
        return Ok(MetaValue::String(string(r, &format!("value of '{key}'"))?));
    }
    if ty != TYPE_ARRAY {
        return Err(FormatError::invalid(format!(
            "metadata '{key}' has unknown type {ty}"
        )));
    }
    let elem = r.u32(&format!("element type of '{key}'"))?;
    let count = r.u64(&format!("length of '{key}'"))?;
    // Every element takes at least a byte (a string its 8-byte length): refuse an impossible
    // count at once rather than after allocating or looping over it.
    let least = match (fixed_size(elem), elem) {
        (Some(size), _) => size,
        (None, TYPE_STRING) => 8,
        _ => {
            return Err(FormatError::invalid(format!(
                "metadata '{key}' is an array of type {elem}, which GGUF models do not use"
            )));
        }
    };
    if count > MAX_ARRAY {
        return Err(FormatError::invalid(format!(
            "array '{key}' claims {count} elements (at most {MAX_ARRAY} are allowed): corrupt"
        )));
    }
    r.ensure(
        count.saturating_mul(least),
        &format!("array '{key}' of {count} elements"),
    )?;
    let mut items = Vec::with_capacity(count as usize);
    for i in 0..count {
        let what = format!("element {i} of '{key}'");
        items.push(if elem == TYPE_STRING {
            MetaValue::String(string(r, &what)?)
        } else {
            read_fixed(r, elem, &what)?
        });
    }
    Ok(MetaValue::Array(items))
}

/// A ggml tensor type Strata reads: MLX's GGUF reader takes the first six, the rest are
/// expanded to f32 here (`dequant`).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q8_0,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    IQ4NL,
    IQ4XS,
}

impl GgmlType {
    const READABLE: &'static str = "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, \
                                    Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS";

    /// From ggml's type number.
    pub fn of(code: u32) -> Option<Self> {
        Some(match code {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2K,
            11 => Self::Q3K,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            20 => Self::IQ4NL,
            23 => Self::IQ4XS,
            30 => Self::BF16,
            _ => return None,
        })
    }

    /// ggml's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::BF16 => "BF16",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q2K => "Q2_K",
            Self::Q3K => "Q3_K",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::IQ4NL => "IQ4_NL",
            Self::IQ4XS => "IQ4_XS",
        }
    }

    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            Self::F32 | Self::F16 | Self::BF16 => 1,
            Self::Q4_0 | Self::Q4_1 | Self::Q8_0 | Self::Q5_0 | Self::Q5_1 | Self::IQ4NL => 32,
            Self::Q2K | Self::Q3K | Self::Q4K | Self::Q5K | Self::Q6K | Self::IQ4XS => 256,
        }
    }

    /// Bytes per block (ggml's `type_size`).
    pub fn block_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::BF16 => 2,
            Self::Q4_0 | Self::IQ4NL => 18,
            Self::Q4_1 => 20,
            Self::Q5_0 => 22,
            Self::Q5_1 => 24,
            Self::Q8_0 => 34,
            Self::Q2K => 84,
            Self::Q3K => 110,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
            Self::IQ4XS => 136,
        }
    }

    /// Whether MLX's GGUF reader loads it.
    pub fn mlx_reads(self) -> bool {
        matches!(
            self,
            Self::F32 | Self::F16 | Self::BF16 | Self::Q4_0 | Self::Q4_1 | Self::Q8_0
        )
    }
}

/// ggml's names for the types Strata does not read, for the error message.
fn ggml_type_name(ty: u32) -> String {
    let name = match ty {
        9 => "Q8_1",
        15 => "Q8_K",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => return format!("#{ty}"),
    };
    name.to_string()
}
