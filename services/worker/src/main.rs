//! `strata-worker`: serves one model over gRPC on a Unix socket. Normally started by `strata up`.

use std::path::PathBuf;

use anyhow::Context;
use clap::{Parser, Subcommand};
use strata_proto::worker::worker_server::WorkerServer;
use strata_worker::grpc::{ModelInfo, WorkerService};
use strata_worker::{blas_env, mlx_device};

#[derive(Parser)]
#[command(
    name = "strata-worker",
    version,
    about = "Strata worker: one model, MLX inference, gRPC"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the Worker gRPC service on a Unix socket until SIGTERM or Ctrl-C.
    Serve {
        /// Unix socket to listen on (created with mode 0600).
        #[arg(long)]
        socket: PathBuf,
        /// GGUF file or safetensors folder of the model to serve.
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Print which MLX library and device this process gets, then exit.
    Probe,
}

fn main() -> anyhow::Result<()> {
    // Must run before anything else: OpenBLAS reads its settings when libmlx loads.
    let reexec = blas_env::reexec_with_blas_env();
    let cli = Cli::parse();
    strata_runtime::logging::init("strata-worker");
    if let Err(e) = reexec {
        tracing::warn!(error = %e, "could not re-execute with OpenBLAS settings; using its defaults");
    }
    let device = mlx_device::select_default_device();
    let info = ModelInfo {
        model_path: None,
        mlx_version: mlx_device::mlx_version(),
        device: device.to_string(),
    };
    match cli.command {
        Command::Probe => {
            println!("mlx {} on {}", info.mlx_version, info.device);
            Ok(())
        }
        Command::Serve { socket, model } => {
            if let Some(path) = &model {
                anyhow::ensure!(
                    path.exists(),
                    "model path {} does not exist",
                    path.display()
                );
            }
            let info = ModelInfo {
                model_path: model,
                ..info
            };
            let runtime = tokio::runtime::Runtime::new().context("start the tokio runtime")?;
            runtime.block_on(serve(socket, info))
        }
    }
}

async fn serve(socket: PathBuf, info: ModelInfo) -> anyhow::Result<()> {
    let incoming = strata_runtime::uds::bind(&socket).await?;
    tracing::info!(socket = %socket.display(), mlx = %info.mlx_version, device = %info.device, "worker listening");
    tonic::transport::Server::builder()
        .add_service(WorkerServer::new(WorkerService::new(info)))
        .serve_with_incoming_shutdown(incoming, async {
            let signal = strata_runtime::shutdown::signal_received().await;
            tracing::info!(signal, "worker shutting down");
        })
        .await
        .context("gRPC server")?;
    let _ = std::fs::remove_file(&socket);
    Ok(())
}
