//! The inference engine: model loading (GGUF, safetensors), the Llama-family decoder on MLX,
//! the per-sequence KV cache, and the dtype policy that adapts all of it to the device.

pub mod bert;
pub mod config;
pub mod cpu_attention;
pub mod generate;
pub mod gguf;
pub mod image;
pub mod kv;
pub mod kv_payload;
pub mod llama;
pub mod llava;
pub mod loader;
pub mod multimodal;
pub mod policy;
pub mod sample;
pub mod sequence;
pub mod spec_prefill;
pub mod speculative;
pub mod weights;

pub use config::{Architecture, ModelConfig};
pub use kv::KvCache;
pub use llama::Model;
pub use policy::DtypePolicy;

use crate::tokenizer::TokenizerError;

/// Everything that can go wrong inside the engine, with the names a user needs to fix it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("model path {0} does not exist")]
    ModelNotFound(String),
    #[error("unsupported model format at {0}: expected a .gguf file or a folder with config.json")]
    UnknownFormat(String),
    #[error("unknown architecture {0:?} (supported: llama, qwen2)")]
    UnknownArchitecture(String),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("missing or invalid metadata {0}")]
    MissingMetadata(String),
    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("cannot read the model: {0}")]
    Load(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("MLX: {0}")]
    Mlx(String),
}

impl From<mlx_rs::error::Exception> for EngineError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        EngineError::Mlx(e.to_string())
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
