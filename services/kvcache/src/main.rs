//! `strata-kvcache`: the cache service process. Started by `strata up`, or by launchd/systemd.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use strata_kvcache::grpc::KvCacheService;
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
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    strata_runtime::logging::init("strata-kvcache");
    match cli.command {
        Command::Serve { socket } => {
            let incoming = strata_runtime::uds::bind(&socket).await?;
            tracing::info!(socket = %socket.display(), "kvcache listening");
            tonic::transport::Server::builder()
                .add_service(KvCacheServer::new(KvCacheService::new()))
                .serve_with_incoming_shutdown(incoming, async {
                    let signal = strata_runtime::shutdown::signal_received().await;
                    tracing::info!(signal, "kvcache shutting down");
                })
                .await
                .context("gRPC server")?;
            let _ = std::fs::remove_file(&socket);
            Ok(())
        }
    }
}
