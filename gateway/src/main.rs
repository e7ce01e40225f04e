//! `strata`: the command line. `strata up` starts the cache service and the workers, supervises
//! them and serves HTTP until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::{Parser, Subcommand};
use strata_gateway::http::{self, AppState};
use strata_gateway::supervisor::{self, Backoff, ChildKind, ChildSpec};
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
    /// Start the cache service and a worker for the model, then serve HTTP.
    Up(UpArgs),
}

#[derive(clap::Args)]
struct UpArgs {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1:8080", env = "STRATA_BIND")]
    bind: SocketAddr,
    /// GGUF file or safetensors folder to serve [default: the SmolLM2-135M-Instruct that
    /// scripts/setup fetched into $STRATA_CACHE/models].
    #[arg(long, env = "STRATA_MODEL")]
    model: Option<PathBuf>,
    /// Folder for the processes' Unix sockets [default: $XDG_RUNTIME_DIR/strata or /tmp/strata-$UID].
    #[arg(long, env = "STRATA_RUN_DIR")]
    run_dir: Option<PathBuf>,
    /// Directory of the cache service's disk tier (put it on the SSD) [default:
    /// $STRATA_CACHE/kv, i.e. ~/.cache/strata/kv].
    #[arg(long, env = "STRATA_KV_DIR")]
    kv_dir: Option<PathBuf>,
    /// RAM tier size of the cache service.
    #[arg(long, default_value = "1GiB", env = "STRATA_KV_RAM")]
    kv_ram: String,
    /// Disk tier size limit of the cache service.
    #[arg(long, default_value = "20GiB", env = "STRATA_KV_DISK")]
    kv_disk: String,
    /// Folder holding strata-worker and strata-kvcache [default: next to this binary].
    #[arg(long, env = "STRATA_BIN_DIR")]
    bin_dir: Option<PathBuf>,
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    strata_runtime::logging::init("strata");
    let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
    match cli.command {
        Command::Up(args) => runtime.block_on(up(args)),
    }
}

fn cache_dir() -> PathBuf {
    std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| home().join(".cache/strata"))
}

fn default_model() -> PathBuf {
    cache_dir().join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
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
    let model = args.model.unwrap_or_else(default_model);
    anyhow::ensure!(
        model.exists(),
        "model {} not found; run scripts/setup or pass --model",
        model.display()
    );
    let run_dir = args.run_dir.unwrap_or_else(default_run_dir);
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("create run dir {}", run_dir.display()))?;
    let bin_dir = match args.bin_dir {
        Some(dir) => dir,
        None => std::env::current_exe()?
            .parent()
            .map(Path::to_path_buf)
            .context("locate the binary's folder")?,
    };

    let kvcache_socket = run_dir.join("kvcache.sock");
    let kv_dir = args
        .kv_dir
        .clone()
        .unwrap_or_else(|| cache_dir().join("kv"));
    let worker_socket = run_dir.join("worker-0.sock");
    let specs = vec![
        ChildSpec {
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
                args.kv_ram.clone(),
                "--disk".into(),
                args.kv_disk.clone(),
            ],
            socket: kvcache_socket,
        },
        ChildSpec {
            name: "worker-0".into(),
            kind: ChildKind::Worker,
            program: sibling_binary(&bin_dir, "strata-worker")?,
            args: vec![
                "serve".into(),
                "--socket".into(),
                worker_socket.display().to_string(),
                "--model".into(),
                model.display().to_string(),
            ],
            socket: worker_socket,
        },
    ];

    let (shutdown_tx, shutdown_rx) = watch::channel(false);
    let mut children = Vec::new();
    let mut tasks = Vec::new();
    for spec in specs {
        let (state, task) = supervisor::supervise(spec, Backoff::default(), shutdown_rx.clone());
        children.push(state);
        tasks.push(task);
    }

    let listener = tokio::net::TcpListener::bind(args.bind)
        .await
        .with_context(|| format!("bind {}", args.bind))?;
    tracing::info!(
        "listening on http://{} (health: http://{}/health)",
        args.bind,
        args.bind
    );
    let app = http::router(AppState { children });
    let mut http_shutdown = shutdown_rx.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = http_shutdown.changed().await;
            })
            .await
    });

    let signal = strata_runtime::shutdown::signal_received().await;
    tracing::info!(signal, "shutting down");
    let _ = shutdown_tx.send(true);
    for task in tasks {
        let _ = task.await;
    }
    server.await.context("HTTP task")?.context("HTTP server")?;
    tracing::info!("stopped");
    Ok(())
}
