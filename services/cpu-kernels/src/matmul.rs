//! `x · Wᵀ` for a few rows of `x` on the CPU (decode steps of a batch, short prefill chunks).
//!
//! MLX calls OpenBLAS's GEMM for every product of more than one row, and OpenBLAS 0.3.21
//! packs the whole weight matrix into its panel layout on each call, split unevenly between
//! its threads: profiled on a warm hit (SmolLM2, 13 new tokens), its packing routine took more
//! samples than the arithmetic, and 12 rows cost twice one row although the weights are read
//! once either way. No packing is needed when the rows are few: each weight row is read once
//! from memory and multiplied against every row of `x`, which stays in L1/L2. That kernel is
//! written here because no BLAS we can link offers it (MKL's packed GEMM does, but is not in
//! the Debian/PyPI stack this project builds on).
//!
//! Measured beside MLX's product (`cargo bench -p strata-worker --bench few_rows`, 2 cores,
//! AVX-512): SmolLM2's 49152 x 576 head 9-11 ms -> 3-7 ms for one row and
//! 17 -> 11 ms for 12; its 1536 x 576 projections 0.2-0.4 -> 0.05-0.14 ms for 1-12 rows. At 16
//! rows both take the same time.

use rayon::prelude::*;

/// Above this many rows OpenBLAS's packed GEMM wins (its packing is amortised over the rows).
pub const MAX_ROWS: usize = 16;

/// Weight rows per parallel task: 32 rows of 576-1536 f32 are 72-196 KiB, enough work to pay
/// for the task and few enough that both cores get an even share of a 192-row matrix.
const COLS_PER_TASK: usize = 32;

/// `x` is `[rows, k]`, `w` is `[n, k]`, both row-major; returns `x · wᵀ` as `[rows, n]`.
pub fn x_wt(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
    debug_assert_eq!(x.len(), rows * k);
    debug_assert_eq!(w.len(), n * k);
    // Computed column-major (`[n, rows]`) so that each task writes one contiguous piece.
    let mut by_col = vec![0f32; n * rows];
    by_col
        .par_chunks_mut(COLS_PER_TASK * rows)
        .zip(w.par_chunks(COLS_PER_TASK * k))
        .for_each(|(out, w)| columns(x, rows, w, k, out));
    transpose_out(&by_col, rows, n)
}

fn transpose_out(by_col: &[f32], rows: usize, n: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * n];
    for (j, col) in by_col.chunks_exact(rows).enumerate() {
        for (r, &v) in col.iter().enumerate() {
            out[r * n + j] = v;
        }
    }
    out
}

/// `out[j * rows + r] = x[r] · w[j]` for the rows `w` (`[cols, k]`) of one task.
pub(crate) fn columns(x: &[f32], rows: usize, w: &[f32], k: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above).
            unsafe { avx512::columns(x, rows, w, k, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { avx2::columns(x, rows, w, k, out) };
            return;
        }
    }
    for (j, wj) in w.chunks_exact(k).enumerate() {
        for r in 0..rows {
            out[j * rows + r] = dot(&x[r * k..(r + 1) * k], wj);
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (x, y)| x.mul_add(*y, s))
}

/// One module per instruction set: the same tiling with that set's vector type. Tiles of up
/// to 4 rows of `x` by 2 weight rows keep 8 accumulators in registers, so that each load of a
/// weight chunk serves 4 rows and each load of an `x` chunk serves 2 columns.
#[cfg(target_arch = "x86_64")]
macro_rules! tiled_kernel {
    ($module:ident, $feature:literal, $vector:ty, $lanes:expr, $zero:ident, $load:ident,
     $fma:ident, $sum:expr) => {
        mod $module {
            use std::arch::x86_64::*;

            const LANES: usize = $lanes;

            #[target_feature(enable = $feature)]
            pub unsafe fn columns(x: &[f32], rows: usize, w: &[f32], k: usize, out: &mut [f32]) {
                let cols = w.len() / k;
                let mut j = 0;
                while j < cols {
                    let c = (cols - j).min(2);
                    let mut r = 0;
                    while r < rows {
                        let t = (rows - r).min(4);
                        // SAFETY (of each call): the tile's rows, columns and outputs exist
                        // (`tile` asserts it).
                        unsafe {
                            match (t, c) {
                                (4, 2) => tile::<4, 2>(x, r, w, j, k, rows, out),
                                (4, _) => tile::<4, 1>(x, r, w, j, k, rows, out),
                                (3, 2) => tile::<3, 2>(x, r, w, j, k, rows, out),
                                (3, _) => tile::<3, 1>(x, r, w, j, k, rows, out),
                                (2, 2) => tile::<2, 2>(x, r, w, j, k, rows, out),
                                (2, _) => tile::<2, 1>(x, r, w, j, k, rows, out),
                                (_, 2) => tile::<1, 2>(x, r, w, j, k, rows, out),
                                _ => tile::<1, 1>(x, r, w, j, k, rows, out),
                            }
                        }
                        r += t;
                    }
                    j += c;
                }
            }

            #[inline]
            #[target_feature(enable = $feature)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn tile<const R: usize, const C: usize>(
                x: &[f32],
                r0: usize,
                w: &[f32],
                j0: usize,
                k: usize,
                rows: usize,
                out: &mut [f32],
            ) {
                assert!((r0 + R) * k <= x.len() && (j0 + C) * k <= w.len());
                assert!((j0 + C - 1) * rows + r0 + R <= out.len());
                let (xp, wp) = (x.as_ptr(), w.as_ptr());
                let mut acc: [[$vector; C]; R] = [[$zero(); C]; R];
                let body = k / LANES * LANES;
                let mut at = 0;
                while at < body {
                    // SAFETY: at + LANES <= k, inside each row (asserted above).
                    unsafe {
                        let mut wv: [$vector; C] = [$zero(); C];
                        for (c, v) in wv.iter_mut().enumerate() {
                            *v = $load(wp.add((j0 + c) * k + at));
                        }
                        for (i, row) in acc.iter_mut().enumerate() {
                            let xv = $load(xp.add((r0 + i) * k + at));
                            for (a, v) in row.iter_mut().zip(&wv) {
                                *a = $fma(xv, *v, *a);
                            }
                        }
                    }
                    at += LANES;
                }
                for (i, row) in acc.iter().enumerate() {
                    for (c, a) in row.iter().enumerate() {
                        let mut sum: f32 = $sum(*a);
                        let xr = &x[(r0 + i) * k..(r0 + i + 1) * k];
                        let wr = &w[(j0 + c) * k..(j0 + c + 1) * k];
                        for t in body..k {
                            sum = xr[t].mul_add(wr[t], sum);
                        }
                        out[(j0 + c) * rows + r0 + i] = sum;
                    }
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
tiled_kernel!(
    avx2,
    "avx2,fma",
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    |v: __m256| {
        let mut lanes = [0f32; 8];
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        lanes.iter().sum::<f32>()
    }
);

#[cfg(target_arch = "x86_64")]
tiled_kernel!(
    avx512,
    "avx512f",
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    |v: __m512| _mm512_reduce_add_ps(v)
);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    fn naive(x: &[f32], rows: usize, w: &[f32], n: usize, k: usize) -> Vec<f32> {
        let mut out = vec![0f32; rows * n];
        for r in 0..rows {
            for j in 0..n {
                out[r * n + j] = (0..k)
                    .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                    .sum::<f64>() as f32;
            }
        }
        out
    }

    #[test]
    fn matches_a_double_precision_product_on_every_tile_shape() {
        // Odd row and column counts and a k with a tail exercise every tile and remainder.
        for &(rows, n, k) in &[
            (1, 1, 1),
            (3, 5, 7),
            (4, 64, 576),
            (7, 33, 19),
            (16, 70, 1536),
            (13, 97, 64),
        ] {
            let x = values(rows * k, 1);
            let w = values(n * k, 2);
            let got = x_wt(&x, rows, &w, n, k);
            let want = naive(&x, rows, &w, n, k);
            for (g, e) in got.iter().zip(&want) {
                // f32 sums of k products of values in [-0.5, 0.5]: rounding grows like sqrt(k).
                assert!(
                    (g - e).abs() <= 1e-6 * (k as f32).sqrt() * 4.0,
                    "{rows}x{n}x{k}: {g} vs {e}"
                );
            }
        }
    }
}
