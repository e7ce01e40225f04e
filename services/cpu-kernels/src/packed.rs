//! `x · Wᵀ` for a few rows of `x` against a weight matrix kept as 8-bit codes with an affine
//! scale and bias per group: `w = scale · q + bias`. This is how GGUF's Q8_0/Q4_0/Q4_1 and
//! mlx-community's affine 2-8 bit weights are defined, so the products are those of the file's
//! own weights (each element dequantised by one fused multiply-add in f32, then the same f32
//! products and sums as the dense kernel), not of re-quantised ones; `x` stays f32.
//!
//! Why: on a CPU a decode step or a short chunk reads every weight once per product, so its
//! time is the bytes of the weights. Expanded to f32 those are 4 bytes per weight; as codes a
//! byte, or half of one for codes of up to 4 bits (two to a byte), plus a half-precision scale
//! and bias per group of 16-128 (the files' own scales are f16; a matrix whose scales or biases
//! f16 cannot hold exactly gets no codes). The codes are widened to f32 in registers, a few
//! instructions that the memory traffic they save pays for. MLX's CPU
//! `quantized_matmul` computes the same thing without vectorising the weights' expansion, and
//! no BLAS we link has such a product.

use rayon::prelude::*;

/// A `[n, k]` weight matrix as codes and, per group of `group` consecutive weights of a row, a
/// scale and a bias as f16 bits. Codes of up to 4 bits in groups of a multiple of 32 go two to
/// a byte: in each run of 32 codes, byte `i` holds code `i` in its low nibble and code `i + 16`
/// in its high one, so that one load yields two vectors of consecutive weights with a mask and
/// a shift (llama.cpp lays out its Q4_0 blocks the same way). Other codes take a byte each.
#[derive(Clone)]
pub struct PackedMatrix {
    codes: Vec<u8>,
    nibbles: bool,
    scales: Vec<u16>,
    biases: Vec<u16>,
    n: usize,
    k: usize,
    group: usize,
}

/// Weight rows per parallel task, as in the dense kernel.
const COLS_PER_TASK: usize = 32;

/// f16 bits of `v`, when f16 holds it exactly.
fn exact_f16(v: f32) -> Option<u16> {
    let h = half::f16::from_f32(v);
    (h.to_f32() == v || v.is_nan() && h.is_nan()).then(|| h.to_bits())
}

impl PackedMatrix {
    /// The codes of MLX's affine packing (`bits` per value, a little-endian bit stream of u32
    /// words, `[n, k · bits / 32]`) with `[n, k / group]` scales and biases. The group must be
    /// a multiple of 16 (the vector width): 32, 64 and 128 are what MLX and GGUF use.
    pub fn from_mlx_words(
        words: &[u32],
        bits: usize,
        scales: &[f32],
        biases: &[f32],
        n: usize,
        k: usize,
        group: usize,
    ) -> Result<Self, String> {
        if !matches!(bits, 2..=6 | 8) {
            return Err(format!("{bits}-bit codes are not supported"));
        }
        if group == 0 || !group.is_multiple_of(16) || !k.is_multiple_of(group) {
            return Err(format!(
                "a group of {group} does not divide {k} in steps of 16"
            ));
        }
        let groups = k / group;
        if words.len() * 32 != n * k * bits
            || scales.len() != n * groups
            || biases.len() != n * groups
        {
            return Err(format!(
                "{} words, {} scales and {} biases do not hold a {n} x {k} matrix of {bits} bits \
                 in groups of {group}",
                words.len(),
                scales.len(),
                biases.len()
            ));
        }
        let half_bits = |values: &[f32], what: &str| -> Result<Vec<u16>, String> {
            values
                .iter()
                .map(|&v| exact_f16(v).ok_or_else(|| format!("{what} {v} is not exact in f16")))
                .collect()
        };
        let (scales, biases) = (half_bits(scales, "scale")?, half_bits(biases, "bias")?);
        // Values may straddle two words at 3, 5 and 6 bits: read them as one bit stream.
        let mask = (1u64 << bits) - 1;
        let nibbles = bits <= 4 && group.is_multiple_of(32);
        let mut codes = Vec::with_capacity(if nibbles { n * k / 2 } else { n * k });
        let mut row_codes = Vec::with_capacity(k);
        let row_words = k * bits / 32;
        for row in words.chunks_exact(row_words) {
            let mut buffer = 0u64;
            let mut held = 0usize;
            let mut next = row.iter();
            row_codes.clear();
            for _ in 0..k {
                if held < bits {
                    let word = next.next().copied().unwrap_or(0);
                    buffer |= u64::from(word) << held;
                    held += 32;
                }
                row_codes.push((buffer & mask) as u8);
                buffer >>= bits;
                held -= bits;
            }
            if nibbles {
                for run in row_codes.chunks_exact(32) {
                    let (low, high) = run.split_at(16);
                    codes.extend(low.iter().zip(high).map(|(l, h)| l | h << 4));
                }
            } else {
                codes.extend_from_slice(&row_codes);
            }
        }
        Ok(Self {
            codes,
            nibbles,
            scales,
            biases,
            n,
            k,
            group,
        })
    }

    /// Bytes of codes per row.
    fn row_bytes(&self) -> usize {
        if self.nibbles { self.k / 2 } else { self.k }
    }

    /// Code `t` of row `j`.
    fn code(&self, j: usize, t: usize) -> u8 {
        code_in(
            &self.codes[j * self.row_bytes()..(j + 1) * self.row_bytes()],
            self.nibbles,
            t,
        )
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes held (codes, scales and biases).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 2 * (self.scales.len() + self.biases.len())
    }

    /// Weight rows `start..start + len` as a matrix of their own (a fused projection's parts).
    pub fn rows(&self, start: usize, len: usize) -> Option<Self> {
        if start + len > self.n {
            return None;
        }
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        Some(Self {
            codes: self.codes[start * bytes..(start + len) * bytes].to_vec(),
            nibbles: self.nibbles,
            scales: self.scales[start * groups..(start + len) * groups].to_vec(),
            biases: self.biases[start * groups..(start + len) * groups].to_vec(),
            n: len,
            k: self.k,
            group: self.group,
        })
    }

    /// The matrix in f32, each weight as the kernel computes it.
    pub fn dequantize(&self) -> Vec<f32> {
        let groups = self.k / self.group;
        let mut out = Vec::with_capacity(self.n * self.k);
        for j in 0..self.n {
            for t in 0..self.k {
                let g = j * groups + t / self.group;
                out.push(f32::from(self.code(j, t)).mul_add(
                    half::f16::from_bits(self.scales[g]).to_f32(),
                    half::f16::from_bits(self.biases[g]).to_f32(),
                ));
            }
        }
        out
    }

    /// `x · Wᵀ` for `x` of `[rows, k]`, row-major; returns `[rows, n]`.
    pub fn x_wt(&self, x: &[f32], rows: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), rows * self.k);
        let (bytes, groups) = (self.row_bytes(), self.k / self.group);
        let mut by_col = vec![0f32; self.n * rows];
        by_col
            .par_chunks_mut(COLS_PER_TASK * rows)
            .enumerate()
            .for_each(|(task, out)| {
                let j0 = task * COLS_PER_TASK;
                let cols = out.len() / rows;
                let part = Part {
                    codes: &self.codes[j0 * bytes..(j0 + cols) * bytes],
                    nibbles: self.nibbles,
                    scales: &self.scales[j0 * groups..(j0 + cols) * groups],
                    biases: &self.biases[j0 * groups..(j0 + cols) * groups],
                    k: self.k,
                    group: self.group,
                };
                columns(x, rows, &part, out);
            });
        let mut out = vec![0f32; rows * self.n];
        for (j, col) in by_col.chunks_exact(rows).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                out[r * self.n + j] = v;
            }
        }
        out
    }
}

/// Code `t` of a row of codes laid out as `PackedMatrix` says.
fn code_in(row: &[u8], nibbles: bool, t: usize) -> u8 {
    if nibbles {
        let (run, i) = (t / 32, t % 32);
        row[run * 16 + i % 16] >> (4 * (i / 16)) & 15
    } else {
        row[t]
    }
}

/// The weight rows of one task.
struct Part<'a> {
    codes: &'a [u8],
    nibbles: bool,
    scales: &'a [u16],
    biases: &'a [u16],
    k: usize,
    group: usize,
}

impl Part<'_> {
    fn row_bytes(&self) -> usize {
        if self.nibbles { self.k / 2 } else { self.k }
    }
}

/// `out[j * rows + r] = x[r] · w[j]` for the weight rows of `part`.
fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f16c = std::arch::is_x86_feature_detected!("f16c");
        if f16c && std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F and F16C (checked above).
            unsafe { avx512::columns(x, rows, part, out) };
            return;
        }
        if f16c
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above).
            unsafe { avx2::columns(x, rows, part, out) };
            return;
        }
    }
    columns_scalar(x, rows, part, out);
}

fn columns_scalar(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    let (k, groups, bytes) = (part.k, part.k / part.group, part.row_bytes());
    for j in 0..part.codes.len() / bytes {
        let row = &part.codes[j * bytes..(j + 1) * bytes];
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            let mut sum = 0f32;
            for (t, &xv) in xr.iter().enumerate() {
                let q = code_in(row, part.nibbles, t);
                let g = j * groups + t / part.group;
                let w = f32::from(q).mul_add(
                    half::f16::from_bits(part.scales[g]).to_f32(),
                    half::f16::from_bits(part.biases[g]).to_f32(),
                );
                sum = xv.mul_add(w, sum);
            }
            out[j * rows + r] = sum;
        }
    }
}

/// One module per instruction set, as in `matmul`: tiles of up to 4 rows of `x` by 2 weight
/// rows; each chunk of codes is widened and dequantised once in registers and then serves the
/// tile's rows. `$bytes` and `$nibbles` load `$lanes` codes as f32 from bytes or nibbles.
#[cfg(target_arch = "x86_64")]
macro_rules! packed_kernel {
    ($module:ident, $feature:literal, $vector:ty, $lanes:expr, $zero:ident, $load:ident,
     $half_set1:expr, $fma:ident, $bytes:expr, $nibbles:expr, $sum:expr) => {
        mod $module {
            use super::Part;
            use std::arch::x86_64::*;

            const LANES: usize = $lanes;

            #[target_feature(enable = $feature)]
            pub unsafe fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
                if part.nibbles {
                    // SAFETY: the caller's features.
                    unsafe { columns_of::<true>(x, rows, part, out) }
                } else {
                    // SAFETY: as above.
                    unsafe { columns_of::<false>(x, rows, part, out) }
                }
            }

            #[target_feature(enable = $feature)]
            unsafe fn columns_of<const NIB: bool>(
                x: &[f32],
                rows: usize,
                part: &Part<'_>,
                out: &mut [f32],
            ) {
                let cols = part.codes.len() / part.row_bytes();
                let mut j = 0;
                while j < cols {
                    let c = (cols - j).min(2);
                    let mut r = 0;
                    while r < rows {
                        let t = (rows - r).min(4);
                        // SAFETY (of each call): `tile` asserts that its rows, columns and
                        // outputs exist.
                        unsafe {
                            match (t, c) {
                                (4, 2) => tile::<4, 2, NIB>(x, r, part, j, rows, out),
                                (4, _) => tile::<4, 1, NIB>(x, r, part, j, rows, out),
                                (3, 2) => tile::<3, 2, NIB>(x, r, part, j, rows, out),
                                (3, _) => tile::<3, 1, NIB>(x, r, part, j, rows, out),
                                (2, 2) => tile::<2, 2, NIB>(x, r, part, j, rows, out),
                                (2, _) => tile::<2, 1, NIB>(x, r, part, j, rows, out),
                                (_, 2) => tile::<1, 2, NIB>(x, r, part, j, rows, out),
                                _ => tile::<1, 1, NIB>(x, r, part, j, rows, out),
                            }
                        }
                        r += t;
                    }
                    j += c;
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn tile<const R: usize, const C: usize, const NIB: bool>(
                x: &[f32],
                r0: usize,
                part: &Part<'_>,
                j0: usize,
                rows: usize,
                out: &mut [f32],
            ) {
                let (k, group, bytes) = (part.k, part.group, part.row_bytes());
                let groups = k / group;
                assert!((r0 + R) * k <= x.len() && (j0 + C) * bytes <= part.codes.len());
                assert!((j0 + C) * groups <= part.scales.len().min(part.biases.len()));
                assert!((j0 + C - 1) * rows + r0 + R <= out.len());
                assert!(group.is_multiple_of(LANES) && k.is_multiple_of(group));
                let (xp, cp) = (x.as_ptr(), part.codes.as_ptr());
                let mut acc: [[$vector; C]; R] = [[$zero(); C]; R];
                for g in 0..groups {
                    let mut scale: [$vector; C] = [$zero(); C];
                    let mut bias: [$vector; C] = [$zero(); C];
                    for c in 0..C {
                        let at = (j0 + c) * groups + g;
                        scale[c] = $half_set1(part.scales[at]);
                        bias[c] = $half_set1(part.biases[at]);
                    }
                    let mut at = g * group;
                    let end = at + group;
                    while NIB && at < end {
                        // A run of 32 codes in 16 bytes: each load of LANES bytes gives the
                        // weights at `at + u` (low nibbles) and `at + 16 + u` (high ones).
                        for u in (0..16).step_by(LANES) {
                            // SAFETY: the run lies inside each row (k is a multiple of the
                            // group, itself of 32), and its bytes at at / 2 + u.. inside the
                            // row's k / 2.
                            unsafe {
                                let mut low: [$vector; C] = [$zero(); C];
                                let mut high: [$vector; C] = [$zero(); C];
                                for c in 0..C {
                                    let (l, h) = $nibbles(cp.add((j0 + c) * bytes + at / 2 + u));
                                    low[c] = $fma(l, scale[c], bias[c]);
                                    high[c] = $fma(h, scale[c], bias[c]);
                                }
                                for (i, row) in acc.iter_mut().enumerate() {
                                    let xl = $load(xp.add((r0 + i) * k + at + u));
                                    let xh = $load(xp.add((r0 + i) * k + at + 16 + u));
                                    for c in 0..C {
                                        row[c] = $fma(xl, low[c], row[c]);
                                        row[c] = $fma(xh, high[c], row[c]);
                                    }
                                }
                            }
                        }
                        at += 32;
                    }
                    while !NIB && at < end {
                        // SAFETY: at + LANES <= k inside each row (asserted above).
                        unsafe {
                            let mut w: [$vector; C] = [$zero(); C];
                            for c in 0..C {
                                let q = $bytes(cp.add((j0 + c) * bytes + at));
                                w[c] = $fma(q, scale[c], bias[c]);
                            }
                            for (i, row) in acc.iter_mut().enumerate() {
                                let xv = $load(xp.add((r0 + i) * k + at));
                                for (a, wc) in row.iter_mut().zip(&w) {
                                    *a = $fma(xv, *wc, *a);
                                }
                            }
                        }
                        at += LANES;
                    }
                }
                for (i, row) in acc.iter().enumerate() {
                    for (c, a) in row.iter().enumerate() {
                        out[(j0 + c) * rows + r0 + i] = $sum(*a);
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
packed_kernel!(
    avx2,
    "avx2,fma,f16c",
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    // f16 bits broadcast and widened to f32 (F16C).
    |h: u16| _mm256_cvtph_ps(_mm_set1_epi16(h as i16)),
    _mm256_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 8 readable bytes (`_mm_loadl_epi64` reads 8).
    |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))),
    // 8 bytes widened to 8 lanes: their low nibbles, then their high ones.
    |p: *const u8| {
        let lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        (
            _mm256_cvtepi32_ps(_mm256_and_si256(lanes, _mm256_set1_epi32(15))),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(lanes, 4)),
        )
    },
    |v: __m256| {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        lanes.iter().sum::<f32>()
    }
);

#[cfg(target_arch = "x86_64")]
packed_kernel!(
    avx512,
    "avx512f,f16c",
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    // f16 bits broadcast and widened to f32.
    |h: u16| _mm512_cvtph_ps(_mm256_set1_epi16(h as i16)),
    _mm512_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 16 readable bytes.
    |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))),
    // 16 bytes widened to 16 lanes: their low nibbles, then their high ones.
    |p: *const u8| {
        let lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i));
        (
            _mm512_cvtepi32_ps(_mm512_and_si512(lanes, _mm512_set1_epi32(15))),
            _mm512_cvtepi32_ps(_mm512_srli_epi32(lanes, 4)),
        )
    },
    |v: __m512| _mm512_reduce_add_ps(v)
);

#[cfg(test)]
mod tests {
    use super::*;

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    /// MLX's packing of `codes` (`bits` each, low bits first, values straddling words).
    fn pack(codes: &[u8], bits: usize) -> Vec<u32> {
        let mut words = vec![0u32; codes.len() * bits / 32];
        for (i, &q) in codes.iter().enumerate() {
            for b in 0..bits {
                if q >> b & 1 == 1 {
                    let bit = i * bits + b;
                    words[bit / 32] |= 1 << (bit % 32);
                }
            }
        }
        words
    }

    fn matrix(n: usize, k: usize, bits: usize, group: usize) -> (PackedMatrix, Vec<u8>) {
        let codes: Vec<u8> = values(n * k, 3)
            .iter()
            .map(|v| ((v + 0.5) * (1 << bits) as f32) as u8 & ((1 << bits) - 1) as u8)
            .collect();
        let groups = n * k / group;
        // Scales and biases as the files have them: f16 values.
        let f16 = |v: f32| half::f16::from_f32(v).to_f32();
        let scales: Vec<f32> = values(groups, 4).iter().map(|v| f16(v * 0.1)).collect();
        let biases: Vec<f32> = values(groups, 5).iter().map(|v| f16(v * 0.3)).collect();
        let m =
            PackedMatrix::from_mlx_words(&pack(&codes, bits), bits, &scales, &biases, n, k, group)
                .unwrap();
        (m, codes)
    }

    #[test]
    fn mlx_words_unpack_to_their_codes_at_every_width() {
        for bits in [2, 3, 4, 5, 6, 8] {
            let (m, codes) = matrix(3, 64, bits, 32);
            let held: Vec<u8> = (0..3 * 64).map(|i| m.code(i / 64, i % 64)).collect();
            assert_eq!(held, codes, "{bits} bits");
            assert_eq!(m.codes.len(), if bits <= 4 { 96 } else { 192 });
            // Groups of 16 keep 4-bit codes a byte each.
            let (m, codes) = matrix(2, 64, bits, 16);
            let held: Vec<u8> = (0..2 * 64).map(|i| m.code(i / 64, i % 64)).collect();
            assert_eq!(
                (held, m.codes.len()),
                (codes, 128),
                "{bits} bits, groups of 16"
            );
        }
    }

    #[test]
    fn matches_a_double_precision_product_of_the_dequantised_weights() {
        for &(rows, n, k, bits, group) in &[
            (1, 1, 32, 8, 32),
            (3, 5, 64, 4, 32),
            (4, 64, 576, 8, 64),
            (7, 33, 128, 4, 128),
            (16, 70, 1536, 8, 32),
            (13, 97, 96, 6, 32),
            (5, 9, 64, 4, 16),
            (2, 9, 96, 3, 32),
        ] {
            let (m, _) = matrix(n, k, bits, group);
            let w = m.dequantize();
            let x = values(rows * k, 1);
            let got = m.x_wt(&x, rows);
            for r in 0..rows {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                        .sum();
                    let g = got[r * n + j];
                    // Weights reach |0.05 · 255 + 0.15|: rounding grows like sqrt(k) times that.
                    assert!(
                        (g as f64 - want).abs() <= 1e-5 * (k as f64).sqrt() * 14.0,
                        "{rows}x{n}x{k} {bits} bits: {g} vs {want}"
                    );
                }
            }
        }
    }

    /// Every code path this CPU can run computes the same products as the scalar one.
    #[test]
    fn the_vector_paths_equal_the_scalar_one() {
        for bits in [4, 8] {
            let (m, _) = matrix(5, 128, bits, 32);
            let rows = 6;
            let x = values(rows * 128, 7);
            let part = Part {
                codes: &m.codes,
                nibbles: m.nibbles,
                scales: &m.scales,
                biases: &m.biases,
                k: m.k,
                group: m.group,
            };
            let mut want = vec![0f32; m.n * rows];
            columns_scalar(&x, rows, &part, &mut want);
            let close = |got: &[f32], path: &str| {
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                        "{path}, {bits} bits"
                    );
                }
            };
            #[cfg(target_arch = "x86_64")]
            {
                let f16c = std::arch::is_x86_feature_detected!("f16c");
                if f16c && std::arch::is_x86_feature_detected!("avx512f") {
                    let mut got = vec![0f32; m.n * rows];
                    // SAFETY: checked above.
                    unsafe { avx512::columns(&x, rows, &part, &mut got) };
                    close(&got, "avx512");
                }
                if f16c
                    && std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    let mut got = vec![0f32; m.n * rows];
                    // SAFETY: checked above.
                    unsafe { avx2::columns(&x, rows, &part, &mut got) };
                    close(&got, "avx2");
                }
            }
        }
    }

    #[test]
    fn rows_cut_a_fused_matrix_into_parts_that_compute_alike() {
        let (m, _) = matrix(12, 64, 4, 32);
        let x = values(64, 9);
        let whole = m.x_wt(&x, 1);
        let (a, b) = (m.rows(0, 5).unwrap(), m.rows(5, 7).unwrap());
        let mut parts = a.x_wt(&x, 1);
        parts.extend(b.x_wt(&x, 1));
        assert_eq!(parts, whole);
        assert!(m.rows(6, 7).is_none());
    }

    #[test]
    fn scales_that_f16_cannot_hold_exactly_are_refused() {
        let words = [0u32; 8];
        assert!(PackedMatrix::from_mlx_words(&words, 8, &[0.1], &[0.0], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&words, 8, &[0.125], &[1e-9], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&words, 8, &[0.125], &[-2.5], 1, 32, 32).is_ok());
    }

    #[test]
    fn shapes_that_do_not_add_up_are_refused() {
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 8, &[0.0; 1], &[0.0; 1], 1, 32, 24).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 7], 8, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 7, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
    }
}
