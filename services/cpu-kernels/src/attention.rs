//! Attention of a decode step read straight from a sequence's KV cache buffers.

use rayon::prelude::*;

use crate::softmax::softmax_row;

/// New queries per sequence up to which `few_queries` computes attention straight from the
/// cache's buffers: decode steps. For a chunk of 13 queries at 4K context its per-position
/// dot products (64 values, then a horizontal sum) cost more than OpenBLAS's packed product
/// (a 13-token chunk took 250 ms against 175), so longer chunks keep `attention`.
pub const FEW_QUERIES: usize = 1;

/// Positions per parallel task of `few_queries`: 256 keys of 64-128 floats (64-128 KiB) per
/// KV head, so that a decode step at 4K context over 3 KV heads makes 48 even tasks.
const POSITIONS_PER_TASK: usize = 256;

/// One layer's cache buffers for one sequence: keys and values `[kv_heads, capacity, dim]`,
/// row-major, of which positions 0..visible are used (the new tokens last).
#[derive(Clone, Copy)]
pub struct CacheBuffers<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
    pub kv_heads: usize,
    pub capacity: usize,
    pub dim: usize,
    pub visible: usize,
    /// A sliding-window layer's window: each query sees its last `window` positions, its own
    /// included.
    pub window: Option<usize>,
}

impl<'a> CacheBuffers<'a> {
    /// The same buffers from position `skip` on (every head's rows start `skip` later).
    fn skipping(self, skip: usize) -> Self {
        Self {
            keys: &self.keys[skip * self.dim..],
            values: &self.values[skip * self.dim..],
            visible: self.visible - skip,
            ..self
        }
    }
}

/// Causal attention of `t` new queries (`q`: `[heads, t, dim]`, row-major, RoPE applied) over
/// the cache, returned as `[t, heads * dim]` (the output projection's input).
///
/// Why not MLX's products, as `attention` uses: for a few queries each product is thin, and
/// OpenBLAS packs the whole of K and V first (a second copy of what is read) and its threads
/// then spin beside rayon's. Measured on SmolLM2 at 4K context, attention took 27 ms of a
/// 75 ms decode step. Here each key and value row is read once, where it lies in the cache,
/// and a decode step has no OpenBLAS call left: 70 -> 63-66 ms a step (median of 15, with
/// `matmul`; `cargo bench -p strata-worker --bench warm_hit`).
pub fn few_queries(
    q: &[f32],
    heads: usize,
    t: usize,
    kv: CacheBuffers<'_>,
    scale: f32,
) -> Vec<f32> {
    // Positions before the first query's window are seen by no query: left out.
    let kv = match kv.window {
        Some(w) if kv.visible + 1 > t + w => kv.skipping(kv.visible + 1 - t - w),
        _ => kv,
    };
    let CacheBuffers {
        kv_heads,
        capacity,
        dim,
        visible,
        window,
        ..
    } = kv;
    let group = heads / kv_heads;
    let rows = group * t;
    let chunks = visible.div_ceil(POSITIONS_PER_TASK);
    let head_keys = |h: usize, c: usize| {
        let from = c * POSITIONS_PER_TASK;
        let to = visible.min(from + POSITIONS_PER_TASK);
        let base = h * capacity * dim;
        (from, to, base)
    };
    // Scores as one piece per task, each row-major over its positions: [kv_heads][chunk]
    // [rows][positions of the chunk]. Chunk c of a head starts `from(c) * rows` into it.
    let mut by_chunk = vec![0f32; kv_heads * visible * rows];
    let mut pieces: Vec<&mut [f32]> = Vec::with_capacity(kv_heads * chunks);
    for head in by_chunk.chunks_mut(visible * rows) {
        pieces.extend(head.chunks_mut(POSITIONS_PER_TASK * rows));
    }
    pieces.into_par_iter().enumerate().for_each(|(task, out)| {
        let (h, c) = (task / chunks, task % chunks);
        let (from, to, base) = head_keys(h, c);
        let qh = &q[h * rows * dim..(h + 1) * rows * dim];
        let keys = &kv.keys[base + from * dim..base + to * dim];
        scores(qh, rows, keys, dim, out);
    });
    // Softmax of each query row over the positions it sees: row g * t + i is query i, which
    // sees all but the last t - 1 - i positions (and, in a window, only its last `w`).
    let mut weights = vec![0f32; kv_heads * rows * visible];
    weights
        .par_chunks_mut(visible)
        .enumerate()
        .for_each(|(hr, out)| {
            let (h, r) = (hr / rows, hr % rows);
            let seen = visible - (t - 1 - r % t);
            let head = &by_chunk[h * visible * rows..(h + 1) * visible * rows];
            let mut row = Vec::with_capacity(seen);
            for c in 0..chunks {
                let (from, to, _) = head_keys(h, c);
                let len = to - from;
                let piece = &head[from * rows..from * rows + len * rows];
                let part = &piece[r * len..(r + 1) * len];
                let take = len.min(seen.saturating_sub(from));
                row.extend(part[..take].iter().map(|x| x * scale));
            }
            let first = window.map_or(0, |w| seen.saturating_sub(w));
            softmax_row(&row[first..], &mut out[first..seen]);
        });
    // weights · V by position chunks, then the chunks' partial sums added in order.
    let partials: Vec<Vec<f32>> = (0..kv_heads * chunks)
        .into_par_iter()
        .map(|task| {
            let (h, c) = (task / chunks, task % chunks);
            let (from, to, base) = head_keys(h, c);
            let values = &kv.values[base + from * dim..base + to * dim];
            let w = &weights[h * rows * visible..(h + 1) * rows * visible];
            let mut out = vec![0f32; rows * dim];
            weighted_rows(w, visible, from, values, dim, &mut out);
            out
        })
        .collect();
    let mut out = vec![0f32; t * heads * dim];
    for h in 0..kv_heads {
        for c in 0..chunks {
            let part = &partials[h * chunks + c];
            for (r, acc) in part.chunks_exact(dim).enumerate() {
                let (g, i) = (r / t, r % t);
                let at = i * heads * dim + (h * group + g) * dim;
                for (o, a) in out[at..at + dim].iter_mut().zip(acc) {
                    *o += a;
                }
            }
        }
    }
    out
}

/// Query rows from which `scores` and `weighted_rows` use their register-tiled kernels: with
/// fewer (a decode step's few query heads) the key and value rows are read once per query row
/// anyway, and the tiles' transposition and set-up would not pay.
const TILED_ROWS: usize = 4;

/// `out[r * positions + p] = q[r] · keys[p]` for `q` of `[rows, dim]` and `keys` of
/// `[positions, dim]`: row-major by query, as the softmax reads them.
fn scores(q: &[f32], rows: usize, keys: &[f32], dim: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if rows >= TILED_ROWS
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { tiled::scores(q, rows, keys, dim, out) };
            return;
        }
    }
    // A decode step's few rows: the dot-product kernel writes by position, then a transpose.
    let positions = keys.len() / dim.max(1);
    let mut by_position = vec![0f32; positions * rows];
    crate::matmul::columns(q, rows, keys, dim, &mut by_position);
    for (p, col) in by_position.chunks_exact(rows).enumerate() {
        for (r, &v) in col.iter().enumerate() {
            out[r * positions + p] = v;
        }
    }
}

/// `out[r] += Σ_p w[r][from + p] · values[p]` for each row r of `w` (`[rows, stride]`).
fn weighted_rows(
    w: &[f32],
    stride: usize,
    from: usize,
    values: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        if out.len() / dim.max(1) >= TILED_ROWS
            && dim.is_multiple_of(tiled::DIM_STEP)
            && std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { tiled::weighted_rows(w, stride, from, values, dim, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked above); the function is otherwise safe.
            unsafe { weighted_rows_avx512(w, stride, from, values, dim, out) };
            return;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: as above, for AVX2 and FMA.
            unsafe { weighted_rows_avx2(w, stride, from, values, dim, out) };
            return;
        }
    }
    weighted_rows_portable(w, stride, from, values, dim, out);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn weighted_rows_avx512(
    w: &[f32],
    stride: usize,
    from: usize,
    values: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    weighted_rows_portable(w, stride, from, values, dim, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn weighted_rows_avx2(
    w: &[f32],
    stride: usize,
    from: usize,
    values: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    weighted_rows_portable(w, stride, from, values, dim, out)
}

/// Element-wise multiply-adds along `dim`: the compiler vectorises them (no reduction order
/// to keep).
#[inline(always)]
fn weighted_rows_portable(
    w: &[f32],
    stride: usize,
    from: usize,
    values: &[f32],
    dim: usize,
    out: &mut [f32],
) {
    let positions = values.len() / dim;
    for (wr, acc) in w.chunks_exact(stride).zip(out.chunks_exact_mut(dim)) {
        for (&weight, v) in wr[from..from + positions]
            .iter()
            .zip(values.chunks_exact(dim))
        {
            for (a, &x) in acc.iter_mut().zip(v) {
                *a = weight.mul_add(x, *a);
            }
        }
    }
}

/// The two products of attention for many query rows (a chunk of new tokens times the query
/// heads of one KV head) in AVX2, with accumulators held in registers across the whole
/// reduction. The straightforward forms spent more on bookkeeping than on multiply-adds: the
/// scores as one dot product per (row, position), each ending in a horizontal sum of a
/// vector, and the weighted sum of values loading and storing its accumulator row per
/// position.
#[cfg(target_arch = "x86_64")]
mod tiled {
    use std::arch::x86_64::*;

    /// Positions per score tile: two vectors of 8.
    const POSITIONS: usize = 16;
    /// Query rows per score tile (8 accumulators with the two vectors of positions).
    const ROWS: usize = 4;
    /// Floats of `dim` per weighted-sum tile: four vectors, by `WEIGHT_ROWS` rows (12
    /// accumulators).
    pub const DIM_STEP: usize = 32;
    const WEIGHT_ROWS: usize = 3;
    /// Value rows per block of `weighted_rows`: 64 of up to 128 floats, 32 KiB.
    const VALUE_BLOCK: usize = 64;

    /// `scores` of the parent module: each block of 16 keys is transposed once into
    /// `[dim][16]`, then every tile of 4 query rows multiplies it by broadcasts of its own
    /// values, 16 positions per pair of multiply-adds and no horizontal sum.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn scores(q: &[f32], rows: usize, keys: &[f32], dim: usize, out: &mut [f32]) {
        let positions = keys.len() / dim;
        assert!(q.len() >= rows * dim && out.len() >= positions * rows);
        let mut kt = vec![0f32; dim * POSITIONS];
        let mut tile = [[0f32; POSITIONS]; ROWS];
        let mut p0 = 0;
        while p0 < positions {
            let n = POSITIONS.min(positions - p0);
            if n == POSITIONS && dim.is_multiple_of(8) {
                for half in 0..2 {
                    for d0 in (0..dim).step_by(8) {
                        // SAFETY: positions p0 + 8 * half.. + 8 and dims d0..d0 + 8 exist
                        // (a full block; dim a multiple of 8), and `kt` holds dim x 16.
                        unsafe {
                            transpose8(
                                keys.as_ptr().add((p0 + 8 * half) * dim + d0),
                                dim,
                                kt.as_mut_ptr().add(d0 * POSITIONS + 8 * half),
                                POSITIONS,
                            )
                        };
                    }
                }
            } else {
                for d in 0..dim {
                    for l in 0..POSITIONS {
                        kt[d * POSITIONS + l] = if l < n { keys[(p0 + l) * dim + d] } else { 0.0 };
                    }
                }
            }
            let mut r0 = 0;
            while r0 < rows {
                let r = ROWS.min(rows - r0);
                // SAFETY: rows r0..r0 + r of `q` and `dim` rows of 16 floats of `kt` exist
                // (asserted above and sized so); the tile is written in full.
                unsafe {
                    let mut acc = [[_mm256_setzero_ps(); 2]; ROWS];
                    let (kp, qp) = (kt.as_ptr(), q.as_ptr());
                    for d in 0..dim {
                        let k0 = _mm256_loadu_ps(kp.add(d * POSITIONS));
                        let k1 = _mm256_loadu_ps(kp.add(d * POSITIONS + 8));
                        for (i, a) in acc.iter_mut().enumerate().take(r) {
                            let qv = _mm256_broadcast_ss(&*qp.add((r0 + i) * dim + d));
                            a[0] = _mm256_fmadd_ps(qv, k0, a[0]);
                            a[1] = _mm256_fmadd_ps(qv, k1, a[1]);
                        }
                    }
                    for (t, a) in tile.iter_mut().zip(&acc).take(r) {
                        _mm256_storeu_ps(t.as_mut_ptr(), a[0]);
                        _mm256_storeu_ps(t.as_mut_ptr().add(8), a[1]);
                    }
                }
                for (i, t) in tile.iter().enumerate().take(r) {
                    let at = (r0 + i) * positions + p0;
                    out[at..at + n].copy_from_slice(&t[..n]);
                }
                r0 += r;
            }
            p0 += n;
        }
    }

    /// The 8 x 8 floats at `src` (rows `src_stride` apart) transposed to `dst` (rows
    /// `dst_stride` apart): three rounds of shuffles, as in every AVX 8 x 8 transpose.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn transpose8(src: *const f32, src_stride: usize, dst: *mut f32, dst_stride: usize) {
        // SAFETY: the caller guarantees 8 rows of 8 floats at both ends.
        unsafe {
            let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(src.add(i * src_stride)));
            let t = [
                _mm256_unpacklo_ps(r[0], r[1]),
                _mm256_unpackhi_ps(r[0], r[1]),
                _mm256_unpacklo_ps(r[2], r[3]),
                _mm256_unpackhi_ps(r[2], r[3]),
                _mm256_unpacklo_ps(r[4], r[5]),
                _mm256_unpackhi_ps(r[4], r[5]),
                _mm256_unpacklo_ps(r[6], r[7]),
                _mm256_unpackhi_ps(r[6], r[7]),
            ];
            let u = [
                _mm256_shuffle_ps::<0x44>(t[0], t[2]),
                _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
                _mm256_shuffle_ps::<0x44>(t[1], t[3]),
                _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
                _mm256_shuffle_ps::<0x44>(t[4], t[6]),
                _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
                _mm256_shuffle_ps::<0x44>(t[5], t[7]),
                _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
            ];
            let o = [
                _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
                _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
                _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
                _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
                _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
                _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
                _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
                _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
            ];
            for (i, v) in o.iter().enumerate() {
                _mm256_storeu_ps(dst.add(i * dst_stride), *v);
            }
        }
    }

    /// `weighted_rows` of the parent module for `dim` a multiple of 32: tiles of 3 rows by 32
    /// values of `dim`, each value row loaded once per tile and multiplied by broadcasts of
    /// the 3 rows' weights.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn weighted_rows(
        w: &[f32],
        stride: usize,
        from: usize,
        values: &[f32],
        dim: usize,
        out: &mut [f32],
    ) {
        let positions = values.len() / dim;
        let rows = out.len() / dim;
        assert!(dim.is_multiple_of(DIM_STEP) && w.len() >= rows * stride);
        assert!(from + positions <= stride);
        let (wp, vp, op) = (w.as_ptr(), values.as_ptr(), out.as_mut_ptr());
        // Blocks of value rows small enough to stay in L1 while every row tile passes over
        // them (a task's 256 positions of 64-128 floats do not fit).
        for p0 in (0..positions).step_by(VALUE_BLOCK) {
            let p1 = positions.min(p0 + VALUE_BLOCK);
            let mut r0 = 0;
            while r0 < rows {
                let r = WEIGHT_ROWS.min(rows - r0);
                for d0 in (0..dim).step_by(DIM_STEP) {
                    // SAFETY: rows r0..r0 + r of `w` (each `stride` long, `from + positions`
                    // inside it), rows p0..p1 of `values` and rows r0..r0 + r of `out`, each
                    // `dim` long with d0 + 32 <= dim: all inside the slices (asserted above).
                    unsafe {
                        let mut acc = [[_mm256_setzero_ps(); 4]; WEIGHT_ROWS];
                        for p in p0..p1 {
                            let v = vp.add(p * dim + d0);
                            let vs = [
                                _mm256_loadu_ps(v),
                                _mm256_loadu_ps(v.add(8)),
                                _mm256_loadu_ps(v.add(16)),
                                _mm256_loadu_ps(v.add(24)),
                            ];
                            for (i, a) in acc.iter_mut().enumerate().take(r) {
                                let wv =
                                    _mm256_broadcast_ss(&*wp.add((r0 + i) * stride + from + p));
                                for (a, v) in a.iter_mut().zip(&vs) {
                                    *a = _mm256_fmadd_ps(wv, *v, *a);
                                }
                            }
                        }
                        for (i, a) in acc.iter().enumerate().take(r) {
                            for (j, a) in a.iter().enumerate() {
                                let o = op.add((r0 + i) * dim + d0 + 8 * j);
                                _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), *a));
                            }
                        }
                    }
                }
                r0 += r;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    fn close(got: &[f32], want: &[f64], k: usize, what: &str) {
        for (i, (g, e)) in got.iter().zip(want).enumerate() {
            // f32 sums of k products of values in [-0.5, 0.5]: rounding grows like sqrt(k).
            assert!(
                (*g as f64 - e).abs() <= 1e-6 * (k as f64).sqrt() * 4.0,
                "{what}[{i}]: {g} vs {e}"
            );
        }
    }

    /// Scores of every tile shape (rows and positions not multiples of the tiles) against
    /// double-precision dot products.
    #[test]
    fn scores_match_double_precision_dot_products() {
        for &(rows, positions, dim) in &[
            (1, 5, 64),
            (4, 16, 64),
            (7, 33, 64),
            (39, 300, 64),
            (13, 17, 128),
            (8, 64, 24),
            (6, 48, 128),
        ] {
            let (q, keys) = (values(rows * dim, 1), values(positions * dim, 2));
            let mut got = vec![0f32; positions * rows];
            scores(&q, rows, &keys, dim, &mut got);
            let mut want = vec![0f64; positions * rows];
            for p in 0..positions {
                for r in 0..rows {
                    want[r * positions + p] = (0..dim)
                        .map(|d| q[r * dim + d] as f64 * keys[p * dim + d] as f64)
                        .sum();
                }
            }
            close(
                &got,
                &want,
                dim,
                &format!("scores {rows}x{positions}x{dim}"),
            );
        }
    }

    /// Weighted sums of value rows, added to what `out` holds, against double precision.
    #[test]
    fn weighted_rows_match_double_precision_sums() {
        for &(rows, positions, dim, from) in &[
            (1, 9, 64, 0),
            (4, 256, 64, 3),
            (7, 100, 128, 10),
            (39, 37, 64, 0),
            (5, 11, 48, 2),
        ] {
            let stride = from + positions + 5;
            let (w, v) = (values(rows * stride, 3), values(positions * dim, 4));
            let start = values(rows * dim, 5);
            let mut got = start.clone();
            weighted_rows(&w, stride, from, &v, dim, &mut got);
            let want: Vec<f64> = (0..rows * dim)
                .map(|i| {
                    let (r, d) = (i / dim, i % dim);
                    start[i] as f64
                        + (0..positions)
                            .map(|p| w[r * stride + from + p] as f64 * v[p * dim + d] as f64)
                            .sum::<f64>()
                })
                .collect();
            close(
                &got,
                &want,
                positions,
                &format!("weighted {rows}x{positions}x{dim}"),
            );
        }
    }
}
