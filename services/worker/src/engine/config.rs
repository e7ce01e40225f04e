//! Hyper-parameters of a Llama-family decoder, read from GGUF metadata or `config.json`.

use serde::Deserialize;

use super::{EngineError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 1-3.x and its descendants (SmolLM2): biases only where the file has them.
    Llama,
    /// Mistral: a Llama by another name (mlx-lm maps it to its Llama code too).
    Mistral,
    /// Qwen2 / Qwen2.5: Llama plus biases on the q/k/v projections.
    Qwen2,
    /// Qwen3 (dense): an RMSNorm over each query and key head before RoPE, no biases.
    Qwen3,
    /// Phi-3 / Phi-4-mini: q/k/v and gate/up fused into one projection each on disk, partial
    /// rotary embeddings.
    Phi3,
    /// SmolLM3: Llama whose `no_rope_layers` run attention without positions (NoPE).
    SmolLm3,
    /// Gemma 3 (text): sliding-window layers between global ones, each with its own RoPE
    /// base; q/k norms; norms stored as offsets from 1, and a second norm on the output of
    /// attention and of the MLP; a GELU (tanh) MLP; the embedding scaled by sqrt(hidden).
    Gemma3,
    /// Ministral 3 (the text decoder of Mistral's 2512 models): a Llama with YaRN RoPE and
    /// queries scaled up with the position past the original context (Llama 4's attention
    /// temperature).
    Ministral3,
    /// Qwen3 mixture-of-experts (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, and in place
    /// of the MLP a router choosing `num_experts_per_tok` of `num_experts` SwiGLU experts per
    /// token, their outputs weighted by the router's (renormalised) probabilities.
    Qwen3Moe,
    /// Qwen1.5-MoE / Qwen2-MoE: Qwen2's attention (q/k/v biases); every layer routes to
    /// `num_experts_per_tok` experts (probabilities not renormalised) and adds a shared
    /// expert gated by a sigmoid.
    Qwen2Moe,
    /// Qwen3.5 / Qwen3.6 (dense): hybrid layers, mostly Gated DeltaNet (linear attention with
    /// a recurrent state and a causal convolution) with full attention every
    /// `full_attention_interval`-th layer; the attention layers gate their output by a sigmoid
    /// of a second half of `q_proj`, norm q/k per head and rotate a quarter of each head.
    Qwen3_5,
    /// Qwen3.5-MoE / Qwen3.6-35B-A3B: Qwen3.5's layers with Qwen3-Next's mixture of experts in
    /// every layer (softmax router, top-k renormalised, a shared expert behind a sigmoid gate).
    Qwen3_5Moe,
    /// Qwen3-Next (Qwen3-Next-80B-A3B): Qwen3.5-MoE's layers before it, with the Gated
    /// DeltaNet's projections fused per key head on disk (`in_proj_qkvz`, `in_proj_ba`) and
    /// `mlp_only_layers` / `decoder_sparse_step` deciding which layers route.
    Qwen3Next,
    /// gpt-oss (OpenAI's 20B and 120B): sliding-window layers (128 tokens) alternating with
    /// full attention, biases on q/k/v/o, a learned sink logit per query head in attention's
    /// softmax, YaRN RoPE, and a mixture of experts in every layer: a router with a bias,
    /// softmax over the chosen experts' logits, experts with biases and a clamped SwiGLU.
    GptOss,
}

impl Architecture {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Ok(Self::Llama),
            "mistral" | "MistralForCausalLM" => Ok(Self::Mistral),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Self::Qwen3),
            "phi3" | "Phi3ForCausalLM" => Ok(Self::Phi3),
            "smollm3" | "SmolLM3ForCausalLM" => Ok(Self::SmolLm3),
            "gemma3_text" | "Gemma3ForCausalLM" => Ok(Self::Gemma3),
            "ministral3" | "Ministral3ForCausalLM" => Ok(Self::Ministral3),
            "qwen3_moe" | "Qwen3MoeForCausalLM" => Ok(Self::Qwen3Moe),
            "qwen2_moe" | "Qwen2MoeForCausalLM" => Ok(Self::Qwen2Moe),
            "qwen3_5" | "qwen3_5_text" | "Qwen3_5ForCausalLM" => Ok(Self::Qwen3_5),
            "qwen3_5_moe" | "qwen3_5_moe_text" | "Qwen3_5MoeForCausalLM" => Ok(Self::Qwen3_5Moe),
            "gpt_oss" | "GptOssForCausalLM" => Ok(Self::GptOss),
            "qwen3_next" | "Qwen3NextForCausalLM" => Ok(Self::Qwen3Next),
            other => Err(EngineError::UnknownArchitecture(format!(
                "{other} (supported: llama, mistral, qwen2, qwen3, phi3, smollm3, gemma3_text, \
                 ministral3, qwen3_moe, qwen2_moe, qwen3_5, qwen3_5_moe, qwen3_next, gpt_oss)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Mistral => "mistral",
            Self::Qwen2 => "qwen2",
            Self::Qwen3 => "qwen3",
            Self::Phi3 => "phi3",
            Self::SmolLm3 => "smollm3",
            Self::Gemma3 => "gemma3",
            Self::Ministral3 => "ministral3",
            Self::Qwen3Moe => "qwen3_moe",
            Self::Qwen2Moe => "qwen2_moe",
            Self::Qwen3_5 => "qwen3_5",
            Self::Qwen3_5Moe => "qwen3_5_moe",
            Self::GptOss => "gpt_oss",
            Self::Qwen3Next => "qwen3_next",
        }
    }

    /// Query and key heads pass through an RMSNorm of their own before RoPE.
    pub fn has_qk_norm(self) -> bool {
        matches!(
            self,
            Self::Qwen3
                | Self::Gemma3
                | Self::Qwen3Moe
                | Self::Qwen3_5
                | Self::Qwen3_5Moe
                | Self::Qwen3Next
        )
    }

    /// Hybrid layers: linear attention with a recurrent state between attention layers.
    pub fn is_hybrid(self) -> bool {
        matches!(self, Self::Qwen3_5 | Self::Qwen3_5Moe | Self::Qwen3Next)
    }

    /// Gemma's layout: RMSNorm weights stored as offsets from 1, the outputs of attention and
    /// of the MLP normalised before they join the residual, a GELU (tanh) MLP.
    pub fn is_gemma(self) -> bool {
        self == Self::Gemma3
    }
}

/// Layers that attend only to the last `tokens` positions, their own included (Gemma 3's
/// local layers; mlx-lm's windowed mask: key k is seen by query q when q - tokens < k <= q).
#[derive(Debug, Clone, PartialEq)]
pub struct SlidingWindow {
    pub tokens: usize,
    /// The windowed layers, in order.
    pub layers: Vec<usize>,
    /// Their own RoPE base, without the global layers' scaling (Gemma's
    /// `rope_local_base_freq`); None: they rotate as the other layers do (Ministral 3).
    pub rope_theta: Option<f32>,
}

/// Mixture-of-experts layers: which layers route each token to `per_token` of `count`
/// experts (SwiGLU MLPs of `intermediate_size`), and whether the chosen experts' router
/// probabilities are renormalised to sum to 1.
#[derive(Debug, Clone, PartialEq)]
pub struct Experts {
    pub count: usize,
    pub per_token: usize,
    pub intermediate_size: usize,
    pub normalize_top_k: bool,
    pub layers: Vec<usize>,
    /// A shared expert every token also takes, of this width, gated by a sigmoid (Qwen2-MoE).
    pub shared_intermediate_size: Option<usize>,
    /// How an expert's gate and up projections combine.
    pub activation: ExpertActivation,
}

/// An expert's gated activation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertActivation {
    /// `silu(gate) * up`.
    SwiGlu,
    /// gpt-oss: the gate clamped from above and up into `[-limit, limit]`, then
    /// `(up + 1) * gate * sigmoid(1.702 * gate)`.
    ClampedSwiGlu { limit: f32 },
}

/// Gated DeltaNet layers (Qwen3.5, Qwen3-Next): each keeps a causal depthwise convolution's
/// last `conv_kernel - 1` inputs and a recurrent state of `value_heads x value_dim x key_dim`
/// instead of a KV cache (mlx-lm's `GatedDeltaNet`).
#[derive(Debug, Clone, PartialEq)]
pub struct LinearAttention {
    /// The linear-attention layers, in order; the others are full attention.
    pub layers: Vec<usize>,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

impl LinearAttention {
    /// The widths the Gated DeltaNet kernel takes (and sizes the states by).
    pub fn shape(&self) -> strata_cpu_kernels::gated_delta::Shape {
        strata_cpu_kernels::gated_delta::Shape {
            key_heads: self.key_heads,
            value_heads: self.value_heads,
            key_dim: self.key_dim,
            value_dim: self.value_dim,
            conv_kernel: self.conv_kernel,
        }
    }
}

/// Llama 4's attention temperature (Ministral 3): queries at position p are multiplied by
/// `1 + beta · ln(1 + floor(p / original_context))`, so that attention sharpens past the
/// context the model was first trained on.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueryScaling {
    pub beta: f32,
    pub original_context: usize,
}

impl QueryScaling {
    /// The factor on the queries at `position`, in f32 as mlx-lm computes it.
    pub fn factor(&self, position: usize) -> f32 {
        let steps = (position / self.original_context.max(1)) as f32;
        1.0 + self.beta * (1.0 + steps).ln()
    }
}

/// How positions are turned into rotation angles: the frequency of rotary pair `i` is
/// `theta^(-2i/dims)`, then one of these rescalings (Hugging Face's `rope_scaling`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.x: low frequencies slowed by `factor`, high ones kept, a smooth ramp between
    /// the wavelengths `original_context / low_freq_factor` and `/ high_freq_factor`.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_context: f32,
    },
    /// Phi-3's "longrope" (also "su"): each pair's wavelength stretched by its own factor, and
    /// the rotated part of q and k scaled by `mscale`. Like mlx-lm, the long factors serve every
    /// length (mlx-lm's `SuScaledRoPE`); Hugging Face switches to the short ones below
    /// `original_max_position_embeddings`. GGUF Llama 3.1+ files' `rope_freqs` are the same
    /// per-pair factors with `mscale` 1.
    LongRope {
        long_factor: Vec<f32>,
        mscale: f32,
    },
    /// YaRN (Ministral 3, DeepSeek): each pair's period interpolated between the original
    /// and `factor` times it by a linear ramp over the pairs between the `beta_fast` and
    /// `beta_slow` rotation counts in the original context; the rotated part of q and k scaled
    /// by `mscale` (mlx-lm's `YarnRoPE`).
    Yarn {
        factor: f32,
        original_context: f32,
        beta_fast: f32,
        beta_slow: f32,
        mscale: f32,
    },
}

impl RopeScaling {
    /// Per-pair inverse frequencies' reciprocals (what MLX's `rope` takes as `freqs`: the
    /// period divisor of pair i is `freqs[i]`, angle = position / freqs[i]), or `None` when a
    /// plain base and scale describe it.
    pub fn custom_periods(&self, theta: f32, dims: usize) -> Option<Vec<f32>> {
        let base = |i: usize| (theta as f64).powf(2.0 * i as f64 / dims as f64);
        let pairs = dims / 2;
        match self {
            Self::None | Self::Linear { .. } => None,
            Self::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_context,
            } => {
                let (factor, low, high, context) = (
                    *factor as f64,
                    *low_freq_factor as f64,
                    *high_freq_factor as f64,
                    *original_context as f64,
                );
                let (long_wavelength, short_wavelength) = (context / low, context / high);
                Some(
                    (0..pairs)
                        .map(|i| {
                            let period = base(i);
                            let wavelength = 2.0 * std::f64::consts::PI * period;
                            let period = if wavelength > long_wavelength {
                                period * factor
                            } else {
                                period
                            };
                            let medium =
                                wavelength > short_wavelength && wavelength < long_wavelength;
                            if !medium {
                                return period as f32;
                            }
                            let smooth = (context / wavelength - low) / (high - low);
                            (period / ((1.0 - smooth) / factor + smooth)) as f32
                        })
                        .collect(),
                )
            }
            Self::LongRope { long_factor, .. } => Some(
                (0..pairs)
                    .map(|i| (base(i) * long_factor.get(i).copied().unwrap_or(1.0) as f64) as f32)
                    .collect(),
            ),
            Self::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                ..
            } => {
                let (factor, context) = (*factor as f64, *original_context as f64);
                let dims_f = dims as f64;
                let ln_theta = (theta as f64).ln();
                // The pair index at which a period completes `rotations` turns in the context.
                let correction = |rotations: f64| {
                    dims_f * (context / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * ln_theta)
                };
                let low = correction(*beta_fast as f64).floor().max(0.0);
                let high = correction(*beta_slow as f64).ceil().min(dims_f - 1.0);
                let high = if low == high { high + 0.001 } else { high };
                Some(
                    (0..pairs)
                        .map(|i| {
                            let extra = base(i);
                            let inter = factor * extra;
                            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                            let keep = 1.0 - ramp;
                            (inter * extra / (inter * keep + extra * (1.0 - keep))) as f32
                        })
                        .collect(),
                )
            }
        }
    }

    /// MLX's `rope` scale argument: positions are multiplied by it.
    pub fn position_scale(&self) -> f32 {
        match self {
            Self::Linear { factor } => 1.0 / factor,
            _ => 1.0,
        }
    }

    /// The factor on the rotated dimensions of q and k before rotation.
    pub fn input_scale(&self) -> f32 {
        match self {
            Self::LongRope { mscale, .. } | Self::Yarn { mscale, .. } => *mscale,
            _ => 1.0,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// How many leading dimensions of each head RoPE rotates (all of them but in Phi's partial
    /// rotary models).
    pub rope_dims: usize,
    /// Layers whose attention has no positions at all (SmolLM3's NoPE layers).
    pub no_rope_layers: Vec<usize>,
    /// True when rotary pairs are adjacent dimensions (2i, 2i+1), as in GGUF Llama files whose
    /// q/k rows llama.cpp's converter permuted; false for the rotate-half layout of Hugging
    /// Face checkpoints and of Qwen2 everywhere.
    pub rope_traditional: bool,
    pub context_length: usize,
    /// Windowed attention layers, if the family has them (Gemma 3).
    pub sliding_window: Option<SlidingWindow>,
    /// The factor on attention logits: 1/sqrt(head_dim) unless the family sets its own
    /// (Gemma's `query_pre_attn_scalar`).
    pub attention_scale: f32,
    /// The factor on the input embeddings (Gemma: sqrt(hidden), rounded to bfloat16 as
    /// mlx-lm and Hugging Face compute it).
    pub embed_scale: Option<f32>,
    /// Queries scaled with their position (Ministral 3).
    pub query_scaling: Option<QueryScaling>,
    /// Mixture-of-experts layers (Qwen3-MoE).
    pub experts: Option<Experts>,
    /// Linear-attention layers (Qwen3.5's Gated DeltaNet), if the model is hybrid.
    pub linear_attention: Option<LinearAttention>,
    /// Attention output multiplied by `sigmoid` of a gate that `q_proj` computes beside the
    /// queries (Qwen3.5): `q_proj` has twice the rows, per head queries then gate.
    pub attention_output_gate: bool,
    /// One learned logit per query head joins each softmax of attention and takes its share
    /// of the weight without a value (gpt-oss's `self_attn.sinks`).
    pub attention_sinks: bool,
}

impl ModelConfig {
    /// Whether `layer` is a linear-attention (recurrent) layer.
    pub fn is_linear_layer(&self, layer: usize) -> bool {
        self.linear_attention
            .as_ref()
            .is_some_and(|l| l.layers.contains(&layer))
    }

    /// The full-attention layers, which keep K/V, in order.
    pub fn attention_layers(&self) -> Vec<usize> {
        (0..self.num_layers)
            .filter(|&l| !self.is_linear_layer(l))
            .collect()
    }

    /// Whether `layer`'s MLP is a mixture of experts.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.experts
            .as_ref()
            .is_some_and(|e| e.layers.contains(&layer))
    }
}

impl ModelConfig {
    /// Checks the relations the decoder relies on, so that bad files fail at load with a reason.
    pub fn validate(&self) -> Result<()> {
        let bad = |why: String| Err(EngineError::Config(why));
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(format!("empty model dimensions: {self:?}"));
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} attention heads cannot share {} key/value heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!("head dimension {} must be even", self.head_dim));
        }
        if self.context_length == 0 {
            return bad("context length 0".into());
        }
        if self.rope_dims == 0
            || self.rope_dims > self.head_dim
            || !self.rope_dims.is_multiple_of(2)
        {
            return bad(format!(
                "RoPE over {} of {} head dimensions (must be even and at most all)",
                self.rope_dims, self.head_dim
            ));
        }
        if let RopeScaling::LongRope { long_factor, .. } = &self.rope_scaling
            && long_factor.len() != self.rope_dims / 2
        {
            return bad(format!(
                "longrope has {} factors for {} rotary pairs",
                long_factor.len(),
                self.rope_dims / 2
            ));
        }
        if let Some(&layer) = self.no_rope_layers.iter().find(|&&l| l >= self.num_layers) {
            return bad(format!("no-RoPE layer {layer} past the last layer"));
        }
        if let Some(w) = &self.sliding_window {
            if w.tokens == 0 {
                return bad("a sliding window of 0 tokens".into());
            }
            if let Some(&layer) = w.layers.iter().find(|&&l| l >= self.num_layers) {
                return bad(format!("sliding-window layer {layer} past the last layer"));
            }
        }
        if !(self.attention_scale.is_finite() && self.attention_scale > 0.0) {
            return bad(format!("attention scale {}", self.attention_scale));
        }
        if let Some(l) = &self.linear_attention {
            if l.key_heads == 0
                || l.value_heads % l.key_heads != 0
                || l.key_dim == 0
                || l.value_dim == 0
                || l.conv_kernel < 2
            {
                return bad(format!("linear attention shape {l:?}"));
            }
            if let Some(&layer) = l.layers.iter().find(|&&i| i >= self.num_layers) {
                return bad(format!(
                    "linear-attention layer {layer} past the last layer"
                ));
            }
            if l.layers.len() == self.num_layers {
                return bad("a hybrid model without any full-attention layer".into());
            }
        }
        if let Some(e) = &self.experts
            && (e.per_token == 0 || e.per_token > e.count || e.intermediate_size == 0)
        {
            return bad(format!(
                "{} experts per token of {} (intermediate size {})",
                e.per_token, e.count, e.intermediate_size
            ));
        }
        Ok(())
    }

    /// The window of `layer`'s attention, if it is a windowed layer.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        self.sliding_window
            .as_ref()
            .filter(|w| w.layers.contains(&layer))
            .map(|w| w.tokens)
    }

    /// Bytes of K and V per token across the layers that keep them, for a KV element size.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.attention_layers().len() * self.num_kv_heads * self.head_dim * elem_bytes
    }
}

/// The fields of a Hugging Face / MLX `config.json` we use.
#[derive(Debug, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    /// Absent where every layer is a mixture of experts (Qwen3.5-MoE).
    #[serde(default)]
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    pub rope_theta: Option<f32>,
    pub rope_scaling: Option<serde_json::Value>,
    /// Newer configs (transformers 5): `rope_theta` and the scaling in one object.
    pub rope_parameters: Option<serde_json::Value>,
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// mlx-lm's quantised layout: `{"group_size": 64, "bits": 4, "mode": "affine", ...}`
    /// with per-module overrides (`weights::QuantSpec`).
    pub quantization: Option<serde_json::Value>,
    /// Phi's share of each head that RoPE rotates.
    pub partial_rotary_factor: Option<f32>,
    /// Phi-3's pre-extension context, the reference for longrope's mscale.
    pub original_max_position_embeddings: Option<usize>,
    /// SmolLM3: one flag per layer, 1 = RoPE, 0 = NoPE (Hugging Face's naming).
    pub no_rope_layers: Option<Vec<u8>>,
    /// SmolLM3: without `no_rope_layers`, every `interval`-th layer is NoPE.
    pub no_rope_layer_interval: Option<usize>,
    /// Sliding-window attention (Mistral v0.1, Qwen2 with `use_sliding_window`, Gemma).
    pub sliding_window: Option<serde_json::Value>,
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Gemma 3: every `sliding_window_pattern`-th layer is global, the others windowed
    /// (mlx-lm's rule), unless `layer_types` names each layer.
    pub sliding_window_pattern: Option<usize>,
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: the windowed layers' RoPE base.
    pub rope_local_base_freq: Option<f32>,
    /// Qwen3-MoE: experts, how many a token takes, their width, the renormalisation, and
    /// which layers keep a dense MLP.
    pub num_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    /// Absent: mlx-lm's family default (renormalised in Qwen3.5-MoE only).
    pub norm_topk_prob: Option<bool>,
    pub decoder_sparse_step: Option<usize>,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// Qwen2-MoE's shared expert.
    pub shared_expert_intermediate_size: Option<usize>,
    /// gpt-oss: its experts (`num_local_experts`, each of `intermediate_size`) and the clamp of
    /// their SwiGLU.
    pub num_local_experts: Option<usize>,
    pub experts_per_token: Option<usize>,
    pub swiglu_limit: Option<f32>,
    /// Gemma: attention logits are scaled by `query_pre_attn_scalar^-0.5`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Gemma 2 caps logits with tanh; Gemma 3 configs carry null. A cap is refused.
    pub final_logit_softcapping: Option<f32>,
    pub attn_logit_softcapping: Option<f32>,
    /// Qwen3.5's Gated DeltaNet layers: every `full_attention_interval`-th layer is full
    /// attention, the others linear with these head counts and widths.
    pub full_attention_interval: Option<usize>,
    pub linear_num_key_heads: Option<usize>,
    pub linear_num_value_heads: Option<usize>,
    pub linear_key_head_dim: Option<usize>,
    pub linear_value_head_dim: Option<usize>,
    pub linear_conv_kernel_dim: Option<usize>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_context() -> usize {
    2048
}

impl HfConfig {
    pub fn to_model_config(&self) -> Result<ModelConfig> {
        let arch_name = self
            .model_type
            .clone()
            .or_else(|| self.architectures.first().cloned())
            .ok_or_else(|| EngineError::MissingMetadata("config.json model_type".into()))?;
        let arch = Architecture::parse(&arch_name)?;
        let head_dim = self
            .head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1));
        let partial = self.partial_rotary_factor.or_else(|| {
            let share = self
                .rope_parameters
                .as_ref()?
                .get("partial_rotary_factor")?;
            share.as_f64().map(|s| s as f32)
        });
        let rope_dims = match partial {
            Some(share) if arch == Architecture::Phi3 => (head_dim as f32 * share) as usize,
            // mlx-lm's default for the family when the config leaves it out.
            _ if arch.is_hybrid() => (head_dim as f32 * partial.unwrap_or(0.25)) as usize,
            _ => head_dim,
        };
        if let Some(cap) = self.final_logit_softcapping.or(self.attn_logit_softcapping) {
            return Err(EngineError::Config(format!(
                "logit soft-capping ({cap}) is not implemented (Gemma 2); Gemma 3 has none"
            )));
        }
        let gemma = arch.is_gemma();
        let config = ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim,
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta(),
            rope_scaling: self.rope_scaling()?,
            rope_dims,
            no_rope_layers: self.no_rope_layers(arch),
            rope_traditional: false,
            context_length: self.usable_context(arch),
            sliding_window: self.windowed_layers(arch),
            attention_scale: match self.query_pre_attn_scalar {
                Some(s) if gemma => 1.0 / s.sqrt(),
                _ => 1.0 / (head_dim as f32).sqrt(),
            },
            embed_scale: gemma
                .then(|| half::bf16::from_f32((self.hidden_size as f32).sqrt()).to_f32()),
            query_scaling: self.query_scaling(arch)?,
            experts: self.experts(arch)?,
            linear_attention: self.linear_attention(arch)?,
            attention_output_gate: arch.is_hybrid(),
            attention_sinks: arch == Architecture::GptOss,
        };
        config.validate()?;
        Ok(config)
    }

    /// Gemma 3's windowed layers: from `layer_types` where the file has it, otherwise every
    /// layer but each `sliding_window_pattern`-th (default 6, mlx-lm's).
    fn windowed_layers(&self, arch: Architecture) -> Option<SlidingWindow> {
        if !matches!(
            arch,
            Architecture::Gemma3 | Architecture::Ministral3 | Architecture::GptOss
        ) {
            return None;
        }
        let tokens = self.sliding_window.as_ref()?.as_u64()? as usize;
        let layers = match &self.layer_types {
            // gpt-oss without `layer_types`: windowed, then full, and so on (mlx-lm's default).
            None if arch == Architecture::GptOss => {
                (0..self.num_hidden_layers).step_by(2).collect()
            }
            Some(types) => types
                .iter()
                .enumerate()
                .filter(|(_, kind)| kind.as_str() == "sliding_attention")
                .map(|(layer, _)| layer)
                .collect(),
            None => {
                let pattern = self.sliding_window_pattern.unwrap_or(6).max(1);
                (0..self.num_hidden_layers)
                    .filter(|layer| (layer + 1) % pattern != 0)
                    .collect()
            }
        };
        if arch == Architecture::Ministral3 && self.layer_types.is_none() {
            // Without `layer_types` every Ministral 3 layer attends to everything (mlx-lm).
            return None;
        }
        Some(SlidingWindow {
            tokens,
            layers,
            rope_theta: arch
                .is_gemma()
                .then(|| self.rope_local_base_freq.unwrap_or(10_000.0)),
        })
    }

    /// The experts: a Qwen3-MoE layer routes unless it is in `mlp_only_layers` or off the
    /// `decoder_sparse_step`; every Qwen2-MoE layer routes, without renormalising, beside its
    /// shared expert (mlx-lm's rules).
    fn experts(&self, arch: Architecture) -> Result<Option<Experts>> {
        if arch == Architecture::GptOss {
            return self.gpt_oss_experts();
        }
        if !matches!(
            arch,
            Architecture::Qwen3Moe
                | Architecture::Qwen2Moe
                | Architecture::Qwen3_5Moe
                | Architecture::Qwen3Next
        ) {
            return Ok(None);
        }
        // Qwen3.5-MoE routes in every layer beside a shared expert, as Qwen2-MoE does, but
        // renormalises the chosen experts' probabilities unless told otherwise. Qwen3-Next
        // has the shared expert too, in the layers Qwen3-MoE's rule picks.
        let qwen3_5 = arch == Architecture::Qwen3_5Moe;
        let next = arch == Architecture::Qwen3Next;
        let shared = arch == Architecture::Qwen2Moe || qwen3_5 || next;
        let every_layer = shared && !next;
        if shared && self.shared_expert_intermediate_size.is_none() {
            return Err(EngineError::Config(format!(
                "{} needs shared_expert_intermediate_size",
                arch.name()
            )));
        }
        let (Some(count), Some(per_token), Some(width)) = (
            self.num_experts,
            self.num_experts_per_tok,
            self.moe_intermediate_size,
        ) else {
            return Err(EngineError::Config(format!(
                "{} needs num_experts, num_experts_per_tok and moe_intermediate_size",
                arch.name()
            )));
        };
        let step = self.decoder_sparse_step.unwrap_or(1).max(1);
        let layers = (0..self.num_hidden_layers)
            .filter(|l| {
                every_layer
                    || (count > 0 && !self.mlp_only_layers.contains(l) && (l + 1) % step == 0)
            })
            .collect();
        Ok(Some(Experts {
            count,
            per_token,
            intermediate_size: width,
            normalize_top_k: self.norm_topk_prob.unwrap_or(qwen3_5)
                && arch != Architecture::Qwen2Moe,
            layers,
            shared_intermediate_size: self.shared_expert_intermediate_size.filter(|_| shared),
            activation: ExpertActivation::SwiGlu,
        }))
    }

    /// gpt-oss's experts: every layer routes each token to `num_experts_per_tok` (or
    /// `experts_per_token`) of `num_local_experts`, weighted by a softmax over the chosen
    /// logits (the renormalised probabilities), no shared expert.
    fn gpt_oss_experts(&self) -> Result<Option<Experts>> {
        let (Some(count), Some(per_token)) = (
            self.num_local_experts,
            self.num_experts_per_tok.or(self.experts_per_token),
        ) else {
            return Err(EngineError::Config(
                "gpt_oss needs num_local_experts and num_experts_per_tok".into(),
            ));
        };
        Ok(Some(Experts {
            count,
            per_token,
            intermediate_size: self.intermediate_size,
            normalize_top_k: true,
            layers: (0..self.num_hidden_layers).collect(),
            shared_intermediate_size: None,
            activation: ExpertActivation::ClampedSwiGlu {
                limit: self.swiglu_limit.unwrap_or(7.0),
            },
        }))
    }

    /// Qwen3.5's Gated DeltaNet layers: every layer but each `full_attention_interval`-th
    /// (mlx-lm's rule, default 4), with the head counts and widths of mlx-lm's defaults where
    /// the config leaves them out.
    fn linear_attention(&self, arch: Architecture) -> Result<Option<LinearAttention>> {
        if !arch.is_hybrid() {
            return Ok(None);
        }
        let interval = self.full_attention_interval.unwrap_or(4).max(1);
        Ok(Some(LinearAttention {
            layers: (0..self.num_hidden_layers)
                .filter(|l| (l + 1) % interval != 0)
                .collect(),
            key_heads: self.linear_num_key_heads.unwrap_or(16),
            value_heads: self.linear_num_value_heads.unwrap_or(64),
            key_dim: self.linear_key_head_dim.unwrap_or(192),
            value_dim: self.linear_value_head_dim.unwrap_or(128),
            conv_kernel: self.linear_conv_kernel_dim.unwrap_or(4),
        }))
    }

    /// The RoPE base: `rope_theta`, or inside `rope_parameters`, or 10000.
    fn rope_theta(&self) -> f32 {
        self.rope_theta
            .or_else(|| {
                self.rope_parameters
                    .as_ref()?
                    .get("rope_theta")?
                    .as_f64()
                    .map(|t| t as f32)
            })
            .unwrap_or(10_000.0)
    }

    /// Ministral 3's query scaling, from `rope_parameters`.
    fn query_scaling(&self, arch: Architecture) -> Result<Option<QueryScaling>> {
        if arch != Architecture::Ministral3 {
            return Ok(None);
        }
        let p = self.rope_parameters.as_ref();
        let number = |key: &str| p.and_then(|p| p.get(key)).and_then(|v| v.as_f64());
        match (
            number("llama_4_scaling_beta"),
            number("original_max_position_embeddings"),
        ) {
            (Some(beta), Some(context)) if context >= 1.0 => Ok(Some(QueryScaling {
                beta: beta as f32,
                original_context: context as usize,
            })),
            _ => Err(EngineError::Config(
                "ministral3 needs rope_parameters.llama_4_scaling_beta and \
                 original_max_position_embeddings"
                    .into(),
            )),
        }
    }

    /// Hugging Face's `rope_scaling` (or `rope_parameters`) as one of the schemes the decoder
    /// implements; anything else is refused by name rather than run with the wrong positions.
    fn rope_scaling(&self) -> Result<RopeScaling> {
        let Some(v) = self
            .rope_scaling
            .as_ref()
            .or(self.rope_parameters.as_ref())
            .filter(|v| !v.is_null())
        else {
            return Ok(RopeScaling::None);
        };
        let kind = v
            .get("type")
            .or_else(|| v.get("rope_type"))
            .and_then(|t| t.as_str())
            .unwrap_or("default");
        let number = |key: &str| v.get(key).and_then(|f| f.as_f64()).map(|f| f as f32);
        let required = |key: &str| {
            number(key).ok_or_else(|| {
                EngineError::Config(format!("rope_scaling {kind:?} without a number {key:?}"))
            })
        };
        match kind {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear {
                factor: required("factor")?,
            }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: required("factor")?,
                low_freq_factor: number("low_freq_factor").unwrap_or(1.0),
                high_freq_factor: number("high_freq_factor").unwrap_or(4.0),
                original_context: number("original_max_position_embeddings").unwrap_or(8192.0),
            }),
            "longrope" | "su" => {
                let long_factor: Vec<f32> = v
                    .get("long_factor")
                    .and_then(|f| f.as_array())
                    .map(|list| {
                        list.iter()
                            .filter_map(|x| x.as_f64())
                            .map(|x| x as f32)
                            .collect()
                    })
                    .ok_or_else(|| {
                        EngineError::Config("longrope rope_scaling without long_factor".into())
                    })?;
                let original = self
                    .original_max_position_embeddings
                    .map(|n| n as f32)
                    .or_else(|| number("original_max_position_embeddings"))
                    .unwrap_or(4096.0);
                // The attention-temperature correction of the extended context (Phi-3's
                // paper; mlx-lm's default when the file gives no `long_mscale`).
                let stretch = self.max_position_embeddings as f32 / original;
                let mscale = number("long_mscale").unwrap_or(if stretch > 1.0 {
                    (1.0 + stretch.ln() / original.ln()).sqrt()
                } else {
                    1.0
                });
                Ok(RopeScaling::LongRope {
                    long_factor,
                    mscale,
                })
            }
            "yarn" => {
                // mlx-lm's `yarn_get_mscale`, as a ratio of the two.
                let yarn_mscale = |scale: f32, m: f32| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                let factor = required("factor")?;
                Ok(RopeScaling::Yarn {
                    factor,
                    original_context: number("original_max_position_embeddings").unwrap_or(4096.0),
                    beta_fast: number("beta_fast").unwrap_or(32.0),
                    beta_slow: number("beta_slow").unwrap_or(1.0),
                    mscale: yarn_mscale(factor, number("mscale").unwrap_or(1.0))
                        / yarn_mscale(factor, number("mscale_all_dim").unwrap_or(0.0)),
                })
            }
            other => Err(EngineError::Config(format!(
                "unsupported rope_scaling type {other:?} (supported: default, linear, llama3, \
                 longrope, yarn)"
            ))),
        }
    }

    /// SmolLM3's NoPE layers as indices; other families rotate every layer.
    fn no_rope_layers(&self, arch: Architecture) -> Vec<usize> {
        if arch != Architecture::SmolLm3 {
            return Vec::new();
        }
        match &self.no_rope_layers {
            Some(flags) => flags
                .iter()
                .enumerate()
                .filter(|(_, uses_rope)| **uses_rope == 0)
                .map(|(layer, _)| layer)
                .collect(),
            None => {
                let interval = self.no_rope_layer_interval.unwrap_or(4).max(1);
                (0..self.num_hidden_layers)
                    .filter(|layer| (layer + 1) % interval == 0)
                    .collect()
            }
        }
    }

    /// The context the decoder may use. Sliding-window attention changes which keys a query
    /// sees only past the window, so the context is cut to the window: inside it, full
    /// attention is the same computation. The cut is logged and shows as the model's context
    /// in `/v1/models` and `/admin`.
    fn usable_context(&self, arch: Architecture) -> usize {
        let window = self
            .sliding_window
            .as_ref()
            .and_then(|w| w.as_u64())
            .map(|w| w as usize);
        let applies = match arch {
            // Qwen2/3 configs carry a window that is off unless `use_sliding_window`.
            Architecture::Qwen2 | Architecture::Qwen3 => self.use_sliding_window == Some(true),
            // Their windowed layers are computed as such (`windowed_layers`).
            Architecture::Gemma3 | Architecture::Ministral3 | Architecture::GptOss => false,
            _ => true,
        };
        match window {
            Some(w) if applies && w > 0 && w < self.max_position_embeddings => {
                tracing::warn!(
                    arch = arch.name(),
                    window = w,
                    trained_context = self.max_position_embeddings,
                    "sliding-window attention is not implemented: context cut to the window"
                );
                w
            }
            _ => self.max_position_embeddings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: serde_json::Value) -> Result<ModelConfig> {
        let mut base = serde_json::json!({
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 256,
            "max_position_embeddings": 8192,
        });
        for (k, v) in extra.as_object().cloned().unwrap_or_default() {
            base[k] = v;
        }
        let hf: HfConfig =
            serde_json::from_value(base).map_err(|e| EngineError::Config(e.to_string()))?;
        hf.to_model_config()
    }

    #[test]
    fn rope_scaling_kinds_are_read_or_refused_by_name() {
        assert_eq!(
            config(serde_json::json!({})).unwrap().rope_scaling,
            RopeScaling::None
        );
        let linear = config(serde_json::json!({"rope_scaling": {"type": "linear", "factor": 2.0}}));
        assert_eq!(linear.unwrap().rope_scaling.position_scale(), 0.5);
        let llama3 =
            config(serde_json::json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
                .unwrap();
        assert_eq!(
            llama3.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_context: 8192.0
            }
        );
        // The fastest pair keeps its period; the slowest is slowed by the whole factor.
        let periods = llama3.rope_scaling.custom_periods(500_000.0, 16).unwrap();
        assert_eq!(periods[0], 1.0);
        let slowest = 500_000f64.powf(14.0 / 16.0) * 8.0;
        assert!((periods[7] as f64 / slowest - 1.0).abs() < 1e-6);
        let dynamic =
            config(serde_json::json!({"rope_scaling": {"type": "dynamic", "factor": 4.0}}));
        let message = dynamic.unwrap_err().to_string();
        assert!(
            message.contains("\"dynamic\"") && message.contains("longrope, yarn"),
            "{message}"
        );
        let no_factor = config(serde_json::json!({"rope_scaling": {"type": "linear"}}));
        assert!(no_factor.unwrap_err().to_string().contains("factor"));
    }

    #[test]
    fn longrope_takes_mscale_from_the_context_stretch_and_needs_a_factor_per_pair() {
        let phi = config(serde_json::json!({
            "model_type": "phi3",
            "partial_rotary_factor": 0.75,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0, 3.0, 4.0, 5.0, 6.0],
                             "short_factor": [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]},
        }))
        .unwrap();
        assert_eq!((phi.head_dim, phi.rope_dims), (16, 12));
        let want = (1.0 + 32f32.ln() / 4096f32.ln()).sqrt();
        assert!((phi.rope_scaling.input_scale() - want).abs() < 1e-6);
        let wrong = config(serde_json::json!({
            "model_type": "phi3",
            "rope_scaling": {"type": "longrope", "long_factor": [1.0, 2.0]},
        }));
        assert!(
            wrong
                .unwrap_err()
                .to_string()
                .contains("2 factors for 8 rotary pairs")
        );
    }

    #[test]
    fn smollm3_nope_layers_come_from_flags_or_the_interval() {
        let flags =
            config(serde_json::json!({"model_type": "smollm3", "no_rope_layers": [1, 0, 1, 0]}));
        assert_eq!(flags.unwrap().no_rope_layers, [1, 3]);
        let interval = config(serde_json::json!({"model_type": "smollm3"}));
        assert_eq!(interval.unwrap().no_rope_layers, [3]);
        // Other families ignore the field.
        let llama = config(serde_json::json!({"no_rope_layers": [0, 0, 0, 0]}));
        assert!(llama.unwrap().no_rope_layers.is_empty());
    }

    #[test]
    fn a_sliding_window_cuts_the_context_where_it_applies() {
        let mistral = config(serde_json::json!({"model_type": "mistral", "sliding_window": 4096}));
        assert_eq!(mistral.unwrap().context_length, 4096);
        let off = config(serde_json::json!({"model_type": "mistral", "sliding_window": null}));
        assert_eq!(off.unwrap().context_length, 8192);
        // Qwen configs name a window that is off unless `use_sliding_window`.
        let qwen = config(serde_json::json!({"model_type": "qwen2", "sliding_window": 4096}));
        assert_eq!(qwen.unwrap().context_length, 8192);
        let qwen_on = config(serde_json::json!({
            "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": true
        }));
        assert_eq!(qwen_on.unwrap().context_length, 4096);
    }

    #[test]
    fn unknown_architectures_list_the_supported_ones() {
        let err = config(serde_json::json!({"model_type": "gemma2"})).unwrap_err();
        assert!(
            err.to_string()
                .contains("phi3, smollm3, gemma3_text, ministral3"),
            "{err}"
        );
    }

    #[test]
    fn ministral3_reads_yarn_and_its_query_scaling_from_rope_parameters() {
        let m = config(serde_json::json!({
            "model_type": "ministral3",
            "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "rope_theta": 1e9,
                                "original_max_position_embeddings": 16384,
                                "llama_4_scaling_beta": 0.1, "mscale": 1.0,
                                "mscale_all_dim": 1.0},
        }))
        .unwrap();
        assert_eq!(m.rope_theta, 1e9);
        // mscale / mscale_all_dim = 1: no input scale, as published.
        assert_eq!(m.rope_scaling.input_scale(), 1.0);
        let q = m.query_scaling.unwrap();
        assert_eq!((q.factor(0), q.factor(16383)), (1.0, 1.0));
        assert!((q.factor(16384) - (1.0 + 0.1 * 2f32.ln())).abs() < 1e-7);
        let missing = config(serde_json::json!({"model_type": "ministral3"}));
        assert!(
            missing
                .unwrap_err()
                .to_string()
                .contains("llama_4_scaling_beta")
        );
    }

    #[test]
    fn gemma3_windows_come_from_layer_types_or_the_pattern() {
        let gemma = |extra: serde_json::Value| {
            let mut base = serde_json::json!({
                "model_type": "gemma3_text", "num_hidden_layers": 7, "sliding_window": 512,
                "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256, "hidden_size": 96,
            });
            for (k, v) in extra.as_object().cloned().unwrap_or_default() {
                base[k] = v;
            }
            config(base)
        };
        let by_pattern = gemma(serde_json::json!({})).unwrap();
        let w = by_pattern.sliding_window.clone().unwrap();
        assert_eq!(
            (w.tokens, w.layers, w.rope_theta),
            (512, vec![0, 1, 2, 3, 4, 6], Some(1e4))
        );
        // The windows are computed, so the context is not cut to them.
        assert_eq!(by_pattern.context_length, 8192);
        assert_eq!(by_pattern.window_of(5), None);
        assert_eq!(by_pattern.window_of(6), Some(512));
        assert_eq!(by_pattern.attention_scale, 1.0 / 16.0);
        // sqrt(96) = 9.798 in bfloat16, as the reference computes it.
        assert_eq!(by_pattern.embed_scale, Some(9.8125));
        let by_types = gemma(serde_json::json!({"layer_types": [
            "full_attention", "sliding_attention", "full_attention", "sliding_attention",
            "full_attention", "full_attention", "full_attention"]}))
        .unwrap();
        assert_eq!(by_types.sliding_window.unwrap().layers, [1, 3]);
        let capped = gemma(serde_json::json!({"final_logit_softcapping": 30.0}));
        assert!(capped.unwrap_err().to_string().contains("soft-capping"));
        // Other families have no windowed layers and keep 1/sqrt(head_dim).
        let llama = config(serde_json::json!({"query_pre_attn_scalar": 256})).unwrap();
        assert_eq!((llama.sliding_window, llama.embed_scale), (None, None));
        assert_eq!(llama.attention_scale, 0.25);
    }
}
