//! Loading a GGUF file: tensors through MLX's own GGUF reader (which turns Q4_0, Q4_1 and Q8_0
//! into MLX's affine quantised layout), hyper-parameters, tokenizer and chat template from the
//! file's metadata.

use std::path::Path;

use mlx_rs::Dtype;
use mlx_rs::io::GgufFile;

use super::config::{Architecture, ModelConfig, RopeScaling};
use super::weights::TensorStore;
use super::{EngineError, Result};
use crate::tokenizer::GgufTokenizerSpec;

/// GGUF's block size for Q4_0, Q4_1 and Q8_0: 32 values share a scale (and a minimum).
const GGUF_GROUP_SIZE: i32 = 32;

pub struct GgufModel {
    pub config: ModelConfig,
    pub tensors: TensorStore,
    pub tokenizer: GgufTokenizerSpec,
    pub chat_template: Option<String>,
}

struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    fn string(&self, key: &str) -> Result<Option<String>> {
        self.0
            .get_metadata_string(key)
            .map_err(|e| EngineError::Load(format!("metadata {key}: {e}")))
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.0
            .get_metadata_strings(key)
            .map_err(|e| EngineError::Load(format!("metadata {key}: {e}")))
    }

    fn number(&self, key: &str) -> Result<Option<f64>> {
        let Some(value) = self
            .0
            .get_metadata_array(key)
            .map_err(|e| EngineError::Load(format!("metadata {key}: {e}")))?
        else {
            return Ok(None);
        };
        if value.size() != 1 {
            return Err(EngineError::MissingMetadata(format!(
                "{key} (expected one number)"
            )));
        }
        let number = value
            .try_item_cast::<f64>()
            .map_err(|e| EngineError::Load(format!("metadata {key}: {e}")))?;
        Ok(Some(number))
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.number(key)?.map(|v| v as usize))
    }

    fn require_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?
            .ok_or_else(|| EngineError::MissingMetadata(key.to_string()))
    }

    fn ints(&self, key: &str) -> Result<Option<Vec<i32>>> {
        let Some(value) = self
            .0
            .get_metadata_array(key)
            .map_err(|e| EngineError::Load(format!("metadata {key}: {e}")))?
        else {
            return Ok(None);
        };
        let value = value.as_dtype(Dtype::Int32)?;
        value.eval()?;
        Ok(Some(value.as_slice::<i32>().to_vec()))
    }
}

/// mlx-rs opens GGUF files only under a `.gguf` name, and Ollama keeps them as
/// `blobs/sha256-<hex>`: such a file is read through a link with the extension, in a private
/// temporary folder that lives as long as the returned guard (MLX copies the tensors out
/// while loading, so the guard ends with `load`).
fn gguf_named(path: &Path) -> Result<(std::path::PathBuf, Option<tempfile::TempDir>)> {
    if path.extension().is_some_and(|e| e == "gguf") {
        return Ok((path.to_path_buf(), None));
    }
    let io = |e: std::io::Error| EngineError::Load(format!("{}: {e}", path.display()));
    let target = path.canonicalize().map_err(io)?;
    let dir = tempfile::Builder::new()
        .prefix("strata-gguf-")
        .tempdir()
        .map_err(io)?;
    let link = dir.path().join("model.gguf");
    std::os::unix::fs::symlink(&target, &link).map_err(io)?;
    Ok((link, Some(dir)))
}

pub fn load(path: &Path) -> Result<GgufModel> {
    // MLX's GGUF reader trusts the file; a corrupt length field crashes it.
    strata_model_files::check_gguf(path).map_err(|e| EngineError::Load(e.to_string()))?;
    let (readable, _link) = gguf_named(path)?;
    let file = GgufFile::load(&readable)
        .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
    let meta = Meta(&file);
    let arch_name = meta
        .string("general.architecture")?
        .ok_or_else(|| EngineError::MissingMetadata("general.architecture".into()))?;
    let arch = Architecture::parse(&arch_name)?;
    // llama.cpp names Mistral and SmolLM2 "llama"; Phi-3 and SmolLM3 files lay their tensors
    // out differently (fused attn_qkv, NoPE flags) and are not read from GGUF yet.
    if !matches!(
        arch,
        Architecture::Llama | Architecture::Qwen2 | Architecture::Qwen3
    ) {
        return Err(EngineError::UnknownArchitecture(format!(
            "{arch_name} in GGUF (supported there: llama, qwen2, qwen3; load its safetensors \
             folder instead)"
        )));
    }
    let key = |k: &str| format!("{arch_name}.{k}");

    let tokens = meta
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| EngineError::MissingMetadata("tokenizer.ggml.tokens".into()))?;
    let hidden_size = meta.require_usize(&key("embedding_length"))?;
    let num_heads = meta.require_usize(&key("attention.head_count"))?;
    let head_dim = match meta.usize(&key("attention.key_length"))? {
        Some(d) => d,
        None => hidden_size / num_heads.max(1),
    };
    if let Some(rot) = meta.usize(&key("rope.dimension_count"))?
        && rot != head_dim
    {
        return Err(EngineError::Config(format!(
            "partial rotary embeddings ({rot} of {head_dim} dims) are not supported"
        )));
    }
    let rope_scaling = match meta.string(&key("rope.scaling.type"))?.as_deref() {
        None | Some("none") => RopeScaling::None,
        Some("linear") => RopeScaling::Linear {
            factor: meta.number(&key("rope.scaling.factor"))?.unwrap_or(1.0) as f32,
        },
        Some(other) => {
            return Err(EngineError::Config(format!(
                "unsupported rope scaling {other:?} (supported: linear)"
            )));
        }
    };
    let mut config = ModelConfig {
        arch,
        hidden_size,
        intermediate_size: meta.require_usize(&key("feed_forward_length"))?,
        num_layers: meta.require_usize(&key("block_count"))?,
        num_heads,
        num_kv_heads: meta
            .usize(&key("attention.head_count_kv"))?
            .unwrap_or(num_heads),
        head_dim,
        vocab_size: meta.usize(&key("vocab_size"))?.unwrap_or(tokens.len()),
        rms_norm_eps: meta
            .number(&key("attention.layer_norm_rms_epsilon"))?
            .ok_or_else(|| EngineError::MissingMetadata(key("attention.layer_norm_rms_epsilon")))?
            as f32,
        rope_theta: meta.number(&key("rope.freq_base"))?.unwrap_or(10_000.0) as f32,
        rope_scaling,
        rope_dims: head_dim,
        no_rope_layers: Vec::new(),
        // llama.cpp's converter permutes Llama q/k rows for adjacent-pair RoPE; Qwen2 it leaves.
        rope_traditional: arch == Architecture::Llama,
        context_length: meta.require_usize(&key("context_length"))?,
    };
    config.validate()?;

    let tokenizer = GgufTokenizerSpec {
        model: meta
            .string("tokenizer.ggml.model")?
            .ok_or_else(|| EngineError::MissingMetadata("tokenizer.ggml.model".into()))?,
        pre: meta
            .string("tokenizer.ggml.pre")?
            .unwrap_or_else(|| "default".into()),
        merges: meta.strings("tokenizer.ggml.merges")?.unwrap_or_default(),
        token_types: meta.ints("tokenizer.ggml.token_type")?.unwrap_or_default(),
        bos: meta.usize("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos: meta.usize("tokenizer.ggml.eos_token_id")?.map(|v| v as u32),
        add_bos: meta
            .number("tokenizer.ggml.add_bos_token")?
            .is_some_and(|v| v != 0.0),
        tokens,
    };
    let chat_template = meta.string("tokenizer.chat_template")?;
    let arrays = file
        .arrays()
        .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
    // Llama 3.1+ files carry their RoPE rescaling as per-pair period factors in a tensor
    // (llama.cpp's `rope_freqs`), not in metadata.
    if let Some(factors) = arrays.get("rope_freqs.weight") {
        let factors = factors.as_dtype(Dtype::Float32)?;
        factors.eval()?;
        let long_factor = factors
            .try_as_slice::<f32>()
            .map_err(|e| EngineError::Load(format!("rope_freqs: {e}")))?
            .to_vec();
        if config.rope_scaling != RopeScaling::None {
            return Err(EngineError::Config(
                "rope_freqs together with a rope scaling type".into(),
            ));
        }
        config.rope_scaling = RopeScaling::LongRope {
            long_factor,
            mscale: 1.0,
        };
        config.validate()?;
    }
    Ok(GgufModel {
        config,
        tensors: TensorStore::new(arrays, GGUF_GROUP_SIZE),
        tokenizer,
        chat_template,
    })
}
