//! Smoke test through real MLX: one pre-norm transformer block (RMSNorm, grouped-query
//! attention with RoPE and a causal mask, SwiGLU MLP, residuals) with random weights, run by
//! MLX on the CPU and checked against the same block computed in plain Rust with f64.

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::{Array, Device};

const T: usize = 7; // tokens
const D: usize = 48; // hidden size
const H: usize = 6; // query heads
const HK: usize = 2; // key/value heads (grouped-query attention)
const HD: usize = D / H; // head dim
const F: usize = 96; // MLP size
const EPS: f64 = 1e-5;
const ROPE_BASE: f64 = 10_000.0;

/// Deterministic weights without a dependency: SplitMix64 mapped to [-scale, scale).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
    fn vec(&mut self, n: usize, scale: f64) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() * 2.0 - 1.0) * scale) as f32)
            .collect()
    }
}

struct Weights {
    x: Vec<f32>,         // [T, D]
    attn_norm: Vec<f32>, // [D]
    wq: Vec<f32>,        // [H*HD, D] (out, in), as in checkpoints
    wk: Vec<f32>,        // [HK*HD, D]
    wv: Vec<f32>,        // [HK*HD, D]
    wo: Vec<f32>,        // [D, H*HD]
    mlp_norm: Vec<f32>,  // [D]
    w_gate: Vec<f32>,    // [F, D]
    w_up: Vec<f32>,      // [F, D]
    w_down: Vec<f32>,    // [D, F]
}

fn weights() -> Weights {
    let mut r = Rng(42);
    let s = 1.0 / (D as f64).sqrt();
    Weights {
        x: r.vec(T * D, 1.0),
        attn_norm: (0..D).map(|i| 0.5 + (i % 7) as f32 * 0.1).collect(),
        wq: r.vec(H * HD * D, s),
        wk: r.vec(HK * HD * D, s),
        wv: r.vec(HK * HD * D, s),
        wo: r.vec(D * H * HD, s),
        mlp_norm: (0..D).map(|i| 1.2 - (i % 5) as f32 * 0.1).collect(),
        w_gate: r.vec(F * D, s),
        w_up: r.vec(F * D, s),
        w_down: r.vec(D * F, 1.0 / (F as f64).sqrt()),
    }
}

fn arr(v: &[f32], shape: &[usize]) -> Array {
    let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Array::from_slice(v, &shape)
}

/// `x @ w.T` for a checkpoint-layout weight `w` [out, in].
fn linear(x: &Array, w: &Array) -> Array {
    x.matmul(w.t()).unwrap()
}

fn mlx_block(w: &Weights) -> Vec<f32> {
    let x = arr(&w.x, &[1, T, D]);
    let h = fast::rms_norm(&x, Some(&arr(&w.attn_norm, &[D])), EPS as f32).unwrap();
    let heads = |a: Array, n: usize| {
        a.reshape(&[1, T as i32, n as i32, HD as i32])
            .unwrap()
            .transpose_axes(&[0, 2, 1, 3])
            .unwrap()
    };
    let q = heads(linear(&h, &arr(&w.wq, &[H * HD, D])), H);
    let k = heads(linear(&h, &arr(&w.wk, &[HK * HD, D])), HK);
    let v = heads(linear(&h, &arr(&w.wv, &[HK * HD, D])), HK);
    let q = fast::rope(&q, HD as i32, false, ROPE_BASE as f32, 1.0, 0, None).unwrap();
    let k = fast::rope(&k, HD as i32, false, ROPE_BASE as f32, 1.0, 0, None).unwrap();
    let scale = 1.0 / (HD as f32).sqrt();
    let attn = fast::scaled_dot_product_attention(
        &q,
        &k,
        &v,
        scale,
        ScaledDotProductAttentionMask::Causal,
        None,
    )
    .unwrap();
    let attn = attn
        .transpose_axes(&[0, 2, 1, 3])
        .unwrap()
        .reshape(&[1, T as i32, (H * HD) as i32])
        .unwrap();
    let x = &x + linear(&attn, &arr(&w.wo, &[D, H * HD]));
    let h = fast::rms_norm(&x, Some(&arr(&w.mlp_norm, &[D])), EPS as f32).unwrap();
    let gate = mlx_rs::nn::silu(linear(&h, &arr(&w.w_gate, &[F, D]))).unwrap();
    let up = linear(&h, &arr(&w.w_up, &[F, D]));
    let out = &x + linear(&(gate * up), &arr(&w.w_down, &[D, F]));
    out.eval().unwrap();
    out.as_slice::<f32>().to_vec()
}

// ---- the same block in plain Rust, f64 ------------------------------------------------------

fn rms_norm(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + EPS).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| v * inv * f64::from(*g))
        .collect()
}

fn matvec(w: &[f32], x: &[f64], out_dim: usize) -> Vec<f64> {
    let in_dim = x.len();
    (0..out_dim)
        .map(|o| {
            (0..in_dim)
                .map(|i| f64::from(w[o * in_dim + i]) * x[i])
                .sum()
        })
        .collect()
}

/// Rotary embedding in the "non-traditional" (rotate-half) layout used by Llama checkpoints
/// converted for MLX: dimension i pairs with i + HD/2.
fn rope(v: &mut [f64], pos: usize) {
    let half = HD / 2;
    for i in 0..half {
        let freq = ROPE_BASE.powf(-(2.0 * i as f64) / HD as f64);
        let (sin, cos) = (pos as f64 * freq).sin_cos();
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * cos - b * sin;
        v[i + half] = a * sin + b * cos;
    }
}

fn reference_block(w: &Weights) -> Vec<f64> {
    let x: Vec<Vec<f64>> = (0..T)
        .map(|t| {
            w.x[t * D..(t + 1) * D]
                .iter()
                .map(|&v| f64::from(v))
                .collect()
        })
        .collect();
    let mut q = Vec::new();
    let mut k = Vec::new();
    let mut v = Vec::new();
    for (t, xt) in x.iter().enumerate() {
        let h = rms_norm(xt, &w.attn_norm);
        let mut qt = matvec(&w.wq, &h, H * HD);
        let mut kt = matvec(&w.wk, &h, HK * HD);
        for head in qt.chunks_mut(HD) {
            rope(head, t);
        }
        for head in kt.chunks_mut(HD) {
            rope(head, t);
        }
        q.push(qt);
        k.push(kt);
        v.push(matvec(&w.wv, &h, HK * HD));
    }
    let scale = 1.0 / (HD as f64).sqrt();
    let mut out = Vec::new();
    for t in 0..T {
        let mut attn = vec![0.0; H * HD];
        for head in 0..H {
            let kv = head / (H / HK);
            let qh = &q[t][head * HD..(head + 1) * HD];
            let scores: Vec<f64> = (0..=t)
                .map(|s| {
                    let ks = &k[s][kv * HD..(kv + 1) * HD];
                    qh.iter().zip(ks).map(|(a, b)| a * b).sum::<f64>() * scale
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let exps: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = exps.iter().sum();
            for (s, e) in exps.iter().enumerate() {
                for d in 0..HD {
                    attn[head * HD + d] += e / sum * v[s][kv * HD + d];
                }
            }
        }
        let o = matvec(&w.wo, &attn, D);
        let x1: Vec<f64> = x[t].iter().zip(&o).map(|(a, b)| a + b).collect();
        let h = rms_norm(&x1, &w.mlp_norm);
        let gate = matvec(&w.w_gate, &h, F);
        let up = matvec(&w.w_up, &h, F);
        let act: Vec<f64> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let down = matvec(&w.w_down, &act, D);
        out.extend(x1.iter().zip(&down).map(|(a, b)| a + b));
    }
    out
}

#[test]
fn transformer_block_on_mlx_cpu_matches_f64_reference() {
    Device::set_default(&Device::cpu());
    let w = weights();
    let got = mlx_block(&w);
    let want = reference_block(&w);
    assert_eq!(got.len(), want.len());
    let max_abs = want.iter().map(|v| v.abs()).fold(0.0, f64::max);
    let max_err = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (f64::from(*g) - w).abs())
        .fold(0.0, f64::max);
    let rel = max_err / max_abs;
    assert!(max_abs > 0.1, "degenerate output: max |y| = {max_abs}");
    assert!(
        rel < 1e-4,
        "relative error {rel:e} (max abs error {max_err:e}, max |y| {max_abs})"
    );
}

/// The cargo runner (scripts/mlx-env) must have put OpenBLAS's settings in this process's
/// environment before libmlx loaded: that is the only moment OpenBLAS reads them.
#[cfg(target_os = "linux")]
#[test]
fn test_executables_start_with_openblas_settings() {
    assert!(
        std::env::var_os("STRATA_BLAS_ENV").is_some(),
        "not started through scripts/mlx-env"
    );
    assert!(std::env::var_os("OPENBLAS_NUM_THREADS").is_some());
}
