//! The Gated DeltaNet token mixer as MLX operations, for a GPU: the same arithmetic as
//! `strata_cpu_kernels::gated_delta` (causal convolution, normalised queries and keys, gated
//! delta rule, gated RMSNorm) without leaving the device. Written by hand: MLX has a kernel
//! for the recurrence on Metal only, and mlx-lm elsewhere loops over tokens with a dozen
//! small operations each, a few hundred thousand launches for a 32K-token prompt.
//!
//! A prompt runs in the chunked form of the delta rule (the WY representation of Yang et al.,
//! "Gated Delta Networks"): inside a chunk of `CHUNK` tokens every interaction is a matrix
//! product, done for all chunks at once; only the state's hand-over from one chunk to the next
//! is sequential, four products a chunk. With the state `S` (`[Dv, Dk]` a head), a chunk's
//! cumulative decay `Γ` and `A[t][j] = β_t Γ_t/Γ_j (k_t·k_j)` for `j < t`:
//!
//! ```text
//!   U = (I + A)⁻¹ (β V − β Γ K Sᵀ)        the values each token writes
//!   Y = Γ Q Sᵀ + (D ∘ Q Kᵀ) U             outputs, D[t][j] = Γ_t/Γ_j for j <= t
//!   S' = Γ_C S + Uᵀ (Γ_C/Γ K)             the state after the chunk
//! ```
//! `(I + A)⁻¹` is a product of `(I + X^(2^i))` with `X = −A`, exact because `A` is strictly
//! lower triangular. A decode step (a few tokens) runs the rule token by token.

use mlx_rs::fast;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{broadcast_to, concatenate, conv1d, logaddexp, matmul, sigmoid, tri, zeros};
use mlx_rs::{Array, Dtype};
use strata_cpu_kernels::gated_delta::Shape;

use super::super::Result;

/// Tokens per chunk of the chunked form: its triangular solve is six products of
/// `CHUNK x CHUNK` matrices, its sequential part `tokens / CHUNK` steps.
const CHUNK: i32 = 64;
/// Squarings in `(I + A)⁻¹ = (I + X)(I + X²)(I + X⁴)...`: `2^(SQUARINGS + 1) >= CHUNK`.
const SQUARINGS: usize = 5;
/// Up to this many tokens run token by token (a decode step, a short resumed tail).
const STEP_TOKENS: i32 = 4;

/// A layer's own weights, f32, on the device.
pub(super) struct DeviceWeights {
    /// The depthwise convolution in conv1d's layout, `[channels, kernel, 1]`.
    pub conv: Array,
    pub a_log: Array,
    pub dt_bias: Array,
    pub norm: Array,
    pub eps: f32,
}

impl DeviceWeights {
    /// From the host copies `GatedDeltaNet` keeps (convolution `[channels, kernel]`).
    pub fn new(
        shape: Shape,
        conv: &[f32],
        a_log: &[f32],
        dt_bias: &[f32],
        norm: &[f32],
        eps: f32,
    ) -> Result<Self> {
        let (channels, kernel) = (shape.channels() as i32, shape.conv_kernel as i32);
        let conv = Array::from_slice(conv, &[channels, kernel, 1]);
        let weights = Self {
            conv,
            a_log: Array::from_slice(a_log, &[a_log.len() as i32]),
            dt_bias: Array::from_slice(dt_bias, &[dt_bias.len() as i32]),
            norm: Array::from_slice(norm, &[norm.len() as i32]),
            eps,
        };
        for a in [
            &weights.conv,
            &weights.a_log,
            &weights.dt_bias,
            &weights.norm,
        ] {
            a.eval()?;
        }
        Ok(weights)
    }
}

/// One sequence's projections for a chunk of `t` tokens (any float dtype).
pub(super) struct DeviceInputs<'a> {
    /// `[t, channels]`
    pub qkv: &'a Array,
    /// `[t, value_heads * value_dim]`
    pub z: &'a Array,
    /// `[t, value_heads]`
    pub b: &'a Array,
    /// `[t, value_heads]`
    pub a: &'a Array,
}

/// What a chunk leaves: its outputs (`[t, value_heads * value_dim]`, f32, before
/// `out_proj`), the state after it, and the states after each asked-for token, all in
/// `KvCache::recurrent_array`'s layout.
pub(super) struct DeviceOutputs {
    pub out: Array,
    pub state: Array,
    pub snapshots: Vec<Array>,
}

fn f32(a: &Array) -> Result<Array> {
    Ok(a.as_dtype(Dtype::Float32)?)
}

fn silu(x: &Array) -> Result<Array> {
    Ok(x.multiply(sigmoid(x)?)?)
}

fn softplus(x: &Array) -> Result<Array> {
    // log(e^x + 1), one fused operation (a decode step runs a few thousand small ones).
    Ok(logaddexp(x, Array::from_f32(0.0))?)
}

/// `x` (`[rows, heads, dim]`) scaled to unit RMS (with `eps`) times `factor`.
fn unit_rms(x: &Array, eps: f32, factor: f32) -> Result<Array> {
    Ok(fast::rms_norm(x, None, eps)?.multiply(Array::from_f32(factor))?)
}

/// Runs `inputs` through the mixer from `state`; `snapshots_after` are indices (ascending)
/// of tokens after which the state is also returned.
pub(super) fn forward(
    shape: Shape,
    weights: &DeviceWeights,
    inputs: &DeviceInputs<'_>,
    state: &Array,
    snapshots_after: &[usize],
) -> Result<DeviceOutputs> {
    let (hk, hv) = (shape.key_heads as i32, shape.value_heads as i32);
    let (dk, dv) = (shape.key_dim as i32, shape.value_dim as i32);
    let (channels, kernel) = (shape.channels() as i32, shape.conv_kernel as i32);
    let taps = kernel - 1;
    let conv_floats = shape.conv_floats() as i32;
    let t = inputs.qkv.shape()[0];

    // The causal convolution over the last `taps` inputs and this chunk's.
    let conv_state = state.try_index(..conv_floats)?.reshape(&[taps, channels])?;
    let s0 = state.try_index(conv_floats..)?.reshape(&[hv, dv, dk])?;
    let xs = concatenate(&[conv_state, f32(inputs.qkv)?], 0)?;
    // One depthwise convolution (MLX's conv1d with a group per channel, cross-correlation
    // as the host kernel computes it): `[1, taps + t, channels]` -> `[1, t, channels]`.
    let conv = conv1d(
        xs.expand_dims(0)?,
        &weights.conv,
        None,
        None,
        None,
        channels,
    )?
    .squeeze_axes(&[0])?;
    let mixed = silu(&conv)?;
    let conv_after =
        |i: i32| -> Result<Array> { Ok(xs.try_index(i + 1..i + 1 + taps)?.flatten(None, None)?) };

    // Queries and keys per key head, normalised as mlx-lm does, shared by its value heads.
    let key_width = hk * dk;
    let inv = (dk as f32).powf(-0.5);
    let eps = 1e-6 * inv * inv;
    let group = hv / hk;
    let per_value_head = |x: Array| -> Result<Array> {
        Ok(
            broadcast_to(x.reshape(&[t, hk, 1, dk])?, &[t, hk, group, dk])?
                .reshape(&[t, hv, dk])?,
        )
    };
    let q = per_value_head(unit_rms(
        &mixed.try_index((.., ..key_width))?.reshape(&[t, hk, dk])?,
        eps,
        inv * inv,
    )?)?;
    let k = per_value_head(unit_rms(
        &mixed
            .try_index((.., key_width..2 * key_width))?
            .reshape(&[t, hk, dk])?,
        eps,
        inv,
    )?)?;
    let v = mixed
        .try_index((.., 2 * key_width..))?
        .reshape(&[t, hv, dv])?;
    let beta = sigmoid(f32(inputs.b)?)?;
    // log g: the decay of each token, per value head.
    let log_g = weights
        .a_log
        .exp()?
        .multiply(softplus(&f32(inputs.a)?.add(&weights.dt_bias)?)?)?
        .negative()?;

    let recurrence = Recurrence {
        hv,
        dk,
        dv,
        q,
        k,
        v,
        beta,
        log_g,
    };
    let (y, s, states) = if t <= STEP_TOKENS {
        recurrence.by_token(s0, snapshots_after)?
    } else {
        recurrence.by_chunk(s0, snapshots_after)?
    };

    // The gated RMSNorm of each head's output.
    let z = f32(inputs.z)?.reshape(&[t, hv, dv])?;
    let out = fast::rms_norm(&y, Some(&weights.norm), weights.eps)?
        .multiply(silu(&z)?)?
        .reshape(&[t, hv * dv])?;
    let whole = |conv: Array, s: &Array| -> Result<Array> {
        Ok(concatenate(&[conv, s.flatten(None, None)?], 0)?)
    };
    let state = whole(conv_after(t - 1)?, &s)?;
    let snapshots = snapshots_after
        .iter()
        .zip(&states)
        .map(|(&i, s)| whole(conv_after(i as i32)?, s))
        .collect::<Result<Vec<_>>>()?;
    Ok(DeviceOutputs {
        out,
        state,
        snapshots,
    })
}

/// The delta rule's inputs for `t` tokens: `q`, `k` `[t, hv, dk]` (normalised), `v`
/// `[t, hv, dv]`, `beta` and `log_g` `[t, hv]`, all f32.
struct Recurrence {
    hv: i32,
    dk: i32,
    dv: i32,
    q: Array,
    k: Array,
    v: Array,
    beta: Array,
    log_g: Array,
}

/// What running the rule over some tokens gives: outputs `[t, hv, dv]`, the state after the
/// last token, and the states after each asked-for token.
type Stepped = (Array, Array, Vec<Array>);

impl Recurrence {
    /// Token by token: outputs `[t, hv, dv]`, the final state and the states after
    /// `snapshots_after`.
    fn by_token(&self, mut s: Array, snapshots_after: &[usize]) -> Result<Stepped> {
        let (hv, dk, dv) = (self.hv, self.dk, self.dv);
        let t = self.q.shape()[0];
        let mut ys = Vec::with_capacity(t as usize);
        let mut states = Vec::with_capacity(snapshots_after.len());
        for i in 0..t {
            let q = self.q.try_index(i)?.reshape(&[hv, dk, 1])?;
            let k = self.k.try_index(i)?.reshape(&[hv, dk, 1])?;
            let v = self.v.try_index(i)?.reshape(&[hv, dv, 1])?;
            let g = self.log_g.try_index(i)?.exp()?.reshape(&[hv, 1, 1])?;
            let beta = self.beta.try_index(i)?.reshape(&[hv, 1, 1])?;
            s = s.multiply(g)?;
            let delta = v.subtract(matmul(&s, &k)?)?.multiply(beta)?;
            s = s.add(matmul(&delta, k.transpose_axes(&[0, 2, 1])?)?)?;
            ys.push(matmul(&s, &q)?.reshape(&[1, hv, dv])?);
            if snapshots_after.contains(&(i as usize)) {
                states.push(s.clone());
            }
        }
        Ok((concatenate(&ys, 0)?, s, states))
    }

    /// The chunked form. The tokens are cut into segments ending after each snapshot point
    /// and at the end, each padded with identity steps (`k = v = 0`, `β = 0`, no decay) to
    /// whole chunks, so that every snapshot is a state between two chunks.
    fn by_chunk(&self, mut s: Array, snapshots_after: &[usize]) -> Result<Stepped> {
        let (hv, dk, dv) = (self.hv, self.dk, self.dv);
        let t = self.q.shape()[0];
        let mut ends: Vec<i32> = snapshots_after
            .iter()
            .map(|&i| i as i32 + 1)
            .filter(|&e| e < t)
            .collect();
        ends.push(t);
        ends.dedup();
        // (first token, tokens, first chunk, chunks) of each segment.
        let mut segments = Vec::with_capacity(ends.len());
        let (mut start, mut chunks) = (0, 0);
        for &end in &ends {
            let n = (end - start + CHUNK - 1) / CHUNK;
            segments.push((start, end - start, chunks, n));
            chunks += n;
            start = end;
        }
        let padded = |x: &Array| -> Result<Array> {
            let mut parts = Vec::with_capacity(2 * segments.len());
            for &(first, len, _, n) in &segments {
                parts.push(x.try_index(first..first + len)?);
                if n * CHUNK > len {
                    let mut pad = x.shape().to_vec();
                    pad[0] = n * CHUNK - len;
                    parts.push(zeros::<f32>(&pad)?);
                }
            }
            Ok(concatenate(&parts, 0)?)
        };
        // `[hv, chunks, CHUNK, ...]`: heads and chunks are batch axes of every product.
        let chunked = |x: &Array, d: i32| -> Result<Array> {
            Ok(padded(x)?
                .transpose_axes(&[1, 0, 2])?
                .reshape(&[hv, chunks, CHUNK, d])?)
        };
        let (q, k, v) = (
            chunked(&self.q, dk)?,
            chunked(&self.k, dk)?,
            chunked(&self.v, dv)?,
        );
        let rows = |x: &Array| -> Result<Array> {
            Ok(padded(x)?
                .transpose_axes(&[1, 0])?
                .reshape(&[hv, chunks, CHUNK])?)
        };
        let (beta, log_g) = (rows(&self.beta)?, rows(&self.log_g)?);

        let cum = log_g.cumsum(-1, None, None)?;
        let lower = tri::<f32>(CHUNK, None, Some(0))?;
        let strictly_lower = tri::<f32>(CHUNK, None, Some(-1))?;
        // D[t][j] = Γ_t / Γ_j for j <= t, else 0 (masked before `exp`: above the diagonal the
        // exponent is positive and may overflow).
        let diff = cum.expand_dims(-1)?.subtract(cum.expand_dims(-2)?)?;
        let decay = diff.multiply(&lower)?.exp()?.multiply(&lower)?;
        let key_t = k.transpose_axes(&[0, 1, 3, 2])?;
        let a = matmul(&k, &key_t)?
            .multiply(&decay)?
            .multiply(beta.expand_dims(-1)?)?
            .multiply(&strictly_lower)?;
        // (I + A)⁻¹ = (I + X)(I + X²)(I + X⁴)... with X = −A, nilpotent.
        let mut power = a.negative()?;
        let mut inverse = power.add(Array::eye::<f32>(CHUNK, None, None)?)?;
        for _ in 0..SQUARINGS {
            power = matmul(&power, &power)?;
            inverse = inverse.add(matmul(&inverse, &power)?)?;
        }
        let gamma = cum.exp()?;
        let written = matmul(&inverse, v.multiply(beta.expand_dims(-1)?)?)?;
        let by_state = matmul(
            &inverse,
            k.multiply(beta.multiply(&gamma)?.expand_dims(-1)?)?,
        )?;
        let q_decayed = q.multiply(gamma.expand_dims(-1)?)?;
        let within = matmul(&q, &key_t)?.multiply(&decay)?;
        let last = cum.try_index((.., .., CHUNK - 1..))?;
        let k_to_end = k.multiply(last.subtract(&cum)?.exp()?.expand_dims(-1)?)?;
        let end_decay = last.exp()?.expand_dims(-1)?;

        let mut ys = Vec::with_capacity(chunks as usize);
        let mut states = Vec::with_capacity(snapshots_after.len());
        let mut segment = segments.iter().peekable();
        for c in 0..chunks {
            let s_t = s.transpose_axes(&[0, 2, 1])?;
            let u = written
                .try_index((.., c))?
                .subtract(matmul(by_state.try_index((.., c))?, &s_t)?)?;
            ys.push(
                matmul(q_decayed.try_index((.., c))?, &s_t)?
                    .add(matmul(within.try_index((.., c))?, &u)?)?,
            );
            s = s.multiply(end_decay.try_index((.., c))?)?.add(matmul(
                u.transpose_axes(&[0, 2, 1])?,
                k_to_end.try_index((.., c))?,
            )?)?;
            if let Some(&&(_, _, first, n)) = segment.peek()
                && c == first + n - 1
            {
                segment.next();
                if states.len() < snapshots_after.len() {
                    states.push(s.clone());
                }
            }
        }
        // `[hv, chunks * CHUNK, dv]` -> each segment's own rows, `[t, hv, dv]`.
        let y = concatenate(&ys, 1)?.transpose_axes(&[1, 0, 2])?;
        let mut parts = Vec::with_capacity(segments.len());
        for &(_, len, first, _) in &segments {
            parts.push(y.try_index(first * CHUNK..first * CHUNK + len)?);
        }
        Ok((concatenate(&parts, 0)?, s, states))
    }
}
