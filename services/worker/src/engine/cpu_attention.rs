//! Attention on the CPU: MLX's matrix products (OpenBLAS) for Q·Kᵀ and weights·V, with the
//! causal softmax between them done here.
//!
//! Why by hand: MLX's CPU backend computes `exp` one element at a time on one thread (about
//! 17 ns per element on this machine), so a softmax over a prefill chunk's scores costs
//! several times both matrix products together: for 256 queries of SmolLM2 over 4K positions
//! (10M scores) 175 ms of the 194 ms its fused attention takes per layer, and its fused kernel
//! falls back to the same operations on the CPU. No crate offers a vectorised, multi-threaded
//! masked softmax over a borrowed buffer; this one is a few lines of branch-free arithmetic
//! the compiler vectorises, spread over the cores with rayon.
//!
//! The query heads that share a KV head are stacked as the rows of one product against that
//! head's keys (no repeated KV heads). Every row is computed on its own, whatever the thread
//! split, so results do not depend on the number of cores.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use rayon::prelude::*;

use strata_cpu_kernels::softmax::softmax_row;

use super::{EngineError, Result};

/// Scores held at once per product: longer chunks are split by queries so that a chunk at a
/// long context does not hold gigabytes of scores (256 queries x 9 heads x 32K positions is
/// 300 MB in f32).
const MAX_SCORES: usize = 8 << 20;

/// Scores per rayon task: smaller rows are grouped so that a decode step's few rows do not
/// pay a task each.
const SCORES_PER_TASK: usize = 1 << 15;

/// One sequence's attention inputs: queries `[1, heads, t, dim]` (RoPE applied), keys and
/// values `[1, kv_heads, held + t, dim]`, the new tokens last; for a sliding-window layer, the
/// window (each query sees its last `window` positions, its own included).
#[derive(Clone, Copy)]
pub struct AttentionInput<'a> {
    pub q: &'a Array,
    pub keys: &'a Array,
    pub values: &'a Array,
    pub window: Option<usize>,
}

/// Whether this path computes `q`'s attention (f32 only: other dtypes keep MLX's kernel).
pub fn applies(q: &Array, keys: &Array) -> bool {
    q.dtype() == Dtype::Float32 && keys.dtype() == Dtype::Float32
}

/// Causal scaled dot-product attention of every input, `[1, heads, t, dim]` each. The new
/// token at chunk index i (position held + i) sees positions 0..=held + i. All scores of one
/// call are evaluated together: one synchronisation for a whole batch of decode steps.
pub fn attention(inputs: &[AttentionInput<'_>], scale: f32) -> Result<Vec<Array>> {
    attention_bounded(inputs, scale, MAX_SCORES)
}

/// `attention` holding at most `max_scores` scores at once (but one query's).
fn attention_bounded(
    inputs: &[AttentionInput<'_>],
    scale: f32,
    max_scores: usize,
) -> Result<Vec<Array>> {
    // Each input split into pieces of queries: (input, first query, queries).
    let mut pieces = Vec::new();
    for (n, input) in inputs.iter().enumerate() {
        let (heads, t) = (input.q.shape()[1] as usize, input.q.shape()[2] as usize);
        let positions = input.keys.shape()[2] as usize;
        let per_query = heads * positions;
        let step = (max_scores / per_query.max(1)).clamp(1, t.max(1));
        let mut at = 0;
        while at < t {
            pieces.push((n, at, step.min(t - at)));
            at += step;
        }
    }
    // Scores of pieces in order, evaluated a batch at a time within the memory bound.
    let mut outputs: Vec<Vec<Array>> = inputs.iter().map(|_| Vec::new()).collect();
    let mut start = 0;
    while start < pieces.len() {
        let mut end = start;
        let mut held = 0;
        while end < pieces.len() {
            let (n, _, len) = pieces[end];
            let size = len * inputs[n].q.shape()[1] as usize * inputs[n].keys.shape()[2] as usize;
            if end > start && held + size > max_scores {
                break;
            }
            held += size;
            end += 1;
        }
        let batch = &pieces[start..end];
        let scores = batch
            .iter()
            .map(|&(n, first, len)| piece_scores(&inputs[n], first, len, scale))
            .collect::<Result<Vec<_>>>()?;
        mlx_rs::transforms::eval(scores.iter().map(|(s, _)| s))?;
        for (&(n, _, len), (scores, from)) in batch.iter().zip(&scores) {
            let weights = causal_softmax(scores, len, inputs[n].window)?;
            outputs[n].push(piece_output(&inputs[n], &weights, *from, len)?);
        }
        start = end;
    }
    outputs
        .into_iter()
        .map(|mut parts| {
            if parts.len() == 1 {
                parts
                    .pop()
                    .ok_or_else(|| EngineError::Mlx("no attention output".into()))
            } else {
                Ok(concatenate(&parts, 2)?)
            }
        })
        .collect()
}

/// The scores `[1, kv_heads, group * len, visible - from]` of queries first..first + len
/// against the keys they can see (positions `from` up to the last of them: from 0, or in a
/// window from the first query's window), and `from`.
fn piece_scores(
    input: &AttentionInput<'_>,
    first: usize,
    len: usize,
    scale: f32,
) -> Result<(Array, usize)> {
    let (heads, t, dim) = (input.q.shape()[1], input.q.shape()[2], input.q.shape()[3]);
    let kv_heads = input.keys.shape()[1];
    let positions = input.keys.shape()[2] as usize;
    let held = positions - t as usize;
    let visible = held + first + len;
    let from = input
        .window
        .map_or(0, |w| (held + first + 1).saturating_sub(w));
    let q = if len == t as usize {
        input.q.clone()
    } else {
        input
            .q
            .try_index((.., .., first as i32..(first + len) as i32, ..))?
    };
    let q = q.multiply(Array::from_f32(scale))?.reshape(&[
        1,
        kv_heads,
        (heads / kv_heads) * len as i32,
        dim,
    ])?;
    let keys = visible_rows(input.keys, from, visible)?;
    let scores = q.matmul(&keys.transpose_axes(&[0, 1, 3, 2])?)?;
    Ok((scores, from))
}

/// `weights · V` of a piece whose scores start at position `from`, back in
/// `[1, heads, len, dim]`.
fn piece_output(
    input: &AttentionInput<'_>,
    weights: &Array,
    from: usize,
    len: usize,
) -> Result<Array> {
    let (heads, dim) = (input.q.shape()[1], input.q.shape()[3]);
    let visible = from + weights.shape()[3] as usize;
    let values = visible_rows(input.values, from, visible)?;
    Ok(weights
        .matmul(&values)?
        .reshape(&[1, heads, len as i32, dim])?)
}

fn visible_rows(a: &Array, from: usize, visible: usize) -> Result<Array> {
    if from == 0 && a.shape()[2] as usize == visible {
        Ok(a.clone())
    } else {
        Ok(a.try_index((.., .., from as i32..visible as i32, ..))?)
    }
}

/// Softmax of each row of `scores` (`[1, kv_heads, group * len, cols]`, evaluated) over the
/// positions its query sees: row r is query r % len, the (len - 1 - r % len)-th from the end,
/// which sees all but that many of the last positions, and in a `window` only the last
/// `window` of those. Masked positions get weight 0.
fn causal_softmax(scores: &Array, len: usize, window: Option<usize>) -> Result<Array> {
    let cols = scores.shape()[3] as usize;
    let data = scores
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(format!("reading attention scores: {e}")))?;
    let mut out = vec![0f32; data.len()];
    let rows_per_task = (SCORES_PER_TASK / cols.max(1)).max(1);
    out.par_chunks_mut(cols * rows_per_task)
        .zip(data.par_chunks(cols * rows_per_task))
        .enumerate()
        .for_each(|(task, (out, data))| {
            for (i, (out, row)) in out.chunks_mut(cols).zip(data.chunks(cols)).enumerate() {
                let r = task * rows_per_task + i;
                let seen = cols - (len - 1 - r % len);
                let first = window.map_or(0, |w| seen.saturating_sub(w));
                softmax_row(&row[first..seen], &mut out[first..seen]);
            }
        });
    Ok(Array::from_slice(&out, scores.shape()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLX's fused attention with the mask of a window (`None`: causal).
    fn reference(q: &Array, k: &Array, v: &Array, scale: f32, window: Option<usize>) -> Array {
        use mlx_rs::fast::{ScaledDotProductAttentionMask, scaled_dot_product_attention};
        let (t, positions) = (q.shape()[2] as usize, k.shape()[2] as usize);
        let Some(w) = window else {
            let mask = (t > 1).then_some(ScaledDotProductAttentionMask::Causal);
            return scaled_dot_product_attention(q, k, v, scale, mask, None).unwrap();
        };
        let mask: Vec<f32> = (0..t * positions)
            .map(|i| {
                let (query, key) = (positions - t + i / positions, i % positions);
                if key <= query && key + w > query {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
            .collect();
        let mask = Array::from_slice(&mask, &[t as i32, positions as i32]);
        scaled_dot_product_attention(q, k, v, scale, &mask, None).unwrap()
    }

    /// Against MLX's own attention on the same inputs: a prefill chunk (causal, queries split
    /// into pieces by a small bound) and a decode step, with grouped-query heads; causal, and
    /// in windows shorter than, equal to and longer than the chunk.
    #[test]
    fn attention_matches_mlx_fused_attention() {
        let (heads, kv_heads, dim) = (6, 2, 16);
        for ((held, t), window) in [(0, 9), (37, 5), (50, 1)]
            .into_iter()
            .flat_map(|case| [None, Some(3), Some(5), Some(40)].map(|w| (case, w)))
        {
            let positions = held + t;
            let q = mlx_rs::random::normal::<f32>(&[1, heads, t, dim], None, None, None).unwrap();
            let k = mlx_rs::random::normal::<f32>(&[1, kv_heads, positions, dim], None, None, None)
                .unwrap();
            let v = mlx_rs::random::normal::<f32>(&[1, kv_heads, positions, dim], None, None, None)
                .unwrap();
            let scale = 0.25;
            let want = reference(&q, &k, &v, scale, window);
            let input = AttentionInput {
                q: &q,
                keys: &k,
                values: &v,
                window,
            };
            // Whole, and split into pieces of a query or two.
            for bound in [MAX_SCORES, 2 * heads as usize * positions as usize] {
                let got = attention_bounded(&[input], scale, bound)
                    .unwrap()
                    .pop()
                    .unwrap();
                assert_eq!(got.shape(), want.shape());
                let diff = got
                    .subtract(&want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(None)
                    .unwrap()
                    .try_item_cast::<f32>()
                    .unwrap();
                assert!(
                    diff < 1e-5,
                    "held {held} t {t} window {window:?} bound {bound}: max difference {diff}"
                );
            }
        }
    }

    /// `few_queries` reads the cache's buffers in place (capacity beyond the visible
    /// positions, grouped heads) and agrees with MLX's fused attention, causal and windowed.
    #[test]
    fn few_queries_match_mlx_fused_attention() {
        let (heads, kv_heads, dim) = (9, 3, 64);
        for ((held, t), window) in [(0, 1), (5, 3), (600, 1), (700, 13)]
            .into_iter()
            .flat_map(|case| [None, Some(2), Some(13), Some(512)].map(|w| (case, w)))
        {
            let positions = held + t;
            let capacity = positions + 37;
            let q = mlx_rs::random::normal::<f32>(&[1, heads, t, dim], None, None, None).unwrap();
            let k = mlx_rs::random::normal::<f32>(&[1, kv_heads, capacity, dim], None, None, None)
                .unwrap();
            let v = mlx_rs::random::normal::<f32>(&[1, kv_heads, capacity, dim], None, None, None)
                .unwrap();
            let visible = |a: &Array| a.try_index((.., .., 0..positions, ..)).unwrap();
            let scale = 0.125;
            let want = reference(&q, &visible(&k), &visible(&v), scale, window)
                .transpose_axes(&[0, 2, 1, 3])
                .unwrap()
                .reshape(&[t, heads * dim])
                .unwrap();
            let buffers = strata_cpu_kernels::attention::CacheBuffers {
                keys: k.try_as_slice().unwrap(),
                values: v.try_as_slice().unwrap(),
                kv_heads: kv_heads as usize,
                capacity: capacity as usize,
                dim: dim as usize,
                visible: positions as usize,
                window,
            };
            let got = strata_cpu_kernels::attention::few_queries(
                q.try_as_slice().unwrap(),
                heads as usize,
                t as usize,
                buffers,
                scale,
            );
            let want: &[f32] = want.try_as_slice().unwrap();
            let diff = got
                .iter()
                .zip(want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-5,
                "held {held} t {t} window {window:?}: max difference {diff}"
            );
        }
    }
}
