//! The worker's gRPC server (`strata.worker.v1.Worker`), served on a Unix socket.

mod service;

pub use service::{EmbeddingServing, ModelInfo, Served, Serving, WARMUP_FEATURE, WorkerService};
