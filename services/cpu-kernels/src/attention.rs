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
    let CacheBuffers {
        kv_heads,
        capacity,
        dim,
        visible,
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
    // Scores by position, then query row: [kv_heads][visible][rows], one piece per task.
    let mut by_position = vec![0f32; kv_heads * visible * rows];
    let mut pieces: Vec<&mut [f32]> = Vec::with_capacity(kv_heads * chunks);
    for head in by_position.chunks_mut(visible * rows) {
        pieces.extend(head.chunks_mut(POSITIONS_PER_TASK * rows));
    }
    pieces.into_par_iter().enumerate().for_each(|(task, out)| {
        let (h, c) = (task / chunks, task % chunks);
        let (from, to, base) = head_keys(h, c);
        let qh = &q[h * rows * dim..(h + 1) * rows * dim];
        let keys = &kv.keys[base + from * dim..base + to * dim];
        crate::matmul::columns(qh, rows, keys, dim, out);
    });
    // Softmax of each query row over the positions it sees: row g * t + i is query i, which
    // sees all but the last t - 1 - i positions.
    let mut weights = vec![0f32; kv_heads * rows * visible];
    weights
        .par_chunks_mut(visible)
        .enumerate()
        .for_each(|(hr, out)| {
            let (h, r) = (hr / rows, hr % rows);
            let seen = visible - (t - 1 - r % t);
            let scores = &by_position[h * visible * rows..(h + 1) * visible * rows];
            let mut row = vec![0f32; seen];
            for (p, x) in row.iter_mut().enumerate() {
                *x = scores[p * rows + r] * scale;
            }
            softmax_row(&row, &mut out[..seen]);
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
