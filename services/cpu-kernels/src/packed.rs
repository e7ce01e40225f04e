//! `x · Wᵀ` for a few rows of `x` against a weight matrix kept as 8-bit codes with an affine
//! scale and bias per group: `w = scale · q + bias`. This is how GGUF's Q8_0/Q4_0/Q4_1 and
//! mlx-community's affine 2-8 bit weights are defined, so the products are those of the file's
//! own weights (each element dequantised by one fused multiply-add in f32, then the same f32
//! products and sums as the dense kernel), not of re-quantised ones; `x` stays f32.
//!
//! Why: on a CPU a decode step or a short chunk reads every weight once per product, so its
//! time is the bytes of the weights. Expanded to f32 those are 4 bytes per weight; as codes 1
//! (plus 8 bytes of scale and bias per group of 32-128). The codes are widened to f32 in
//! registers, a few instructions that the memory traffic they save pays for. MLX's CPU
//! `quantized_matmul` computes the same thing without vectorising the weights' expansion, and
//! no BLAS we link has such a product.

use rayon::prelude::*;

/// A `[n, k]` weight matrix as one code byte per weight and, per group of `group` consecutive
/// weights of a row, an f32 scale and bias.
#[derive(Clone)]
pub struct PackedMatrix {
    codes: Vec<u8>,
    scales: Vec<f32>,
    biases: Vec<f32>,
    n: usize,
    k: usize,
    group: usize,
}

/// Weight rows per parallel task, as in the dense kernel (a quarter of its bytes).
const COLS_PER_TASK: usize = 32;

impl PackedMatrix {
    /// The codes of MLX's affine packing (`bits` per value, low bits first in each u32 word of a
    /// `[n, k · bits / 32]` array) with `[n, k / group]` scales and biases. The group must be a
    /// multiple of 16 (the vector width): 32, 64 and 128 are what MLX and GGUF use.
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
        // Values may straddle two words at 3, 5 and 6 bits: read them as one bit stream.
        let mask = (1u64 << bits) - 1;
        let mut codes = Vec::with_capacity(n * k);
        let row_words = k * bits / 32;
        for row in words.chunks_exact(row_words) {
            let mut buffer = 0u64;
            let mut held = 0usize;
            let mut next = row.iter();
            for _ in 0..k {
                if held < bits {
                    let word = next.next().copied().unwrap_or(0);
                    buffer |= u64::from(word) << held;
                    held += 32;
                }
                codes.push((buffer & mask) as u8);
                buffer >>= bits;
                held -= bits;
            }
        }
        Ok(Self {
            codes,
            scales: scales.to_vec(),
            biases: biases.to_vec(),
            n,
            k,
            group,
        })
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn k(&self) -> usize {
        self.k
    }

    /// Bytes held (codes, scales and biases).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * (self.scales.len() + self.biases.len())
    }

    /// Weight rows `start..start + len` as a matrix of their own (a fused projection's parts).
    pub fn rows(&self, start: usize, len: usize) -> Option<Self> {
        if start + len > self.n {
            return None;
        }
        let groups = self.k / self.group;
        Some(Self {
            codes: self.codes[start * self.k..(start + len) * self.k].to_vec(),
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
        self.codes
            .iter()
            .enumerate()
            .map(|(i, &q)| {
                let g = (i / self.k) * groups + (i % self.k) / self.group;
                f32::from(q).mul_add(self.scales[g], self.biases[g])
            })
            .collect()
    }

    /// `x · Wᵀ` for `x` of `[rows, k]`, row-major; returns `[rows, n]`.
    pub fn x_wt(&self, x: &[f32], rows: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), rows * self.k);
        let (k, groups) = (self.k, self.k / self.group);
        let mut by_col = vec![0f32; self.n * rows];
        by_col
            .par_chunks_mut(COLS_PER_TASK * rows)
            .enumerate()
            .for_each(|(task, out)| {
                let j0 = task * COLS_PER_TASK;
                let cols = out.len() / rows;
                let part = Part {
                    codes: &self.codes[j0 * k..(j0 + cols) * k],
                    scales: &self.scales[j0 * groups..(j0 + cols) * groups],
                    biases: &self.biases[j0 * groups..(j0 + cols) * groups],
                    k,
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

/// The weight rows of one task.
struct Part<'a> {
    codes: &'a [u8],
    scales: &'a [f32],
    biases: &'a [f32],
    k: usize,
    group: usize,
}

/// `out[j * rows + r] = x[r] · w[j]` for the weight rows of `part`.
fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            unsafe { avx512::columns(x, rows, part, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { avx2::columns(x, rows, part, out) };
            return;
        }
    }
    let (k, groups) = (part.k, part.k / part.group);
    for (j, codes) in part.codes.chunks_exact(k).enumerate() {
        for r in 0..rows {
            let xr = &x[r * k..(r + 1) * k];
            let mut sum = 0f32;
            for (t, (&q, &xv)) in codes.iter().zip(xr).enumerate() {
                let g = j * groups + t / part.group;
                let w = f32::from(q).mul_add(part.scales[g], part.biases[g]);
                sum = xv.mul_add(w, sum);
            }
            out[j * rows + r] = sum;
        }
    }
}

/// One module per instruction set, as in `matmul`: tiles of up to 4 rows of `x` by 2 weight
/// rows; each chunk of codes is widened and dequantised once in registers and then serves the
/// tile's rows. `$codes` loads `$lanes` code bytes as f32.
#[cfg(target_arch = "x86_64")]
macro_rules! packed_kernel {
    ($module:ident, $feature:literal, $vector:ty, $lanes:expr, $zero:ident, $load:ident,
     $set1:ident, $fma:ident, $codes:expr, $sum:expr) => {
        mod $module {
            use super::Part;
            use std::arch::x86_64::*;

            const LANES: usize = $lanes;

            #[target_feature(enable = $feature)]
            pub unsafe fn columns(x: &[f32], rows: usize, part: &Part<'_>, out: &mut [f32]) {
                let cols = part.codes.len() / part.k;
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
                                (4, 2) => tile::<4, 2>(x, r, part, j, rows, out),
                                (4, _) => tile::<4, 1>(x, r, part, j, rows, out),
                                (3, 2) => tile::<3, 2>(x, r, part, j, rows, out),
                                (3, _) => tile::<3, 1>(x, r, part, j, rows, out),
                                (2, 2) => tile::<2, 2>(x, r, part, j, rows, out),
                                (2, _) => tile::<2, 1>(x, r, part, j, rows, out),
                                (_, 2) => tile::<1, 2>(x, r, part, j, rows, out),
                                _ => tile::<1, 1>(x, r, part, j, rows, out),
                            }
                        }
                        r += t;
                    }
                    j += c;
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            unsafe fn tile<const R: usize, const C: usize>(
                x: &[f32],
                r0: usize,
                part: &Part<'_>,
                j0: usize,
                rows: usize,
                out: &mut [f32],
            ) {
                let (k, group) = (part.k, part.group);
                let groups = k / group;
                assert!((r0 + R) * k <= x.len() && (j0 + C) * k <= part.codes.len());
                assert!((j0 + C) * groups <= part.scales.len().min(part.biases.len()));
                assert!((j0 + C - 1) * rows + r0 + R <= out.len());
                assert!(group.is_multiple_of(LANES));
                let (xp, cp) = (x.as_ptr(), part.codes.as_ptr());
                let mut acc: [[$vector; C]; R] = [[$zero(); C]; R];
                for g in 0..groups {
                    let mut scale: [$vector; C] = [$zero(); C];
                    let mut bias: [$vector; C] = [$zero(); C];
                    for c in 0..C {
                        scale[c] = $set1(part.scales[(j0 + c) * groups + g]);
                        bias[c] = $set1(part.biases[(j0 + c) * groups + g]);
                    }
                    let mut at = g * group;
                    let end = at + group;
                    while at < end {
                        // SAFETY: at + LANES <= k inside each row (asserted above).
                        unsafe {
                            let mut w: [$vector; C] = [$zero(); C];
                            for c in 0..C {
                                let q = $codes(cp.add((j0 + c) * k + at));
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
    "avx2,fma",
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 8 readable bytes (`_mm_loadl_epi64` reads 8).
    |p: *const u8| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))),
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
    "avx512f",
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    // Called inside `tile`'s unsafe block, on 16 readable bytes.
    |p: *const u8| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i))),
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
        let scales: Vec<f32> = values(groups, 4).iter().map(|v| v * 0.1).collect();
        let biases: Vec<f32> = values(groups, 5).iter().map(|v| v * 0.3).collect();
        let m =
            PackedMatrix::from_mlx_words(&pack(&codes, bits), bits, &scales, &biases, n, k, group)
                .unwrap();
        (m, codes)
    }

    #[test]
    fn mlx_words_unpack_to_their_codes_at_every_width() {
        for bits in [2, 3, 4, 5, 6, 8] {
            let (m, codes) = matrix(3, 64, bits, 32);
            assert_eq!(m.codes, codes, "{bits} bits");
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
    fn shapes_that_do_not_add_up_are_refused() {
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 8, &[0.0; 1], &[0.0; 1], 1, 32, 24).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 7], 8, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
        assert!(PackedMatrix::from_mlx_words(&[0; 8], 7, &[0.0; 1], &[0.0; 1], 1, 32, 32).is_err());
    }
}
