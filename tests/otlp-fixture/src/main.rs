//! A trace backend for the end-to-end tests: `otlp-embedded` takes spans over OTLP/gRPC and
//! serves the Jaeger UI and Jaeger's JSON query API (`/api/traces?service=S&limit=N`), in
//! memory. The tests start it, point Strata at it and read the traces back.

use std::net::SocketAddr;

use clap::Parser;
use otlp_embedded::{Config, State, TraceServiceImpl, TraceServiceServer, ui_app};

#[derive(Parser)]
struct Args {
    /// Where spans arrive (OTLP/gRPC).
    #[arg(long, default_value = "127.0.0.1:4317")]
    otlp: SocketAddr,
    /// Where the Jaeger UI and query API answer.
    #[arg(long, default_value = "127.0.0.1:16686")]
    http: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let state = State::new(Config {
        max_length: 1000,
        max_memory_usage: 64 << 20,
    });
    let listener = tokio::net::TcpListener::bind(args.http).await?;
    let ui = ui_app(state.clone(), "/");
    let http = tokio::spawn(async move { axum::serve(listener, ui).await });
    eprintln!(
        "otlp fixture: OTLP on {}, Jaeger API on {}",
        args.otlp, args.http
    );
    tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(TraceServiceImpl::new(state)))
        .serve(args.otlp)
        .await?;
    http.abort();
    Ok(())
}
