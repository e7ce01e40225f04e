//! ggml's block quantisations expanded to f32, block by block. Written by hand because the only
//! Rust implementations live inside whole inference frameworks (candle, llama.cpp bindings),
//! and MLX reads only F32/F16/BF16/Q4_0/Q4_1/Q8_0 from GGUF. The layouts are ggml's block
//! structs (`ggml-common.h`), little-endian; each function is checked against the PyPI `gguf`
//! package's numpy dequantisers block by block (tests/dequant.rs), with the same order of f32
//! operations so that the results agree bit for bit.

use half::f16;
use rayon::prelude::*;

use crate::gguf::GgmlType;

/// Values in a K-quant super-block.
const QK_K: usize = 256;

/// IQ4_NL's and IQ4_XS's non-linear 4-bit code book.
const IQ4_VALUES: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// Blocks handed to one worker thread at a time: large enough that scheduling costs nothing
/// next to the arithmetic.
const BLOCKS_PER_TASK: usize = 256;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Expands `data` (whole blocks of `ty`) into `out`, which holds exactly the values they
/// encode. Returns false when the sizes do not agree.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> bool {
    let (block, bytes) = (ty.block_values(), ty.block_bytes());
    if !data.len().is_multiple_of(bytes) || data.len() / bytes * block != out.len() {
        return false;
    }
    let one = block_fn(ty);
    data.par_chunks(bytes * BLOCKS_PER_TASK)
        .zip(out.par_chunks_mut(block * BLOCKS_PER_TASK))
        .for_each(|(src, dst)| {
            for (b, y) in src.chunks_exact(bytes).zip(dst.chunks_exact_mut(block)) {
                one(b, y);
            }
        });
    true
}

type BlockFn = fn(&[u8], &mut [f32]);

fn block_fn(ty: GgmlType) -> BlockFn {
    match ty {
        GgmlType::F32 => f32_block,
        GgmlType::F16 => f16_block,
        GgmlType::BF16 => bf16_block,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q5_0 => q5_0,
        GgmlType::Q5_1 => q5_1,
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q2K => q2_k,
        GgmlType::Q3K => q3_k,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        GgmlType::IQ4NL => iq4_nl,
        GgmlType::IQ4XS => iq4_xs,
    }
}

fn f32_block(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
}

fn f16_block(b: &[u8], y: &mut [f32]) {
    y[0] = f16_at(b, 0);
}

fn bf16_block(b: &[u8], y: &mut [f32]) {
    y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
}

/// 32 values: scale d (f16), then 16 bytes whose low nibbles are values 0-15 and high nibbles
/// values 16-31, offset by 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * (i32::from(q & 0x0f) - 8) as f32;
        y[j + 16] = d * (i32::from(q >> 4) - 8) as f32;
    }
}

/// As Q4_0 with a minimum m (f16) instead of the offset: d * q + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = d * f32::from(q & 0x0f) + m;
        y[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// Fifth bits of a Q5 block: bit j of the little-endian u32 is value j's.
fn high_bits(b: &[u8]) -> u32 {
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// 32 values: d (f16), the 32 fifth bits, then nibbles as Q4_0; offset by 16.
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = high_bits(&b[2..6]);
    for (j, &q) in b[6..22].iter().enumerate() {
        let lo = i32::from(q & 0x0f) | ((((qh >> j) & 1) as i32) << 4);
        let hi = i32::from(q >> 4) | ((((qh >> (j + 16)) & 1) as i32) << 4);
        y[j] = d * (lo - 16) as f32;
        y[j + 16] = d * (hi - 16) as f32;
    }
}

/// As Q5_0 with a minimum: d * q + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = high_bits(&b[4..8]);
    for (j, &q) in b[8..24].iter().enumerate() {
        let lo = u32::from(q & 0x0f) | (((qh >> j) & 1) << 4);
        let hi = u32::from(q >> 4) | (((qh >> (j + 16)) & 1) << 4);
        y[j] = d * lo as f32 + m;
        y[j + 16] = d * hi as f32 + m;
    }
}

/// 32 values: d (f16) and 32 signed bytes.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..34].iter().enumerate() {
        y[j] = f32::from(q as i8) * d;
    }
}

/// 256 values in 16 groups of 16: a byte per group (scale in the low nibble, minimum in the
/// high one), 2-bit values four to a byte, then d and dmin (f16). Byte l of each 32-byte half
/// holds values l, l+32, l+64, l+96 of that half, lowest bits first.
fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for e in 0..QK_K {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        let q = (qs[half * 32 + l] >> (2 * shift)) & 3;
        let sc = scales[e / 16];
        let dl = d * f32::from(sc & 0x0f);
        let ml = dmin * f32::from(sc >> 4);
        y[e] = dl * f32::from(q) - ml;
    }
}

/// 256 values in 16 groups: a high-bit mask (bit b of byte l is value 32b+l's third bit,
/// set meaning no offset of -4), 2-bit values as Q2_K, 16 signed 6-bit scales packed in 12
/// bytes (low nibbles in bytes 0-7, high pairs in bytes 8-11), then d (f16).
fn q3_k(b: &[u8], y: &mut [f32]) {
    let (hmask, qs, packed) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_at(b, 108);
    let mut dl = [0f32; 16];
    for (i, dl) in dl.iter_mut().enumerate() {
        let low = (packed[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        let sc = i32::from(low | (high << 4)) - 32;
        *dl = d * sc as f32;
    }
    for e in 0..QK_K {
        let (half, shift, l) = (e / 128, (e / 32) % 4, e % 32);
        let low = i32::from((qs[half * 32 + l] >> (2 * shift)) & 3);
        let bit = (hmask[e % 32] >> (e / 32)) & 1;
        let q = low - if bit == 0 { 4 } else { 0 };
        y[e] = dl[e / 16] * q as f32;
    }
}

/// The 8 six-bit scales and minimums of a Q4_K/Q5_K super-block, packed in 12 bytes.
fn scales_mins_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let (mut sc, mut mn) = ([0u8; 8], [0u8; 8]);
    for j in 0..4 {
        sc[j] = s[j] & 0x3f;
        mn[j] = s[j + 4] & 0x3f;
        sc[j + 4] = (s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
    (sc, mn)
}

/// 256 values in 8 groups of 32: d and dmin (f16), packed scales and minimums, then nibbles:
/// byte l of each 32-byte chunk holds value l of group 2c (low) and of group 2c+1 (high).
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = scales_mins_k4(&b[4..16]);
    let qs = &b[16..144];
    for g in 0..8 {
        let dl = d * f32::from(sc[g]);
        let ml = dmin * f32::from(mn[g]);
        for l in 0..32 {
            let q = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0f;
            y[g * 32 + l] = dl * f32::from(q) - ml;
        }
    }
}

/// Q4_K with a fifth bit per value: bit g of byte l of the high-bit array is value l of
/// group g's.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = scales_mins_k4(&b[4..16]);
    let (qh, qs) = (&b[16..48], &b[48..176]);
    for g in 0..8 {
        let dl = d * f32::from(sc[g]);
        let ml = dmin * f32::from(mn[g]);
        for l in 0..32 {
            let low = (qs[(g / 2) * 32 + l] >> (4 * (g % 2))) & 0x0f;
            let high = (qh[l] >> g) & 1;
            y[g * 32 + l] = dl * f32::from(low | (high << 4)) - ml;
        }
    }
}

/// 256 values in 16 groups of 16: low nibbles (per 128-value half, byte m holds value m low
/// and value m+64 high), high 2-bit pairs (byte l of a half holds values l, l+32, l+64, l+96),
/// 16 signed 8-bit scales, then d (f16); values offset by 32.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for e in 0..QK_K {
        let (half, within) = (e / 128, e % 128);
        let low = (ql[half * 64 + within % 64] >> (4 * (within / 64))) & 0x0f;
        let high = (qh[half * 32 + within % 32] >> (2 * (within / 32))) & 3;
        let q = i32::from(low | (high << 4)) - 32;
        let dl = d * f32::from(scales[e / 16] as i8);
        y[e] = dl * q as f32;
    }
}

/// Q4_0's layout with the nibbles indexing a non-linear code book.
fn iq4_nl(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * f32::from(IQ4_VALUES[usize::from(q & 0x0f)]);
        y[j + 16] = d * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
    }
}

/// 256 values in 8 groups of 32, IQ4_NL's code book with a signed 6-bit scale per group:
/// d (f16), the scales' high pairs (u16), their low nibbles (4 bytes), then 16 bytes per group
/// laid out as one IQ4_NL block.
fn iq4_xs(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let scales_h = u16::from_le_bytes([b[2], b[3]]);
    let (scales_l, qs) = (&b[4..8], &b[8..136]);
    for g in 0..8 {
        let low = (scales_l[g / 2] >> (4 * (g % 2))) & 0x0f;
        let high = ((scales_h >> (2 * g)) & 3) as u8;
        let dl = d * (i32::from(low | (high << 4)) - 32) as f32;
        for (m, &q) in qs[g * 16..g * 16 + 16].iter().enumerate() {
            y[g * 32 + m] = dl * f32::from(IQ4_VALUES[usize::from(q & 0x0f)]);
            y[g * 32 + m + 16] = dl * f32::from(IQ4_VALUES[usize::from(q >> 4)]);
        }
    }
}
