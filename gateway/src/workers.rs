//! The models the gateway serves: names (ids and aliases) to the worker that runs each, its
//! supervised state, and a gRPC client to it. A configured model is loaded (its worker process
//! supervised) or not; requests go only to a worker that is ready, otherwise they get 503 with
//! Retry-After at once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use strata_proto::worker::worker_client::WorkerClient;
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

use crate::config::ModelKind;
use crate::http::error::{ApiError, ErrorKind};
use crate::supervisor::{self, Backoff, ChildSpec, ChildState, Control, Phase};

/// Largest gRPC message between gateway and worker (long prompts as token ids).
pub const MAX_WORKER_MESSAGE_BYTES: usize = 64 << 20;

/// A worker process under supervision.
struct Running {
    state: watch::Receiver<ChildState>,
    control: mpsc::Sender<Control>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

pub struct ModelEntry {
    pub id: String,
    pub aliases: Vec<String>,
    pub kind: ModelKind,
    pub path: PathBuf,
    pinned: AtomicBool,
    spec: ChildSpec,
    client: WorkerClient<Channel>,
    running: Mutex<Option<Running>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ModelEntry {
    pub fn new(
        id: String,
        aliases: Vec<String>,
        kind: ModelKind,
        pinned: bool,
        path: PathBuf,
        spec: ChildSpec,
    ) -> Self {
        // The channel reconnects by itself after the worker restarts.
        let channel = strata_runtime::uds::channel(&spec.socket, std::time::Duration::from_secs(2));
        let client = WorkerClient::new(channel)
            .max_decoding_message_size(MAX_WORKER_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_WORKER_MESSAGE_BYTES);
        Self {
            id,
            aliases,
            kind,
            path,
            pinned: AtomicBool::new(pinned),
            spec,
            client,
            running: Mutex::new(None),
        }
    }

    pub fn worker_name(&self) -> &str {
        &self.spec.name
    }

    pub fn pinned(&self) -> bool {
        self.pinned.load(Ordering::Relaxed)
    }

    pub fn set_pinned(&self, pinned: bool) {
        self.pinned.store(pinned, Ordering::Relaxed);
    }

    /// The worker's state; None when the model is not loaded.
    pub fn state(&self) -> Option<ChildState> {
        lock(&self.running)
            .as_ref()
            .map(|r| r.state.borrow().clone())
    }

    pub fn state_watch(&self) -> Option<watch::Receiver<ChildState>> {
        lock(&self.running).as_ref().map(|r| r.state.clone())
    }

    pub fn control(&self) -> Option<mpsc::Sender<Control>> {
        lock(&self.running).as_ref().map(|r| r.control.clone())
    }

    /// Starts the worker under supervision. False when it is already loaded.
    pub fn load(&self) -> bool {
        let mut running = lock(&self.running);
        if running.is_some() {
            return false;
        }
        let (stop, stop_rx) = watch::channel(false);
        let s = supervisor::supervise(self.spec.clone(), Backoff::default(), stop_rx);
        *running = Some(Running {
            state: s.state,
            control: s.control,
            stop,
            task: s.task,
        });
        true
    }

    /// Stops the worker (SIGTERM, then SIGKILL after the grace period). False when it was not
    /// loaded.
    pub async fn unload(&self) -> bool {
        let running = lock(&self.running).take();
        match running {
            Some(r) => {
                let _ = r.stop.send(true);
                let _ = r.task.await;
                true
            }
            None => false,
        }
    }

    /// A client to this model's worker, if it is ready to serve.
    pub fn ready_client(&self) -> Result<WorkerClient<Channel>, ApiError> {
        let Some(state) = self.state() else {
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                format!(
                    "model {} is not loaded (an operator can load it: POST /admin/api/models/{}/load)",
                    self.id, self.id
                ),
            ));
        };
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
    models: Arc<Vec<Arc<ModelEntry>>>,
}

impl Registry {
    pub fn new(models: Vec<ModelEntry>) -> Self {
        Self {
            models: Arc::new(models.into_iter().map(Arc::new).collect()),
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

    /// By model id or worker name (the admin API accepts both).
    pub fn find(&self, name: &str) -> Option<Arc<ModelEntry>> {
        self.models
            .iter()
            .find(|m| m.id == name || m.worker_name() == name)
            .cloned()
    }

    /// Stops every worker (gateway shutdown).
    pub async fn unload_all(&self) {
        for m in self.models.iter() {
            m.unload().await;
        }
    }
}
