//! A forward pass of a few rows (decode steps of a batch, a few new tokens after a cache hit)
//! computed on the CPU by Rust kernels end to end, with no MLX graph between them.
//!
//! Why: on a CPU a decode step of SmolLM2 reads ~93 MB of weight codes (about 6 ms), but
//! through MLX it cost ~40 ms: each layer built and evaluated small graphs (norms, RoPE, slice
//! updates of the cache, adds) between the few-rows kernels, and every evaluation handed the
//! work to MLX's stream thread and back (perf: futex wake-ups and the scheduler took more
//! samples than the products). Here the same operations run in place on `f32` slices: the
//! products through `strata_cpu_kernels` (the file's codes or the f32 weights), attention read
//! straight from the cache's buffers, new K/V rows written into them (`KvCache::host_rows`).
//! The arithmetic is the MLX path's, one operation at a time in f32; results equal it within
//! rounding (tests in `llama::tests`).

use mlx_rs::ops::{arange, exp};
use mlx_rs::{Array, Dtype};
use strata_cpu_kernels::attention::few_queries;
use strata_cpu_kernels::packed::{PackedMatrix, x_wt_many};

use super::super::config::ModelConfig;
use super::super::kv::HostKv;
use super::super::weights::{Linear, Matrix};
use super::super::{EngineError, Result};
use super::{Model, SeqChunk, read};

/// Rows of a batch (all sequences' new tokens) up to which a pass runs here. Products stay
/// on the few-rows kernels up to there: called from the pool, OpenBLAS's own threads fight
/// rayon's for the cores (measured, Qwen2.5-1.5B after a 1K prefix, 25 new tokens: 0.88 s on
/// the codes kernel, 1.72 s through BLAS on dequantised panels, 1.78 s on MLX's path;
/// `cargo bench -p strata-worker --bench warm_hit`). Longer chunks are prefill, where BLAS
/// products amortise their packing and MLX's graph its dispatch.
pub const HOST_MAX_ROWS: usize = 64;

/// Attention scores (new tokens x query heads x positions seen) up to which a pass runs here:
/// they are all held at once, twice (scores and weights). Longer chunks at long contexts go to
/// MLX's path, which splits them (`cpu_attention`).
const HOST_MAX_SCORES: usize = 8 << 20;

/// What a host pass needs beyond the model's matrices, in f32 slices: norms, biases, RoPE's
/// inverse frequencies.
pub(super) struct HostWeights {
    layers: Vec<HostLayer>,
    final_norm: Vec<f32>,
    /// Per rotated pair, as MLX computes them (`exp(-i · ln(base) / half)`, or the reciprocal
    /// of explicit periods), so that angles match its RoPE bit for bit.
    inv_freqs: Vec<f32>,
    /// Longrope's factor on the rotated dimensions (`[head_dim]`).
    input_scale: Option<Vec<f32>>,
    /// Sliding-window layers' inverse frequencies (their own base, unscaled).
    window_inv_freqs: Option<Vec<f32>>,
}

struct HostLayer {
    attn_norm: Vec<f32>,
    mlp_norm: Vec<f32>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// Gemma's norms on the outputs of attention and of the MLP.
    attn_out_norm: Option<Vec<f32>>,
    mlp_out_norm: Option<Vec<f32>>,
    /// Biases of q, k, v, o, gate, up, down.
    biases: [Option<Vec<f32>>; 7],
}

fn to_vec(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(Dtype::Float32)?;
    Ok(read(&a)?.to_vec())
}

/// Whether the pass can read `m` as f32 slices: codes, or a row-major f32 matrix.
fn host_readable(m: &Matrix) -> bool {
    match m {
        Matrix::Codes(_) | Matrix::WithCodes { .. } => true,
        Matrix::Dense(w) => w.dtype() == Dtype::Float32 && w.try_as_slice::<f32>().is_ok(),
        Matrix::Quantized(_) => false,
    }
}

impl HostWeights {
    /// The host pass's weights for a model computing in f32 on a CPU, or None when some matrix
    /// cannot be read as f32 (MLX-quantised weights for a GPU).
    pub(super) fn new(model: &Model) -> Result<Option<Self>> {
        let c = &model.config;
        // Mixture-of-experts layers take MLX's path (`moe`).
        let Some(projections) = model
            .layers
            .iter()
            .map(|l| l.dense_projections())
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(None);
        };
        let matrices = projections
            .iter()
            .flat_map(|p| p.map(|m| &m.matrix))
            .chain(std::iter::once(&model.embed))
            .chain(model.head.as_ref());
        let mut readable = true;
        for m in matrices {
            readable &= host_readable(m);
        }
        if !readable || model.policy.compute != Dtype::Float32 || model.policy.kv != Dtype::Float32
        {
            return Ok(None);
        }
        let mut layers = Vec::with_capacity(model.layers.len());
        for (l, p) in model.layers.iter().zip(&projections) {
            let bias = |lin: &Linear| lin.bias.as_ref().map(to_vec).transpose();
            layers.push(HostLayer {
                attn_norm: to_vec(&l.attn_norm)?,
                mlp_norm: to_vec(&l.mlp_norm)?,
                q_norm: l
                    .attention()
                    .and_then(|a| a.q_norm.as_ref())
                    .map(to_vec)
                    .transpose()?,
                k_norm: l
                    .attention()
                    .and_then(|a| a.k_norm.as_ref())
                    .map(to_vec)
                    .transpose()?,
                attn_out_norm: l.attn_out_norm.as_ref().map(to_vec).transpose()?,
                mlp_out_norm: l.mlp_out_norm.as_ref().map(to_vec).transpose()?,
                biases: [
                    bias(p[0])?,
                    bias(p[1])?,
                    bias(p[2])?,
                    bias(p[3])?,
                    bias(p[4])?,
                    bias(p[5])?,
                    bias(p[6])?,
                ],
            });
        }
        Ok(Some(Self {
            layers,
            final_norm: to_vec(&model.final_norm)?,
            inv_freqs: inverse_frequencies(c, c.rope_theta, model.rotary.periods.as_ref())?,
            input_scale: model.rotary.input_scale.as_ref().map(to_vec).transpose()?,
            window_inv_freqs: c
                .sliding_window
                .as_ref()
                .and_then(|w| w.rope_theta)
                .map(|theta| inverse_frequencies(c, theta, None))
                .transpose()?,
        }))
    }
}

/// RoPE's inverse frequencies for base `theta` by MLX's own operations (those of its RoPE on
/// a CPU).
fn inverse_frequencies(c: &ModelConfig, theta: f32, periods: Option<&Array>) -> Result<Vec<f32>> {
    let inv = match periods {
        Some(p) => p.as_dtype(Dtype::Float32)?.reciprocal()?,
        None => {
            let half = (c.rope_dims / 2) as i32;
            let step = theta.ln() / half as f32;
            exp(arange::<_, f32>(0, -half, -1)?.multiply(Array::from_f32(step))?)?
        }
    };
    to_vec(&inv)
}

/// A matrix as the kernels read it.
enum HostMatrix<'a> {
    Packed(&'a PackedMatrix),
    Dense { w: &'a [f32], n: usize, k: usize },
}

fn host_matrix(m: &Matrix) -> Result<HostMatrix<'_>> {
    match m {
        Matrix::Codes(p) | Matrix::WithCodes { packed: p, .. } => Ok(HostMatrix::Packed(p)),
        Matrix::Dense(w) => Ok(HostMatrix::Dense {
            w: read(w)?,
            n: w.shape()[0] as usize,
            k: w.shape()[1] as usize,
        }),
        Matrix::Quantized(_) => Err(EngineError::Mlx(
            "a host pass over MLX-quantised weights".into(),
        )),
    }
}

/// `x · Wᵀ (+ bias)` for each matrix (all of `x`'s row length), `x` of `[rows, k]`: one
/// parallel pass over all of them when all are codes.
fn products<const N: usize>(
    matrices: [&HostMatrix<'_>; N],
    biases: [&Option<Vec<f32>>; N],
    x: &[f32],
    rows: usize,
) -> Result<[Vec<f32>; N]> {
    let packed: Vec<&PackedMatrix> = matrices
        .iter()
        .filter_map(|m| match m {
            HostMatrix::Packed(p) => Some(*p),
            HostMatrix::Dense { .. } => None,
        })
        .collect();
    let mut outs = if packed.len() == N {
        x_wt_many(&packed, x, rows)
    } else {
        matrices
            .iter()
            .map(|m| match m {
                HostMatrix::Packed(p) => p.x_wt(x, rows),
                HostMatrix::Dense { w, n, k } => {
                    strata_cpu_kernels::matmul::x_wt(x, rows, w, *n, *k)
                }
            })
            .collect()
    };
    for (out, bias) in outs.iter_mut().zip(biases) {
        if let Some(b) = bias {
            for row in out.chunks_exact_mut(b.len()) {
                for (y, b) in row.iter_mut().zip(b) {
                    *y += b;
                }
            }
        }
    }
    outs.try_into()
        .map_err(|_| EngineError::Mlx("a product group lost an output".into()))
}

/// RMSNorm of each `weight.len()`-wide row of `x` into `out`, as MLX's CPU computes it:
/// `x · rsqrt(mean(x²) + eps) · weight`.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    for (row, out) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        // Eight running sums, so that the loop vectorises.
        let mut acc = [0f32; 8];
        let mut chunks = row.chunks_exact(8);
        for c in &mut chunks {
            for (a, v) in acc.iter_mut().zip(c) {
                *a += v * v;
            }
        }
        let tail: f32 = chunks.remainder().iter().map(|v| v * v).sum();
        let mean = (acc.iter().sum::<f32>() + tail) / d as f32;
        let inv = 1.0 / (mean + eps).sqrt();
        for ((o, v), w) in out.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    }
}

/// `silu(gate) · up`, in place in `gate`.
fn swiglu(gate: &mut [f32], up: &[f32]) {
    strata_cpu_kernels::activation::swiglu(gate, up);
}

/// `gelu_tanh(gate) · up` (Gemma), in place in `gate`, in MLX's order of operations:
/// `0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 · x³)))`.
fn geglu(gate: &mut [f32], up: &[f32]) {
    let c = (2.0 / std::f32::consts::PI).sqrt();
    for (g, u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = 0.5 * x * (1.0 + (c * (x + 0.044715 * (x * x * x))).tanh()) * u;
    }
}

/// Gemma's norm on a block output, in place: `y = rms_norm(y) · weight`.
fn output_norm(y: &mut [f32], weight: &Option<Vec<f32>>, eps: f32) {
    if let Some(w) = weight {
        let input = y.to_vec();
        rms_norm(&input, w, eps, y);
    }
}

impl Model {
    /// Whether `host_forward` computes this batch: a CPU computing in f32 with host weights,
    /// a few rows, scores within bounds.
    pub(super) fn host_step_applies(&self, batch: &[SeqChunk<'_>]) -> bool {
        let rows: usize = batch.iter().map(|s| s.tokens.len()).sum();
        self.host.is_some()
            && rows <= HOST_MAX_ROWS
            && batch.iter().all(|s| {
                let t = s.tokens.len();
                t * self.config.num_heads * (s.cache.len() + t) <= HOST_MAX_SCORES
            })
    }

    /// `forward` (logits after each sequence's last new token, `[batch, vocab]`) computed by
    /// the host kernels. The batch is checked by the caller.
    pub(super) fn host_forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Array> {
        let host = self
            .host
            .as_ref()
            .ok_or_else(|| EngineError::Mlx("no host weights".into()))?;
        let ids: Vec<usize> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().map(|&t| t as usize))
            .collect();
        let mut x = self.host_embed(&ids)?;
        if let Some(scale) = self.config.embed_scale {
            for v in &mut x {
                *v *= scale;
            }
        }
        // Every sequence's RoPE position of each new token, in batch order.
        let mut positions = Vec::with_capacity(ids.len());
        for seq in batch.iter() {
            for (_, len, first) in seq.cache.position_runs(seq.tokens.len()) {
                positions.extend(first..first + len);
            }
        }
        // Everything the pass reads, as slices and pointers: MLX is called only here, on the
        // engine thread.
        let layers = self
            .layers
            .iter()
            .map(|l| {
                l.dense_projections()
                    .ok_or_else(|| EngineError::Mlx("a host pass over experts".into()))?
                    .map(|lin| host_matrix(&lin.matrix))
                    .into_iter()
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        let head = host_matrix(self.head.as_ref().unwrap_or(&self.embed))?;
        let mut kv = batch
            .iter_mut()
            .map(|seq| seq.cache.host_rows(seq.tokens.len()))
            .collect::<Result<Vec<_>>>()?;
        let pass = HostPass {
            config: &self.config,
            host,
            layers: &layers,
            head: &head,
            positions: &positions,
        };
        // The whole pass on one of the pool's threads: the kernels' parallel loops then start
        // from a worker and share work with the other by stealing, instead of waking the pool
        // and sleeping on a latch from outside it a few hundred times a step.
        let logits = rayon::scope(|_| pass.run(x, &mut kv))?;
        drop(kv);
        for seq in batch.iter_mut() {
            seq.cache.advance(seq.tokens.len());
        }
        let vocab = logits.len() / batch.len().max(1);
        Ok(Array::from_slice(
            &logits,
            &[batch.len() as i32, vocab as i32],
        ))
    }

    /// The input embeddings of `ids` (checked against the vocabulary), `[ids, hidden]`.
    fn host_embed(&self, ids: &[usize]) -> Result<Vec<f32>> {
        match host_matrix(&self.embed)? {
            HostMatrix::Packed(p) => p
                .gather_rows(ids)
                .ok_or_else(|| EngineError::Config("a token id past the embedding".into())),
            HostMatrix::Dense { w, n, k } => {
                let mut out = Vec::with_capacity(ids.len() * k);
                for &id in ids {
                    if id >= n {
                        return Err(EngineError::Config("a token id past the embedding".into()));
                    }
                    out.extend_from_slice(&w[id * k..(id + 1) * k]);
                }
                Ok(out)
            }
        }
    }
}

/// What one host pass reads: plain slices and shared references, so that it runs on any
/// thread.
struct HostPass<'a> {
    config: &'a ModelConfig,
    host: &'a HostWeights,
    /// Each layer's q, k, v, o, gate, up, down.
    layers: &'a [Vec<HostMatrix<'a>>],
    head: &'a HostMatrix<'a>,
    positions: &'a [usize],
}

impl HostPass<'_> {
    /// The layers and the head over the embeddings `x` (`[rows, hidden]`, sequences in
    /// batch order, `kv[i]` holding sequence i's new tokens): the logits after each
    /// sequence's last row, `[sequences, vocab]`.
    fn run(&self, mut x: Vec<f32>, kv: &mut [HostKv<'_>]) -> Result<Vec<f32>> {
        let c = self.config;
        let (h, hk, hd, d) = (c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size);
        let rows = self.positions.len();
        let scale = c.attention_scale;
        let mut normed = vec![0f32; rows * d];
        for (li, (m, hl)) in self.layers.iter().zip(&self.host.layers).enumerate() {
            rms_norm(&x, &hl.attn_norm, c.rms_norm_eps, &mut normed);
            let [mut q, mut k, v] = products(
                [&m[0], &m[1], &m[2]],
                [&hl.biases[0], &hl.biases[1], &hl.biases[2]],
                &normed,
                rows,
            )?;
            if let (Some(qn), Some(kn)) = (&hl.q_norm, &hl.k_norm) {
                let q_in = q.clone();
                rms_norm(&q_in, qn, c.rms_norm_eps, &mut q);
                let k_in = k.clone();
                rms_norm(&k_in, kn, c.rms_norm_eps, &mut k);
            }
            if !c.no_rope_layers.contains(&li) {
                let rotation = match (&self.host.window_inv_freqs, c.window_of(li)) {
                    // A sliding-window layer: its own base, none of the scaling.
                    (Some(inv_freqs), Some(_)) => Rotation {
                        inv_freqs,
                        position_scale: 1.0,
                        input_scale: None,
                    },
                    _ => Rotation {
                        inv_freqs: &self.host.inv_freqs,
                        position_scale: c.rope_scaling.position_scale(),
                        input_scale: self.host.input_scale.as_deref(),
                    },
                };
                rope(c, &rotation, &mut q, h, self.positions);
                rope(c, &rotation, &mut k, hk, self.positions);
            }
            if let Some(scaling) = c.query_scaling {
                for (row, &p) in q.chunks_exact_mut(h * hd).zip(self.positions) {
                    let factor = scaling.factor(p);
                    for v in row {
                        *v *= factor;
                    }
                }
            }
            let mut attended = Vec::with_capacity(rows * h * hd);
            let mut at = 0;
            for seq in kv.iter_mut() {
                let t = seq.new_tokens();
                let (from, to) = (at * hk * hd, (at + t) * hk * hd);
                seq.write(li, &k[from..to], &v[from..to])?;
                // The kernel takes queries head-major: [heads, t, dim].
                let mut qh = vec![0f32; t * h * hd];
                for i in 0..t {
                    for head in 0..h {
                        qh[(head * t + i) * hd..][..hd]
                            .copy_from_slice(&q[((at + i) * h + head) * hd..][..hd]);
                    }
                }
                let mut cache = seq
                    .buffers(li)
                    .ok_or_else(|| EngineError::Mlx(format!("no KV buffers for layer {li}")))?;
                cache.window = c.window_of(li);
                attended.extend(few_queries(&qh, h, t, cache, scale));
                at += t;
            }
            let [mut o] = products([&m[3]], [&hl.biases[3]], &attended, rows)?;
            output_norm(&mut o, &hl.attn_out_norm, c.rms_norm_eps);
            add_into(&mut x, &o);
            rms_norm(&x, &hl.mlp_norm, c.rms_norm_eps, &mut normed);
            let [mut gate, up] = products(
                [&m[4], &m[5]],
                [&hl.biases[4], &hl.biases[5]],
                &normed,
                rows,
            )?;
            if c.arch.is_gemma() {
                geglu(&mut gate, &up);
            } else {
                swiglu(&mut gate, &up);
            }
            let [mut down] = products([&m[6]], [&hl.biases[6]], &gate, rows)?;
            output_norm(&mut down, &hl.mlp_out_norm, c.rms_norm_eps);
            add_into(&mut x, &down);
        }
        // Each sequence's last row through the final norm and the head.
        let mut last = Vec::with_capacity(kv.len() * d);
        let mut end = 0;
        for seq in kv.iter() {
            end += seq.new_tokens();
            last.extend_from_slice(&x[(end - 1) * d..end * d]);
        }
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &self.host.final_norm, c.rms_norm_eps, &mut normed);
        let [logits] = products([self.head], [&None], &normed, kv.len())?;
        Ok(logits)
    }
}

/// How one layer rotates positions.
struct Rotation<'a> {
    inv_freqs: &'a [f32],
    position_scale: f32,
    /// Longrope's factor on the rotated dimensions (`[head_dim]`).
    input_scale: Option<&'a [f32]>,
}

/// RoPE in place on `x` (`[rows, heads · head_dim]`), row r at `positions[r]`: MLX's
/// fallback arithmetic (angle = (position · scale) · inverse frequency, then
/// `x1·cos − x2·sin`, `x1·sin + x2·cos`) on pairs of halves, or of neighbours when
/// `rope_traditional`.
fn rope(
    c: &ModelConfig,
    rotation: &Rotation<'_>,
    x: &mut [f32],
    heads: usize,
    positions: &[usize],
) {
    let hd = c.head_dim;
    let half = c.rope_dims / 2;
    let position_scale = rotation.position_scale;
    let mut cos = vec![0f32; half];
    let mut sin = vec![0f32; half];
    for (row, &p) in x.chunks_exact_mut(heads * hd).zip(positions) {
        let position = p as f32 * position_scale;
        for i in 0..half {
            let theta = position * rotation.inv_freqs[i];
            cos[i] = theta.cos();
            sin[i] = theta.sin();
        }
        for head in row.chunks_exact_mut(hd) {
            if let Some(s) = rotation.input_scale {
                for (v, s) in head.iter_mut().zip(s) {
                    *v *= s;
                }
            }
            for i in 0..half {
                let (a, b) = if c.rope_traditional {
                    (2 * i, 2 * i + 1)
                } else {
                    (i, i + half)
                };
                let (x1, x2) = (head[a], head[b]);
                head[a] = x1 * cos[i] - x2 * sin[i];
                head[b] = x1 * sin[i] + x2 * cos[i];
            }
        }
    }
}

fn add_into(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
