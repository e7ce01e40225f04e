//! KV quantisation for cached blocks: 8-bit or 4-bit affine codes per group of values, as
//! MLX's `quantize` lays them out (a scale and a minimum per group of 64 along head_dim), so
//! that a block on SSD or in RAM takes about a quarter (8-bit) or an eighth (4-bit) of its
//! f32 bytes; or float16 values (half the bytes of float32 KV). Blocks are quantised when stored and expanded back to the live dtype when
//! imported; the live KV of a running sequence keeps full precision.
//!
//! Written here rather than with MLX's own `quantize`: block bytes live on the host (they
//! come from an export and go to gRPC or sled), the codec is a short loop over them, and
//! going through MLX would add two array round trips per block. The format is Strata's own,
//! named in the block header (`kv_quant`) and in the namespace, so quantised blocks never
//! mix with full-precision ones or with another scheme.

use mlx_rs::Dtype;

/// Values per group: one scale and one minimum for each.
pub const GROUP: usize = 64;

/// A storage scheme for cached KV other than the live dtype.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvQuant {
    /// float16 values (for KV computed in float32: half the bytes, a rounding of each value).
    F16,
    Q8,
    Q4,
}

impl KvQuant {
    /// The scheme for `bits` per cached value when KV is computed in `live`: None where that
    /// is the live dtype itself (32 for float32, 16 for float16/bfloat16).
    pub fn from_bits(bits: u32, live: Dtype) -> Result<Option<Self>, String> {
        let live_bits = if live == Dtype::Float32 { 32 } else { 16 };
        match bits {
            8 => Ok(Some(Self::Q8)),
            4 => Ok(Some(Self::Q4)),
            16 if live_bits == 32 => Ok(Some(Self::F16)),
            b if b == live_bits => Ok(None),
            other => Err(format!(
                "KV cache bits must be 4, 8, 16 or, for KV computed in float32, 32; got {other} (KV is computed in {live:?})"
            )),
        }
    }

    pub fn bits(self) -> usize {
        match self {
            Self::F16 => 16,
            Self::Q8 => 8,
            Self::Q4 => 4,
        }
    }

    /// The scheme's name in block headers and namespaces.
    pub fn scheme(self) -> &'static str {
        match self {
            Self::F16 => "f16",
            Self::Q8 => "affine-q8-g64",
            Self::Q4 => "affine-q4-g64",
        }
    }

    /// Encoded bytes of one group.
    fn group_bytes(self) -> usize {
        match self {
            Self::F16 => 2 * GROUP,
            _ => 8 + GROUP * self.bits() / 8,
        }
    }

    /// Encoded bytes of `values` values (a multiple of the group size).
    pub fn encoded_len(self, values: usize) -> usize {
        values / GROUP * self.group_bytes()
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("head_dim {0} is not a multiple of the quantisation group ({GROUP})")]
    Group(usize),
    #[error("{0} bytes are not whole {1:?} values in groups of {GROUP}")]
    Length(usize, Dtype),
    #[error("KV dtype {0:?} cannot be quantised")]
    Dtype(Dtype),
}

/// Whether blocks of this head size can be quantised.
pub fn supports(head_dim: usize) -> Result<(), QuantError> {
    if head_dim == 0 || !head_dim.is_multiple_of(GROUP) {
        return Err(QuantError::Group(head_dim));
    }
    Ok(())
}

fn element_bytes(dtype: Dtype) -> Result<usize, QuantError> {
    match dtype {
        Dtype::Float32 => Ok(4),
        Dtype::Float16 | Dtype::Bfloat16 => Ok(2),
        other => Err(QuantError::Dtype(other)),
    }
}

fn read(dtype: Dtype, b: &[u8]) -> f32 {
    match dtype {
        Dtype::Float16 => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        Dtype::Bfloat16 => half::bf16::from_le_bytes([b[0], b[1]]).to_f32(),
        _ => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
    }
}

fn write(dtype: Dtype, v: f32, out: &mut Vec<u8>) {
    match dtype {
        Dtype::Float16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
        Dtype::Bfloat16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        _ => out.extend_from_slice(&v.to_le_bytes()),
    }
}

/// Values of `from` as `to` (whole values: callers check the length). float32 <-> float16,
/// the pair an L2 hit of f16 blocks pays for, runs on slices: `half` converts those 8 at a
/// time (F16C) where one value at a time costs a call and a feature check each.
fn convert(bytes: &[u8], from: Dtype, to: Dtype) -> Vec<u8> {
    match (from, to) {
        (Dtype::Float16, Dtype::Float32) => return f16_to_f32(bytes),
        (Dtype::Float32, Dtype::Float16) => return f32_to_f16(bytes),
        _ => {}
    }
    let (a, b) = (
        element_bytes(from).unwrap_or(4),
        element_bytes(to).unwrap_or(4),
    );
    let mut out = Vec::with_capacity(bytes.len() / a * b);
    for v in bytes.chunks_exact(a) {
        write(to, read(from, v), &mut out);
    }
    out
}

/// Values converted per round: two stack buffers of 16 KiB and 8 KiB.
const SLICE: usize = 4096;

fn f16_to_f32(bytes: &[u8]) -> Vec<u8> {
    use half::slice::HalfFloatSliceExt;
    let mut out = Vec::with_capacity(bytes.len() * 2);
    let mut halves = [half::f16::ZERO; SLICE];
    let mut floats = [0f32; SLICE];
    for part in bytes.chunks(2 * SLICE) {
        let n = part.len() / 2;
        for (h, b) in halves.iter_mut().zip(part.chunks_exact(2)) {
            *h = half::f16::from_le_bytes([b[0], b[1]]);
        }
        halves[..n].convert_to_f32_slice(&mut floats[..n]);
        out.extend(floats[..n].iter().flat_map(|v| v.to_le_bytes()));
    }
    out
}

fn f32_to_f16(bytes: &[u8]) -> Vec<u8> {
    use half::slice::HalfFloatSliceExt;
    let mut out = Vec::with_capacity(bytes.len() / 2);
    let mut halves = [half::f16::ZERO; SLICE];
    let mut floats = [0f32; SLICE];
    for part in bytes.chunks(4 * SLICE) {
        let n = part.len() / 4;
        for (f, b) in floats.iter_mut().zip(part.chunks_exact(4)) {
            *f = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
        halves[..n].convert_from_f32_slice(&floats[..n]);
        out.extend(halves[..n].iter().flat_map(|h| h.to_le_bytes()));
    }
    out
}

/// Quantises KV bytes of `dtype` (any layout whose rows are head_dim long: groups never cross
/// a row when head_dim is a multiple of the group).
pub fn encode(q: KvQuant, dtype: Dtype, bytes: &[u8]) -> Result<Vec<u8>, QuantError> {
    let elem = element_bytes(dtype)?;
    if !bytes.len().is_multiple_of(elem * GROUP) {
        return Err(QuantError::Length(bytes.len(), dtype));
    }
    if q == KvQuant::F16 {
        return Ok(convert(bytes, dtype, Dtype::Float16));
    }
    let levels = ((1u32 << q.bits()) - 1) as f32;
    let mut out = Vec::with_capacity(q.encoded_len(bytes.len() / elem));
    let mut values = [0f32; GROUP];
    for group in bytes.chunks_exact(elem * GROUP) {
        for (v, b) in values.iter_mut().zip(group.chunks_exact(elem)) {
            *v = read(dtype, b);
        }
        let min = values.iter().copied().fold(f32::INFINITY, f32::min);
        let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let scale = if max > min { (max - min) / levels } else { 0.0 };
        out.extend_from_slice(&scale.to_le_bytes());
        out.extend_from_slice(&min.to_le_bytes());
        let code = |v: f32| -> u8 {
            if scale == 0.0 {
                0
            } else {
                ((v - min) / scale).round().clamp(0.0, levels) as u8
            }
        };
        match q {
            KvQuant::Q4 => out.extend(
                values
                    .chunks_exact(2)
                    .map(|pair| code(pair[0]) | (code(pair[1]) << 4)),
            ),
            _ => out.extend(values.iter().map(|&v| code(v))),
        }
    }
    Ok(out)
}

/// Expands quantised bytes back to `dtype` values.
pub fn decode(q: KvQuant, dtype: Dtype, bytes: &[u8]) -> Result<Vec<u8>, QuantError> {
    let elem = element_bytes(dtype)?;
    let group_bytes = q.group_bytes();
    if !bytes.len().is_multiple_of(group_bytes) {
        return Err(QuantError::Length(bytes.len(), dtype));
    }
    if q == KvQuant::F16 {
        return Ok(convert(bytes, Dtype::Float16, dtype));
    }
    let mut out = Vec::with_capacity(bytes.len() / group_bytes * GROUP * elem);
    for group in bytes.chunks_exact(group_bytes) {
        let scale = f32::from_le_bytes([group[0], group[1], group[2], group[3]]);
        let min = f32::from_le_bytes([group[4], group[5], group[6], group[7]]);
        let codes = &group[8..];
        match q {
            KvQuant::Q4 => {
                for &c in codes {
                    write(dtype, min + f32::from(c & 0x0f) * scale, &mut out);
                    write(dtype, min + f32::from(c >> 4) * scale, &mut out);
                }
            }
            _ => {
                for &c in codes {
                    write(dtype, min + f32::from(c) * scale, &mut out);
                }
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    fn f32_values(bytes: &[u8]) -> Vec<f32> {
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect()
    }

    #[test]
    fn round_trips_within_half_a_step_and_shrinks() {
        let values: Vec<f32> = (0..4 * GROUP)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let bytes = f32_bytes(&values);
        for q in [KvQuant::Q8, KvQuant::Q4] {
            let packed = encode(q, Dtype::Float32, &bytes).unwrap();
            assert_eq!(packed.len(), q.encoded_len(values.len()));
            let back = f32_values(&decode(q, Dtype::Float32, &packed).unwrap());
            for (g, (orig, got)) in values.chunks(GROUP).zip(back.chunks(GROUP)).enumerate() {
                let min = orig.iter().copied().fold(f32::INFINITY, f32::min);
                let max = orig.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let step = (max - min) / ((1u32 << q.bits()) - 1) as f32;
                for (a, b) in orig.iter().zip(got) {
                    assert!(
                        (a - b).abs() <= step / 2.0 + 1e-5,
                        "group {g}: {a} vs {b} ({q:?})"
                    );
                }
            }
        }
        // float16 of float32 KV: each value rounded to the nearest half.
        let packed = encode(KvQuant::F16, Dtype::Float32, &bytes).unwrap();
        assert_eq!(packed.len(), bytes.len() / 2);
        let back = f32_values(&decode(KvQuant::F16, Dtype::Float32, &packed).unwrap());
        for (a, b) in values.iter().zip(&back) {
            assert_eq!(*b, half::f16::from_f32(*a).to_f32());
        }
        // f32: 256 bytes per group become 72 (8-bit) and 40 (4-bit).
        assert_eq!(KvQuant::Q8.encoded_len(GROUP), 72);
        assert_eq!(KvQuant::Q4.encoded_len(GROUP), 40);
    }

    #[test]
    fn float16_blocks_convert_as_value_by_value_over_many_slices() {
        // More values than one conversion round, ending mid-round, with the edges of float16:
        // subnormals, overflow to infinity, ties, signed zeros.
        let specials = [
            0.0,
            -0.0,
            6.0e-8,
            -6.1e-5,
            65504.0,
            70000.0,
            -1.0e9,
            1.0 + 1.0 / 2048.0,
        ];
        let values: Vec<f32> = (0..3 * SLICE + 5 * GROUP)
            .map(|i| match specials.get(i % 97) {
                Some(&v) => v,
                None => ((i * 7919 % 20011) as f32 - 10005.0) / 313.0,
            })
            .collect();
        let packed = encode(KvQuant::F16, Dtype::Float32, &f32_bytes(&values)).unwrap();
        let one_by_one: Vec<u8> = values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        assert_eq!(packed, one_by_one);
        let back = f32_values(&decode(KvQuant::F16, Dtype::Float32, &packed).unwrap());
        for (a, b) in values.iter().zip(&back) {
            assert_eq!(b.to_bits(), half::f16::from_f32(*a).to_f32().to_bits());
        }
    }

    #[test]
    fn constant_groups_and_half_precision_survive() {
        let bytes: Vec<u8> = (0..GROUP)
            .flat_map(|_| half::f16::from_f32(1.5).to_le_bytes())
            .collect();
        let packed = encode(KvQuant::Q4, Dtype::Float16, &bytes).unwrap();
        assert_eq!(decode(KvQuant::Q4, Dtype::Float16, &packed).unwrap(), bytes);
    }

    #[test]
    fn bad_sizes_and_settings_are_errors() {
        assert!(encode(KvQuant::Q8, Dtype::Float32, &[0u8; 10]).is_err());
        assert!(decode(KvQuant::Q8, Dtype::Float32, &[0u8; 71]).is_err());
        assert!(supports(96).is_err() && supports(64).is_ok() && supports(128).is_ok());
        assert!(KvQuant::from_bits(3, Dtype::Float32).is_err());
        assert_eq!(KvQuant::from_bits(32, Dtype::Float32), Ok(None));
        assert_eq!(
            KvQuant::from_bits(16, Dtype::Float32),
            Ok(Some(KvQuant::F16))
        );
        assert_eq!(KvQuant::from_bits(16, Dtype::Float16), Ok(None));
        assert!(KvQuant::from_bits(32, Dtype::Bfloat16).is_err());
    }
}
