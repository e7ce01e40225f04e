//! `strata.toml`: what `strata up` serves and how. Every field has a default, so a file may
//! name only its models; command-line flags override the file.
//!
//! ```toml
//! bind = "127.0.0.1:8080"
//! api_keys = ["sk-local-1"]          # /v1 needs one of these when set
//! admin_token = "change-me"          # /admin needs it; generated when absent
//! request_timeout_secs = 600
//!
//! [cache]
//! dir = "/Volumes/FastSSD/strata-kv"
//! ram = "4GiB"
//! disk = "100GiB"
//! exact = false                      # true: block-granular, bit-identical hits only
//!
//! [[models]]
//! id = "smollm2"
//! path = "~/.cache/strata/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf"
//! kind = "llm"
//! aliases = ["gpt-4o-mini", "claude-*"]   # `*` patterns route agents' sub-task names
//! pinned = true
//! max_output_tokens = 4096           # longer max_tokens are clamped (and told)
//! ```
//!
//! `default_model = "smollm2"` at the top level serves every model name that no id, alias or
//! pattern matches (agents send `claude-opus-*`, `gpt-*` for sub-tasks); without it such
//! names are a 404.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default = "default_bind")]
    pub bind: SocketAddr,
    /// Keys accepted on /v1 (as `Authorization: Bearer KEY` or `x-api-key: KEY`). Empty: open.
    #[serde(default)]
    pub api_keys: Vec<String>,
    /// Host names, besides localhost and the bind address, that requests may be addressed to
    /// (`*`: any). Others get 403: a page that re-points its own name at 127.0.0.1 (DNS
    /// rebinding) cannot use the server.
    #[serde(default)]
    pub allowed_hosts: Vec<String>,
    /// Browser origins (`https://chat.example.com`) whose pages may call the API, with CORS
    /// (`*`: any). Loopback origins, the dashboard's among them, are always allowed.
    #[serde(default)]
    pub allowed_origins: Vec<String>,
    /// Token for /admin. When absent, one is generated and written to the run dir (0600).
    #[serde(default)]
    pub admin_token: Option<String>,
    /// OTLP/gRPC endpoint for traces (e.g. http://127.0.0.1:4317); off when absent.
    #[serde(default)]
    pub otlp_endpoint: Option<String>,
    /// Give each API key its own cache namespace, so tenants never share KV blocks (nor learn
    /// through `cached_tokens` what another sent). Default: on when API keys are configured;
    /// `false` shares the cache between keys.
    #[serde(default)]
    pub tenant_by_api_key: Option<bool>,
    #[serde(default = "default_request_timeout")]
    pub request_timeout_secs: u64,
    /// Open client connections allowed at once; past it, new ones wait to be accepted.
    /// Default (and ceiling): the file descriptors the gateway may open, less a reserve of 256.
    #[serde(default)]
    pub max_connections: Option<usize>,
    /// Largest request body accepted, in bytes.
    #[serde(default = "default_max_body")]
    pub max_body_bytes: usize,
    #[serde(default)]
    pub run_dir: Option<PathBuf>,
    #[serde(default)]
    pub cache: CacheConfig,
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Memory for all workers together, e.g. "12GiB": loading a model that would not fit
    /// first unloads the least recently used unpinned, idle ones [default: no limit].
    #[serde(default)]
    pub models_memory_budget: Option<String>,
    /// Folders scanned for more models (see `--model-dir`).
    #[serde(default)]
    pub model_dirs: Vec<PathBuf>,
    /// Also scan the Hugging Face cache, LM Studio's and Ollama's folders (see `--discover`).
    #[serde(default)]
    pub discover: bool,
    /// Folders whose image files requests may name as `file://` URLs (see `--image-dir`);
    /// empty: local files are refused.
    #[serde(default)]
    pub image_dirs: Vec<PathBuf>,
    /// Fetch `http://` image URLs for vision models; refused by default, since it lets any
    /// client make this machine send requests.
    #[serde(default)]
    pub allow_remote_images: bool,
    /// Hosts remote images may come from although they are not public addresses (a LAN
    /// server); every other loopback, private, link-local or metadata address is refused.
    #[serde(default)]
    pub private_image_hosts: Vec<String>,
    /// Longest wait before restarting a crashed child, in milliseconds [default: 30000].
    #[serde(default)]
    pub restart_backoff_max_ms: Option<u64>,
    /// The model (id or alias) that serves requests naming a model no id, alias or alias
    /// pattern matches [default: none; such requests are a 404].
    #[serde(default)]
    pub default_model: Option<String>,
}

#[derive(Debug, Clone, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CacheConfig {
    /// The disk tier's directory (the chosen SSD) [default: $STRATA_CACHE/kv].
    pub dir: Option<PathBuf>,
    /// RAM tier size [default: 1GiB].
    pub ram: Option<String>,
    /// Disk tier limit [default: 20GiB].
    pub disk: Option<String>,
    /// Socket of a cache service run by launchd/systemd; when it answers, `strata up` uses it
    /// instead of starting its own [default: RUN_DIR/kvcache.sock].
    pub socket: Option<PathBuf>,
    /// The cache service is run by launchd or systemd: never start one, even when it does not
    /// answer yet (at boot, or while its manager restarts it); workers compute meanwhile.
    #[serde(default)]
    pub external: bool,
    /// Block-granular, bit-identical reuse: a hit takes whole blocks (and partial blocks whose
    /// tokens all continue the prompt), with chunk ends fixed by position, so a warm run
    /// repeats a cold run's arithmetic bit for bit. Off by default: a hit then reuses the
    /// longest common prefix at any token, within floating-point rounding of a cold run.
    #[serde(default)]
    pub exact: bool,
    /// Sync each block to stable storage as it is written, so that cached blocks survive a
    /// power loss (slower writes). Off by default: a process crash loses nothing written; a
    /// power loss may lose the last blocks, which are then misses, never wrong.
    #[serde(default)]
    pub fsync: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelKind {
    Llm,
    Vlm,
    Embedding,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub id: String,
    pub path: PathBuf,
    #[serde(default = "default_kind")]
    pub kind: ModelKind,
    /// Other names clients may use for this model; `*` matches any run of characters
    /// (`"claude-*"`), checked after every exact id and alias.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// The longest answer, in tokens: a request asking for more is clamped and told so in
    /// `strata_warnings` [default: what the context leaves after the prompt].
    #[serde(default)]
    pub max_output_tokens: Option<u32>,
    /// Tokens of context to serve instead of the model's own (prompt plus answer); more than
    /// the model was trained on runs, with a warning in the log [default: the model's].
    #[serde(default)]
    pub context_length: Option<u32>,
    /// Never unloaded to make room for another model.
    #[serde(default)]
    pub pinned: bool,
    /// The worker's memory budget, e.g. "8GiB"; requests that would not fit are refused
    /// [default: 80% of physical memory].
    #[serde(default)]
    pub memory_budget: Option<String>,
    /// Cache blocks of generated tokens too (see `strata-worker serve --store-decode-kv`)
    /// [default: on, off with `cache.exact`; `strata up --store-decode-kv` for every model].
    #[serde(default)]
    pub store_decode_kv: Option<bool>,
    /// A draft model (GGUF file or safetensors folder) with this model's tokenizer: requests
    /// then decode speculatively unless they send `"speculative_decoding": false`. A draft
    /// with another tokenizer stops the worker at load, saying so.
    #[serde(default)]
    pub draft_model: Option<PathBuf>,
    /// Tokens the draft proposes per step [default: the worker's, 4].
    #[serde(default)]
    pub draft_tokens: Option<usize>,
    /// Bits per value of this model's cached KV blocks [default: as computed, 32 on CPU and
    /// 16 on GPUs]: 16 (float16, for KV computed in float32), 8 or 4 (affine codes) store
    /// fewer bytes in RAM and on SSD, and hits are then close to, not bit-identical with,
    /// computing the prompt (see `strata-worker serve --kv-cache-bits`).
    #[serde(default)]
    pub kv_cache_bits: Option<u32>,
    /// This model's own hot tier (L0, in its worker's memory), e.g. "2GiB"; "0" turns it off
    /// [default: 256MiB].
    #[serde(default)]
    pub l0_bytes: Option<String>,
    /// Memory for finished sequences' live KV caches, which the next prompt sharing their
    /// start resumes from in place, e.g. "4GiB"; "0" turns parking off [default: the
    /// worker's, 1 GiB on a CPU and 8 GiB on a GPU].
    #[serde(default)]
    pub parked_bytes: Option<String>,
    /// Tokens per prefill pass [default: the device's, 256 on the CPU and 4096 on a GPU].
    #[serde(default)]
    pub prefill_chunk_tokens: Option<usize>,
    /// Tokens per cached KV block [default: 256]. A hybrid model's block carries a snapshot
    /// of every recurrent layer, so models with large states (Qwen3.6-35B-A3B's is 63 MB)
    /// store fewer bytes per token with longer blocks; hits still resume at message ends.
    #[serde(default)]
    pub block_tokens: Option<usize>,
    /// Tokens of a synthetic prompt the worker runs once at load, so that MLX compiles its
    /// GPU kernels before the first request [default: the worker's, 4096 on a GPU, 0 on
    /// the CPU].
    #[serde(default)]
    pub warmup_tokens: Option<usize>,
    /// How a CPU multiplies prompt chunks of 8+ rows by a GGUF file's weights: "f32" or
    /// "bf16" (twice the multiply-adds per instruction on CPUs with AVX-512 BF16; answers
    /// differ from f32 within bf16 rounding, and the cached blocks are named apart)
    /// [default: the worker's, f32].
    #[serde(default)]
    pub cpu_products: Option<CpuProducts>,
    /// Load when `strata up` starts even if not pinned [default: only pinned models start
    /// loaded; the others load on their first request].
    #[serde(default)]
    pub preload: bool,
    /// Unload after this many seconds without a request (never while pinned).
    #[serde(default)]
    pub idle_ttl_secs: Option<u64>,
}

/// `cpu_products` in a model's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CpuProducts {
    F32,
    Bf16,
}

impl CpuProducts {
    /// The worker's `--cpu-products` value.
    pub fn arg(self) -> &'static str {
        match self {
            CpuProducts::F32 => "f32",
            CpuProducts::Bf16 => "bf16",
        }
    }
}

impl ModelConfig {
    /// A model found or named on the command line: unpinned, with every default.
    pub fn new(id: String, path: PathBuf, kind: ModelKind) -> Self {
        Self {
            id,
            path,
            kind,
            aliases: Vec::new(),
            max_output_tokens: None,
            context_length: None,
            pinned: false,
            memory_budget: None,
            store_decode_kv: None,
            draft_model: None,
            draft_tokens: None,
            kv_cache_bits: None,
            l0_bytes: None,
            parked_bytes: None,
            prefill_chunk_tokens: None,
            block_tokens: None,
            warmup_tokens: None,
            cpu_products: None,
            preload: false,
            idle_ttl_secs: None,
        }
    }
}

fn default_bind() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 8080))
}

fn default_request_timeout() -> u64 {
    600
}

fn default_max_body() -> usize {
    16 << 20
}

fn default_kind() -> ModelKind {
    ModelKind::Llm
}

impl Default for Config {
    fn default() -> Self {
        Self {
            bind: default_bind(),
            api_keys: Vec::new(),
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            admin_token: None,
            otlp_endpoint: None,
            tenant_by_api_key: None,
            request_timeout_secs: default_request_timeout(),
            max_connections: None,
            max_body_bytes: default_max_body(),
            run_dir: None,
            cache: CacheConfig::default(),
            models: Vec::new(),
            models_memory_budget: None,
            model_dirs: Vec::new(),
            discover: false,
            image_dirs: Vec::new(),
            allow_remote_images: false,
            private_image_hosts: Vec::new(),
            restart_backoff_max_ms: None,
            default_model: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{0}")]
    Invalid(String),
}

impl Config {
    /// The OTLP endpoint of the config file at `path`, read before logging starts (the file
    /// is read again, with its errors reported, when the gateway starts).
    pub fn otlp_endpoint_of(path: Option<&Path>) -> Option<String> {
        Self::load(path?).ok()?.otlp_endpoint
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        let mut config: Config = toml::from_str(&text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        for m in &mut config.models {
            m.path = expand_home(&m.path);
        }
        config.cache.dir = config.cache.dir.as_deref().map(expand_home);
        config.model_dirs = config.model_dirs.iter().map(|d| expand_home(d)).collect();
        config.validate()?;
        Ok(config)
    }

    /// Ids and aliases are unique, models exist.
    pub fn validate(&self) -> Result<(), ConfigError> {
        // An empty key would let in every request that presents an empty one.
        if self.api_keys.iter().any(|k| k.trim().is_empty()) {
            return Err(ConfigError::Invalid(
                "an API key is empty: every key must be a non-empty secret".into(),
            ));
        }
        if self
            .admin_token
            .as_ref()
            .is_some_and(|t| t.trim().is_empty())
        {
            return Err(ConfigError::Invalid(
                "admin_token is empty: set a secret, or leave it out to have one generated".into(),
            ));
        }
        let mut names = std::collections::HashSet::new();
        for m in &self.models {
            if m.id.is_empty() {
                return Err(ConfigError::Invalid("a model has an empty id".into()));
            }
            for name in std::iter::once(&m.id).chain(&m.aliases) {
                if !names.insert(name.as_str()) {
                    return Err(ConfigError::Invalid(format!(
                        "model name {name:?} is used twice"
                    )));
                }
            }
            if m.max_output_tokens == Some(0) {
                return Err(ConfigError::Invalid(format!(
                    "model {}: max_output_tokens must be at least 1",
                    m.id
                )));
            }
            if !m.path.exists() {
                return Err(ConfigError::Invalid(format!(
                    "model {}: {} does not exist",
                    m.id,
                    m.path.display()
                )));
            }
            // The kind decides how requests are shaped (images, embeddings), so a folder
            // whose config says otherwise is refused here rather than misserved.
            let config_json = m.path.join("config.json");
            if let Some(found) = std::fs::read(&config_json)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .map(|c| crate::discovery::kind_of(&c))
                && found != m.kind
            {
                return Err(ConfigError::Invalid(format!(
                    "model {}: configured as kind {:?}, but {} describes a {:?} model",
                    m.id,
                    m.kind,
                    config_json.display(),
                    found
                )));
            }
        }
        if let Some(d) = &self.default_model
            && !self
                .models
                .iter()
                .any(|m| &m.id == d || m.aliases.contains(d))
        {
            return Err(ConfigError::Invalid(format!(
                "default_model {d:?} is not the id or alias of a configured model"
            )));
        }
        Ok(())
    }
}

fn expand_home(p: &Path) -> PathBuf {
    match p.strip_prefix("~") {
        Ok(rest) => std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(rest))
            .unwrap_or_else(|| p.to_owned()),
        Err(_) => p.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minimal_file_gets_defaults_and_bad_files_say_why() {
        let dir = tempfile::tempdir().unwrap();
        let model = dir.path().join("m.gguf");
        std::fs::write(&model, b"x").unwrap();
        let path = dir.path().join("strata.toml");
        std::fs::write(
            &path,
            format!(
                "[[models]]\nid = \"m\"\npath = {:?}\naliases = [\"gpt-4o\"]\n",
                model.display().to_string()
            ),
        )
        .unwrap();
        let c = Config::load(&path).unwrap();
        assert_eq!(c.bind, default_bind());
        // The APIs and /admin are reachable from this machine only unless asked otherwise.
        assert!(c.bind.ip().is_loopback());
        assert_eq!(c.models[0].kind, ModelKind::Llm);
        assert_eq!(c.models[0].aliases, vec!["gpt-4o"]);

        std::fs::write(&path, "bind = 12\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("strata.toml") && e.contains("bind"), "{e}");
        std::fs::write(&path, "colour = \"blue\"\n").unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("colour"), "{e}");
        std::fs::write(
            &path,
            format!(
                "[[models]]\nid = \"a\"\npath = {0:?}\n[[models]]\nid = \"b\"\npath = {0:?}\naliases = [\"a\"]\n",
                model.display().to_string()
            ),
        )
        .unwrap();
        let e = Config::load(&path).unwrap_err().to_string();
        assert!(e.contains("used twice"), "{e}");

        // cpu_products: the worker's two values, and a clear error for anything else.
        let with = |value: &str| {
            let text = format!(
                "[[models]]\nid = \"m\"\npath = {:?}\ncpu_products = \"{value}\"\n",
                model.display().to_string()
            );
            std::fs::write(&path, text).unwrap();
            Config::load(&path)
        };
        assert_eq!(
            with("bf16").unwrap().models[0].cpu_products,
            Some(CpuProducts::Bf16)
        );
        assert_eq!(CpuProducts::Bf16.arg(), "bf16");
        assert_eq!(
            with("f32").unwrap().models[0].cpu_products,
            Some(CpuProducts::F32)
        );
        let e = with("fp8").unwrap_err().to_string();
        assert!(e.contains("fp8") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn a_kind_that_contradicts_the_folder_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("config.json"),
            r#"{"model_type": "llava", "vision_config": {}}"#,
        )
        .unwrap();
        let mut config = Config {
            models: vec![ModelConfig::new(
                "v".into(),
                dir.path().to_path_buf(),
                ModelKind::Llm,
            )],
            ..Config::default()
        };
        let err = config.validate().unwrap_err().to_string();
        assert!(
            err.contains("configured as kind Llm") && err.contains("Vlm"),
            "{err}"
        );
        config.models[0].kind = ModelKind::Vlm;
        config.validate().unwrap();
    }

    #[test]
    fn empty_secrets_are_refused() {
        let mut config = Config {
            api_keys: vec!["sk-1".into(), " ".into()],
            ..Config::default()
        };
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("API key is empty")
        );
        config.api_keys.clear();
        config.admin_token = Some(String::new());
        assert!(
            config
                .validate()
                .unwrap_err()
                .to_string()
                .contains("admin_token is empty")
        );
    }
}
