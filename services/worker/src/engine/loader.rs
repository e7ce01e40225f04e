//! Opens a model from a path: a GGUF file, or a Hugging Face / MLX safetensors folder. Returns
//! everything a worker serves with: the decoder, tokenizer, chat template, stop tokens and the
//! fingerprint that names the model's KV blocks.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use super::config::HfConfig;
use super::gguf;
use super::image::ClipPreprocess;
use super::llama::{Model, TensorNaming};
use super::llava::Llava;
use super::multimodal::{ImageInput, Vision};
use super::policy::DtypePolicy;
use super::weights::{QuantSpec, TensorStore};
use super::{EngineError, Result};
use std::sync::Arc;

use crate::template::ChatTemplate;
use crate::tokenizer::Tokenizer;

/// Version of the rules that turn a model into KV blocks; bump it to orphan every old block.
/// 2: GGUF Llama 3.1+ files apply their `rope_freqs` (blocks from 1 rotated without them).
pub const CACHE_FORMAT_VERSION: u32 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelFormat {
    Gguf,
    Safetensors,
}

pub struct LoadedModel {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub model: Model,
    /// Vision-language models: the vision tower, and how images enter prompts.
    pub vision: Option<Vision>,
    /// Shared with the request handlers, which tokenize while the engine computes.
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    pub policy: DtypePolicy,
    /// Token ids that end a generation (EOS and the turn-end tokens the vocabulary has).
    pub stop_tokens: Vec<u32>,
    /// Names the KV blocks this model computes under this policy (hex BLAKE3).
    pub fingerprint: String,
    pub block_tokens: usize,
    /// The draft model for speculative decoding, when configured (see `speculative`).
    pub draft: Option<super::speculative::Draft>,
    /// Products of prompt chunks by weights kept as codes in bf16 (see
    /// `strata_cpu_kernels::packed::set_bf16_products`, set before loading).
    pub bf16_products: bool,
    /// Whether the operator asked for bf16 products (set by the caller: not applied when the
    /// CPU lacks the instructions or the model keeps no codes, and said so).
    pub bf16_products_asked: bool,
}

/// Tokens that end a turn in the templates we meet, besides the declared EOS.
const TURN_END_TOKENS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end|>",
    // Gemma: its EOS is `<eos>`, a turn ends with this.
    "<end_of_turn>",
];

/// A GGUF file without the extension: Ollama keeps its weights as `blobs/sha256-<hex>`.
fn starts_with_gguf_magic(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

pub fn open(path: &Path, policy: DtypePolicy, block_tokens: usize) -> Result<LoadedModel> {
    if block_tokens == 0 {
        return Err(EngineError::Config(
            "block_tokens must be at least 1".into(),
        ));
    }
    if !path.exists() {
        return Err(EngineError::ModelNotFound(path.display().to_string()));
    }
    let (format, model, vision, tokenizer, template_source, files) = if path.is_dir() {
        let (model, vision, tokenizer, template) = open_folder(path, policy)?;
        let files = weight_files(path)?;
        (
            ModelFormat::Safetensors,
            model,
            vision,
            tokenizer,
            template,
            files,
        )
    } else if path.extension().is_some_and(|e| e == "gguf") || starts_with_gguf_magic(path) {
        let g = gguf::load(
            path,
            policy.compute == Dtype::Float32 && !policy.quantized_weights,
        )?;
        let tokenizer = Tokenizer::from_gguf(&g.tokenizer)?;
        let model = Model::load(g.config, &g.tensors, TensorNaming::Gguf, policy)?;
        (
            ModelFormat::Gguf,
            model,
            None,
            tokenizer,
            g.chat_template,
            vec![path.to_path_buf()],
        )
    } else {
        return Err(EngineError::UnknownFormat(path.display().to_string()));
    };
    let token_text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
    let template = ChatTemplate::new(
        template_source.as_deref(),
        &token_text(tokenizer.bos_token()),
        &token_text(tokenizer.eos_token()),
    )
    .map_err(|e| EngineError::Config(e.to_string()))?;
    let mut stop_tokens: Vec<u32> = tokenizer.eos_token().into_iter().collect();
    for t in TURN_END_TOKENS {
        if let Some(id) = tokenizer.special_id(t)
            && !stop_tokens.contains(&id)
        {
            stop_tokens.push(id);
        }
    }
    // A VLM's weights are held as its loader decides (see `Llava::load`).
    let policy = model.policy();
    let bf16_products =
        strata_cpu_kernels::packed::bf16_products() && model.weight_code_bytes() > 0;
    let fingerprint = fingerprint(&files, &model, policy, block_tokens, bf16_products)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        format,
        model,
        vision,
        tokenizer: Arc::new(tokenizer),
        template: Arc::new(template),
        policy,
        stop_tokens,
        fingerprint,
        block_tokens,
        draft: None,
        bf16_products,
        bf16_products_asked: false,
    })
}

/// BLAKE3 over the weight files, the config, the dtype policy, the KV layout, the block size,
/// bf16 products (when on) and the cache format version: anything that changes the bytes of a
/// KV block changes it.
fn fingerprint(
    files: &[PathBuf],
    model: &Model,
    policy: DtypePolicy,
    block_tokens: usize,
    bf16_products: bool,
) -> Result<String> {
    let mut hasher = blake3::Hasher::new();
    hasher.update(format!("strata-cache-format-{CACHE_FORMAT_VERSION}\n").as_bytes());
    for file in files {
        let mut f = std::fs::File::open(file)
            .map_err(|e| EngineError::Load(format!("{}: {e}", file.display())))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f
                .read(&mut buf)
                .map_err(|e| EngineError::Load(format!("{}: {e}", file.display())))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    hasher.update(format!("{:?}\n", model.config()).as_bytes());
    hasher.update(format!("policy={policy} {policy:?}\n").as_bytes());
    hasher.update(model.kv_layout().describe().as_bytes());
    hasher.update(format!("\nblock_tokens={block_tokens}\n").as_bytes());
    if bf16_products {
        // Only then: the f32 products' blocks keep the names they always had.
        hasher.update(b"cpu_products=bf16\n");
    }
    Ok(hasher.finalize().to_hex().to_string())
}

/// The files whose bytes define a safetensors model.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![dir.join("config.json")];
    files.extend(safetensors_files(dir)?);
    Ok(files)
}

pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| EngineError::Load(format!("{}: {e}", dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(EngineError::Load(format!(
            "no *.safetensors in {}",
            dir.display()
        )));
    }
    Ok(files)
}

/// One safetensors file's tensors, after checking its header: MLX's reader accepts shapes whose
/// size overflows and silently truncates dimensions past 32 bits.
pub(crate) fn load_safetensors(file: &Path) -> Result<HashMap<String, Array>> {
    strata_model_files::check_safetensors(file).map_err(|e| EngineError::Load(e.to_string()))?;
    Array::load_safetensors(file).map_err(|e| EngineError::Load(format!("{}: {e}", file.display())))
}

/// `tokenizer_config.json` fields we use. Special tokens may be strings or objects.
#[derive(Debug, Default, Deserialize)]
struct TokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
    #[serde(default)]
    add_bos_token: bool,
}

fn token_string(v: &Option<serde_json::Value>) -> Option<String> {
    match v {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .map(str::to_string),
        _ => None,
    }
}

pub(crate) fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let bytes =
        std::fs::read(path).map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| EngineError::Load(format!("{}: {e}", path.display())))
}

type OpenedFolder = (Model, Option<Vision>, Tokenizer, Option<String>);

fn open_folder(dir: &Path, policy: DtypePolicy) -> Result<OpenedFolder> {
    let raw: serde_json::Value = read_json(&dir.join("config.json"))?;
    let tk_config_path = dir.join("tokenizer_config.json");
    let tk_config: TokenizerConfig = if tk_config_path.exists() {
        read_json(&tk_config_path)?
    } else {
        TokenizerConfig::default()
    };
    // A template is a string, or a list of named templates of which "default" is the one.
    let template = match &tk_config.chat_template {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => list.iter().find_map(|t| {
            (t.get("name")?.as_str()? == "default")
                .then(|| t.get("template")?.as_str().map(str::to_string))?
        }),
        _ => None,
    };
    // Newer folders (processors' layout) keep the template in a file of its own.
    let template = match template {
        Some(t) => Some(t),
        None => template_file(dir)?,
    };
    let tokenizer = Tokenizer::from_file(
        &dir.join("tokenizer.json"),
        token_string(&tk_config.bos_token).as_deref(),
        token_string(&tk_config.eos_token).as_deref(),
        tk_config.add_bos_token,
    )?;
    if raw.get("model_type").and_then(|t| t.as_str()) == Some("llava") {
        let Llava { text, vision } = Llava::load(dir)?;
        let input = ImageInput::of(&vision, ClipPreprocess::load(dir)?);
        let vision = Vision {
            tower: vision,
            input,
        };
        return Ok((text, Some(vision), tokenizer, template));
    }
    // Gemma 3 4B-27B and Mistral's 2512 models as published: the text decoder inside a
    // vision-language checkpoint.
    let wrapper = raw
        .get("model_type")
        .and_then(|t| t.as_str())
        .filter(|t| ["gemma3", "mistral3", "qwen3_5", "qwen3_5_moe"].contains(t))
        .map(str::to_string);
    let language_model = wrapper.is_some();
    let raw = match wrapper.as_deref() {
        Some("gemma3") => gemma3_text_config(&raw)?,
        Some("mistral3") => mistral3_text_config(&raw)?,
        Some(_) => qwen3_5_text_config(&raw)?,
        None => raw,
    };
    let hf: HfConfig = serde_json::from_value(raw)
        .map_err(|e| EngineError::Load(format!("{}: {e}", dir.join("config.json").display())))?;
    let config = hf.to_model_config()?;
    let mut tensors: HashMap<String, Array> = HashMap::new();
    for file in safetensors_files(dir)? {
        tensors.extend(load_safetensors(&file)?);
    }
    if language_model {
        let before = tensors.len();
        tensors = tensors
            .into_iter()
            .filter_map(|(name, t)| Some((language_model_tensor(&name)?, t)))
            .collect();
        tracing::warn!(
            model_type = wrapper.as_deref().unwrap_or_default(),
            dropped_tensors = before - tensors.len(),
            "vision-language checkpoint: the text decoder is served, the vision tower is not \
             loaded (requests with images are refused)"
        );
    }
    let quant = match &hf.quantization {
        Some(q) => QuantSpec::from_mlx_config(q)?,
        None => QuantSpec::affine(64),
    };
    let floats = quant.float_modes();
    if !floats.is_empty() && policy.quantized_weights {
        tracing::warn!(
            modes = ?floats,
            "matrices in these quantisation modes are expanded to dense weights at load on this \
             device (mlx-rs binds packed products for affine codes only; experts stay packed): \
             more memory than the file"
        );
    }
    if !policy.quantized_weights && tensors.keys().any(|name| name.ends_with("_blocks")) {
        tracing::warn!(
            "OpenAI's MXFP4 experts (`*_blocks`) are expanded to dense weights at load on this \
             device (it computes in f32): more memory than the file"
        );
    }
    let store = TensorStore::new(tensors, quant);
    let model = Model::load(config, &store, TensorNaming::HuggingFace, policy)?;
    Ok((model, None, tokenizer, template))
}

/// Where a Gemma 3 vision-language checkpoint keeps its text decoder's tensors (Hugging Face's
/// and mlx-community's layout).
const LANGUAGE_MODEL: &str = "language_model.";

/// A text decoder's tensor of a vision-language checkpoint under the decoder's own name:
/// `language_model.X` -> `X`, Hugging Face's newer `model.language_model.X` -> `model.X`,
/// others (a top-level `lm_head`) as they are; None for the vision tower's and projector's
/// (mlx-lm's `gemma3` and `mistral3` sanitizers).
fn language_model_tensor(name: &str) -> Option<String> {
    // The vision tower and projector, and Qwen3.5's vision model (`model.visual`) and
    // multi-token-prediction head (`mtp.`), which serving text does not use.
    if name.contains("vision_tower")
        || name.contains("multi_modal_projector")
        || name.starts_with("model.visual.")
        || name.starts_with("mtp.")
    {
        return None;
    }
    if let Some(rest) = name.strip_prefix("model.language_model.") {
        return Some(format!("model.{rest}"));
    }
    Some(
        name.strip_prefix(LANGUAGE_MODEL)
            .unwrap_or(name)
            .to_string(),
    )
}

/// The text decoder config of a `mistral3` config.json: its `text_config` (an untied head
/// unless it says otherwise, as mlx-lm's `mistral3.ModelArgs` reads it), with the
/// quantisation's per-module keys moved to the decoder's own names.
fn mistral3_text_config(raw: &serde_json::Value) -> Result<serde_json::Value> {
    let mut config = raw
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| EngineError::Load("a mistral3 config.json without text_config".into()))?;
    if config.get("tie_word_embeddings").is_none() {
        config["tie_word_embeddings"] = false.into();
    }
    move_quantization(raw, &mut config);
    Ok(config)
}

/// The text decoder config of a Qwen3.5 (`qwen3_5`, `qwen3_5_moe`) vision-language
/// config.json: its `text_config`, the head tied only where the wrapper says so (mlx-lm's
/// `qwen3_5.ModelArgs`).
fn qwen3_5_text_config(raw: &serde_json::Value) -> Result<serde_json::Value> {
    let mut config = raw
        .get("text_config")
        .filter(|t| t.is_object())
        .cloned()
        .ok_or_else(|| EngineError::Load("a qwen3_5 config.json without text_config".into()))?;
    if config.get("tie_word_embeddings").is_none() {
        config["tie_word_embeddings"] = raw
            .get("tie_word_embeddings")
            .cloned()
            .unwrap_or(false.into());
    }
    move_quantization(raw, &mut config);
    Ok(config)
}

/// A vision-language config's `quantization` into its decoder's config, the per-module keys
/// under the decoder's own tensor names.
fn move_quantization(raw: &serde_json::Value, text: &mut serde_json::Value) {
    if let Some(quant) = raw.get("quantization").and_then(|q| q.as_object()) {
        let moved: serde_json::Map<String, serde_json::Value> = quant
            .iter()
            .map(|(k, v)| (language_model_tensor(k).unwrap_or(k.clone()), v.clone()))
            .collect();
        text["quantization"] = moved.into();
    }
}

/// The `gemma3_text` config of a `gemma3` (vision-language) config.json: its `text_config`
/// over the defaults mlx-lm 0.32.2 fills in (`gemma3_text.ModelArgs`, and `gemma3.ModelArgs`'s
/// vocabulary and head counts; published configs leave most of them out), with the
/// quantisation's per-module keys moved out of `language_model.`.
fn gemma3_text_config(raw: &serde_json::Value) -> Result<serde_json::Value> {
    let text = raw
        .get("text_config")
        .and_then(|t| t.as_object())
        .ok_or_else(|| EngineError::Load("a gemma3 config.json without text_config".into()))?;
    let mut config = serde_json::json!({
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "intermediate_size": 6912,
        "head_dim": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    });
    for (key, value) in text {
        config[key] = value.clone();
    }
    config["model_type"] = "gemma3_text".into();
    config["vocab_size"] = raw.get("vocab_size").cloned().unwrap_or(262_208.into());
    for (key, default) in [("num_attention_heads", 8), ("num_key_value_heads", 4)] {
        if config.get(key).is_none_or(|v| v.is_null()) {
            config[key] = default.into();
        }
    }
    move_quantization(raw, &mut config);
    Ok(config)
}

/// `chat_template.jinja`, or the `chat_template` field of `chat_template.json`.
fn template_file(dir: &Path) -> Result<Option<String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| EngineError::Load(format!("{}: {e}", jinja.display())));
    }
    let json = dir.join("chat_template.json");
    if !json.exists() {
        return Ok(None);
    }
    let value: serde_json::Value = read_json(&json)?;
    match value.get("chat_template") {
        Some(serde_json::Value::String(t)) => Ok(Some(t.clone())),
        _ => Err(EngineError::Load(format!(
            "{}: no chat_template string",
            json.display()
        ))),
    }
}
