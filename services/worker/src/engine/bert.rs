//! BERT-family sentence encoders (e.g. all-MiniLM-L6-v2) on MLX: the encoder of a
//! `BertModel` safetensors folder, then the pooling and normalisation that the folder's
//! sentence-transformers files ask for. Inputs of a batch are padded to its longest; padded
//! positions are masked out of attention and of the pooling, so a text embeds the same alone
//! or in a batch.

use std::collections::HashMap;
use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{arange, maximum, sum_axes};
use mlx_rs::{Array, Dtype, fast};
use serde::Deserialize;

use super::loader::{load_safetensors, read_json, safetensors_files};
use super::policy::DtypePolicy;
use super::weights::{Linear, QuantSpec, TensorStore};
use super::{EngineError, Result};

/// The `config.json` fields of a BERT encoder.
#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    #[serde(default)]
    pub architectures: Vec<String>,
    #[serde(default)]
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub max_position_embeddings: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_position_type")]
    pub position_embedding_type: String,
}

fn default_eps() -> f32 {
    1e-12
}
fn default_act() -> String {
    "gelu".into()
}
fn default_position_type() -> String {
    "absolute".into()
}

/// How token vectors become one sentence vector (sentence-transformers' `1_Pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Cls,
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

#[derive(Deserialize)]
struct ModuleEntry {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: (Array, Array),
    intermediate: Linear,
    output: Linear,
    out_norm: (Array, Array),
}

pub struct BertEncoder {
    pub config: BertConfig,
    pub pooling: Pooling,
    pub normalize: bool,
    /// Longest input in tokens, special tokens included (longer inputs are truncated).
    pub max_tokens: usize,
    word: Array,
    position: Array,
    token_type: Array,
    embed_norm: (Array, Array),
    layers: Vec<Layer>,
}

impl BertEncoder {
    /// Loads a folder with `config.json`, `*.safetensors` and, when present, the
    /// sentence-transformers files (`modules.json`, `1_Pooling/config.json`,
    /// `sentence_bert_config.json`). Without them: mean pooling, normalised, as the
    /// sentence-transformers default for a plain encoder.
    pub fn load(dir: &Path) -> Result<Self> {
        let config: BertConfig = read_json(&dir.join("config.json"))?;
        if config.position_embedding_type != "absolute" {
            return Err(EngineError::Config(format!(
                "position_embedding_type {:?} is not supported (only absolute)",
                config.position_embedding_type
            )));
        }
        if config.hidden_act != "gelu" {
            return Err(EngineError::Config(format!(
                "hidden_act {:?} is not supported (only gelu)",
                config.hidden_act
            )));
        }
        if config.num_attention_heads == 0
            || !config
                .hidden_size
                .is_multiple_of(config.num_attention_heads)
        {
            return Err(EngineError::Config(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                config.hidden_size, config.num_attention_heads
            )));
        }
        let (pooling, normalize, pooling_path) = read_modules(dir)?;
        let pooling = match pooling_path {
            Some(p) => read_pooling(&dir.join(p).join("config.json"))?,
            None => pooling,
        };
        let st_path = dir.join("sentence_bert_config.json");
        let max_seq = if st_path.exists() {
            read_json::<SentenceBertConfig>(&st_path)?.max_seq_length
        } else {
            None
        };
        let max_tokens = max_seq
            .unwrap_or(config.max_position_embeddings)
            .min(config.max_position_embeddings);

        let mut tensors: HashMap<String, Array> = HashMap::new();
        for file in safetensors_files(dir)? {
            let loaded = load_safetensors(&file)?;
            // Some exports prefix every name with the model's name.
            tensors.extend(
                loaded
                    .into_iter()
                    .map(|(k, v)| (k.strip_prefix("bert.").unwrap_or(&k).to_string(), v)),
            );
        }
        let store = TensorStore::new(tensors, QuantSpec::affine(64));
        let p = DtypePolicy::F32;
        let norm = |base: &str| -> Result<(Array, Array)> {
            Ok((
                store.vector(&format!("{base}.weight"), p)?,
                store.vector(&format!("{base}.bias"), p)?,
            ))
        };
        let mut layers = Vec::with_capacity(config.num_hidden_layers);
        for i in 0..config.num_hidden_layers {
            let at = |name: &str| format!("encoder.layer.{i}.{name}");
            layers.push(Layer {
                query: store.linear(&at("attention.self.query"), p)?,
                key: store.linear(&at("attention.self.key"), p)?,
                value: store.linear(&at("attention.self.value"), p)?,
                attn_out: store.linear(&at("attention.output.dense"), p)?,
                attn_norm: norm(&at("attention.output.LayerNorm"))?,
                intermediate: store.linear(&at("intermediate.dense"), p)?,
                output: store.linear(&at("output.dense"), p)?,
                out_norm: norm(&at("output.LayerNorm"))?,
            });
        }
        let encoder = Self {
            word: store.vector("embeddings.word_embeddings.weight", p)?,
            position: store.vector("embeddings.position_embeddings.weight", p)?,
            token_type: store.vector("embeddings.token_type_embeddings.weight", p)?,
            embed_norm: norm("embeddings.LayerNorm")?,
            layers,
            config,
            pooling,
            normalize,
            max_tokens,
        };
        encoder.eval_weights()?;
        Ok(encoder)
    }

    /// Safetensors loads are lazy and bound to this thread's stream; the engine computes on
    /// another thread, so everything is materialised here.
    fn eval_weights(&self) -> Result<()> {
        for a in [&self.word, &self.position, &self.token_type] {
            a.eval()?;
        }
        self.embed_norm.0.eval()?;
        self.embed_norm.1.eval()?;
        for l in &self.layers {
            for lin in [
                &l.query,
                &l.key,
                &l.value,
                &l.attn_out,
                &l.intermediate,
                &l.output,
            ] {
                lin.eval()?;
            }
            for n in [&l.attn_norm, &l.out_norm] {
                n.0.eval()?;
                n.1.eval()?;
            }
        }
        Ok(())
    }

    pub fn dimensions(&self) -> usize {
        self.config.hidden_size
    }

    pub fn vocab_size(&self) -> usize {
        self.word.shape()[0] as usize
    }

    /// One vector per input (token ids with their special tokens, at most `max_tokens` each),
    /// computed as one padded batch.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.word.shape()[0] as u32;
        let longest = inputs.iter().map(Vec::len).max().unwrap_or(0);
        if inputs.is_empty() || longest == 0 {
            return Err(EngineError::InvalidRequest(
                "nothing to embed: every input needs at least one token".into(),
            ));
        }
        if longest > self.max_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "an input has {longest} tokens; this model takes at most {}",
                self.max_tokens
            )));
        }
        if let Some(bad) = inputs.iter().flatten().find(|&&t| t >= vocab) {
            return Err(EngineError::InvalidRequest(format!(
                "token id {bad} outside the vocabulary of {vocab}"
            )));
        }
        let (b, l) = (inputs.len() as i32, longest as i32);
        let mut ids = vec![0u32; inputs.len() * longest];
        let mut keep = vec![0f32; inputs.len() * longest];
        for (row, input) in inputs.iter().enumerate() {
            ids[row * longest..row * longest + input.len()].copy_from_slice(input);
            keep[row * longest..row * longest + input.len()].fill(1.0);
        }
        let ids = Array::from_slice(&ids, &[b, l]);
        let keep = Array::from_slice(&keep, &[b, l]);

        let c = &self.config;
        let (heads, hidden) = (c.num_attention_heads as i32, c.hidden_size as i32);
        let head_dim = hidden / heads;
        let positions = arange::<_, i32>(None, l, None)?;
        let mut x = self
            .word
            .take_axis(&ids, 0)?
            .add(self.position.take_axis(&positions, 0)?)?
            .add(self.token_type.try_index(0)?)?;
        x = fast::layer_norm(&x, &self.embed_norm.0, &self.embed_norm.1, c.layer_norm_eps)?;
        // Additive key mask [B, 1, 1, L]: 0 where a token is, a large negative where padding is.
        let mask = keep
            .subtract(Array::from_f32(1.0))?
            .multiply(Array::from_f32(1e9))?
            .reshape(&[b, 1, 1, l])?;
        let scale = 1.0 / (head_dim as f32).sqrt();
        let split = |a: Array| -> Result<Array> {
            Ok(a.reshape(&[b, l, heads, head_dim])?
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        for layer in &self.layers {
            let q = split(layer.query.forward(&x)?)?;
            let k = split(layer.key.forward(&x)?)?;
            let v = split(layer.value.forward(&x)?)?;
            let attn = fast::scaled_dot_product_attention(&q, &k, &v, scale, &mask, None)?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, hidden])?;
            let h = x.add(layer.attn_out.forward(&attn)?)?;
            x = fast::layer_norm(&h, &layer.attn_norm.0, &layer.attn_norm.1, c.layer_norm_eps)?;
            let inner = gelu(&layer.intermediate.forward(&x)?)?;
            let h = x.add(layer.output.forward(&inner)?)?;
            x = fast::layer_norm(&h, &layer.out_norm.0, &layer.out_norm.1, c.layer_norm_eps)?;
        }

        let pooled = match self.pooling {
            Pooling::Cls => x.try_index((.., 0, ..))?,
            Pooling::Mean => {
                let weights = keep.reshape(&[b, l, 1])?;
                let total = sum_axes(&x.multiply(&weights)?, &[1], false)?;
                let count = maximum(&sum_axes(&weights, &[1], false)?, Array::from_f32(1e-9))?;
                total.divide(&count)?
            }
        };
        let out = if self.normalize {
            // As torch.nn.functional.normalize: v / max(|v|, 1e-12).
            let norm = pooled.square()?.sum_axes(&[1], true)?.sqrt()?;
            pooled.divide(&maximum(&norm, Array::from_f32(1e-12))?)?
        } else {
            pooled
        };
        let out = out.as_dtype(Dtype::Float32)?;
        out.eval()?;
        let flat = out.as_slice::<f32>();
        let d = hidden as usize;
        Ok(flat.chunks(d).map(<[f32]>::to_vec).collect())
    }
}

/// Exact (erf) GELU, as BERT's "gelu". Written out with MLX's own ops rather than
/// `mlx_rs::nn::gelu`: that one is a compiled function, whose CPU kernel evaluates erf one
/// element at a time through libm, which made GELU most of a long batch's time.
fn gelu(x: &Array) -> Result<Array> {
    let half = x.multiply(Array::from_f32(0.5))?;
    let cdf = mlx_rs::ops::erf(&x.multiply(Array::from_f32(std::f32::consts::FRAC_1_SQRT_2))?)?
        .add(Array::from_f32(1.0))?;
    Ok(half.multiply(&cdf)?)
}

/// (pooling, normalize, the pooling module's folder) from `modules.json`; without the file,
/// mean pooling and normalisation.
fn read_modules(dir: &Path) -> Result<(Pooling, bool, Option<String>)> {
    let path = dir.join("modules.json");
    if !path.exists() {
        return Ok((Pooling::Mean, true, None));
    }
    let modules: Vec<ModuleEntry> = read_json(&path)?;
    let normalize = modules.iter().any(|m| m.kind.ends_with(".Normalize"));
    let pooling_path = modules
        .iter()
        .find(|m| m.kind.ends_with(".Pooling"))
        .map(|m| m.path.clone());
    Ok((Pooling::Mean, normalize, pooling_path))
}

fn read_pooling(path: &Path) -> Result<Pooling> {
    let p: PoolingConfig = read_json(path)?;
    if p.pooling_mode_max_tokens || p.pooling_mode_mean_sqrt_len_tokens {
        return Err(EngineError::Config(format!(
            "{}: only mean and CLS pooling are supported",
            path.display()
        )));
    }
    match (p.pooling_mode_mean_tokens, p.pooling_mode_cls_token) {
        (true, false) => Ok(Pooling::Mean),
        (false, true) => Ok(Pooling::Cls),
        _ => Err(EngineError::Config(format!(
            "{}: exactly one of mean and CLS pooling must be on",
            path.display()
        ))),
    }
}
