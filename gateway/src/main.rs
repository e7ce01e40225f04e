//! `strata`: the command line. `strata up` starts the cache service and the workers, supervises
//! them and serves HTTP until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use std::sync::Arc;
use std::time::Duration;

use strata_gateway::config::{Config, ModelConfig, ModelKind};
use strata_gateway::http::admin::AdminState;
use strata_gateway::http::{self, AppState};
use strata_gateway::supervisor::{self, Backoff, ChildKind, ChildSpec, ChildState, Phase};
use strata_gateway::workers::{ModelEntry, Registry};
use tokio::sync::watch;

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Strata: local LLM inference with a KV cache that survives restarts"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Start the cache service (unless one already answers) and one worker per model, then
    /// serve HTTP until SIGTERM or Ctrl-C.
    Up(Box<UpArgs>),
    /// The gateway's health and its children, from a running `strata up`.
    Status(ClientArgs),
    /// Worker processes: state, pid, model, restarts, last exit reason.
    Workers(ClientArgs),
    /// Restart one worker (by worker name or model id).
    Restart {
        worker: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Start a configured model's worker.
    Load {
        model: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Stop a model's worker (refused while it is pinned).
    Unload {
        model: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Keep a model loaded.
    Pin {
        model: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    Unpin {
        model: String,
        #[command(flatten)]
        client: ClientArgs,
    },
    /// Download a model from the Hugging Face Hub (or $HF_ENDPOINT) into the Hugging Face
    /// cache ($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub), shared with other
    /// tools; resumable, with SHA-256 checks; $HF_TOKEN or the cache's token file for gated
    /// models. Prints the snapshot folder (serve it with --model-dir on the cache, or
    /// --discover).
    Pull {
        /// org/name or org/name@revision (branch, tag or commit).
        model: String,
        /// Only files matching this pattern (`*` wildcards; repeatable), e.g. "*Q4_K_M.gguf".
        #[arg(long)]
        include: Vec<String>,
        /// The hub cache folder to download into.
        #[arg(long)]
        cache_dir: Option<std::path::PathBuf>,
    },
    /// The cache service's statistics, or clear a model's blocks.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
}

#[derive(Subcommand)]
enum CacheAction {
    Stats(ClientArgs),
    /// Drop the blocks of one model (or of all models without --model).
    Clear {
        #[arg(long)]
        model: Option<String>,
        #[command(flatten)]
        client: ClientArgs,
    },
}

#[derive(clap::Args)]
struct ClientArgs {
    /// The gateway's address.
    #[arg(long, default_value = "http://127.0.0.1:8080", env = "STRATA_URL")]
    url: String,
    /// Admin token [default: the run dir's admin-token file].
    #[arg(long, env = "STRATA_ADMIN_TOKEN")]
    admin_token: Option<String>,
    #[arg(long, env = "STRATA_RUN_DIR")]
    run_dir: Option<PathBuf>,
}

#[derive(clap::Args)]
struct UpArgs {
    /// strata.toml with models, cache and keys (see the README); flags below override it.
    #[arg(long, env = "STRATA_CONFIG")]
    config: Option<PathBuf>,
    /// Address to serve HTTP on [default: 127.0.0.1:8080].
    #[arg(long, env = "STRATA_BIND")]
    bind: Option<SocketAddr>,
    /// GGUF file or safetensors folder to serve when the config names no models [default:
    /// the SmolLM2-135M-Instruct that scripts/setup fetched into $STRATA_CACHE/models].
    #[arg(long, env = "STRATA_MODEL")]
    model: Option<PathBuf>,
    /// The id clients use for --model [default: its file name].
    #[arg(long, env = "STRATA_MODEL_ID")]
    model_id: Option<String>,
    /// Another name for --model (repeatable); `*` matches any run of characters, e.g.
    /// `--alias 'claude-*'` serves the names coding agents send.
    #[arg(long = "alias")]
    aliases: Vec<String>,
    /// Longest answer of --model in tokens; longer max_tokens are clamped and told.
    #[arg(long)]
    max_output_tokens: Option<u32>,
    /// The model (id or alias) serving every model name nothing else matches.
    #[arg(long, env = "STRATA_DEFAULT_MODEL")]
    default_model: Option<String>,
    /// Folder for the processes' Unix sockets [default: $XDG_RUNTIME_DIR/strata or /tmp/strata-$UID].
    #[arg(long, env = "STRATA_RUN_DIR")]
    run_dir: Option<PathBuf>,
    /// Directory of the cache service's disk tier (put it on the SSD) [default:
    /// $STRATA_CACHE/kv, i.e. ~/.cache/strata/kv].
    #[arg(long, env = "STRATA_KV_DIR")]
    kv_dir: Option<PathBuf>,
    /// RAM tier size of the cache service [default: 1GiB].
    #[arg(long, env = "STRATA_KV_RAM")]
    kv_ram: Option<String>,
    /// Disk tier size limit of the cache service [default: 20GiB].
    #[arg(long, env = "STRATA_KV_DISK")]
    kv_disk: Option<String>,
    /// The cache service at the configured socket is run by launchd or systemd: never start
    /// one (see `cache.external` in strata.toml).
    #[arg(long, env = "STRATA_EXTERNAL_KVCACHE")]
    external_kvcache: bool,
    /// Longest wait before restarting a crashed worker or cache service, in milliseconds;
    /// waits start at 500 ms and double [default: 30000].
    #[arg(long, env = "STRATA_RESTART_BACKOFF_MAX_MS")]
    restart_backoff_max_ms: Option<u64>,
    /// A host name, besides localhost and the bind address, that requests may be addressed to
    /// (repeatable; `*` for any). Others get 403, a guard against DNS rebinding.
    #[arg(
        long = "allow-host",
        env = "STRATA_ALLOWED_HOSTS",
        value_delimiter = ','
    )]
    allowed_hosts: Vec<String>,
    /// A browser origin (e.g. https://chat.example.com) whose pages may call the API, with
    /// CORS (repeatable; `*` for any). Pages of other origins get 403.
    #[arg(
        long = "allow-origin",
        env = "STRATA_ALLOWED_ORIGINS",
        value_delimiter = ','
    )]
    allowed_origins: Vec<String>,
    /// An API key /v1 accepts (repeatable); /v1 is open when none is configured. A flag's
    /// value is visible to other users in `ps`: prefer STRATA_API_KEY or --api-key-file.
    #[arg(long = "api-key", env = "STRATA_API_KEY")]
    api_keys: Vec<String>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped).
    #[arg(long = "api-key-file", env = "STRATA_API_KEY_FILE")]
    api_key_file: Option<PathBuf>,
    /// An embedding model (a BERT-family safetensors folder such as all-MiniLM-L6-v2) to
    /// serve next to the others, under its folder name (repeatable).
    #[arg(long = "embedding-model", env = "STRATA_EMBEDDING_MODEL")]
    embedding_models: Vec<PathBuf>,
    /// A vision-language model (a LLaVA-1.5 safetensors folder in the llava-hf layout) to
    /// serve next to the others, under its folder name (repeatable).
    #[arg(long = "vlm-model", env = "STRATA_VLM_MODEL")]
    vlm_models: Vec<PathBuf>,
    /// A folder whose images requests may name as file:// URLs (repeatable); without one,
    /// file:// images are refused.
    #[arg(long = "image-dir", env = "STRATA_IMAGE_DIR")]
    image_dirs: Vec<PathBuf>,
    /// Fetch http(s):// image URLs named in requests (off: only inline images and files from
    /// --image-dir are read).
    #[arg(long, env = "STRATA_ALLOW_REMOTE_IMAGES")]
    allow_remote_images: bool,
    /// A host (name or address as URLs name it) that remote images may come from although it
    /// is not a public address, e.g. a LAN image server (repeatable). Other loopback, private,
    /// link-local and metadata addresses are refused, also after DNS and on redirects.
    #[arg(
        long = "private-image-host",
        env = "STRATA_PRIVATE_IMAGE_HOSTS",
        value_delimiter = ','
    )]
    private_image_hosts: Vec<String>,
    /// A folder to scan for models (GGUF files, safetensors folders, also `org/name`
    /// sub-folders; a Hugging Face hub cache or an Ollama store is read in its own layout):
    /// each is offered under its path below the folder (or its hub / Ollama name), loaded on
    /// first request (repeatable).
    #[arg(long = "model-dir", env = "STRATA_MODEL_DIR")]
    model_dirs: Vec<PathBuf>,
    /// Also scan where other tools keep models on this machine: the Hugging Face cache
    /// ($HF_HUB_CACHE, $HF_HOME/hub, ~/.cache/huggingface/hub), LM Studio's models folder and
    /// Ollama's store ($OLLAMA_MODELS, ~/.ollama/models).
    #[arg(long, env = "STRATA_DISCOVER")]
    discover: bool,
    /// Memory for all workers together, e.g. 12GiB; see `models_memory_budget` in strata.toml.
    #[arg(long, env = "STRATA_MODELS_MEMORY_BUDGET")]
    models_memory_budget: Option<String>,
    /// Memory budget of each worker whose model has none in the config, e.g. 8GiB.
    #[arg(long, env = "STRATA_WORKER_MEMORY_BUDGET")]
    worker_memory_budget: Option<String>,
    /// Cache the KV of generated tokens too, so that a chat's next turn skips the previous
    /// answer (`--store-decode-kv false` to turn it off). On by default, off with
    /// `--cache-exact`: decode-step KV rounds differently from prefill KV, so a hit on it equals
    /// computing it within rounding, as every token-granular hit does, but not bit for bit.
    /// A model's own `store_decode_kv` in strata.toml wins over this.
    #[arg(long, env = "STRATA_STORE_DECODE_KV", num_args = 0..=1, default_missing_value = "true")]
    store_decode_kv: Option<bool>,
    /// Block-granular, bit-identical cache hits (`cache.exact` in strata.toml). By default a hit
    /// reuses the longest common prefix at any token and equals a cold run within rounding.
    #[arg(long, env = "STRATA_CACHE_EXACT")]
    cache_exact: bool,
    /// How CPU workers multiply prompt chunks by a GGUF file's weights: f32, or bf16 on CPUs
    /// with AVX-512 BF16 (see the README's CPU kernels). A model's own `cpu_products` in
    /// strata.toml wins over this.
    #[arg(long, env = "STRATA_CPU_PRODUCTS", value_enum)]
    cpu_products: Option<strata_gateway::config::CpuProducts>,
    /// Export traces over OTLP/gRPC to this collector, e.g. http://127.0.0.1:4317 (Jaeger);
    /// off when neither this nor `otlp_endpoint` in the config is set.
    #[arg(long)]
    otlp_endpoint: Option<String>,
    /// Folder holding strata-worker and strata-kvcache [default: next to this binary].
    #[arg(long, env = "STRATA_BIN_DIR")]
    bin_dir: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    // Sockets, tokens, block files: nothing this process writes is readable by other users.
    strata_runtime::private::restrict_new_files();
    let cli = Cli::parse();
    let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
    // Traces (for `up`): the flag, then the config file; the children get the endpoint in
    // their environment. Read before anything logs, since the exporter is part of logging.
    let otlp_endpoint = match &cli.command {
        Command::Up(args) => args
            .otlp_endpoint
            .clone()
            .or_else(|| Config::otlp_endpoint_of(args.config.as_deref())),
        _ => None,
    };
    let _trace_export = {
        let _guard = runtime.enter();
        strata_runtime::logging::init_with_traces(
            "strata",
            "strata-gateway",
            otlp_endpoint.as_deref(),
        )
    };
    match cli.command {
        Command::Up(args) => runtime.block_on(up(*args)),
        Command::Status(c) => runtime.block_on(client_get(&c, "/health", false)),
        Command::Workers(c) => runtime.block_on(client_get(&c, "/admin/api/workers", true)),
        Command::Restart { worker, client } => runtime.block_on(client_post(
            &client,
            &format!("/admin/api/workers/{worker}/restart"),
            serde_json::json!({}),
        )),
        Command::Load { model, client } => runtime.block_on(load_with_progress(&client, &model)),
        Command::Unload { model, client } => {
            runtime.block_on(model_action(&client, &model, "unload"))
        }
        Command::Pin { model, client } => runtime.block_on(model_action(&client, &model, "pin")),
        Command::Unpin { model, client } => {
            runtime.block_on(model_action(&client, &model, "unpin"))
        }
        Command::Pull {
            model,
            include,
            cache_dir,
        } => runtime.block_on(async {
            use std::io::IsTerminal;
            let snapshot = strata_gateway::pull::pull(strata_gateway::pull::PullRequest {
                spec: model.clone(),
                include,
                cache_dir,
                progress: std::io::stderr().is_terminal(),
            })
            .await?;
            let id = model.split('@').next().unwrap_or(&model);
            println!("{}", snapshot.display());
            eprintln!("pulled {model}: served as {id} by --discover or --model-dir on the cache");
            Ok(())
        }),
        Command::Cache { action } => match action {
            CacheAction::Stats(c) => {
                runtime.block_on(client_get(&c, "/admin/api/cache/stats", true))
            }
            CacheAction::Clear { model, client } => runtime.block_on(client_post(
                &client,
                "/admin/api/cache/clear",
                serde_json::json!({"model": model}),
            )),
        },
    }
}

fn admin_token(c: &ClientArgs) -> anyhow::Result<String> {
    if let Some(t) = &c.admin_token {
        return Ok(t.clone());
    }
    let path = c
        .run_dir
        .clone()
        .unwrap_or_else(default_run_dir)
        .join(ADMIN_TOKEN_FILE);
    std::fs::read_to_string(&path)
        .map(|t| t.trim().to_string())
        .with_context(|| {
            format!(
                "read the admin token from {} (or pass --admin-token)",
                path.display()
            )
        })
}

async fn client_get(c: &ClientArgs, path: &str, admin: bool) -> anyhow::Result<()> {
    let mut req = reqwest::Client::new().get(format!("{}{path}", c.url.trim_end_matches('/')));
    if admin {
        req = req.bearer_auth(admin_token(c)?);
    }
    print_response(
        req.send()
            .await
            .with_context(|| format!("reach the gateway at {}", c.url))?,
    )
    .await
}

async fn client_post(c: &ClientArgs, path: &str, body: serde_json::Value) -> anyhow::Result<()> {
    let req = reqwest::Client::new()
        .post(format!("{}{path}", c.url.trim_end_matches('/')))
        .bearer_auth(admin_token(c)?)
        .json(&body);
    print_response(
        req.send()
            .await
            .with_context(|| format!("reach the gateway at {}", c.url))?,
    )
    .await
}

async fn model_action(c: &ClientArgs, model: &str, action: &str) -> anyhow::Result<()> {
    client_post(
        c,
        &format!("/admin/api/models/{model}/{action}"),
        serde_json::json!({}),
    )
    .await
}

/// `strata load`: asks the gateway to load the model (making room in the models' budget),
/// then shows its worker's state until it is ready.
async fn load_with_progress(c: &ClientArgs, model: &str) -> anyhow::Result<()> {
    let base = c.url.trim_end_matches('/');
    let token = admin_token(c)?;
    let http = reqwest::Client::new();
    let r = http
        .post(format!("{base}/admin/api/models/{model}/load"))
        .bearer_auth(&token)
        .json(&serde_json::json!({}))
        .send()
        .await
        .with_context(|| format!("reach the gateway at {}", c.url))?;
    let status = r.status();
    let body: serde_json::Value = r.json().await.context("the gateway's answer is not JSON")?;
    if !status.is_success() {
        println!("{}", serde_json::to_string_pretty(&body)?);
        anyhow::bail!("HTTP {status}");
    }
    let id = body["model"].as_str().unwrap_or(model).to_string();
    let worker = format!("worker-{id}");
    let bar = indicatif::ProgressBar::new_spinner();
    bar.enable_steady_tick(Duration::from_millis(120));
    let started = std::time::Instant::now();
    loop {
        let workers: serde_json::Value = http
            .get(format!("{base}/admin/api/workers"))
            .bearer_auth(&token)
            .send()
            .await
            .context("poll the gateway")?
            .json()
            .await
            .context("the gateway's answer is not JSON")?;
        let phase = workers["workers"]
            .as_array()
            .and_then(|ws| ws.iter().find(|w| w["name"] == worker.as_str()))
            .and_then(|w| w["phase"].as_str())
            .unwrap_or("unknown")
            .to_string();
        let secs = started.elapsed().as_secs_f64();
        match phase.as_str() {
            "ready" => {
                // The spinner draws only on a terminal; the result is printed either way.
                bar.finish_and_clear();
                println!("{id} is ready ({secs:.1} s)");
                return Ok(());
            }
            "stopped" | "unloaded" => {
                bar.abandon_with_message(format!("{id}: {phase}"));
                anyhow::bail!("model {id} did not load ({phase}); see `strata workers`");
            }
            _ if secs > 300.0 => {
                bar.abandon_with_message(format!("{id}: still {phase} after {secs:.0} s"));
                anyhow::bail!("model {id} is not ready after {secs:.0} s");
            }
            _ => bar.set_message(format!("loading {id}: {phase} ({secs:.0} s)")),
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn print_response(r: reqwest::Response) -> anyhow::Result<()> {
    let status = r.status();
    let body: serde_json::Value = r.json().await.context("the gateway's answer is not JSON")?;
    println!("{}", serde_json::to_string_pretty(&body)?);
    anyhow::ensure!(
        status.is_success() || status == reqwest::StatusCode::SERVICE_UNAVAILABLE,
        "HTTP {status}"
    );
    Ok(())
}

const ADMIN_TOKEN_FILE: &str = "admin-token";
/// The id of the model `strata up` serves when given none.
const DEFAULT_MODEL_ID: &str = "smollm2-135m-instruct";

fn cache_dir() -> PathBuf {
    std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/strata"))
}

fn default_model() -> PathBuf {
    cache_dir().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

const DEFAULT_EMBEDDING_ID: &str = "all-minilm-l6-v2";

fn default_embedding_model() -> PathBuf {
    cache_dir().join("models/all-minilm-l6-v2")
}

fn home() -> PathBuf {
    std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/".into())
}

fn default_run_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) => PathBuf::from(dir).join("strata"),
        // SAFETY: getuid(2) cannot fail.
        None => PathBuf::from(format!("/tmp/strata-{}", unsafe { libc::getuid() })),
    }
}

/// Creates the run directory (sockets, admin token) and makes it 0700: other users must not
/// reach the sockets. A directory owned by someone else (e.g. /tmp itself) is refused rather
/// than changed.
fn private_dir(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    std::fs::create_dir_all(dir).with_context(|| format!("create run dir {}", dir.display()))?;
    let meta = std::fs::metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    // SAFETY: getuid(2) cannot fail.
    let me = unsafe { libc::getuid() };
    anyhow::ensure!(
        meta.uid() == me,
        "run dir {} belongs to uid {}, not to this user ({me}); pick a directory of your own (--run-dir)",
        dir.display(),
        meta.uid()
    );
    if meta.permissions().mode() & 0o777 != 0o700 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("make {} private (0700)", dir.display()))?;
    }
    Ok(())
}

fn sibling_binary(bin_dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = bin_dir.join(name);
    anyhow::ensure!(
        path.is_file(),
        "{} not found; build the workspace (`cargo build --release`) or pass --bin-dir",
        path.display()
    );
    Ok(path)
}

async fn up(args: UpArgs) -> anyhow::Result<()> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if let Some(bind) = args.bind {
        config.bind = bind;
    }
    config.api_keys.extend(args.api_keys.iter().cloned());
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("read API keys from {}", path.display()))?;
        let keys: Vec<String> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(str::to_string)
            .collect();
        anyhow::ensure!(!keys.is_empty(), "{} holds no API key", path.display());
        config.api_keys.extend(keys);
    }
    config
        .allowed_hosts
        .extend(args.allowed_hosts.iter().cloned());
    config
        .allowed_origins
        .extend(args.allowed_origins.iter().cloned());
    if config.models.is_empty() || args.model.is_some() {
        let path = args.model.clone().unwrap_or_else(default_model);
        anyhow::ensure!(
            path.exists(),
            "model {} not found; run scripts/setup or pass --model",
            path.display()
        );
        let id = args.model_id.clone().unwrap_or_else(|| {
            if args.model.is_none() {
                return DEFAULT_MODEL_ID.to_string();
            }
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into())
        });
        config.models = vec![ModelConfig {
            pinned: true,
            aliases: args.aliases.clone(),
            max_output_tokens: args.max_output_tokens,
            ..ModelConfig::new(id, path, ModelKind::Llm)
        }];
        // `make run` on a fresh machine: the embedding model setup fetched is served too, so
        // a client's first embeddings call works.
        let minilm = default_embedding_model();
        if args.model.is_none() && args.embedding_models.is_empty() && minilm.is_dir() {
            config.models.push(ModelConfig {
                pinned: true,
                ..ModelConfig::new(DEFAULT_EMBEDDING_ID.into(), minilm, ModelKind::Embedding)
            });
        }
    }
    let named = args
        .embedding_models
        .iter()
        .map(|p| (p, ModelKind::Embedding))
        .chain(args.vlm_models.iter().map(|p| (p, ModelKind::Vlm)));
    for (path, kind) in named {
        anyhow::ensure!(
            path.is_dir(),
            "{kind:?} model {} is not a folder (expected config.json and *.safetensors)",
            path.display()
        );
        let id = path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| format!("{kind:?}").to_lowercase());
        config.models.push(ModelConfig {
            pinned: true,
            ..ModelConfig::new(id, path.clone(), kind)
        });
    }
    config.image_dirs.extend(args.image_dirs.iter().cloned());
    config.allow_remote_images |= args.allow_remote_images;
    config
        .private_image_hosts
        .extend(args.private_image_hosts.iter().cloned());
    let mut model_dirs: Vec<PathBuf> = args.model_dirs.clone();
    model_dirs.extend(config.model_dirs.iter().cloned());
    if args.discover || config.discover {
        let standard = strata_gateway::discovery::standard_dirs();
        tracing::info!(dirs = ?standard, "discovering models where other tools keep them");
        model_dirs.extend(
            standard
                .into_iter()
                .filter(|d| !model_dirs.contains(d))
                .collect::<Vec<_>>(),
        );
    }
    for dir in &model_dirs {
        let found = strata_gateway::discovery::scan(dir)
            .with_context(|| format!("scan the model folder {}", dir.display()))?;
        for f in found {
            let taken = config
                .models
                .iter()
                .any(|m| m.id == f.id || m.aliases.contains(&f.id) || m.path == f.path);
            if taken {
                tracing::info!(id = %f.id, "discovered model already configured");
                continue;
            }
            tracing::info!(id = %f.id, kind = ?f.kind, path = %f.path.display(), "discovered model");
            config.models.push(ModelConfig::new(f.id, f.path, f.kind));
        }
    }
    if args.default_model.is_some() {
        config.default_model = args.default_model.clone();
    }
    config.validate()?;
    let otlp_endpoint = args.otlp_endpoint.clone().or(config.otlp_endpoint.clone());
    let child_envs: Vec<(String, String)> = otlp_endpoint
        .iter()
        .map(|e| {
            (
                strata_runtime::logging::OTLP_ENDPOINT_ENV.to_string(),
                e.clone(),
            )
        })
        .collect();
    let run_dir = args
        .run_dir
        .clone()
        .or(config.run_dir.clone())
        .unwrap_or_else(default_run_dir);
    private_dir(&run_dir)?;
    let bin_dir = match args.bin_dir.clone() {
        Some(dir) => dir,
        None => std::env::current_exe()?
            .parent()
            .map(Path::to_path_buf)
            .context("locate the binary's folder")?,
    };
    let admin_token = write_admin_token(&run_dir, config.admin_token.clone())?;

    let kvcache_socket = config
        .cache
        .socket
        .clone()
        .unwrap_or_else(|| run_dir.join("kvcache.sock"));
    let kv_dir = args
        .kv_dir
        .clone()
        .or(config.cache.dir.clone())
        .unwrap_or_else(|| cache_dir().join("kv"));
    let kv_ram = args
        .kv_ram
        .clone()
        .or(config.cache.ram.clone())
        .unwrap_or_else(|| "1GiB".into());
    let kv_disk = args
        .kv_disk
        .clone()
        .or(config.cache.disk.clone())
        .unwrap_or_else(|| "20GiB".into());
    let backoff = Backoff {
        max: args
            .restart_backoff_max_ms
            .or(config.restart_backoff_max_ms)
            .map_or(Backoff::default().max, Duration::from_millis),
        ..Backoff::default()
    };
    let kvcache_spec = ChildSpec {
        name: "kvcache".into(),
        kind: ChildKind::KvCache,
        program: sibling_binary(&bin_dir, "strata-kvcache")?,
        args: vec![
            "serve".into(),
            "--socket".into(),
            kvcache_socket.display().to_string(),
            "--dir".into(),
            kv_dir.display().to_string(),
            "--ram".into(),
            kv_ram,
            "--disk".into(),
            kv_disk,
        ]
        .into_iter()
        .chain(config.cache.fsync.then(|| "--fsync".to_string()))
        .collect(),
        socket: kvcache_socket.clone(),
        envs: child_envs.clone(),
        backoff: backoff.clone(),
    };
    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    // The cache service has its own signal: it stops only after the workers, which store
    // their last blocks into it on the way out.
    let (kvcache_shutdown_tx, kvcache_shutdown_rx) = watch::channel(false);
    // launchd or systemd may run the cache service: use it when it answers, and always when
    // it is declared external.
    let external = args.external_kvcache || config.cache.external;
    let kvcache = match supervisor::probe(&kvcache_spec).await {
        Ok(detail) => {
            tracing::info!(socket = %kvcache_socket.display(), %detail, "using the cache service already running");
            None
        }
        Err(e) if external => {
            tracing::warn!(socket = %kvcache_socket.display(), error = %e.message(), "the external cache service does not answer yet; serving without the shared cache until it does");
            None
        }
        Err(_) => Some(supervisor::supervise(kvcache_spec, kvcache_shutdown_rx)),
    };
    let worker_program = sibling_binary(&bin_dir, "strata-worker")?;
    let mut models = Vec::new();
    for (i, m) in config.models.iter().enumerate() {
        let socket = run_dir.join(format!("worker-{i}.sock"));
        let spec = ChildSpec {
            name: format!("worker-{}", m.id),
            kind: ChildKind::Worker,
            program: worker_program.clone(),
            args: vec![
                "serve".into(),
                "--socket".into(),
                socket.display().to_string(),
                "--model".into(),
                m.path.display().to_string(),
                "--model-id".into(),
                m.id.clone(),
                "--kvcache-socket".into(),
                kvcache_socket.display().to_string(),
            ]
            .into_iter()
            .chain(
                m.memory_budget
                    .clone()
                    .or(args.worker_memory_budget.clone())
                    .map(|b| ["--memory-budget".to_string(), b])
                    .into_iter()
                    .flatten(),
            )
            .chain(
                m.store_decode_kv
                    .or(args.store_decode_kv)
                    .unwrap_or(!(config.cache.exact || args.cache_exact))
                    .then(|| "--store-decode-kv".to_string()),
            )
            .chain((config.cache.exact || args.cache_exact).then(|| "--cache-exact".to_string()))
            .chain(
                m.draft_model
                    .iter()
                    .flat_map(|p| ["--draft-model".to_string(), p.display().to_string()]),
            )
            .chain(
                m.draft_tokens
                    .iter()
                    .flat_map(|n| ["--draft-tokens".to_string(), n.to_string()]),
            )
            .chain(
                m.kv_cache_bits
                    .iter()
                    .flat_map(|n| ["--kv-cache-bits".to_string(), n.to_string()]),
            )
            .chain(
                m.context_length
                    .iter()
                    .flat_map(|n| ["--context-length".to_string(), n.to_string()]),
            )
            .chain(
                m.l0_bytes
                    .iter()
                    .flat_map(|b| ["--l0-bytes".to_string(), b.clone()]),
            )
            .chain(
                m.parked_bytes
                    .iter()
                    .flat_map(|b| ["--parked-bytes".to_string(), b.clone()]),
            )
            .chain(
                m.prefill_chunk_tokens
                    .iter()
                    .flat_map(|n| ["--prefill-chunk-tokens".to_string(), n.to_string()]),
            )
            .chain(
                m.block_tokens
                    .iter()
                    .flat_map(|n| ["--block-tokens".to_string(), n.to_string()]),
            )
            .chain(
                m.warmup_tokens
                    .iter()
                    .flat_map(|n| ["--warmup-tokens".to_string(), n.to_string()]),
            )
            .chain(
                m.cpu_products
                    .or(args.cpu_products)
                    .iter()
                    .flat_map(|p| ["--cpu-products".to_string(), p.arg().to_string()]),
            )
            .collect(),
            socket,
            envs: child_envs.clone(),
            backoff: backoff.clone(),
        };
        let memory = memory_estimate(m, args.worker_memory_budget.as_deref())?;
        models.push(
            ModelEntry::new(
                m.id.clone(),
                m.aliases.clone(),
                m.kind,
                m.pinned,
                m.path.clone(),
                spec,
            )
            .with_memory(memory, m.idle_ttl_secs.map(Duration::from_secs))
            .with_max_output_tokens(m.max_output_tokens),
        );
    }
    let budget = args
        .models_memory_budget
        .clone()
        .or(config.models_memory_budget.clone())
        .map(|b| parse_size::parse_size(&b).with_context(|| format!("models memory budget {b:?}")))
        .transpose()?;
    let registry = Registry::new(models, budget)
        .with_default_model(config.default_model.as_deref())
        .map_err(anyhow::Error::msg)?;
    // Pinned (and preloaded) models start loaded, the rest on their first request.
    for (m, c) in registry.models().iter().zip(&config.models) {
        if (m.pinned() || c.preload)
            && let Err(e) = registry.load(m).await
        {
            anyhow::bail!("cannot start model {}: {}", m.id, e.message);
        }
    }
    tokio::spawn(registry.clone().unload_idle());

    let listener = tokio::net::TcpListener::bind(config.bind)
        .await
        .with_context(|| format!("bind {}", config.bind))?;
    tracing::info!(
        "listening on http://{} (OpenAI and Anthropic APIs under /v1; health: /health)",
        config.bind
    );
    let mut progress: Vec<watch::Receiver<ChildState>> =
        kvcache.iter().map(|k| k.state.clone()).collect();
    progress.extend(registry.models().iter().filter_map(|m| m.state_watch()));
    let (kvcache_state, kvcache_control, kvcache_task) = match kvcache {
        Some(k) => (Some(k.state), Some(k.control), Some(k.task)),
        None => (None, None, None),
    };
    http::metrics::install().context("install the Prometheus recorder")?;
    let image_policy = http::images::ImagePolicy::new(
        &config.image_dirs,
        config.allow_remote_images,
        &config.private_image_hosts,
    )
    .context("an image folder (--image-dir, image_dirs)")?;
    // Tenants by API key (default with keys): their salts are keyed with a secret kept beside
    // the blocks, so that namespaces stay the same across restarts.
    let tenant_salt_key = if config
        .tenant_by_api_key
        .unwrap_or(!config.api_keys.is_empty())
    {
        Some(Arc::new(tenant_secret(&kv_dir)?))
    } else {
        None
    };
    let app = http::router(AppState {
        kvcache: kvcache_state,
        registry: registry.clone(),
        api_keys: Arc::new(config.api_keys.clone()),
        admin: AdminState {
            token: Arc::new(admin_token),
            kvcache_control,
            kvcache_socket,
        },
        request_timeout: Duration::from_secs(config.request_timeout_secs),
        max_body_bytes: config.max_body_bytes,
        tenant_salt_key,
        images: Arc::new(image_policy),
        browser: Arc::new(strata_gateway::http::guard::BrowserPolicy::new(
            config.bind,
            &config.allowed_hosts,
            &config.allowed_origins,
        )),
        started_unix: strata_gateway::http::generation::unix_now(),
    });
    let cap = http::serve::connection_cap();
    let cap = config.max_connections.map_or(cap, |n| n.clamp(1, cap));
    let server = tokio::spawn(http::serve::serve_capped(
        listener,
        app,
        shutdown_rx.clone(),
        cap,
    ));
    tokio::spawn(report_progress(progress));

    let signal = strata_runtime::shutdown::signal_received().await;
    tracing::info!(signal, "shutting down");
    let _ = shutdown_tx.send(true);
    // Workers first (they may still store blocks), then the cache service.
    registry.unload_all().await;
    let _ = kvcache_shutdown_tx.send(true);
    if let Some(task) = kvcache_task {
        let _ = task.await;
    }
    // Open streams would hold the HTTP server forever: give them a moment, then go.
    match tokio::time::timeout(Duration::from_secs(5), server).await {
        Ok(joined) => joined.context("HTTP task")?,
        Err(_) => tracing::warn!("HTTP connections still open after 5 s; closing them"),
    }
    tracing::info!("stopped");
    Ok(())
}

/// What a model's worker is counted for against the models' budget: its own memory budget
/// when one is set (the worker never grows past it), else an estimate from its weight files:
/// a GGUF's quantised weights are expanded to f32 on the CPU (about 6x; SmolLM2's 98 MB
/// Q4_1 file holds ~600 MB resident), safetensors are loaded about as stored; plus the
/// worker's L0 for an LLM (`l0_bytes`, 256 MiB by default) and its parked KV caches
/// (`parked_bytes`; 1 GiB by default, the worker's own default on a CPU).
fn memory_estimate(m: &ModelConfig, default_budget: Option<&str>) -> anyhow::Result<u64> {
    if let Some(b) = m.memory_budget.as_deref().or(default_budget) {
        return parse_size::parse_size(b)
            .with_context(|| format!("model {}: memory budget {b:?}", m.id));
    }
    let files: Vec<PathBuf> = if m.path.is_dir() {
        std::fs::read_dir(&m.path)
            .with_context(|| format!("read {}", m.path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect()
    } else {
        vec![m.path.clone()]
    };
    let bytes: u64 = files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|md| md.len())
        .sum();
    let weights = if m.path.is_dir() {
        bytes * 3 / 2
    } else {
        bytes * 6
    };
    let l0 = match (&m.kind, &m.l0_bytes) {
        (ModelKind::Embedding, _) => 0,
        (_, Some(b)) => {
            parse_size::parse_size(b).with_context(|| format!("model {}: l0_bytes {b:?}", m.id))?
        }
        (_, None) => 256 << 20,
    };
    let parked = match (&m.kind, &m.parked_bytes) {
        (ModelKind::Embedding, _) => 0,
        (_, Some(b)) => parse_size::parse_size(b)
            .with_context(|| format!("model {}: parked_bytes {b:?}", m.id))?,
        (_, None) => 1 << 30,
    };
    Ok(weights + l0 + parked + (64 << 20))
}

/// Logs each child's progress until all are ready once (models take a while to load).
async fn report_progress(children: Vec<watch::Receiver<ChildState>>) {
    let started = std::time::Instant::now();
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tick.tick().await;
        let waiting: Vec<String> = children
            .iter()
            .map(|c| c.borrow().clone())
            .filter(|c| c.phase != Phase::Ready)
            .map(|c| format!("{} ({:?})", c.name, c.phase).to_lowercase())
            .collect();
        if waiting.is_empty() {
            tracing::info!(
                seconds = started.elapsed().as_secs_f32(),
                "all models ready"
            );
            return;
        }
        tracing::info!(
            seconds = started.elapsed().as_secs(),
            "waiting for {}",
            waiting.join(", ")
        );
    }
}

/// The admin token: from the config, or a new random one; written to RUN_DIR/admin-token
/// (0600) so that the CLI on this machine can read it.
/// The secret tenant salts are keyed with: 32 random bytes in `kv_dir/tenant-secret` (0600),
/// made on first use.
fn tenant_secret(kv_dir: &Path) -> anyhow::Result<[u8; 32]> {
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    let path = kv_dir.join("tenant-secret");
    match std::fs::read(&path) {
        Ok(bytes) => {
            return <[u8; 32]>::try_from(bytes.as_slice()).map_err(|_| {
                anyhow::anyhow!(
                    "{} is not a 32-byte secret; remove it to have a new one made (tenants' cached blocks are then not found again)",
                    path.display()
                )
            });
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let mut secret = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut secret))
        .context("read /dev/urandom")?;
    std::fs::create_dir_all(kv_dir).with_context(|| format!("create {}", kv_dir.display()))?;
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .and_then(|mut f| f.write_all(&secret))
        .with_context(|| format!("write {}", path.display()))?;
    Ok(secret)
}

fn write_admin_token(run_dir: &Path, configured: Option<String>) -> anyhow::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let token = match configured {
        Some(t) => t,
        None => {
            let mut bytes = [0u8; 24];
            std::fs::File::open("/dev/urandom")
                .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut bytes))
                .context("read /dev/urandom for the admin token")?;
            bytes.iter().map(|b| format!("{b:02x}")).collect()
        }
    };
    let path = run_dir.join(ADMIN_TOKEN_FILE);
    let _ = std::fs::remove_file(&path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("write {}", path.display()))?;
    f.write_all(token.as_bytes())?;
    Ok(token)
}
