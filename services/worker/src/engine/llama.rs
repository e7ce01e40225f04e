//! The Llama-family decoder: pre-norm blocks of grouped-query attention with RoPE and a SwiGLU
//! MLP. Llama 1-3.x, SmolLM2, Mistral; Qwen2 (q/k/v biases); Qwen3 (an RMSNorm on each query
//! and key head); Phi-3 (fused projections on disk, partial rotary, longrope); SmolLM3 (NoPE
//! layers); Gemma 3 (sliding-window layers with their own RoPE base, norms on the outputs of
//! attention and the MLP, GELU, a scaled embedding). The differences are all in `ModelConfig`
//! and in which tensors a layer has.
//!
//! `forward` runs a *ragged batch*: several sequences, each with its own new tokens and its own
//! KV cache at its own offset, in one pass. Projections and MLPs run once over all tokens (the
//! matrix products that dominate the cost); attention runs per sequence against its own cache.
//! A batch can mix prefill chunks and single decode tokens.

use mlx_rs::fast::{self, ScaledDotProductAttentionMask};
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use super::config::{Architecture, ModelConfig};
use super::cpu_attention::{self, AttentionInput};
use super::kv::{KvCache, KvLayout, RecurrentLayers, WindowedLayers};
use super::policy::DtypePolicy;
use super::weights::{Linear, Matrix, TensorStore};
use super::{EngineError, Result};

mod delta_rule_device;
mod host_step;
mod linear_attention;
mod moe;

/// How a file names its tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorNaming {
    /// llama.cpp's names: `token_embd`, `blk.N.attn_q`, ...
    Gguf,
    /// Hugging Face / mlx-lm names: `model.embed_tokens`, `model.layers.N.self_attn.q_proj`, ...
    HuggingFace,
}

impl TensorNaming {
    fn embed(self) -> &'static str {
        match self {
            Self::Gguf => "token_embd",
            Self::HuggingFace => "model.embed_tokens",
        }
    }
    fn final_norm(self) -> &'static str {
        match self {
            Self::Gguf => "output_norm.weight",
            Self::HuggingFace => "model.norm.weight",
        }
    }
    fn head(self) -> &'static str {
        match self {
            Self::Gguf => "output",
            Self::HuggingFace => "lm_head",
        }
    }
    fn layer(self, i: usize, part: &str) -> String {
        let hf = |p: &str| format!("model.layers.{i}.{p}");
        let gguf = |p: &str| format!("blk.{i}.{p}");
        match (self, part) {
            (Self::Gguf, "attn_norm") => gguf("attn_norm.weight"),
            (Self::Gguf, "mlp_norm") => gguf("ffn_norm.weight"),
            (Self::Gguf, "q") => gguf("attn_q"),
            (Self::Gguf, "k") => gguf("attn_k"),
            (Self::Gguf, "v") => gguf("attn_v"),
            (Self::Gguf, "o") => gguf("attn_output"),
            (Self::Gguf, "gate") => gguf("ffn_gate"),
            (Self::Gguf, "up") => gguf("ffn_up"),
            (Self::Gguf, "down") => gguf("ffn_down"),
            (Self::Gguf, "q_norm") => gguf("attn_q_norm.weight"),
            (Self::Gguf, "k_norm") => gguf("attn_k_norm.weight"),
            (Self::Gguf, "attn_out_norm") => gguf("post_attention_norm.weight"),
            (Self::Gguf, "mlp_out_norm") => gguf("post_ffw_norm.weight"),
            // Gemma's pre-MLP norm has the name other families' MLP norm has.
            (Self::Gguf, "gemma_mlp_norm") => gguf("ffn_norm.weight"),
            // Phi-3: q, k, v in one matrix; gate and up in one, under the up projection's name.
            (Self::Gguf, "qkv") => gguf("attn_qkv"),
            (Self::Gguf, "gate_up") => gguf("ffn_up"),
            (Self::HuggingFace, "attn_norm") => hf("input_layernorm.weight"),
            (Self::HuggingFace, "mlp_norm") => hf("post_attention_layernorm.weight"),
            (Self::HuggingFace, "q") => hf("self_attn.q_proj"),
            (Self::HuggingFace, "k") => hf("self_attn.k_proj"),
            (Self::HuggingFace, "v") => hf("self_attn.v_proj"),
            (Self::HuggingFace, "o") => hf("self_attn.o_proj"),
            (Self::HuggingFace, "gate") => hf("mlp.gate_proj"),
            (Self::HuggingFace, "up") => hf("mlp.up_proj"),
            (Self::HuggingFace, "down") => hf("mlp.down_proj"),
            (Self::HuggingFace, "q_norm") => hf("self_attn.q_norm.weight"),
            (Self::HuggingFace, "k_norm") => hf("self_attn.k_norm.weight"),
            (Self::HuggingFace, "sinks") => hf("self_attn.sinks"),
            (Self::HuggingFace, "qkv") => hf("self_attn.qkv_proj"),
            (Self::HuggingFace, "gate_up") => hf("mlp.gate_up_proj"),
            // Gemma: `post_attention_layernorm` is the norm on attention's output, and the
            // MLP's input norm is `pre_feedforward_layernorm`.
            (Self::HuggingFace, "attn_out_norm") => hf("post_attention_layernorm.weight"),
            (Self::HuggingFace, "gemma_mlp_norm") => hf("pre_feedforward_layernorm.weight"),
            (Self::HuggingFace, "mlp_out_norm") => hf("post_feedforward_layernorm.weight"),
            (_, other) => format!("unknown part {other}"),
        }
    }
}

struct Layer {
    attn_norm: Array,
    mixer: Mixer,
    mlp_norm: Array,
    ffn: FeedForward,
    /// Gemma's norms on the outputs of attention and of the MLP, before the residual adds.
    attn_out_norm: Option<Array>,
    mlp_out_norm: Option<Array>,
}

/// How a layer mixes tokens: attention over its KV cache, or (hybrid models) a Gated
/// DeltaNet over a recurrent state.
enum Mixer {
    Attention(Box<Attention>),
    Linear(Box<linear_attention::GatedDeltaNet>),
}

struct Attention {
    /// `[heads * head_dim, hidden]`, or twice the rows where the output is gated (Qwen3.5:
    /// per head, the queries then the gate).
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// Qwen3's per-head RMSNorm weights for queries and keys (`[head_dim]`).
    q_norm: Option<Array>,
    k_norm: Option<Array>,
    /// gpt-oss's sink logit per query head (`[heads]`), in the softmax beside the scores.
    sinks: Option<Array>,
}

/// A layer's MLP: one gated MLP, or a mixture of experts.
enum FeedForward {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Experts(Box<moe::MoeMlp>),
}

impl Layer {
    /// The seven projections of a layer with a dense MLP (q, k, v, o, gate, up, down).
    fn dense_projections(&self) -> Option<[&Linear; 7]> {
        match (&self.mixer, &self.ffn) {
            (Mixer::Attention(a), FeedForward::Dense { gate, up, down }) => {
                Some([&a.q, &a.k, &a.v, &a.o, gate, up, down])
            }
            _ => None,
        }
    }

    /// The attention of an attention layer.
    fn attention(&self) -> Option<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a.as_ref()),
            Mixer::Linear(_) => None,
        }
    }
}

/// How positions enter attention, precomputed from the config.
struct Rotary {
    /// Per-pair periods when the scheme is not a plain base (Llama 3, longrope).
    periods: Option<Array>,
    /// Longrope's factor on the rotated dimensions (`[head_dim]`, 1 past `rope_dims`).
    input_scale: Option<Array>,
}

pub struct Model {
    config: ModelConfig,
    policy: DtypePolicy,
    embed: Matrix,
    /// `None` when the output head is tied to the embeddings.
    head: Option<Matrix>,
    final_norm: Array,
    layers: Vec<Layer>,
    rotary: Rotary,
    /// Attention runs through `cpu_attention` (on the CPU, in f32) instead of MLX's kernel.
    cpu_attention: bool,
    /// Norms, biases and RoPE frequencies for passes of a few rows computed wholly on the CPU
    /// (`host_step`); None off a CPU or where a matrix is not f32-readable.
    host: Option<host_step::HostWeights>,
    /// The sliding-window layers, as the KV cache keeps them.
    window: Option<WindowedLayers>,
}

/// What a forward pass returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outputs {
    /// Logits after each sequence's last new token.
    LastLogits,
    /// Logits after every new token (one sequence).
    AllLogits,
    /// Attention weights of the new tokens over all positions (one sequence).
    AttentionScores,
}

/// Softmax attention weights of queries `q` (`[1, heads, t, dim]`, RoPE applied) over `keys`
/// (`[1, kv_heads, held + t, dim]`), causal (and within `window` positions of each query for
/// a windowed layer), averaged over heads and queries: `[held + t]`. Grouped-query heads
/// share their KV head, as in attention itself.
fn attention_weights(
    q: &Array,
    keys: &Array,
    held: i32,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (heads, t, dim) = (q.shape()[1], q.shape()[2], q.shape()[3]);
    let kv_heads = keys.shape()[1];
    let positions = keys.shape()[2];
    let group = heads / kv_heads;
    let q = q.reshape(&[1, kv_heads, group * t, dim])?;
    let scores = q
        .matmul(&keys.transpose_axes(&[0, 1, 3, 2])?)?
        .multiply(Array::from_f32(scale))?;
    // Row r is query r % t, at position held + r % t: it sees keys up to there.
    let rows = (group * t) as usize;
    let mut mask = vec![0f32; rows * positions as usize];
    for r in 0..rows {
        let last = (held + (r as i32 % t)) as usize;
        let row = &mut mask[r * positions as usize..(r + 1) * positions as usize];
        let first = window.map_or(0, |w| (last + 1).saturating_sub(w));
        for (k, m) in row.iter_mut().enumerate() {
            if k < first || k > last {
                *m = f32::NEG_INFINITY;
            }
        }
    }
    let mask = Array::from_slice(&mask, &[group * t, positions]);
    let scores = scores.add(&mask)?;
    let weights = match sinks {
        None => mlx_rs::ops::softmax_axis(scores, -1, true)?,
        Some(sinks) => {
            // Row r of KV head g is query head g * group + r / t: its sink joins the softmax
            // as one more column, whose weight goes to no position.
            let column = mlx_rs::ops::broadcast_to(
                sinks
                    .as_dtype(scores.dtype())?
                    .reshape(&[1, kv_heads, group, 1, 1])?,
                &[1, kv_heads, group, t, 1],
            )?
            .reshape(&[1, kv_heads, group * t, 1])?;
            let with_sink = concatenate(&[scores, column], -1)?;
            mlx_rs::ops::softmax_axis(with_sink, -1, true)?.try_index((.., .., .., ..positions))?
        }
    };
    Ok(weights.mean_axes(&[0, 1, 2], false)?)
}

/// MLX's fused attention of `q` over `keys`/`values` (`[1, heads, positions, dim]`, the new
/// tokens last): causal, and for a windowed layer each query sees its last `window` positions
/// only (an explicit mask; a single query just reads the window's rows). `sinks`: one logit
/// per query head in each softmax (gpt-oss).
fn fused_attention(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let t = q.shape()[2];
    let positions = keys.shape()[2];
    let Some(w) = window.filter(|&w| (w as i32) < positions) else {
        let mask = (t > 1).then_some(ScaledDotProductAttentionMask::Causal);
        return Ok(fast::scaled_dot_product_attention(
            q, keys, values, scale, mask, sinks,
        )?);
    };
    let held = positions - t;
    if t == 1 {
        let from = positions - w as i32;
        let keys = keys.try_index((.., .., from.., ..))?;
        let values = values.try_index((.., .., from.., ..))?;
        return Ok(fast::scaled_dot_product_attention(
            q, &keys, &values, scale, None, sinks,
        )?);
    }
    let mut mask = vec![f32::NEG_INFINITY; (t * positions) as usize];
    for i in 0..t {
        let last = held + i;
        let first = (last + 1 - w as i32).max(0);
        for k in first..=last {
            mask[(i * positions + k) as usize] = 0.0;
        }
    }
    let mask = Array::from_slice(&mask, &[t, positions]).as_dtype(q.dtype())?;
    Ok(fast::scaled_dot_product_attention(
        q,
        keys,
        values,
        scale,
        ScaledDotProductAttentionMask::Array(&mask),
        sinks,
    )?)
}

/// `silu(gate) · up` computed on the host where both are f32 arrays of one shape (a CPU
/// computing in f32: `strata_cpu_kernels::activation` says why), else through MLX.
fn host_swiglu(gate: Array, up: &Array) -> Result<Array> {
    if gate.dtype() != Dtype::Float32 || up.dtype() != Dtype::Float32 || gate.shape() != up.shape()
    {
        return Ok(mlx_rs::nn::silu(gate)?.multiply(up)?);
    }
    gate.eval()?;
    up.eval()?;
    match (gate.try_as_slice::<f32>(), up.try_as_slice::<f32>()) {
        (Ok(g), Ok(u)) => {
            let mut out = g.to_vec();
            strata_cpu_kernels::activation::swiglu(&mut out, u);
            Ok(Array::from_slice(&out, gate.shape()))
        }
        // Not laid out row-major in memory: MLX's own operations.
        _ => Ok(mlx_rs::nn::silu(gate)?.multiply(up)?),
    }
}

/// Attention's output (`[tokens, heads * dim]`) times `sigmoid(gate)` where the layer gates
/// it (Qwen3.5).
fn gated(attn: Array, gate: Option<&Array>) -> Result<Array> {
    match gate {
        Some(g) => Ok(attn.multiply(mlx_rs::ops::sigmoid(g)?)?),
        None => Ok(attn),
    }
}

/// Whether a hybrid model's decoder norms (not the gated norm of its linear attention) are
/// stored as offsets from 1: Hugging Face's Qwen3.5 files, whose convolutions are laid out
/// `[channels, 1, kernel]`; mlx-lm's conversions move the kernel axis and fold the 1 in (its
/// `qwen3_5.sanitize`).
fn hybrid_norms_are_offsets(
    config: &ModelConfig,
    store: &TensorStore,
    naming: TensorNaming,
) -> Result<bool> {
    let Some(first) = config
        .linear_attention
        .as_ref()
        .and_then(|l| l.layers.first())
    else {
        return Ok(false);
    };
    if naming != TensorNaming::HuggingFace {
        return Ok(false);
    }
    let conv = store.require(&format!("model.layers.{first}.linear_attn.conv1d.weight"))?;
    Ok(conv.shape().last().is_some_and(|&k| k != 1))
}

/// Whether passes of a few rows run on the host kernels (`host_step`) on a CPU;
/// `STRATA_HOST_STEPS=0` keeps them on MLX's operations, for measuring one against the other.
fn host_steps_enabled() -> bool {
    std::env::var("STRATA_HOST_STEPS").map_or(true, |v| v != "0")
}

fn read(a: &Array) -> Result<&[f32]> {
    a.try_as_slice::<f32>()
        .map_err(|e| EngineError::Mlx(format!("reading attention inputs: {e}")))
}

/// One sequence's part of a ragged batch: its new tokens and its cache.
pub struct SeqChunk<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut KvCache,
}

impl Model {
    pub fn load(
        config: ModelConfig,
        store: &TensorStore,
        naming: TensorNaming,
        policy: DtypePolicy,
    ) -> Result<Self> {
        config.validate()?;
        let hybrid_offset = hybrid_norms_are_offsets(&config, store, naming)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let name = |part: &str| naming.layer(i, part);
            let linear = config
                .linear_attention
                .as_ref()
                .filter(|_| config.is_linear_layer(i));
            let projections = if linear.is_some() {
                None
            } else if config.arch == Architecture::Phi3
                && store.contains(&format!("{}.weight", name("qkv")))
            {
                // Phi-3 stores q, k and v as one matrix, rows in that order.
                let (hd, h, kv) = (config.head_dim, config.num_heads, config.num_kv_heads);
                let mut parts = store
                    .linear_split(&name("qkv"), &[h * hd, kv * hd, kv * hd], policy)?
                    .into_iter();
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(q), Some(k), Some(v)) => Some((q, k, v)),
                    _ => return Err(EngineError::Mlx("qkv split lost a part".into())),
                }
            } else {
                Some((
                    store.linear(&name("q"), policy)?,
                    store.linear(&name("k"), policy)?,
                    store.linear(&name("v"), policy)?,
                ))
            };
            let (gate, up) = if config.is_moe_layer(i) {
                (None, None)
            } else if config.arch == Architecture::Phi3
                && store.contains(&format!("{}.weight", name("gate_up")))
            {
                // Phi-3's gate and up projections, one matrix, gate rows first.
                let n = config.intermediate_size;
                let mut parts = store
                    .linear_split(&name("gate_up"), &[n, n], policy)?
                    .into_iter();
                match (parts.next(), parts.next()) {
                    (Some(gate), Some(up)) => (Some(gate), Some(up)),
                    _ => return Err(EngineError::Mlx("gate_up split lost a part".into())),
                }
            } else {
                (
                    Some(store.linear(&name("gate"), policy)?),
                    Some(store.linear(&name("up"), policy)?),
                )
            };
            let ffn = match (gate, up, &config.experts) {
                (Some(gate), Some(up), _) => FeedForward::Dense {
                    gate,
                    up,
                    down: store.linear(&name("down"), policy)?,
                },
                (_, _, Some(experts)) if naming == TensorNaming::HuggingFace => {
                    FeedForward::Experts(Box::new(moe::MoeMlp::load(store, i, experts, policy)?))
                }
                _ => {
                    return Err(EngineError::Config(
                        "mixture-of-experts layers are read from safetensors folders only".into(),
                    ));
                }
            };
            let gemma = config.arch.is_gemma();
            // Gemma's Hugging Face files store each norm as its offset from 1 (its RMSNorm
            // scales by 1 + weight, computed in the weight's dtype, as here); llama.cpp's
            // converter folds the 1 into GGUF files. Qwen3.5's do too, as published; mlx-lm's
            // conversions add the 1 (`norm_offset` says which, from the convolution's layout).
            let norm_offset = (gemma && naming == TensorNaming::HuggingFace) || hybrid_offset;
            let norm = |part: &str| -> Result<Array> {
                let weight = store.vector(&name(part), policy)?;
                Ok(if norm_offset {
                    weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?
                } else {
                    weight
                })
            };
            let (q_norm, k_norm) = if config.arch.has_qk_norm() && linear.is_none() {
                (Some(norm("q_norm")?), Some(norm("k_norm")?))
            } else {
                (None, None)
            };
            let sinks = if config.attention_sinks && linear.is_none() {
                Some(store.vector(&name("sinks"), policy)?)
            } else {
                None
            };
            let mixer = match (projections, linear) {
                (Some((q, k, v)), _) => Mixer::Attention(Box::new(Attention {
                    q,
                    k,
                    v,
                    o: store.linear(&name("o"), policy)?,
                    q_norm,
                    k_norm,
                    sinks,
                })),
                (None, Some(widths)) => {
                    Mixer::Linear(Box::new(linear_attention::GatedDeltaNet::load(
                        store,
                        i,
                        widths,
                        config.rms_norm_eps,
                        policy,
                    )?))
                }
                (None, None) => {
                    return Err(EngineError::Config(format!("layer {i} has no token mixer")));
                }
            };
            let (attn_out_norm, mlp_out_norm) = if gemma {
                (Some(norm("attn_out_norm")?), Some(norm("mlp_out_norm")?))
            } else {
                (None, None)
            };
            let layer = Layer {
                attn_norm: norm("attn_norm")?,
                mixer,
                mlp_norm: norm(if gemma { "gemma_mlp_norm" } else { "mlp_norm" })?,
                ffn,
                attn_out_norm,
                mlp_out_norm,
            };
            // Materialise layer by layer: dequantising everything lazily first would hold the
            // packed and the expanded weights at once. Everything is evaluated here, norms and
            // biases too: a lazy array is bound to this thread's MLX stream, and the engine
            // runs on another thread (safetensors loads are lazy).
            if let Some(a) = layer.attention() {
                for m in [&a.q, &a.k, &a.v, &a.o] {
                    m.eval()?;
                }
            }
            if let FeedForward::Dense { gate, up, down } = &layer.ffn {
                for m in [gate, up, down] {
                    m.eval()?;
                }
            }
            layer.attn_norm.eval()?;
            layer.mlp_norm.eval()?;
            let (q_norm, k_norm) = match layer.attention() {
                Some(a) => (&a.q_norm, &a.k_norm),
                None => (&None, &None),
            };
            let sinks = layer.attention().and_then(|a| a.sinks.as_ref()).cloned();
            for norm in [
                q_norm,
                k_norm,
                &layer.attn_out_norm,
                &layer.mlp_out_norm,
                &sinks,
            ]
            .into_iter()
            .flatten()
            {
                norm.eval()?;
            }
            layers.push(layer);
        }
        let embed = store.matrix(naming.embed(), policy)?;
        embed.eval()?;
        let head_weight = format!("{}.weight", naming.head());
        let head = if store.contains(&head_weight) {
            let head = store.matrix(naming.head(), policy)?;
            head.eval()?;
            Some(head)
        } else {
            None
        };
        let mut final_norm = store.vector(naming.final_norm(), policy)?;
        if (config.arch.is_gemma() && naming == TensorNaming::HuggingFace) || hybrid_offset {
            final_norm = final_norm.add(Array::from_f32(1.0).as_dtype(final_norm.dtype())?)?;
        }
        final_norm.eval()?;
        let rotary = Rotary::new(&config, policy)?;
        let window = config
            .sliding_window
            .as_ref()
            .map(|w| WindowedLayers::new(w.tokens, &w.layers))
            .transpose()?;
        let cpu = crate::mlx_device::default_device_kind() == "cpu";
        let mut model = Self {
            config,
            policy,
            embed,
            head,
            final_norm,
            layers,
            rotary,
            cpu_attention: cpu,
            host: None,
            window,
        };
        if cpu && host_steps_enabled() {
            model.host = host_step::HostWeights::new(&model)?;
        }
        if !cpu {
            model.set_device_recurrence(true)?;
        }
        Ok(model)
    }

    /// Runs the recurrence of linear-attention layers as MLX operations on the device (the
    /// default off a CPU) or in the host kernel (the default on one); returns how many layers
    /// changed. The two agree within f32 rounding (tests compare them on a CPU).
    pub fn set_device_recurrence(&mut self, on: bool) -> Result<usize> {
        let mut changed = 0;
        for layer in &mut self.layers {
            if let Mixer::Linear(mixer) = &mut layer.mixer
                && mixer.on_device() != on
            {
                mixer.set_on_device(on)?;
                changed += 1;
            }
        }
        if changed > 0 {
            tracing::info!(
                on_device = on,
                layers = changed,
                "linear-attention recurrence placed"
            );
        }
        Ok(changed)
    }

    /// Turns passes of a few rows on the host kernels (`host_step`) on or off; returns whether
    /// they are on (never off a CPU, or for weights that are not f32-readable).
    pub fn set_host_steps(&mut self, on: bool) -> Result<bool> {
        self.host = None;
        if on && self.cpu_attention {
            self.host = host_step::HostWeights::new(self)?;
        }
        Ok(self.host.is_some())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Bytes of the weights kept as codes for the few-rows kernel (0 unless a CPU serves a
    /// quantised file).
    pub fn weight_code_bytes(&self) -> usize {
        let layers = self.layers.iter().flat_map(|l| {
            l.dense_projections()
                .into_iter()
                .flatten()
                .map(|lin| &lin.matrix)
        });
        layers
            .chain(std::iter::once(&self.embed))
            .chain(self.head.as_ref())
            .map(Matrix::code_bytes)
            .sum()
    }

    /// Serves `tokens` of context instead of the model's own. Positions are rotated on the fly
    /// (no table sized by the context), so only the limit moves.
    pub fn set_context_length(&mut self, tokens: usize) {
        self.config.context_length = tokens;
    }

    pub fn policy(&self) -> DtypePolicy {
        self.policy
    }

    /// The cache's layout: K/V for the attention layers (all of them but a hybrid model's
    /// linear-attention layers, whose recurrent states the cache keeps beside them).
    pub fn kv_layout(&self) -> KvLayout {
        let c = &self.config;
        KvLayout {
            num_layers: c.attention_layers().len(),
            kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            dtype: self.policy.kv,
            window: self.window,
            recurrent: c.linear_attention.as_ref().map(|l| {
                let shape = l.shape();
                RecurrentLayers {
                    layers: l.layers.len(),
                    conv_floats: shape.conv_floats(),
                    state_floats: shape.state_floats(),
                }
            }),
        }
    }

    /// Whether the model has recurrent (linear-attention) layers: its cache can resume only
    /// where it holds a snapshot of their states.
    pub fn is_hybrid(&self) -> bool {
        self.config.linear_attention.is_some()
    }

    /// An empty cache for one sequence, growing `step_tokens` at a time.
    pub fn new_cache(&self, step_tokens: usize) -> KvCache {
        KvCache::new(self.kv_layout(), step_tokens)
    }

    /// Runs the new tokens of every sequence through the model, appends their K/V to each
    /// sequence's cache, and returns the logits after each sequence's last new token
    /// (`[batch, vocab]`, f32).
    pub fn forward(&self, batch: &mut [SeqChunk<'_>]) -> Result<Array> {
        self.check(batch)?;
        if self.host_step_applies(batch) {
            return self.host_forward(batch);
        }
        let ids: Vec<u32> = batch
            .iter()
            .flat_map(|s| s.tokens.iter().copied())
            .collect();
        let x = self.embed_tokens(&ids)?;
        self.layers_and_head(x, batch, Outputs::LastLogits)
    }

    /// One sequence's new tokens through the model, returning the logits after *every* new
    /// token (`[t, vocab]`, f32): speculative decoding verifies all drafted tokens at once.
    pub fn forward_all_positions(&self, seq: SeqChunk<'_>) -> Result<Array> {
        let mut batch = [seq];
        self.check(&batch)?;
        let x = self.embed_tokens(batch[0].tokens)?;
        self.layers_and_head(x, &mut batch, Outputs::AllLogits)
    }

    /// One sequence's new tokens through the model (their KV appended as usual), returning
    /// how much attention they pay to every position held: softmax weights averaged over
    /// heads, the new tokens and layers (`[positions]`, f32). SpecPrefill scores prompt tokens
    /// with this; no logits are computed.
    pub fn attention_to_positions(&self, seq: SeqChunk<'_>) -> Result<Array> {
        let mut batch = [seq];
        self.check(&batch)?;
        let x = self.embed_tokens(batch[0].tokens)?;
        self.layers_and_head(x, &mut batch, Outputs::AttentionScores)
    }

    /// The input embeddings `[N, D]` of token ids (unchecked: `forward` validates them).
    pub fn embed_tokens(&self, ids: &[u32]) -> Result<Array> {
        let ids = Array::from_slice(ids, &[ids.len() as i32]);
        let rows = self.embed.rows(&ids, self.policy.compute)?;
        match self.config.embed_scale {
            Some(scale) => Ok(rows.multiply(Array::from_f32(scale).as_dtype(rows.dtype())?)?),
            None => Ok(rows),
        }
    }

    /// `forward` from input embeddings `[N, D]` (one row per token of `batch`, in order), for
    /// callers that put other rows there, such as a VLM's image features.
    pub fn forward_embedded(&self, x: Array, batch: &mut [SeqChunk<'_>]) -> Result<Array> {
        self.check(batch)?;
        self.layers_and_head(x, batch, Outputs::LastLogits)
    }

    /// Every sequence has tokens, fits the context and names only vocabulary ids.
    fn check(&self, batch: &[SeqChunk<'_>]) -> Result<()> {
        let c = &self.config;
        if batch.is_empty() || batch.iter().any(|s| s.tokens.is_empty()) {
            return Err(EngineError::Config(
                "forward needs at least one token per sequence".into(),
            ));
        }
        for seq in batch.iter() {
            if seq.cache.len() + seq.tokens.len() > c.context_length {
                return Err(EngineError::Config(format!(
                    "{} tokens exceed the context length {}",
                    seq.cache.len() + seq.tokens.len(),
                    c.context_length
                )));
            }
            if let Some(&bad) = seq.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
                return Err(EngineError::Config(format!(
                    "token id {bad} outside the vocabulary"
                )));
            }
        }
        Ok(())
    }

    fn layers_and_head(
        &self,
        x: Array,
        batch: &mut [SeqChunk<'_>],
        want: Outputs,
    ) -> Result<Array> {
        let c = &self.config;
        let mut x = x;
        // Token ranges of each sequence inside the flat batch.
        let mut ranges = Vec::with_capacity(batch.len());
        let mut at = 0i32;
        for seq in batch.iter() {
            let t = seq.tokens.len() as i32;
            ranges.push((at, at + t));
            at += t;
        }

        let (h, hk, hd) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let scale = c.attention_scale;
        let mut attention: Option<Array> = None;
        // A decode step or a short chunk: products by the few-rows CPU kernel (`strata_cpu_kernels::matmul`).
        let few = self.cpu_attention
            && at as usize
                <= strata_cpu_kernels::matmul::MAX_ROWS.max(super::weights::PACKED_MAX_ROWS);
        let decode_positions = self.batched_decode_positions(batch, want);
        // Each layer's place among the layers that keep K/V, and among the recurrent ones.
        let (mut kv_index, mut recurrent_index) = (0, 0);
        for (li, layer) in self.layers.iter().enumerate() {
            let window = c.window_of(li);
            let normed = fast::rms_norm(&x, Some(&layer.attn_norm), c.rms_norm_eps)?;
            let att = match &layer.mixer {
                Mixer::Attention(att) => att,
                Mixer::Linear(mixer) => {
                    let out = mixer.forward(&normed, batch, &ranges, recurrent_index, few)?;
                    recurrent_index += 1;
                    x = x.add(out)?;
                    x = self.mlp(layer, &x, few)?;
                    continue;
                }
            };
            let kvi = kv_index;
            kv_index += 1;
            let [q, k, v] = Linear::forward_group([&att.q, &att.k, &att.v], &normed, few)?;
            // Qwen3.5: each head's rows of q_proj are its queries, then its output gate.
            let (q, gate) = if c.attention_output_gate {
                let rows = q.shape()[0];
                let both = q.reshape(&[rows, h, 2, hd])?;
                let queries = both.try_index((.., .., 0, ..))?.reshape(&[rows, h * hd])?;
                let gate = both.try_index((.., .., 1, ..))?.reshape(&[rows, h * hd])?;
                (queries, Some(gate))
            } else {
                (q, None)
            };
            if let Some(positions) = &decode_positions {
                let attn = self.batched_decode_attention(
                    att,
                    [&q, &k, &v],
                    batch,
                    (li, kvi),
                    positions,
                    window,
                )?;
                let attn = gated(attn, gate.as_ref())?;
                x = self.attention_residual(layer, att, &x, &attn, few)?;
                x = self.mlp(layer, &x, few)?;
                continue;
            }
            // Each sequence's queries (RoPE applied) and everything its cache holds.
            let mut inputs = Vec::with_capacity(batch.len());
            for (seq, &(start, end)) in batch.iter_mut().zip(&ranges) {
                let t = end - start;
                let rows = |a: &Array| -> Result<Array> {
                    if ranges.len() == 1 {
                        Ok(a.clone())
                    } else {
                        Ok(a.try_index(start..end)?)
                    }
                };
                let heads = |a: Array, n: i32| -> Result<Array> {
                    Ok(a.reshape(&[1, t, n, hd])?.transpose_axes(&[0, 2, 1, 3])?)
                };
                let held = seq.cache.len() as i32;
                let positions = seq.cache.position_runs(t as usize);
                let (mut q, mut k) = (heads(rows(&q)?, h)?, heads(rows(&k)?, hk)?);
                if let (Some(qn), Some(kn)) = (&att.q_norm, &att.k_norm) {
                    q = fast::rms_norm(&q, Some(qn), c.rms_norm_eps)?;
                    k = fast::rms_norm(&k, Some(kn), c.rms_norm_eps)?;
                }
                let q = self.scale_queries(self.rope_runs(&q, li, &positions)?, &positions)?;
                let k = self.rope_runs(&k, li, &positions)?;
                let v = heads(rows(&v)?, hk)?;
                let (keys, values) = seq.cache.append(kvi, &k, &v)?;
                let (keys, values) = if keys.dtype() == q.dtype() {
                    (keys, values)
                } else {
                    (keys.as_dtype(q.dtype())?, values.as_dtype(q.dtype())?)
                };
                if want == Outputs::AttentionScores {
                    let weights =
                        attention_weights(&q, &keys, held, scale, window, att.sinks.as_ref())?;
                    attention = Some(match attention.take() {
                        Some(sum) => sum.add(&weights)?,
                        None => weights,
                    });
                }
                inputs.push((q, keys, values));
            }
            // The CPU kernels have no sinks: gpt-oss's attention takes MLX's (which does).
            let our_kernels = self.cpu_attention && att.sinks.is_none();
            let few_queries = our_kernels
                && inputs.iter().all(|(q, keys, _)| {
                    q.shape()[2] as usize <= strata_cpu_kernels::attention::FEW_QUERIES
                        && cpu_attention::applies(q, keys)
                });
            if few_queries {
                let attn = self.few_queries_attention(batch, li, kvi, &inputs, scale)?;
                let attn = gated(attn, gate.as_ref())?;
                x = self.attention_residual(layer, att, &x, &attn, few)?;
                x = self.mlp(layer, &x, few)?;
                continue;
            }
            let ours = our_kernels
                && inputs
                    .iter()
                    .all(|(q, keys, _)| cpu_attention::applies(q, keys));
            let attended = if ours {
                let views: Vec<AttentionInput<'_>> = inputs
                    .iter()
                    .map(|(q, keys, values)| AttentionInput {
                        q,
                        keys,
                        values,
                        window,
                    })
                    .collect();
                cpu_attention::attention(&views, scale)?
            } else {
                inputs
                    .iter()
                    .map(|(q, keys, values)| {
                        fused_attention(q, keys, values, scale, window, att.sinks.as_ref())
                    })
                    .collect::<Result<Vec<_>>>()?
            };
            let mut outputs = Vec::with_capacity(batch.len());
            for (attn, &(start, end)) in attended.into_iter().zip(&ranges) {
                let t = end - start;
                outputs.push(attn.transpose_axes(&[0, 2, 1, 3])?.reshape(&[t, h * hd])?);
            }
            let attn = if outputs.len() == 1 {
                outputs
                    .pop()
                    .ok_or_else(|| EngineError::Mlx("no output".into()))?
            } else {
                concatenate(&outputs, 0)?
            };
            let attn = gated(attn, gate.as_ref())?;
            x = self.attention_residual(layer, att, &x, &attn, few)?;
            x = self.mlp(layer, &x, few)?;
        }
        for (seq, &(start, end)) in batch.iter_mut().zip(&ranges) {
            seq.cache.advance((end - start) as usize);
        }
        if let Some(sum) = attention {
            return Ok(sum.divide(Array::from_f32(self.layers.len() as f32))?);
        }

        let x = if want == Outputs::AllLogits {
            x
        } else {
            let last: Vec<i32> = ranges.iter().map(|&(_, end)| end - 1).collect();
            let last = Array::from_slice(&last, &[last.len() as i32]);
            x.take_axis(&last, 0)?
        };
        let x = fast::rms_norm(&x, Some(&self.final_norm), c.rms_norm_eps)?;
        let head = self.head.as_ref().unwrap_or(&self.embed);
        // One row per sequence (unless all positions are wanted): the few-rows kernel on a
        // CPU whatever the chunk's length.
        let few_head = if self.cpu_attention {
            head.apply_few_rows(&x)?
        } else {
            None
        };
        let logits = match few_head {
            Some(logits) => logits,
            None => head.apply(&x)?,
        };
        Ok(logits.as_dtype(Dtype::Float32)?)
    }

    /// Attention and products through MLX's kernels even on a CPU, as on a GPU or Metal: for
    /// tests of the paths only an accelerator takes otherwise.
    pub fn use_mlx_kernels(&mut self) {
        self.cpu_attention = false;
        self.host = None;
    }

    /// Whether a decode step of `batch` runs as one (`batched_decode_positions`): for tests.
    pub fn decodes_as_one_batch(&self, batch: &[SeqChunk<'_>]) -> bool {
        self.batched_decode_positions(batch, Outputs::LastLogits)
            .is_some()
    }

    /// The position of each sequence's one new token, if `batch` is a decode step that runs
    /// as one: several sequences of one token each, logits wanted, on MLX's attention (not a
    /// CPU's, whose kernels read each cache in place), in a family whose RoPE is the plain one
    /// (no per-layer base, no query scaling). Why: on a GPU a batched decode step is bound by
    /// the number of operations in its graph, not by arithmetic; each sequence's own RoPE,
    /// slices and transposes made 8 streams take ~35 ms a step on an H100 against 5.5 ms for
    /// one.
    fn batched_decode_positions(&self, batch: &[SeqChunk<'_>], want: Outputs) -> Option<Array> {
        let c = &self.config;
        if self.cpu_attention
            || want != Outputs::LastLogits
            || batch.len() < 2
            || c.sliding_window.is_some()
            || c.query_scaling.is_some()
        {
            return None;
        }
        let mut positions = Vec::with_capacity(batch.len());
        for seq in batch {
            match seq.cache.position_runs(seq.tokens.len())[..] {
                [(0, 1, position)] if seq.tokens.len() == 1 => positions.push(position as i32),
                _ => return None,
            }
        }
        Some(Array::from_slice(&positions, &[positions.len() as i32]))
    }

    /// Attention of layer `li` (K/V layer `kvi`) for a decode step of one token per sequence:
    /// queries and keys of the whole batch through RoPE together (one position per row), then
    /// per sequence only its cache append and MLX's fused attention. `[sequences, heads * dim]`.
    fn batched_decode_attention(
        &self,
        att: &Attention,
        [q, k, v]: [&Array; 3],
        batch: &mut [SeqChunk<'_>],
        (li, kvi): (usize, usize),
        positions: &Array,
        window: Option<usize>,
    ) -> Result<Array> {
        let c = &self.config;
        let n = batch.len() as i32;
        let (h, hk, hd) = (c.num_heads as i32, c.num_kv_heads as i32, c.head_dim as i32);
        let heads = |a: &Array, heads: i32| -> Result<Array> {
            Ok(a.reshape(&[n, 1, heads, hd])?
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        let (mut q, mut k) = (heads(q, h)?, heads(k, hk)?);
        if let (Some(qn), Some(kn)) = (&att.q_norm, &att.k_norm) {
            q = fast::rms_norm(&q, Some(qn), c.rms_norm_eps)?;
            k = fast::rms_norm(&k, Some(kn), c.rms_norm_eps)?;
        }
        let q = self.rope_rows(&q, li, positions)?;
        let k = self.rope_rows(&k, li, positions)?;
        let v = heads(v, hk)?;
        let mut outputs = Vec::with_capacity(batch.len());
        for (i, seq) in batch.iter_mut().enumerate() {
            let i = i as i32;
            let (keys, values) =
                seq.cache
                    .append(kvi, &k.try_index(i..i + 1)?, &v.try_index(i..i + 1)?)?;
            let q = q.try_index(i..i + 1)?;
            let (keys, values) = if keys.dtype() == q.dtype() {
                (keys, values)
            } else {
                (keys.as_dtype(q.dtype())?, values.as_dtype(q.dtype())?)
            };
            outputs.push(fused_attention(
                &q,
                &keys,
                &values,
                c.attention_scale,
                window,
                att.sinks.as_ref(),
            )?);
        }
        // `[n, heads, 1, dim]` is `[n, heads * dim]` in memory: one new token per sequence.
        Ok(concatenate(&outputs, 0)?.reshape(&[n, h * hd])?)
    }

    /// RoPE of layer `li` over `[n, heads, 1, dim]`, row `i` at `positions[i]`.
    fn rope_rows(&self, x: &Array, li: usize, positions: &Array) -> Result<Array> {
        if self.config.no_rope_layers.contains(&li) {
            return Ok(x.clone());
        }
        let x = match &self.rotary.input_scale {
            Some(scale) => x.multiply(scale)?,
            None => x.clone(),
        };
        let c = &self.config;
        let base = match self.rotary.periods {
            Some(_) => None,
            None => Some(c.rope_theta),
        };
        Ok(fast::rope_dynamic(
            &x,
            c.rope_dims as i32,
            c.rope_traditional,
            base,
            c.rope_scaling.position_scale(),
            positions,
            self.rotary.periods.as_ref(),
        )?)
    }

    /// The residual stream after attention: `x + o(attn)`, the output normalised first in
    /// Gemma.
    fn attention_residual(
        &self,
        layer: &Layer,
        att: &Attention,
        x: &Array,
        attn: &Array,
        few: bool,
    ) -> Result<Array> {
        let out = att.o.forward_on(attn, few)?;
        let out = match &layer.attn_out_norm {
            Some(norm) => fast::rms_norm(&out, Some(norm), self.config.rms_norm_eps)?,
            None => out,
        };
        Ok(x.add(out)?)
    }

    /// The residual stream after the layer's MLP.
    fn mlp(&self, layer: &Layer, x: &Array, few: bool) -> Result<Array> {
        let eps = self.config.rms_norm_eps;
        let normed = fast::rms_norm(x, Some(&layer.mlp_norm), eps)?;
        let out = match &layer.ffn {
            FeedForward::Experts(experts) => experts.forward(&normed, few)?,
            FeedForward::Dense { gate, up, down } => {
                let [gate, up] = Linear::forward_group([gate, up], &normed, few)?;
                let hidden = if self.config.arch.is_gemma() {
                    mlx_rs::nn::gelu_approximate(gate)?.multiply(&up)?
                } else if self.host.is_some() {
                    host_swiglu(gate, &up)?
                } else {
                    mlx_rs::nn::silu(gate)?.multiply(&up)?
                };
                down.forward_on(&hidden, few)?
            }
        };
        let out = match &layer.mlp_out_norm {
            Some(norm) => fast::rms_norm(&out, Some(norm), eps)?,
            None => out,
        };
        Ok(x.add(out)?)
    }

    /// Attention of layer `li` for sequences of a few new queries each, read from their caches
    /// in place (`strata_cpu_kernels::attention::few_queries`): `[tokens, heads * dim]` in batch order.
    fn few_queries_attention(
        &self,
        batch: &[SeqChunk<'_>],
        li: usize,
        kv_index: usize,
        inputs: &[(Array, Array, Array)],
        scale: f32,
    ) -> Result<Array> {
        let c = &self.config;
        let mut buffers = Vec::with_capacity(batch.len());
        for seq in batch {
            buffers.push(
                seq.cache
                    .layer_buffers(kv_index)
                    .ok_or_else(|| EngineError::Mlx("no KV buffers after an append".into()))?,
            );
        }
        // One evaluation for the whole batch: queries and the cache writes of this step.
        mlx_rs::transforms::eval(
            inputs
                .iter()
                .map(|(q, _, _)| q)
                .chain(buffers.iter().flat_map(|(k, v)| [*k, *v])),
        )?;
        let mut outputs = Vec::with_capacity(batch.len());
        for ((q, keys, _), (kb, vb)) in inputs.iter().zip(&buffers) {
            let t = q.shape()[2] as usize;
            let cache = strata_cpu_kernels::attention::CacheBuffers {
                keys: read(kb)?,
                values: read(vb)?,
                kv_heads: c.num_kv_heads,
                capacity: kb.shape()[2] as usize,
                dim: c.head_dim,
                visible: keys.shape()[2] as usize,
                window: c.window_of(li),
            };
            let out =
                strata_cpu_kernels::attention::few_queries(read(q)?, c.num_heads, t, cache, scale);
            outputs.push(Array::from_slice(
                &out,
                &[t as i32, (c.num_heads * c.head_dim) as i32],
            ));
        }
        Ok(if outputs.len() == 1 {
            outputs
                .pop()
                .ok_or_else(|| EngineError::Mlx("no output".into()))?
        } else {
            concatenate(&outputs, 0)?
        })
    }

    /// Ministral 3's queries (`[1, heads, t, dim]`, at `runs` of positions) times their
    /// position's factor (`QueryScaling`); other families' as they are.
    fn scale_queries(&self, q: Array, runs: &[(usize, usize, usize)]) -> Result<Array> {
        let Some(scaling) = self.config.query_scaling else {
            return Ok(q);
        };
        let factors: Vec<f32> = runs
            .iter()
            .flat_map(|&(_, len, first)| (first..first + len).map(|p| scaling.factor(p)))
            .collect();
        let factors = Array::from_slice(&factors, &[1, 1, factors.len() as i32, 1]);
        Ok(q.multiply(factors.as_dtype(q.dtype())?)?)
    }

    /// RoPE of layer `li` over `[1, heads, t, dim]` whose tokens sit at `runs` of positions
    /// (one run unless pruned prompt positions were skipped inside the chunk).
    fn rope_runs(&self, x: &Array, li: usize, runs: &[(usize, usize, usize)]) -> Result<Array> {
        if self.config.no_rope_layers.contains(&li) {
            return Ok(x.clone());
        }
        if let Some(w) = &self.config.sliding_window
            && let Some(theta) = w.rope_theta
            && w.layers.contains(&li)
        {
            // Gemma's local layers: their own base, none of the global layers' scaling.
            let (_, _, position) = runs.first().copied().unwrap_or_default();
            if runs.len() > 1 {
                return Err(EngineError::Config(
                    "skipped positions (SpecPrefill) in a sliding-window model".into(),
                ));
            }
            let dims = self.config.rope_dims as i32;
            return Ok(fast::rope(
                x,
                dims,
                self.config.rope_traditional,
                Some(theta),
                1.0,
                position as i32,
                None,
            )?);
        }
        let x = match &self.rotary.input_scale {
            Some(scale) => x.multiply(scale)?,
            None => x.clone(),
        };
        if let [(_, _, position)] = runs {
            return self.rope(&x, *position as i32);
        }
        let parts = runs
            .iter()
            .map(|&(start, len, position)| {
                let part = x.try_index((.., .., start as i32..(start + len) as i32, ..))?;
                self.rope(&part, position as i32)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(concatenate(&parts, 2)?)
    }

    fn rope(&self, x: &Array, offset: i32) -> Result<Array> {
        let c = &self.config;
        // With explicit periods MLX takes no base.
        let base = match self.rotary.periods {
            Some(_) => None,
            None => Some(c.rope_theta),
        };
        Ok(fast::rope(
            x,
            c.rope_dims as i32,
            c.rope_traditional,
            base,
            c.rope_scaling.position_scale(),
            offset,
            self.rotary.periods.as_ref(),
        )?)
    }
}

impl Rotary {
    fn new(c: &ModelConfig, policy: DtypePolicy) -> Result<Self> {
        let periods = c
            .rope_scaling
            .custom_periods(c.rope_theta, c.rope_dims)
            .map(|p| Array::from_slice(&p, &[p.len() as i32]));
        let mscale = c.rope_scaling.input_scale();
        let input_scale = if mscale == 1.0 {
            None
        } else {
            let scales: Vec<f32> = (0..c.head_dim)
                .map(|d| if d < c.rope_dims { mscale } else { 1.0 })
                .collect();
            Some(Array::from_slice(&scales, &[c.head_dim as i32]).as_dtype(policy.compute)?)
        };
        for a in periods.iter().chain(&input_scale) {
            a.eval()?;
        }
        Ok(Self {
            periods,
            input_scale,
        })
    }
}
