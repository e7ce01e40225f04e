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

use super::config::{Architecture, ModelConfig, RopeScaling, SlidingWindow};
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

    fn floats(&self, key: &str) -> Result<Option<Vec<f32>>> {
        match self.value(key) {
            None => Ok(None),
            Some(MetaValue::Array(items)) => items
                .iter()
                .map(|v| v.as_f64().map(|f| f as f32))
                .collect::<Option<Vec<_>>>()
                .map(Some)
                .ok_or_else(|| {
                    EngineError::Load(format!("metadata {key} is not an array of numbers"))
                }),
            Some(_) => Err(EngineError::Load(format!(
                "metadata {key} is not an array of numbers"
            ))),
        }
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

/// A small tensor's values as f32 (RoPE factors).
fn floats(tensor: &Array, name: &str) -> Result<Vec<f32>> {
    let values = tensor.as_dtype(Dtype::Float32)?;
    values.eval()?;
    Ok(values
        .try_as_slice::<f32>()
        .map_err(|e| EngineError::Load(format!("{name}: {e}")))?
        .to_vec())
}

/// What a Gemma 3 GGUF leaves to llama.cpp's defaults (src/models/gemma3.cpp): windowed
/// layers all but every 6th (unless `attention.sliding_window_pattern` says otherwise), their
/// RoPE base 1e4 (`rope.freq_base_swa`), attention scaled by 1/sqrt(head_dim) except in the
/// 27B (62 layers: 1/sqrt(hidden / heads), its `query_pre_attn_scalar`); the embedding scaled
/// by sqrt(hidden) in bfloat16, as the reference implementations compute it. The norms'
/// `1 + w` is already folded into the file's weights by the converter.
fn gemma3_settings(
    config: &mut ModelConfig,
    meta: &Meta<'_>,
    key: &dyn Fn(&str) -> String,
) -> Result<()> {
    config.embed_scale = Some(half::bf16::from_f32((config.hidden_size as f32).sqrt()).to_f32());
    if config.num_layers == 62 {
        config.attention_scale = 1.0 / ((config.hidden_size / config.num_heads) as f32).sqrt();
    }
    let Some(window) = meta.usize(&key("attention.sliding_window"))? else {
        return Ok(());
    };
    let pattern_key = key("attention.sliding_window_pattern");
    let layers = match meta.value(&pattern_key) {
        // One flag per layer: true = windowed.
        Some(MetaValue::Array(flags)) => flags
            .iter()
            .enumerate()
            .filter(|(_, f)| f.as_f64().is_some_and(|v| v != 0.0))
            .map(|(layer, _)| layer)
            .collect(),
        _ => {
            let pattern = meta.usize(&pattern_key)?.unwrap_or(6).max(1);
            (0..config.num_layers)
                .filter(|layer| (layer + 1) % pattern != 0)
                .collect()
        }
    };
    config.sliding_window = Some(SlidingWindow {
        tokens: window,
        layers,
        rope_theta: Some(meta.number(&key("rope.freq_base_swa"))?.unwrap_or(10_000.0) as f32),
    });
    Ok(())
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
    // llama.cpp calls Gemma 3's text decoder "gemma3".
    let arch = match arch_name.as_str() {
        "gemma3" => Architecture::Gemma3,
        other => Architecture::parse(other)?,
    };
    // llama.cpp names Mistral and SmolLM2 "llama".
    if !matches!(
        arch,
        Architecture::Llama
            | Architecture::Qwen2
            | Architecture::Qwen3
            | Architecture::Gemma3
            | Architecture::Phi3
            | Architecture::SmolLm3
    ) {
        return Err(EngineError::UnknownArchitecture(format!(
            "{arch_name} in GGUF (supported there: llama, qwen2, qwen3, gemma3, phi3, smollm3; \
             load its safetensors folder instead)"
        )));
    }
    if let Some(cap) = meta.number(&format!("{arch_name}.final_logit_softcapping"))? {
        return Err(EngineError::Config(format!(
            "logit soft-capping ({cap}) is not implemented"
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
    // Phi's partial rotary (Phi-4-mini rotates 3/4 of each head); other families rotate all.
    let rope_dims = match meta.usize(&key("rope.dimension_count"))? {
        Some(rot) if rot != head_dim && arch != Architecture::Phi3 => {
            return Err(EngineError::Config(format!(
                "partial rotary embeddings ({rot} of {head_dim} dims) in {arch_name} are not \
                 supported"
            )));
        }
        Some(rot) => rot,
        None => head_dim,
    };
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
    let num_layers = meta.require_usize(&key("block_count"))?;
    let mut config = ModelConfig {
        arch,
        hidden_size,
        intermediate_size: meta.require_usize(&key("feed_forward_length"))?,
        num_layers,
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
        rope_dims,
        // SmolLM3: llama.cpp fixes its NoPE layers at every 4th (src/models/smollm3.cpp).
        no_rope_layers: if arch == Architecture::SmolLm3 {
            (0..num_layers).filter(|l| (l + 1) % 4 == 0).collect()
        } else {
            Vec::new()
        },
        // llama.cpp's converter permutes Llama q/k rows for adjacent-pair RoPE (SmolLM3 is
        // converted as a Llama); the other families it leaves.
        rope_traditional: matches!(arch, Architecture::Llama | Architecture::SmolLm3),
        context_length: meta.require_usize(&key("context_length"))?,
        sliding_window: None,
        attention_scale: 1.0 / (head_dim as f32).sqrt(),
        embed_scale: None,
        query_scaling: None,
        experts: None,
        linear_attention: None,
        attention_output_gate: false,
        attention_sinks: false,
    };
    if arch == Architecture::Gemma3 {
        gemma3_settings(&mut config, &meta, &key)?;
    }
    // Phi-3 (not Phi-4) attends within a window: as from safetensors, the context is cut to
    // it (inside it full attention is the same computation).
    if arch == Architecture::Phi3
        && let Some(window) = meta.usize(&key("attention.sliding_window"))?
        && window > 0
        && window < config.context_length
    {
        tracing::warn!(
            arch = arch_name,
            window,
            trained_context = config.context_length,
            "sliding-window attention over every layer: context cut to the window"
        );
        config.context_length = window;
    }
    config.validate()?;

    let tokenizer_model = meta
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| EngineError::MissingMetadata("tokenizer.ggml.model".into()))?;
    let tokenizer = GgufTokenizerSpec {
        pre: meta
            .string("tokenizer.ggml.pre")?
            .unwrap_or_else(|| "default".into()),
        merges: meta.strings("tokenizer.ggml.merges")?.unwrap_or_default(),
        token_types: meta.ints("tokenizer.ggml.token_type")?.unwrap_or_default(),
        bos: meta.usize("tokenizer.ggml.bos_token_id")?.map(|v| v as u32),
        eos: meta.usize("tokenizer.ggml.eos_token_id")?.map(|v| v as u32),
        // llama.cpp's defaults where the file is silent: SentencePiece vocabularies ("llama")
        // start with BOS and a space before the text.
        add_bos: meta
            .number("tokenizer.ggml.add_bos_token")?
            .map_or(tokenizer_model.as_str() == "llama", |v| v != 0.0),
        scores: meta.floats("tokenizer.ggml.scores")?.unwrap_or_default(),
        add_space_prefix: meta
            .number("tokenizer.ggml.add_space_prefix")?
            .map_or(tokenizer_model.as_str() == "llama", |v| v != 0.0),
        unknown: meta
            .usize("tokenizer.ggml.unknown_token_id")?
            .map(|v| v as u32),
        model: tokenizer_model,
        tokens,
    };
    let chat_template = meta.string("tokenizer.chat_template")?;
    let (arrays, codes) = tensors(&file, path, keep_codes)?;
    // Phi-3's longrope: llama.cpp's converter writes the long and short per-pair factors as
    // tensors and the attention factor in metadata; like mlx-lm (and Phi-3 from safetensors
    // here), the long factors serve every length.
    if arch == Architecture::Phi3
        && let Some(factors) = arrays.get("rope_factors_long.weight")
    {
        let long_factor = floats(factors, "rope_factors_long")?;
        config.rope_scaling = RopeScaling::LongRope {
            long_factor,
            mscale: meta
                .number(&key("rope.scaling.attn_factor"))?
                .unwrap_or(1.0) as f32,
        };
        config.validate()?;
    }
    // Llama 3.1+ files carry their RoPE rescaling as per-pair period factors in a tensor
    // (llama.cpp's `rope_freqs`), not in metadata.
    if let Some(factors) = arrays.get("rope_freqs.weight") {
        let long_factor = floats(factors, "rope_freqs")?;
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
