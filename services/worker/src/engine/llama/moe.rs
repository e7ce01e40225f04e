//! Mixture-of-experts MLPs (Qwen3-MoE, Qwen2-MoE, Qwen3.5-MoE, gpt-oss): a router scores every expert for each token, the
//! `per_token` best are run and their outputs summed, weighted by the router's probabilities
//! (renormalised over the chosen ones where the model says so). The experts' weights are
//! stacked per projection (`[experts, out, in]`) and applied with MLX's `gather_mm` (or
//! `gather_qmm` on packed affine codes where the policy keeps weights quantised), which
//! multiplies each token only by the experts it chose: the arithmetic of mlx-lm's `SwitchGLU`.

use mlx_rs::Array;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{
    argpartition_axis, argsort, dequantize, gather_mm, gather_qmm, softmax_axis, stack,
};

use super::super::config::{ExpertActivation, Experts};
use super::super::policy::DtypePolicy;
use super::super::weights::{Linear, QuantMode, TensorStore, dequantize_mode, gather_qmm_mode};
use super::super::{EngineError, Result};

/// (token, expert) pairs from which they are sorted by expert before the products.
const SORT_FROM_PAIRS: i32 = 64;
/// Sorted pairs from which packed experts are expanded to floats for the products.
const EXPAND_FROM_ROWS: i32 = 8192;

pub(super) struct MoeMlp {
    /// `[experts, hidden]`: each expert's score for a token.
    router: Linear,
    gate: ExpertWeights,
    up: ExpertWeights,
    down: ExpertWeights,
    /// gpt-oss: each expert's biases of its gate, up and down projections (`[experts, out]`).
    biases: Option<[Array; 3]>,
    activation: ExpertActivation,
    per_token: i32,
    normalize_top_k: bool,
    shared: Option<SharedExpert>,
}

/// Qwen2-MoE's shared expert: a SwiGLU MLP every token takes, scaled by
/// `sigmoid(gate · x)`.
struct SharedExpert {
    gate: Linear,
    up: Linear,
    down: Linear,
    /// `[1, hidden]`.
    scale: Linear,
}

/// One projection of every expert.
enum ExpertWeights {
    /// `[experts, in, out]`: transposed for `gather_mm` (`x · W`) once at load.
    Dense(Array),
    /// MLX's codes `[experts, out, in · bits / 32]` with their scales, and biases in affine
    /// mode (mlx-lm's affine experts; gpt-oss's MXFP4 ones).
    Packed {
        weight: Array,
        scales: Array,
        biases: Option<Array>,
        group_size: i32,
        bits: i32,
        mode: QuantMode,
    },
}

impl ExpertWeights {
    /// (experts, outputs per expert).
    fn experts_and_out(&self) -> (i32, i32) {
        match self {
            Self::Dense(w) => (w.shape()[0], w.shape()[2]),
            Self::Packed { weight, .. } => (weight.shape()[0], weight.shape()[1]),
        }
    }

    /// `x` (`[tokens, k, 1, in]` or `[tokens, 1, 1, in]`) through each token's `chosen`
    /// experts: `[tokens, k, 1, out]`. With `sorted`, `chosen` is ascending (rows of one
    /// expert together), and the kernel multiplies each expert's rows as one matrix.
    fn apply(&self, x: &Array, chosen: &Array, sorted: bool) -> Result<Array> {
        Ok(match self {
            Self::Dense(w) => gather_mm(x, w, None, chosen, sorted)?,
            Self::Packed {
                weight,
                scales,
                biases,
                group_size,
                bits,
                mode,
            } => {
                let (g, b) = (*group_size, *bits);
                if sorted && x.shape()[0] >= EXPAND_FROM_ROWS {
                    // Many sorted rows: the codes expanded once and one float product per
                    // expert. On an H100 at 4,096 tokens (32K pairs) of Qwen3.6-35B-A3B's
                    // experts this took 1.7 ms a projection against 12.3 ms for MLX 0.32's
                    // gather_qmm; level at 4K pairs (docs/BENCHMARKS.md,
                    // scripts/gpu_moe_kernels.py).
                    let dense = match (biases, mode) {
                        (Some(biases), QuantMode::Affine) => {
                            dequantize(weight, scales, biases, g, b)?
                        }
                        _ => dequantize_mode(weight, scales, g, b, *mode)?.as_dtype(x.dtype())?,
                    };
                    gather_mm(x, dense.swap_axes(-1, -2)?, None, chosen, true)?
                } else {
                    match (biases, mode) {
                        (Some(biases), QuantMode::Affine) => {
                            gather_qmm(x, weight, scales, biases, None, chosen, true, g, b, sorted)?
                        }
                        _ => gather_qmm_mode(
                            x,
                            weight,
                            scales,
                            biases.as_ref(),
                            chosen,
                            g,
                            b,
                            *mode,
                            sorted,
                        )?,
                    }
                }
            }
        })
    }
}

/// One projection of Qwen3.5-MoE's fused expert tensors, `[experts, out, in]`.
fn fused_expert_projection(store: &TensorStore, prefix: &str, part: &str) -> Result<Array> {
    if part == "down_proj" {
        return Ok(store
            .require(&format!("{prefix}.experts.down_proj"))?
            .clone());
    }
    let fused = store.require(&format!("{prefix}.experts.gate_up_proj"))?;
    let rows = fused.shape().get(1).copied().unwrap_or(0);
    if fused.ndim() != 3 || rows % 2 != 0 {
        return Err(EngineError::Config(format!(
            "{prefix}.experts.gate_up_proj: shape {:?}, expected [experts, 2 * width, hidden]",
            fused.shape()
        )));
    }
    let mid = rows / 2;
    Ok(match part {
        "gate_proj" => fused.try_index((.., ..mid, ..))?,
        _ => fused.try_index((.., mid.., ..))?,
    })
}

/// Experts in a float mode (MXFP4 and kin): kept packed where the policy keeps weights
/// packed (Metal, CUDA: MLX's `gather_qmm` in that mode), else expanded once at load (a CPU
/// computes in f32).
fn float_mode_experts(
    weight: Array,
    scales: Array,
    group_size: i32,
    bits: i32,
    mode: QuantMode,
    policy: DtypePolicy,
) -> Result<ExpertWeights> {
    if policy.quantized_weights {
        for a in [&weight, &scales] {
            a.eval()?;
        }
        return Ok(ExpertWeights::Packed {
            weight,
            scales,
            biases: None,
            group_size,
            bits,
            mode,
        });
    }
    let dense = dequantize_mode(&weight, &scales, group_size, bits, mode)?
        .as_dtype(policy.compute)?
        .transpose_axes(&[0, 2, 1])?
        .contiguous()?;
    dense.eval()?;
    Ok(ExpertWeights::Dense(dense))
}

/// OpenAI's MXFP4 experts (`<name>_blocks`: `[experts, rows, in / 32, 16]` bytes of 4-bit
/// floats, `<name>_scales`: e8m0 bytes per 32) as MLX's mxfp4 codes `[experts, rows, in / 8]`
/// and scales: the same packing byte for byte, read as uint32 words.
fn openai_mxfp4(store: &TensorStore, name: &str) -> Result<Option<(Array, Array)>> {
    let Some(blocks) = store.get(&format!("{name}_blocks")) else {
        return Ok(None);
    };
    let scales = store.require(&format!("{name}_scales"))?;
    let shape = blocks.shape();
    let [e, rows, groups, 16] = shape[..] else {
        return Err(EngineError::Config(format!(
            "{name}_blocks: shape {shape:?}, expected [experts, rows, groups, 16]"
        )));
    };
    let words = blocks
        .view::<u32>()
        .map_err(|e| EngineError::Config(format!("{name}_blocks as uint32 words: {e}")))?
        .reshape(&[e, rows, groups * 4])?;
    Ok(Some((words, scales.clone())))
}

/// gpt-oss's experts as Hugging Face publishes them: unquantised (transformers'
/// `GptOssExperts`: `gate_up_proj` `[experts, hidden, 2 * width]` with the gate in the even
/// columns and up in the odd ones, `down_proj` `[experts, width, hidden]`, so already
/// `[experts, in, out]`), or in OpenAI's MXFP4 (`gate_up_proj_blocks`: rows out, gate and up
/// rows interleaved), expanded at load; their biases beside them. None where the folder is
/// mlx-lm's layout.
fn gpt_oss_experts(
    store: &TensorStore,
    prefix: &str,
    policy: DtypePolicy,
) -> Result<Option<([ExpertWeights; 3], [Array; 3])>> {
    let experts = format!("{prefix}.experts");
    let bad = |name: &str, shape: &[i32], want: &str| {
        EngineError::Config(format!(
            "{experts}.{name}: shape {shape:?} is not gpt-oss's {want}"
        ))
    };
    // Gate and up interleaved along `axis` of `a`: (gate, up), each contiguous.
    let deinterleave = |a: &Array, axis: usize, name: &str| -> Result<(Array, Array)> {
        let shape = a.shape().to_vec();
        if shape.len() <= axis || shape[axis] % 2 != 0 {
            return Err(bad(name, &shape, "gate and up interleaved"));
        }
        let mut pairs = shape.clone();
        pairs[axis] /= 2;
        pairs.insert(axis + 1, 2);
        let pairs = a.reshape(&pairs)?;
        let half = |i: i32| -> Result<Array> {
            Ok(pairs
                .take_axis(Array::from_int(i), axis as i32 + 1)?
                .contiguous()?)
        };
        Ok((half(0)?, half(1)?))
    };
    let weights = match (
        openai_mxfp4(store, &format!("{experts}.gate_up_proj"))?,
        openai_mxfp4(store, &format!("{experts}.down_proj"))?,
    ) {
        // MLX's mxfp4 codes, `[experts, out, in / 8]`, gate and up rows interleaved.
        (Some((gate_up, gate_up_scales)), Some((down, down_scales))) => {
            let (gate, up) = deinterleave(&gate_up, 1, "gate_up_proj_blocks")?;
            let (gate_scales, up_scales) = deinterleave(&gate_up_scales, 1, "gate_up_proj_scales")?;
            let packed =
                |w: Array, s: Array| float_mode_experts(w, s, 32, 4, QuantMode::Mxfp4, policy);
            [
                packed(gate, gate_scales)?,
                packed(up, up_scales)?,
                packed(down, down_scales)?,
            ]
        }
        (None, None) => {
            let Some(gate_up) = store.get(&format!("{experts}.gate_up_proj")) else {
                return Ok(None);
            };
            // transformers' layout: `[experts, in, out]` already, gate and up columns
            // interleaved.
            if gate_up.ndim() != 3 {
                return Err(bad(
                    "gate_up_proj",
                    gate_up.shape(),
                    "[experts, hidden, 2 * width]",
                ));
            }
            let (gate, up) = deinterleave(gate_up, 2, "gate_up_proj")?;
            let down = store.require(&format!("{experts}.down_proj"))?.clone();
            let dense = |a: Array| -> Result<ExpertWeights> {
                let a = a.as_dtype(policy.compute)?.contiguous()?;
                a.eval()?;
                Ok(ExpertWeights::Dense(a))
            };
            [dense(gate)?, dense(up)?, dense(down)?]
        }
        _ => {
            return Err(EngineError::Config(format!(
                "{experts}: gate_up_proj and down_proj are not both in MXFP4 blocks"
            )));
        }
    };
    let bias = store.require(&format!("{experts}.gate_up_proj_bias"))?;
    let (gate_bias, up_bias) = deinterleave(bias, 1, "gate_up_proj_bias")?;
    let down_bias = store.require(&format!("{experts}.down_proj_bias"))?.clone();
    let vector = |a: Array| -> Result<Array> {
        let a = a.as_dtype(policy.compute)?.contiguous()?;
        a.eval()?;
        Ok(a)
    };
    Ok(Some((
        weights,
        [vector(gate_bias)?, vector(up_bias)?, vector(down_bias)?],
    )))
}

impl MoeMlp {
    /// Layer `layer`'s router (`mlp.gate`, gpt-oss's `mlp.router`) and experts: Hugging
    /// Face's one tensor per expert (`mlp.experts.E.gate_proj`), Qwen3.5-MoE's and gpt-oss's
    /// fused ones, or mlx-lm's stacked `mlp.switch_mlp.gate_proj` (gpt-oss:
    /// `mlp.experts.gate_proj`), dense or packed.
    pub(super) fn load(
        store: &TensorStore,
        layer: usize,
        experts: &Experts,
        policy: DtypePolicy,
    ) -> Result<Self> {
        let prefix = format!("model.layers.{layer}.mlp");
        let gpt_oss = matches!(experts.activation, ExpertActivation::ClampedSwiGlu { .. });
        let router = if gpt_oss {
            store.linear(&format!("{prefix}.router"), policy)?
        } else {
            store.linear(&format!("{prefix}.gate"), policy)?
        };
        let stacked_name = |part: &str| {
            if gpt_oss {
                format!("{prefix}.experts.{part}")
            } else {
                format!("{prefix}.switch_mlp.{part}")
            }
        };
        let projection = |part: &str| -> Result<ExpertWeights> {
            let stacked = stacked_name(part);
            if let Some(scales) = store.get(&format!("{stacked}.scales")) {
                let q = store.quant.of(&stacked);
                let Some(bits) = q.bits else {
                    return Err(EngineError::Config(format!(
                        "{stacked}: quantised experts without a bit width"
                    )));
                };
                let weight = store.require(&format!("{stacked}.weight"))?.clone();
                if q.mode != QuantMode::Affine {
                    return float_mode_experts(
                        weight,
                        scales.clone(),
                        q.group_size,
                        bits,
                        q.mode,
                        policy,
                    );
                }
                let biases = store.require(&format!("{stacked}.biases"))?.clone();
                if policy.quantized_weights {
                    for a in [&weight, scales, &biases] {
                        a.eval()?;
                    }
                    return Ok(ExpertWeights::Packed {
                        weight,
                        scales: scales.clone(),
                        biases: Some(biases),
                        group_size: q.group_size,
                        bits,
                        mode: QuantMode::Affine,
                    });
                }
                // A CPU computes in f32: the experts' codes expanded once, at load.
                let dense = dequantize(&weight, scales, &biases, q.group_size, bits)?;
                let dense = dense
                    .as_dtype(policy.compute)?
                    .transpose_axes(&[0, 2, 1])?
                    .contiguous()?;
                dense.eval()?;
                return Ok(ExpertWeights::Dense(dense));
            }
            let weight = match store.get(&format!("{stacked}.weight")) {
                Some(w) => w.clone(),
                // Qwen3.5-MoE as published: gate and up fused per expert
                // (`experts.gate_up_proj`, `[experts, 2 * width, hidden]`, gate rows first) and
                // `experts.down_proj`, without a `.weight` suffix (mlx-lm's sanitize splits them).
                None if store.contains(&format!("{prefix}.experts.gate_up_proj")) => {
                    fused_expert_projection(store, &prefix, part)?
                }
                None => {
                    let each = (0..experts.count)
                        .map(|e| store.require(&format!("{prefix}.experts.{e}.{part}.weight")))
                        .collect::<Result<Vec<_>>>()?;
                    stack(&each, 0)?
                }
            };
            let weight = weight
                .as_dtype(policy.compute)?
                .transpose_axes(&[0, 2, 1])?;
            // A contiguous copy: the transposed view would be re-strided on every product.
            let weight = weight.contiguous()?;
            weight.eval()?;
            Ok(ExpertWeights::Dense(weight))
        };
        let shared = match experts.shared_intermediate_size {
            None => None,
            Some(_) => {
                let part = |p: &str| store.linear(&format!("{prefix}.shared_expert.{p}"), policy);
                let shared = SharedExpert {
                    gate: part("gate_proj")?,
                    up: part("up_proj")?,
                    down: part("down_proj")?,
                    scale: store.linear(&format!("{prefix}.shared_expert_gate"), policy)?,
                };
                for m in [&shared.gate, &shared.up, &shared.down, &shared.scale] {
                    m.eval()?;
                }
                Some(shared)
            }
        };
        let fused = if gpt_oss {
            gpt_oss_experts(store, &prefix, policy)?
        } else {
            None
        };
        let ([gate, up, down], biases) = match fused {
            Some((weights, biases)) => (weights, Some(biases)),
            None => {
                let biases = if gpt_oss {
                    // mlx-lm's layout: each stacked projection with its `bias`.
                    let bias = |part: &str| -> Result<Array> {
                        let b = store
                            .require(&format!("{}.bias", stacked_name(part)))?
                            .as_dtype(policy.compute)?;
                        b.eval()?;
                        Ok(b)
                    };
                    Some([bias("gate_proj")?, bias("up_proj")?, bias("down_proj")?])
                } else {
                    None
                };
                (
                    [
                        projection("gate_proj")?,
                        projection("up_proj")?,
                        projection("down_proj")?,
                    ],
                    biases,
                )
            }
        };
        let moe = Self {
            router,
            gate,
            up,
            down,
            biases,
            activation: experts.activation,
            per_token: experts.per_token as i32,
            normalize_top_k: experts.normalize_top_k,
            shared,
        };
        moe.router.eval()?;
        let (e, width) = (experts.count as i32, experts.intermediate_size as i32);
        let found = moe.gate.experts_and_out();
        if found != (e, width) {
            return Err(EngineError::Config(format!(
                "{prefix}: {} experts of width {}, the config says {e} of width {width}",
                found.0, found.1
            )));
        }
        Ok(moe)
    }

    /// The MLP's output for `x` (`[tokens, hidden]`, normalised).
    pub(super) fn forward(&self, x: &Array, few: bool) -> Result<Array> {
        let (tokens, hidden) = (x.shape()[0], x.shape()[1]);
        let k = self.per_token;
        let logits = self.router.forward_on(x, few)?;
        let experts = logits.shape()[1];
        let probs = softmax_axis(&logits, -1, true)?;
        // The k largest probabilities of each token (their order does not matter).
        let chosen = argpartition_axis(&probs, experts - k, -1)?.try_index((.., experts - k..))?;
        let mut weights = probs.take_along_axis(&chosen, -1)?;
        if self.normalize_top_k {
            weights = weights.divide(weights.sum_axis(-1, true)?)?;
        }
        let out = if tokens * k >= SORT_FROM_PAIRS {
            // A prefill chunk: the (token, expert) pairs sorted by expert, so that each
            // expert's rows are one product, as mlx-lm's SwitchGLU does from 64 pairs; the
            // outputs are put back in the tokens' order after.
            let flat = chosen.flatten(None, None)?;
            let order = argsort(&flat)?;
            let back = argsort(&order)?;
            let experts = flat.take(&order)?;
            let rows = x
                .take_axis(order.floor_divide(Array::from_int(k))?, 0)?
                .reshape(&[tokens * k, 1, hidden])?;
            let gate = self.gate.apply(&rows, &experts, true)?;
            let up = self.up.apply(&rows, &experts, true)?;
            let [gate, up] = [(gate, 0), (up, 1)].map(|(y, i)| self.add_bias(y, i, &experts));
            let act = self.activate(gate?, up?)?;
            let out = self.down.apply(&act, &experts, true)?;
            let out = self.add_bias(out, 2, &experts)?;
            out.take_axis(&back, 0)?.reshape(&[tokens, k, hidden])?
        } else {
            // [tokens, 1, 1, hidden] against each token's k experts: [tokens, k, 1, out].
            let xe = x.reshape(&[tokens, 1, 1, hidden])?;
            let gate = self.gate.apply(&xe, &chosen, false)?;
            let up = self.up.apply(&xe, &chosen, false)?;
            let [gate, up] = [(gate, 0), (up, 1)].map(|(y, i)| self.add_bias(y, i, &chosen));
            let act = self.activate(gate?, up?)?;
            let out = self.down.apply(&act, &chosen, false)?;
            let out = self.add_bias(out, 2, &chosen)?;
            out.reshape(&[tokens, k, hidden])?
        };
        let routed = out
            .multiply(weights.reshape(&[tokens, k, 1])?)?
            .sum_axis(-2, false)?;
        let Some(shared) = &self.shared else {
            return Ok(routed);
        };
        let [gate, up] = Linear::forward_group([&shared.gate, &shared.up], x, few)?;
        let mlp = shared
            .down
            .forward_on(&mlx_rs::nn::silu(gate)?.multiply(&up)?, few)?;
        let scale = mlx_rs::ops::sigmoid(shared.scale.forward_on(x, few)?)?;
        Ok(routed.add(scale.multiply(&mlp)?)?)
    }

    /// `y` (`[..., 1, out]`, rows by `experts` of the same leading shape) plus projection
    /// `which`'s bias of each row's expert, where the experts have biases.
    fn add_bias(&self, y: Array, which: usize, experts: &Array) -> Result<Array> {
        let Some(biases) = &self.biases else {
            return Ok(y);
        };
        let rows = biases[which].take_axis(experts, 0)?;
        let mut shape = rows.shape().to_vec();
        shape.insert(shape.len() - 1, 1);
        Ok(y.add(rows.reshape(&shape)?)?)
    }

    /// The expert's gated activation of its gate and up projections.
    fn activate(&self, gate: Array, up: Array) -> Result<Array> {
        Ok(match self.activation {
            ExpertActivation::SwiGlu => mlx_rs::nn::silu(gate)?.multiply(&up)?,
            ExpertActivation::ClampedSwiGlu { limit } => {
                let dtype = gate.dtype();
                let scalar = |v: f32| Array::from_f32(v).as_dtype(dtype);
                let gate = mlx_rs::ops::minimum(&gate, scalar(limit)?)?;
                let up = mlx_rs::ops::clip(&up, (scalar(-limit)?, scalar(limit)?))?;
                let glu = gate.multiply(mlx_rs::ops::sigmoid(gate.multiply(scalar(1.702)?)?)?)?;
                up.add(scalar(1.0)?)?.multiply(&glu)?
            }
        })
    }
}
