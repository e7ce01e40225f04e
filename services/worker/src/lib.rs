//! `strata-worker`: one process per loaded model, running MLX through mlx-rs behind gRPC.

pub mod admission;
pub mod blas_env;
pub mod device_copy;
pub mod embedder;
pub mod engine;
pub mod grammar;
pub mod grpc;
pub mod kv_quant;
pub mod mlx_device;
pub mod prefix_cache;
pub mod scheduler;
pub mod template;
pub mod tokenizer;
