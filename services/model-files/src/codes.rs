//! ggml's affine block quantisations as what they are: per value an unsigned integer code,
//! per group of values a scale and a bias, `w = scale · code + bias`. The CPU kernels multiply
//! by the codes directly (`strata_cpu_kernels::packed`), reading a byte or half of one per
//! weight instead of the 4 bytes of the f32 expansion.
//!
//! Each group's scale and bias are formed with the f32 operations `dequant` uses, and the
//! codes are offset so that `fma(code, scale, bias)` is the exact product that `dequant`
//! rounds once: the two agree bit for bit (tests/dequant.rs checks it on every fixture).
//! IQ4_NL and IQ4_XS index a non-linear code book and are not affine: they have no codes.

use half::f16;
use rayon::prelude::*;

use crate::gguf::GgmlType;

/// Codes, scales and biases of whole blocks, in order.
pub struct AffineCodes {
    /// One per value, each below `1 << bits`.
    pub codes: Vec<u8>,
    pub bits: usize,
    /// Values per group: one scale and one bias each.
    pub group: usize,
    pub scales: Vec<f32>,
    pub biases: Vec<f32>,
}

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The codes of `data` (whole blocks of `ty`), or `None` for a type that is not affine or
/// sizes that do not agree.
pub fn affine_codes(ty: GgmlType, data: &[u8]) -> Option<AffineCodes> {
    let (one, bits, group): (BlockFn, usize, usize) = match ty {
        GgmlType::Q4_0 => (q4_0, 4, 32),
        GgmlType::Q4_1 => (q4_1, 4, 32),
        GgmlType::Q5_0 => (q5_0, 5, 32),
        GgmlType::Q5_1 => (q5_1, 5, 32),
        GgmlType::Q8_0 => (q8_0, 8, 32),
        GgmlType::Q2K => (q2_k, 2, 16),
        GgmlType::Q3K => (q3_k, 3, 16),
        GgmlType::Q4K => (q4_k, 4, 32),
        GgmlType::Q5K => (q5_k, 5, 32),
        GgmlType::Q6K => (q6_k, 6, 16),
        _ => return None,
    };
    let (values, bytes) = (ty.block_values(), ty.block_bytes());
    if data.is_empty() || !data.len().is_multiple_of(bytes) {
        return None;
    }
    let blocks = data.len() / bytes;
    let groups = values / group;
    let mut codes = vec![0u8; blocks * values];
    let mut scales = vec![0f32; blocks * groups];
    let mut biases = vec![0f32; blocks * groups];
    data.par_chunks(bytes)
        .zip(codes.par_chunks_mut(values))
        .zip(scales.par_chunks_mut(groups))
        .zip(biases.par_chunks_mut(groups))
        .for_each(|(((b, q), s), m)| one(b, q, s, m));
    Some(AffineCodes {
        codes,
        bits,
        group,
        scales,
        biases,
    })
}

/// One block: its codes, and per group a scale and a bias.
type BlockFn = fn(&[u8], &mut [u8], &mut [f32], &mut [f32]);

/// `d · (q - 8)`.
fn q4_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &byte) in b[2..18].iter().enumerate() {
        q[j] = byte & 0x0f;
        q[j + 16] = byte >> 4;
    }
    (s[0], m[0]) = (d, -8.0 * d);
}

/// `d · q + m`.
fn q4_1(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    for (j, &byte) in b[4..20].iter().enumerate() {
        q[j] = byte & 0x0f;
        q[j + 16] = byte >> 4;
    }
    (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
}

/// The 5-bit values of a Q5_0/Q5_1 block whose fifth bits start at `at`.
fn five_bits(b: &[u8], at: usize, q: &mut [u8]) {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    for (j, &byte) in b[at + 4..at + 20].iter().enumerate() {
        q[j] = (byte & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + 16] = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
}

/// `d · (q - 16)`.
fn q5_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let d = f16_at(b, 0);
    five_bits(b, 2, q);
    (s[0], m[0]) = (d, -16.0 * d);
}

/// `d · q + m`.
fn q5_1(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    five_bits(b, 4, q);
    (s[0], m[0]) = (f16_at(b, 0), f16_at(b, 2));
}

/// `d · q` for a signed byte q, as the unsigned code q + 128.
fn q8_0(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &byte) in b[2..34].iter().enumerate() {
        q[j] = (byte as i8 as i16 + 128) as u8;
    }
    (s[0], m[0]) = (d, -128.0 * d);
}

/// 16 groups of 16: `d · sc · q - dmin · mn`.
fn q2_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, q) in q.iter_mut().enumerate() {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        *q = (qs[half * 32 + l] >> (2 * shift)) & 3;
    }
    for (g, &sc) in scales.iter().enumerate() {
        s[g] = d * f32::from(sc & 0x0f);
        m[g] = -(dmin * f32::from(sc >> 4));
    }
}

/// 16 groups of 16: `dl · (q - 4)` with q's third bit set when the high-bit mask is.
fn q3_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    for g in 0..16 {
        let low = (packed[g % 8] >> (4 * (g / 8))) & 0x0f;
        let high = (packed[8 + g % 4] >> (2 * (g / 4))) & 3;
        let dl = d * (i32::from(low | (high << 4)) - 32) as f32;
        (s[g], m[g]) = (dl, -4.0 * dl);
    }
    for (e, q) in q.iter_mut().enumerate() {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        let low = (qs[half * 32 + l] >> (2 * shift)) & 3;
        let bit = (hmask[e % 32] >> (e / 32)) & 1;
        *q = low | (bit << 2);
    }
}

/// The 8 six-bit scales and minimums of a Q4_K/Q5_K super-block, packed in 12 bytes.
fn scales_mins_k4(b: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = b[j] & 0x3f;
        mn[j] = b[j + 4] & 0x3f;
        sc[j + 4] = (b[j + 8] & 0x0f) | ((b[j] >> 2) & 0x30);
        mn[j + 4] = (b[j + 8] >> 4) | ((b[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// The scales and biases of a Q4_K/Q5_K block: `d · sc · q - dmin · mn` per group of 32.
fn k4_groups(b: &[u8], s: &mut [f32], m: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = scales_mins_k4(&b[4..16]);
    for g in 0..8 {
        s[g] = d * f32::from(sc[g]);
        m[g] = -(dmin * f32::from(mn[g]));
    }
}

fn q4_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    k4_groups(b, s, m);
    let qs = &b[16..144];
    for (e, q) in q.iter_mut().enumerate() {
        let (g, l) = (e / 32, e % 32);
        *q = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0f;
    }
}

fn q5_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    k4_groups(b, s, m);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for (e, q) in q.iter_mut().enumerate() {
        let (g, l) = (e / 32, e % 32);
        let low = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0f;
        *q = low | (((qh[l] >> g) & 1) << 4);
    }
}

/// 16 groups of 16: `d · sc · (q - 32)` for a signed byte sc.
fn q6_k(b: &[u8], q: &mut [u8], s: &mut [f32], m: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (e, q) in q.iter_mut().enumerate() {
        let (half, within) = (e / 128, e % 128);
        let low = (ql[half * 64 + within % 64] >> (4 * (within / 64))) & 0x0f;
        let high = (qh[half * 32 + within % 32] >> (2 * (within / 32))) & 3;
        *q = low | (high << 4);
    }
    for (g, &sc) in scales.iter().enumerate() {
        let dl = d * f32::from(sc as i8);
        (s[g], m[g]) = (dl, -32.0 * dl);
    }
}
