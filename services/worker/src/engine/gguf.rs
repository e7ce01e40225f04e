//! Loading a GGUF file: hyper-parameters, tokenizer and chat template from the file's metadata
//! (read by `strata_model_files`); tensors through MLX's own GGUF reader where it reads every
//! type (it turns Q4_0, Q4_1 and Q8_0 into MLX's affine quantised layout), else expanded to f32
//! in Rust (K-quants, Q5_0, Q5_1, IQ4_NL, IQ4_XS).

use std::path::Path;

use std::collections::HashMap;

use mlx_rs::{Array, Dtype};
use std::sync::Arc;

use strata_cpu_kernels::packed::PackedMatrix;
use strata_model_files::{GgufFile, MetaValue, affine_codes};

use super::config::{Architecture, ModelConfig, RopeScaling};
use super::weights::{QuantSpec, TensorStore};
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

/// The file's metadata, read by `strata_model_files` (MLX's reader cannot open files with
/// K-quants at all, so the metadata never comes from it).
struct Meta<'a>(&'a GgufFile);

impl Meta<'_> {
    fn value(&self, key: &str) -> Option<&MetaValue> {
        self.0.get(key)
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(|s| Some(s.to_string()))
                .ok_or_else(|| EngineError::Load(format!("metadata {key} is not a string"))),
        }
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_strings().map(Some).ok_or_else(|| {
                EngineError::Load(format!("metadata {key} is not an array of strings"))
            }),
        }
    }

    fn number(&self, key: &str) -> Result<Option<f64>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| {
                EngineError::MissingMetadata(format!("{key} (expected one number)"))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<Option<usize>> {
        Ok(self.number(key)?.map(|v| v as usize))
    }

    fn require_usize(&self, key: &str) -> Result<usize> {
        self.usize(key)?
            .ok_or_else(|| EngineError::MissingMetadata(key.to_string()))
    }

    fn ints(&self, key: &str) -> Result<Option<Vec<i32>>> {
        match self.value(key) {
            None => Ok(None),
            Some(v) => v
                .as_ints()
                .map(|ints| Some(ints.into_iter().map(|i| i as i32).collect()))
                .ok_or_else(|| {
                    EngineError::Load(format!("metadata {key} is not an array of integers"))
                }),
        }
    }
}

/// Matrices' codes by base name (`blk.0.attn_q`).
type CodesByName = HashMap<String, Arc<PackedMatrix>>;

/// The file's tensors by name. Where MLX's reader takes every type, it loads them (keeping
/// Q4_0/Q4_1/Q8_0 in its packed affine layout); otherwise every tensor is expanded to f32
/// here, which is what the CPU computes on anyway (on Metal/CUDA the f32 matrices are cast
/// to the compute dtype, f16, at build). With `keep_codes` (a CPU), the matrices of affine
/// block types (K-quants, Q5_0, ...) also keep their codes for the few-rows kernel.
fn tensors(
    file: &GgufFile,
    path: &Path,
    keep_codes: bool,
) -> Result<(HashMap<String, Array>, CodesByName)> {
    if file.mlx_reads_all() {
        let (readable, _link) = gguf_named(path)?;
        let arrays = mlx_rs::io::GgufFile::load(&readable)
            .and_then(|f| f.arrays())
            .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
        return Ok((arrays, HashMap::new()));
    }
    let load = |e: strata_model_files::FileError| EngineError::Load(e.to_string());
    let mut arrays = HashMap::with_capacity(file.tensors.len());
    let mut codes = HashMap::new();
    // Matrices with codes are not expanded at all where the codes serve every product.
    let codes_alone = keep_codes && super::weights::codes_replace_expansion();
    for t in &file.tensors {
        let data = file.read_raw(t).map_err(load)?;
        let shape = t.shape();
        if keep_codes
            && let (Some(base), &[n, k]) = (t.name.strip_suffix(".weight"), shape.as_slice())
            && let Some(c) = affine_codes(t.ty, &data)
        {
            let (n, k) = (n as usize, k as usize);
            match PackedMatrix::from_codes(&c.codes, c.bits, &c.scales, &c.biases, n, k, c.group) {
                Ok(packed) => {
                    codes.insert(base.to_string(), Arc::new(packed));
                    if codes_alone {
                        continue;
                    }
                }
                Err(reason) => tracing::debug!(tensor = %t.name, %reason, "no codes kept"),
            }
        }
        let values = file.expand(t, &data).map_err(load)?;
        arrays.insert(t.name.clone(), Array::from_slice(&values, &shape));
    }
    tracing::info!(
        path = %path.display(),
        types = %type_counts(file),
        matrices_with_codes = codes.len(),
        f32_expansion_kept = !codes_alone,
        "GGUF types MLX cannot read were expanded to f32 at load (or kept as codes)"
    );
    Ok((arrays, codes))
}

/// "Q4_K x 12, Q6_K x 3, ..." for the log.
fn type_counts(file: &GgufFile) -> String {
    let mut counts: Vec<(&str, usize)> = Vec::new();
    for t in &file.tensors {
        match counts.iter_mut().find(|(name, _)| *name == t.ty.name()) {
            Some((_, n)) => *n += 1,
            None => counts.push((t.ty.name(), 1)),
        }
    }
    counts
        .iter()
        .map(|(name, n)| format!("{name} x {n}"))
        .collect::<Vec<_>>()
        .join(", ")
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

/// `keep_codes`: a CPU will compute in f32 (see `tensors`).
pub fn load(path: &Path, keep_codes: bool) -> Result<GgufModel> {
    // Read and checked here first: MLX's GGUF reader trusts the file (a corrupt length field
    // crashes it) and cannot read K-quants.
    let file = GgufFile::open(path).map_err(|e| EngineError::Load(e.to_string()))?;
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
    let (arrays, codes) = tensors(&file, path, keep_codes)?;
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
        tensors: TensorStore::new(arrays, QuantSpec::affine(GGUF_GROUP_SIZE)).with_codes(codes),
        tokenizer,
        chat_template,
    })
}
