//! `strata-kvcache`: the cache service process. Started by `strata up`, or by launchd/systemd.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use strata_kvcache::grpc::{KvCacheService, MAX_MESSAGE_BYTES};
use strata_kvcache::store::disk::Quotas;
use strata_kvcache::store::{Store, StoreConfig};
use strata_proto::kvcache::kv_cache_server::KvCacheServer;

#[derive(Parser)]
#[command(
    name = "strata-kvcache",
    version,
    about = "Strata cache service: KV blocks in RAM and on SSD, over gRPC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the KvCache gRPC service on a Unix socket until SIGTERM or Ctrl-C.
    Serve {
        /// Unix socket to listen on (created with mode 0600).
        #[arg(long)]
        socket: PathBuf,
        /// Directory for the disk tier (the chosen SSD); created if missing.
        #[arg(long)]
        dir: PathBuf,
        /// RAM tier size, e.g. 512MiB or 8GiB.
        #[arg(long, default_value = "1GiB", value_parser = parse_bytes)]
        ram: u64,
        /// Disk tier size limit, e.g. 100GiB; enforced on the bytes of the files themselves.
        #[arg(long, default_value = "20GiB", value_parser = parse_bytes)]
        disk: u64,
        /// SSD write budget per day (UTC), e.g. 50GiB; once spent, new blocks stay in RAM
        /// only until midnight, and Stats says so. Unlimited when absent.
        #[arg(long, value_parser = parse_bytes)]
        disk_write_budget: Option<u64>,
        /// Disk quota of every namespace (model) not given its own with --quota.
        #[arg(long, value_parser = parse_bytes)]
        default_quota: Option<u64>,
        /// Disk quota of one namespace, as NAMESPACE=BYTES (e.g. the model fingerprint=8GiB);
        /// repeatable. Its own least recently used blocks make room under it.
        #[arg(long = "quota", value_parser = parse_quota)]
        quotas: Vec<(String, u64)>,
        /// Sync every block file, its directory and the index to stable storage as it is
        /// written, so that blocks survive a power loss (a sync per block: slower writes).
        /// Without it, a crash of the process loses nothing written, a power loss may lose the
        /// last blocks (they are then misses, never wrong).
        #[arg(long)]
        fsync: bool,
    },
    /// Read bandwidth of L1 and L2 against the disk's own (`dd`), and sled vs files for
    /// payloads. Writes about 3x --total into --dir. Not part of CI.
    Bench {
        #[arg(long)]
        dir: PathBuf,
        #[arg(long, default_value = "2GiB", value_parser = parse_bytes)]
        total: u64,
        #[arg(long, default_value = "4MiB", value_parser = parse_bytes)]
        block: u64,
    },
}

fn parse_quota(s: &str) -> Result<(String, u64), String> {
    let (ns, bytes) = s
        .rsplit_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAMESPACE=BYTES"))?;
    if ns.is_empty() {
        return Err(format!("{s:?}: empty namespace"));
    }
    Ok((ns.to_string(), parse_bytes(bytes)?))
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| format!("{s:?}: {e} (e.g. 512MiB, 8GiB)"))
}

/// How long in-flight requests get to finish after SIGTERM.
const DRAIN_GRACE: Duration = Duration::from_secs(3);
/// How long a graceful stop may spend writing queued blocks to disk.
const FLUSH_BOUND: Duration = Duration::from_secs(10);

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Sockets, tokens, block files: nothing this process writes is readable by other users.
    strata_runtime::private::restrict_new_files();
    let cli = Cli::parse();
    let _traces = match &cli.command {
        Command::Serve { .. } => {
            strata_runtime::logging::init_from_env("strata-kvcache", "strata-kvcache")
        }
        _ => {
            strata_runtime::logging::init("strata-kvcache");
            None
        }
    };
    match cli.command {
        Command::Bench { dir, total, block } => {
            strata_kvcache::bench::run(strata_kvcache::bench::BenchArgs {
                dir,
                total_bytes: total,
                block_bytes: block,
            })
            .await
        }
        Command::Serve {
            socket,
            dir,
            ram,
            disk,
            disk_write_budget,
            default_quota,
            quotas,
            fsync,
        } => {
            // The service's RSS must stay under --ram + 64 MiB (the bench's own client side
            // keeps glibc's defaults, as a worker would).
            strata_runtime::memory::return_large_buffers();
            let (store, writer) = Store::open(StoreConfig {
                dir: dir.clone(),
                ram_bytes: ram,
                disk_bytes: disk,
                disk_write_budget,
                quotas: Quotas {
                    default: default_quota,
                    per_namespace: quotas.into_iter().collect(),
                },
                fsync,
            })
            .with_context(|| format!("open the store in {}", dir.display()))?;
            let incoming = strata_runtime::uds::bind(&socket).await?;
            tracing::info!(socket = %socket.display(), dir = %dir.display(), ram, disk, "kvcache listening");
            let service = KvCacheServer::new(KvCacheService::new(store.clone()))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            strata_runtime::shutdown::serve_until_signal("kvcache", DRAIN_GRACE, |drain| {
                strata_runtime::uds::server()
                    .add_service(service)
                    .serve_with_incoming_shutdown(incoming, drain)
            })
            .await
            .context("gRPC server")?;
            let _ = std::fs::remove_file(&socket);
            drop(store);
            let flushed = tokio::task::spawn_blocking(move || writer.shutdown(FLUSH_BOUND))
                .await
                .unwrap_or(false);
            tracing::info!(flushed, "kvcache stopped");
            Ok(())
        }
    }
}
