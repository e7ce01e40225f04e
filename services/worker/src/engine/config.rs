//! Hyper-parameters of a Llama-family decoder, read from GGUF metadata or `config.json`.

use serde::Deserialize;

use super::{EngineError, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// Llama and its descendants (SmolLM2): no attention biases.
    Llama,
    /// Qwen2 / Qwen2.5: Llama plus biases on the q/k/v projections.
    Qwen2,
}

impl Architecture {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Ok(Self::Llama),
            "qwen2" | "Qwen2ForCausalLM" => Ok(Self::Qwen2),
            other => Err(EngineError::UnknownArchitecture(other.to_string())),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
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
    /// Linear RoPE scaling factor (1.0 = none); positions are divided by it.
    pub rope_linear_factor: f32,
    /// True when rotary pairs are adjacent dimensions (2i, 2i+1), as in GGUF Llama files whose
    /// q/k rows llama.cpp's converter permuted; false for the rotate-half layout of Hugging
    /// Face checkpoints and of Qwen2 everywhere.
    pub rope_traditional: bool,
    pub context_length: usize,
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
        Ok(())
    }

    /// Bytes of K and V per token across all layers, for a KV element size in bytes.
    pub fn kv_bytes_per_token(&self, elem_bytes: usize) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * elem_bytes
    }
}

/// The fields of a Hugging Face / MLX `config.json` we use.
#[derive(Debug, Deserialize)]
pub struct HfConfig {
    pub model_type: Option<String>,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: Option<usize>,
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    pub rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_context")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// mlx-lm's quantised layout: `{"group_size": 64, "bits": 4}`.
    pub quantization: Option<HfQuantization>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
pub struct HfQuantization {
    pub group_size: i32,
    pub bits: i32,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
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
        let rope_linear_factor = match &self.rope_scaling {
            None | Some(serde_json::Value::Null) => 1.0,
            Some(v) => {
                let kind = v
                    .get("type")
                    .or_else(|| v.get("rope_type"))
                    .and_then(|t| t.as_str());
                match kind {
                    Some("linear") => v
                        .get("factor")
                        .and_then(|f| f.as_f64())
                        .map(|f| f as f32)
                        .ok_or_else(|| EngineError::Config("rope_scaling without factor".into()))?,
                    Some("default") | None => 1.0,
                    Some(other) => {
                        return Err(EngineError::Config(format!(
                            "unsupported rope_scaling type {other:?} (supported: linear)"
                        )));
                    }
                }
            }
        };
        let config = ModelConfig {
            arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_layers: self.num_hidden_layers,
            num_heads: self.num_attention_heads,
            num_kv_heads: self.num_key_value_heads.unwrap_or(self.num_attention_heads),
            head_dim: self
                .head_dim
                .unwrap_or(self.hidden_size / self.num_attention_heads.max(1)),
            vocab_size: self.vocab_size,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_linear_factor,
            rope_traditional: false,
            context_length: self.max_position_embeddings,
        };
        config.validate()?;
        Ok(config)
    }
}
