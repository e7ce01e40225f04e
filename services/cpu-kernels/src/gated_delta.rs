//! Gated DeltaNet's token mixer (Qwen3.5, Qwen3-Next): a causal depthwise convolution over the
//! projected queries, keys and values, then the gated delta rule, a recurrence over a state
//! matrix per value head, and a gated RMSNorm of its readout. The arithmetic of mlx-lm's
//! `GatedDeltaNet` with its ops-based recurrence (`gated_delta_ops`, what it runs on a CPU),
//! one f32 operation at a time:
//!
//! ```text
//! x_t      = silu(conv1d([conv_state; qkv_t]))          split into q_t, k_t, v_t
//! q_t, k_t = l2-normalised (q also scaled by 1/key_dim, k by 1/sqrt(key_dim))
//! g_t      = exp(-exp(A_log) * softplus(a_t + dt_bias)),  beta_t = sigmoid(b_t)
//! S        = g_t * S;  S += (beta_t * (v_t - S k_t)) k_tᵀ;  y_t = S q_t
//! out_t    = rms_norm(y_t, norm) * silu(z_t)
//! ```
//!
//! Why by hand: MLX has no such kernel on its CPU (mlx-lm loops over tokens with a dozen small
//! operations each, a graph node per token and head), and the state is what the prefix cache
//! snapshots, so it lives on the host as plain floats anyway. Value heads are independent and
//! run in parallel; each walks its tokens in order.

use rayon::prelude::*;

/// The widths of one linear-attention layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl Shape {
    /// Channels of the convolution: queries, keys, values.
    pub fn channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
    /// Floats of the convolution's state: its last `conv_kernel - 1` inputs.
    pub fn conv_floats(&self) -> usize {
        (self.conv_kernel - 1) * self.channels()
    }
    /// Floats of the recurrent state: `[value_heads, value_dim, key_dim]`.
    pub fn state_floats(&self) -> usize {
        self.value_heads * self.value_dim * self.key_dim
    }
}

/// A layer's own parameters.
pub struct Weights<'a> {
    /// The depthwise convolution, `[channels, conv_kernel]` (the last tap on the newest input).
    pub conv: &'a [f32],
    /// Per value head.
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
    /// The gated RMSNorm's weight, `[value_dim]`, and its epsilon.
    pub norm: &'a [f32],
    pub eps: f32,
}

/// One sequence's new tokens: the projections of its `t` tokens, row by row.
pub struct Inputs<'a> {
    /// `[t, channels]`.
    pub qkv: &'a [f32],
    /// `[t, value_heads * value_dim]`: the output gate.
    pub z: &'a [f32],
    /// `[t, value_heads]` each.
    pub b: &'a [f32],
    pub a: &'a [f32],
}

/// The state of one layer for one sequence.
pub struct State<'a> {
    /// `[conv_kernel - 1, channels]`, oldest input first.
    pub conv: &'a mut [f32],
    /// `[value_heads, value_dim, key_dim]`.
    pub recurrent: &'a mut [f32],
}

/// Runs `t` tokens through the layer's mixer, updating `state`; returns the mixer's output
/// before its output projection (`[t, value_heads * value_dim]`) and, for each index `i` in
/// `snapshots_after` (ascending, each < t), a copy of the state after token `i`: convolution
/// floats then recurrent ones, `Shape::conv_floats + state_floats` each.
pub fn forward(
    shape: Shape,
    weights: &Weights<'_>,
    inputs: &Inputs<'_>,
    state: State<'_>,
    snapshots_after: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let Shape {
        key_heads,
        value_heads,
        key_dim,
        value_dim,
        conv_kernel,
    } = shape;
    let channels = shape.channels();
    let t = inputs.qkv.len() / channels.max(1);
    let taps = conv_kernel - 1;
    let key_width = key_heads * key_dim;
    // The convolution, token by token (its state shifts), then the q/k normalisation.
    let mut mixed = vec![0f32; t * channels];
    let mut conv_snapshots: Vec<Vec<f32>> = Vec::with_capacity(snapshots_after.len());
    let mut next_snapshot = snapshots_after.iter().peekable();
    for i in 0..t {
        let x = &inputs.qkv[i * channels..(i + 1) * channels];
        let out = &mut mixed[i * channels..(i + 1) * channels];
        for c in 0..channels {
            let w = &weights.conv[c * conv_kernel..(c + 1) * conv_kernel];
            let mut sum = 0f32;
            for (j, wj) in w[..taps].iter().enumerate() {
                sum += wj * state.conv[j * channels + c];
            }
            sum += w[taps] * x[c];
            out[c] = silu(sum);
        }
        if taps > 0 {
            state.conv.copy_within(channels.., 0);
            state.conv[(taps - 1) * channels..].copy_from_slice(x);
        }
        if next_snapshot.peek() == Some(&&i) {
            next_snapshot.next();
            conv_snapshots.push(state.conv.to_vec());
        }
        // l2 normalisation as mlx-lm's `normalize_qk` writes it (an RMSNorm without weight
        // whose epsilon is scaled to sit on the mean of squares), the readout scale folded in.
        let inv = (key_dim as f32).powf(-0.5);
        let eps = 1e-6 * inv * inv;
        for head in 0..2 * key_heads {
            let v = &mut out[head * key_dim..(head + 1) * key_dim];
            let factor = if head < key_heads { inv * inv } else { inv };
            let mean = v.iter().map(|x| x * x).sum::<f32>() / key_dim as f32;
            let r = 1.0 / (mean + eps).sqrt();
            for x in v.iter_mut() {
                *x = factor * (*x * r);
            }
        }
    }
    // The recurrence: each value head on its own, reading its key head's q and k.
    let group = value_heads / key_heads;
    let head_floats = value_dim * key_dim;
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = state
        .recurrent
        .par_chunks_mut(head_floats)
        .enumerate()
        .map(|(h, s)| {
            let kh = h / group;
            let a_log = weights.a_log[h].exp();
            let mut y = vec![0f32; t * value_dim];
            let mut snaps = Vec::with_capacity(snapshots_after.len() * head_floats);
            let mut next = snapshots_after.iter().peekable();
            let mut kv_mem = vec![0f32; value_dim];
            for i in 0..t {
                let row = &mixed[i * channels..(i + 1) * channels];
                let q = &row[kh * key_dim..(kh + 1) * key_dim];
                let k = &row[key_width + kh * key_dim..key_width + (kh + 1) * key_dim];
                let v = &row[2 * key_width + h * value_dim..2 * key_width + (h + 1) * value_dim];
                let beta = sigmoid(inputs.b[i * value_heads + h]);
                let g =
                    (-a_log * softplus(inputs.a[i * value_heads + h] + weights.dt_bias[h])).exp();
                for (d, mem) in kv_mem.iter_mut().enumerate() {
                    let srow = &mut s[d * key_dim..(d + 1) * key_dim];
                    let mut acc = 0f32;
                    for (sv, kv) in srow.iter_mut().zip(k) {
                        *sv *= g;
                        acc += *sv * kv;
                    }
                    *mem = acc;
                }
                let out = &mut y[i * value_dim..(i + 1) * value_dim];
                for (d, o) in out.iter_mut().enumerate() {
                    let delta = (v[d] - kv_mem[d]) * beta;
                    let srow = &mut s[d * key_dim..(d + 1) * key_dim];
                    let mut acc = 0f32;
                    for ((sv, kv), qv) in srow.iter_mut().zip(k).zip(q) {
                        *sv += kv * delta;
                        acc += *sv * qv;
                    }
                    *o = acc;
                }
                if next.peek() == Some(&&i) {
                    next.next();
                    snaps.extend_from_slice(s);
                }
            }
            (y, snaps)
        })
        .collect();
    // The gated RMSNorm of each head's readout, in token-major order.
    let width = value_heads * value_dim;
    let mut out = vec![0f32; t * width];
    for (h, (y, _)) in per_head.iter().enumerate() {
        for i in 0..t {
            let yi = &y[i * value_dim..(i + 1) * value_dim];
            let z = &inputs.z[i * width + h * value_dim..i * width + (h + 1) * value_dim];
            let mean = yi.iter().map(|x| x * x).sum::<f32>() / value_dim as f32;
            let r = 1.0 / (mean + weights.eps).sqrt();
            let dst = &mut out[i * width + h * value_dim..i * width + (h + 1) * value_dim];
            for d in 0..value_dim {
                dst[d] = silu(z[d]) * (weights.norm[d] * (yi[d] * r));
            }
        }
    }
    let snapshots = conv_snapshots
        .into_iter()
        .enumerate()
        .map(|(n, conv)| {
            let mut snap = conv;
            snap.reserve(shape.state_floats());
            for (_, heads) in &per_head {
                snap.extend_from_slice(&heads[n * head_floats..(n + 1) * head_floats]);
            }
            snap
        })
        .collect();
    (out, snapshots)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn silu(x: f32) -> f32 {
    x * sigmoid(x)
}

/// `log(1 + e^x)` as MLX's `logaddexp(x, 0)` computes it, without overflow.
fn softplus(x: f32) -> f32 {
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_values::values;

    const SHAPE: Shape = Shape {
        key_heads: 2,
        value_heads: 4,
        key_dim: 8,
        value_dim: 6,
        conv_kernel: 4,
    };

    struct Layer {
        conv: Vec<f32>,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        norm: Vec<f32>,
    }

    fn layer() -> Layer {
        Layer {
            conv: values(SHAPE.channels() * SHAPE.conv_kernel, 1),
            a_log: values(SHAPE.value_heads, 2),
            dt_bias: values(SHAPE.value_heads, 3),
            norm: values(SHAPE.value_dim, 4),
        }
    }

    fn run(
        l: &Layer,
        t: std::ops::Range<usize>,
        all: &[Vec<f32>; 4],
        state: (&mut [f32], &mut [f32]),
        snaps: &[usize],
    ) -> (Vec<f32>, Vec<Vec<f32>>) {
        let width = [SHAPE.channels(), SHAPE.value_heads * SHAPE.value_dim];
        let part = |v: &[f32], w: usize| v[t.start * w..t.end * w].to_vec();
        let (qkv, z) = (part(&all[0], width[0]), part(&all[1], width[1]));
        let (b, a) = (
            part(&all[2], SHAPE.value_heads),
            part(&all[3], SHAPE.value_heads),
        );
        let weights = Weights {
            conv: &l.conv,
            a_log: &l.a_log,
            dt_bias: &l.dt_bias,
            norm: &l.norm,
            eps: 1e-6,
        };
        let inputs = Inputs {
            qkv: &qkv,
            z: &z,
            b: &b,
            a: &a,
        };
        let state = State {
            conv: state.0,
            recurrent: state.1,
        };
        forward(SHAPE, &weights, &inputs, state, snaps)
    }

    /// Chunks carried by the state compute what one pass computes, and a snapshot taken
    /// mid-chunk resumes exactly where that pass was: what prefill in chunks and a cache hit
    /// at a snapshot rely on.
    #[test]
    fn chunks_and_snapshots_resume_the_recurrence_exactly() {
        let l = layer();
        let t = 23;
        let all = [
            values(t * SHAPE.channels(), 5),
            values(t * SHAPE.value_heads * SHAPE.value_dim, 6),
            values(t * SHAPE.value_heads, 7),
            values(t * SHAPE.value_heads, 8),
        ];
        let fresh = || {
            (
                vec![0f32; SHAPE.conv_floats()],
                vec![0f32; SHAPE.state_floats()],
            )
        };
        let (mut c, mut s) = fresh();
        let (whole, snaps) = run(&l, 0..t, &all, (&mut c, &mut s), &[4, 15]);
        assert_eq!(snaps.len(), 2);
        assert!(whole.iter().all(|x| x.is_finite()));
        assert!(whole.iter().any(|&x| x.abs() > 1e-3), "output all but zero");

        let (mut c2, mut s2) = fresh();
        let (first, _) = run(&l, 0..9, &all, (&mut c2, &mut s2), &[]);
        let (second, _) = run(&l, 9..t, &all, (&mut c2, &mut s2), &[]);
        let width = SHAPE.value_heads * SHAPE.value_dim;
        assert_eq!(&whole[..9 * width], &first[..]);
        assert_eq!(&whole[9 * width..], &second[..]);
        assert_eq!((c2.clone(), s2.clone()), (c.clone(), s.clone()));

        // Resume from the snapshot after token 15: tokens 16.. as the whole pass had them.
        let snap = &snaps[1];
        let (mut c3, mut s3) = (
            snap[..SHAPE.conv_floats()].to_vec(),
            snap[SHAPE.conv_floats()..].to_vec(),
        );
        let (rest, _) = run(&l, 16..t, &all, (&mut c3, &mut s3), &[]);
        assert_eq!(&whole[16 * width..], &rest[..]);
        assert_eq!((c3, s3), (c, s));
    }

    /// One token against a plain transcription of the update rule in f64.
    #[test]
    fn one_step_is_the_gated_delta_rule() {
        let l = layer();
        let all = [
            values(SHAPE.channels(), 9),
            values(SHAPE.value_heads * SHAPE.value_dim, 10),
            values(SHAPE.value_heads, 11),
            values(SHAPE.value_heads, 12),
        ];
        let mut conv = values(SHAPE.conv_floats(), 13);
        let mut state = values(SHAPE.state_floats(), 14);
        let (conv0, state0) = (conv.clone(), state.clone());
        let (out, _) = run(&l, 0..1, &all, (&mut conv, &mut state), &[]);
        let (k, dk, dv, ch) = (
            SHAPE.conv_kernel,
            SHAPE.key_dim,
            SHAPE.value_dim,
            SHAPE.channels(),
        );
        let silu = |x: f64| x / (1.0 + (-x).exp());
        let mixed: Vec<f64> = (0..ch)
            .map(|c| {
                let mut s = 0.0;
                for j in 0..k - 1 {
                    s += l.conv[c * k + j] as f64 * conv0[j * ch + c] as f64;
                }
                silu(s + l.conv[c * k + k - 1] as f64 * all[0][c] as f64)
            })
            .collect();
        let l2 = |v: &[f64]| -> Vec<f64> {
            let n = (v.iter().map(|x| x * x).sum::<f64>() + 1e-6).sqrt();
            v.iter().map(|x| x / n).collect()
        };
        let kw = SHAPE.key_heads * dk;
        for h in 0..SHAPE.value_heads {
            let kh = h / (SHAPE.value_heads / SHAPE.key_heads);
            let q: Vec<f64> = l2(&mixed[kh * dk..(kh + 1) * dk])
                .iter()
                .map(|x| x / (dk as f64).sqrt())
                .collect();
            let kk = l2(&mixed[kw + kh * dk..kw + (kh + 1) * dk]);
            let v = &mixed[2 * kw + h * dv..2 * kw + (h + 1) * dv];
            let beta = 1.0 / (1.0 + (-(all[2][h] as f64)).exp());
            let x = all[3][h] as f64 + l.dt_bias[h] as f64;
            let g = (-(l.a_log[h] as f64).exp() * (1.0 + x.exp()).ln()).exp();
            let mut s: Vec<f64> = state0[h * dv * dk..(h + 1) * dv * dk]
                .iter()
                .map(|&x| x as f64 * g)
                .collect();
            let mut y = vec![0.0; dv];
            for d in 0..dv {
                let mem: f64 = (0..dk).map(|j| s[d * dk + j] * kk[j]).sum();
                let delta = (v[d] - mem) * beta;
                for j in 0..dk {
                    s[d * dk + j] += kk[j] * delta;
                }
                y[d] = (0..dk).map(|j| s[d * dk + j] * q[j]).sum();
            }
            let rms = (y.iter().map(|x| x * x).sum::<f64>() / dv as f64 + 1e-6).sqrt();
            for d in 0..dv {
                let z = all[1][h * dv + d] as f64;
                let want = silu(z) * l.norm[d] as f64 * y[d] / rms;
                let got = out[h * dv + d] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "head {h} dim {d}: {got} vs {want}"
                );
            }
            for j in 0..dv * dk {
                let got = state[h * dv * dk + j] as f64;
                assert!((got - s[j]).abs() <= 1e-5 * (1.0 + s[j].abs()));
            }
        }
    }
}
