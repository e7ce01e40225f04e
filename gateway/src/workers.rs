//! The models the gateway serves: names (ids and aliases) to the worker that runs each, its
//! supervised state, and a gRPC client to it. Requests go only to a worker that is ready;
//! otherwise they get 503 with Retry-After at once.

use std::path::PathBuf;
use std::sync::Arc;

use strata_proto::worker::worker_client::WorkerClient;
use tokio::sync::watch;
use tonic::transport::Channel;

use crate::config::ModelKind;
use crate::http::error::{ApiError, ErrorKind};
use crate::supervisor::{ChildState, Phase};

/// Largest gRPC message between gateway and worker (long prompts as token ids).
pub const MAX_WORKER_MESSAGE_BYTES: usize = 64 << 20;

pub struct ModelEntry {
    pub id: String,
    pub aliases: Vec<String>,
    pub kind: ModelKind,
    pub pinned: bool,
    pub path: PathBuf,
    pub socket: PathBuf,
    pub state: watch::Receiver<ChildState>,
    client: WorkerClient<Channel>,
}

impl ModelEntry {
    pub fn new(
        id: String,
        aliases: Vec<String>,
        kind: ModelKind,
        pinned: bool,
        path: PathBuf,
        socket: PathBuf,
        state: watch::Receiver<ChildState>,
    ) -> Self {
        // The channel reconnects by itself after the worker restarts.
        let channel = strata_runtime::uds::channel(&socket, std::time::Duration::from_secs(2));
        let client = WorkerClient::new(channel)
            .max_decoding_message_size(MAX_WORKER_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_WORKER_MESSAGE_BYTES);
        Self {
            id,
            aliases,
            kind,
            pinned,
            path,
            socket,
            state,
            client,
        }
    }

    /// A client to this model's worker, if it is ready to serve.
    pub fn ready_client(&self) -> Result<WorkerClient<Channel>, ApiError> {
        let state = self.state.borrow();
        if state.phase == Phase::Ready {
            return Ok(self.client.clone());
        }
        let why = match (&state.phase, &state.last_error) {
            (Phase::Restarting, Some(e)) => format!("restarting after: {e}"),
            (Phase::Starting, _) => "still loading".to_string(),
            (phase, _) => format!("{phase:?}").to_lowercase(),
        };
        Err(ApiError::new(
            ErrorKind::Overloaded,
            format!("model {} is not ready ({why}); retry shortly", self.id),
        ))
    }
}

#[derive(Clone, Default)]
pub struct Registry {
    models: Vec<Arc<ModelEntry>>,
}

impl Registry {
    pub fn new(models: Vec<ModelEntry>) -> Self {
        Self {
            models: models.into_iter().map(Arc::new).collect(),
        }
    }

    pub fn models(&self) -> &[Arc<ModelEntry>] {
        &self.models
    }

    /// The model a request names, by id or alias.
    pub fn resolve(&self, name: &str) -> Result<Arc<ModelEntry>, ApiError> {
        self.models
            .iter()
            .find(|m| m.id == name || m.aliases.iter().any(|a| a == name))
            .cloned()
            .ok_or_else(|| {
                let known: Vec<&str> = self.models.iter().map(|m| m.id.as_str()).collect();
                ApiError::new(
                    ErrorKind::NotFound,
                    format!(
                        "model {name:?} does not exist; this server has: {}",
                        known.join(", ")
                    ),
                )
                .param("model")
                .code("model_not_found")
            })
    }
}
