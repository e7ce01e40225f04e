//! The models the gateway serves: names (ids and aliases) to the worker that runs each, its
//! supervised state, and a gRPC client to it. A configured model is loaded (its worker process
//! supervised) or not; requests go only to a worker that is ready, otherwise they get 503 with
//! Retry-After at once.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_proto::worker::worker_client::WorkerClient;
use tokio::sync::{mpsc, watch};
use tonic::transport::Channel;

use crate::config::ModelKind;
use crate::http::error::{ApiError, ErrorKind};
use crate::supervisor::{self, ChildSpec, ChildState, Control, Phase};

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
    /// Bytes this model's worker is counted for against the models' shared budget.
    pub memory_bytes: u64,
    /// Unloaded after this long without requests (never when pinned).
    pub idle_ttl: Option<Duration>,
    /// Milliseconds since the registry started at the last request (LRU order).
    last_used_ms: AtomicU64,
    /// Requests being served now; a model serving one is never unloaded to make room.
    in_flight: Arc<AtomicUsize>,
    /// The longest answer this model gives (its config's `max_output_tokens`); None: as
    /// long as its context allows.
    pub max_output_tokens: Option<u32>,
}

/// Held while a request uses a model's worker: keeps it from being unloaded under the
/// request.
pub struct InFlight(Arc<AtomicUsize>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
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
            memory_bytes: 0,
            idle_ttl: None,
            last_used_ms: AtomicU64::new(0),
            in_flight: Arc::new(AtomicUsize::new(0)),
            max_output_tokens: None,
        }
    }

    /// Answers of this model are at most `tokens` long (longer requests are clamped, and told).
    pub fn with_max_output_tokens(mut self, tokens: Option<u32>) -> Self {
        self.max_output_tokens = tokens;
        self
    }

    /// Whether a request's model name means this model: its id, an alias, or an alias
    /// pattern with `*` wildcards (`claude-*`).
    fn answers_to(&self, name: &str) -> bool {
        self.id == name || self.aliases.iter().any(|a| a == name)
    }

    fn matches_pattern(&self, name: &str) -> bool {
        self.aliases
            .iter()
            .any(|a| a.contains('*') && wildcard_match(a, name))
    }

    /// Counted for `bytes` against the shared budget, unloaded after `idle_ttl` unused.
    pub fn with_memory(mut self, bytes: u64, idle_ttl: Option<Duration>) -> Self {
        self.memory_bytes = bytes;
        self.idle_ttl = idle_ttl;
        self
    }

    pub fn is_loaded(&self) -> bool {
        lock(&self.running).is_some()
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
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
        let s = supervisor::supervise(self.spec.clone(), stop_rx);
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
        Self::stop(running).await
    }

    /// Unloads the worker only if no request holds it, deciding under the lock that
    /// `enter` takes: a request that arrives meanwhile either counts before the decision
    /// (then the model stays) or finds it unloaded and loads it again; it never gets a
    /// worker that is being stopped. `idle_for`: also only if unused that long.
    async fn unload_if_unused(&self, idle_for: Option<(Duration, u64)>) -> bool {
        let running = {
            let mut running = lock(&self.running);
            let idle = idle_for.is_none_or(|(ttl, now)| {
                now.saturating_sub(self.last_used_ms.load(Ordering::Relaxed))
                    >= ttl.as_millis() as u64
            });
            if self.in_flight() > 0 || self.pinned() || !idle {
                return false;
            }
            running.take()
        };
        Self::stop(running).await
    }

    async fn stop(running: Option<Running>) -> bool {
        match running {
            Some(r) => {
                let _ = r.stop.send(true);
                let _ = r.task.await;
                true
            }
            None => false,
        }
    }

    /// Counts a request in, under the lock `unload_if_unused` decides under.
    fn enter(&self) -> InFlight {
        let _running = lock(&self.running);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.in_flight.clone())
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

#[derive(Clone)]
pub struct Registry {
    models: Arc<Vec<Arc<ModelEntry>>>,
    /// The model that serves names no model answers to (config `default_model`); None:
    /// such names are a 404.
    default_model: Option<Arc<ModelEntry>>,
    /// Memory for all workers together; None: no limit.
    budget_bytes: Option<u64>,
    /// Serialises load and unload decisions, so two requests never both make room.
    loading: Arc<tokio::sync::Mutex<()>>,
    started: Instant,
}

impl Default for Registry {
    fn default() -> Self {
        Self::new(Vec::new(), None)
    }
}

/// How long a request waits for its model's worker to load.
const LOAD_WAIT: Duration = Duration::from_secs(300);

impl Registry {
    pub fn new(models: Vec<ModelEntry>, budget_bytes: Option<u64>) -> Self {
        Self {
            models: Arc::new(models.into_iter().map(Arc::new).collect()),
            default_model: None,
            budget_bytes,
            loading: Arc::new(tokio::sync::Mutex::new(())),
            started: Instant::now(),
        }
    }

    pub fn budget_bytes(&self) -> Option<u64> {
        self.budget_bytes
    }

    /// Bytes counted for the loaded models.
    pub fn used_bytes(&self) -> u64 {
        self.models
            .iter()
            .filter(|m| m.is_loaded())
            .map(|m| m.memory_bytes)
            .sum()
    }

    /// A client to `model`'s worker for one request: loads the model first when it is not
    /// (making room by unloading the least recently used unpinned, idle models), then waits
    /// until its worker is ready. The guard keeps the model loaded while it is held.
    pub async fn acquire(
        &self,
        model: &Arc<ModelEntry>,
    ) -> Result<(WorkerClient<Channel>, InFlight), ApiError> {
        let guard = model.enter();
        self.touch(model);
        if !model.is_loaded() {
            self.load(model).await?;
        }
        let Some(mut state) = model.state_watch() else {
            return Err(model.ready_client().err().unwrap_or_else(|| {
                ApiError::new(ErrorKind::Overloaded, "the model was unloaded; retry")
            }));
        };
        // Wait out a load in progress; a worker that is restarting answers at once (503).
        let waited = tokio::time::timeout(LOAD_WAIT, async {
            loop {
                let phase = state.borrow_and_update().phase;
                if phase != Phase::Starting || state.changed().await.is_err() {
                    break;
                }
            }
        })
        .await;
        if waited.is_err() {
            return Err(ApiError::new(
                ErrorKind::Overloaded,
                format!(
                    "model {} did not finish loading within {} s; retry later",
                    model.id,
                    LOAD_WAIT.as_secs()
                ),
            ));
        }
        Ok((model.ready_client()?, guard))
    }

    fn touch(&self, model: &ModelEntry) {
        let now = self.started.elapsed().as_millis() as u64;
        model.last_used_ms.store(now, Ordering::Relaxed);
    }

    /// Starts `model`'s worker if it is not running, unloading least recently used unpinned
    /// models without requests in flight until it fits the budget. True when it started one.
    pub async fn load(&self, model: &Arc<ModelEntry>) -> Result<bool, ApiError> {
        let _decide = self.loading.lock().await;
        if model.is_loaded() {
            return Ok(false);
        }
        if let Some(budget) = self.budget_bytes {
            let mut victims: Vec<&Arc<ModelEntry>> = self
                .models
                .iter()
                .filter(|m| {
                    m.is_loaded() && !m.pinned() && m.in_flight() == 0 && !Arc::ptr_eq(m, model)
                })
                .collect();
            victims.sort_by_key(|m| m.last_used_ms.load(Ordering::Relaxed));
            let mut victims = victims.into_iter();
            while self.used_bytes() + model.memory_bytes > budget {
                let Some(victim) = victims.next() else {
                    let holders: Vec<String> = self
                        .models
                        .iter()
                        .filter(|m| m.is_loaded())
                        .map(|m| {
                            let why = if m.pinned() { "pinned" } else { "in use" };
                            format!("{} ({} MiB, {why})", m.id, m.memory_bytes >> 20)
                        })
                        .collect();
                    return Err(ApiError::new(
                        ErrorKind::Overloaded,
                        format!(
                            "model {} needs {} MiB but the models' memory budget of {} MiB is held by: {}; retry later, or unpin or unload a model",
                            model.id,
                            model.memory_bytes >> 20,
                            budget >> 20,
                            holders.join(", ")
                        ),
                    ));
                };
                // A request may have taken the victim since the list was made: then it stays.
                if victim.unload_if_unused(None).await {
                    tracing::info!(
                        unloaded = %victim.id,
                        for_model = %model.id,
                        "unloaded the least recently used model to make room"
                    );
                }
            }
        }
        tracing::info!(model = %model.id, memory_mib = model.memory_bytes >> 20, "loading model");
        Ok(model.load())
    }

    /// Unloads unpinned models that have had no request for their idle TTL; runs until the
    /// registry is dropped by everyone else.
    pub async fn unload_idle(self) {
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            let now = self.started.elapsed().as_millis() as u64;
            for m in self.models.iter() {
                let Some(ttl) = m.idle_ttl else { continue };
                let idle = now.saturating_sub(m.last_used_ms.load(Ordering::Relaxed));
                if m.is_loaded()
                    && !m.pinned()
                    && m.in_flight() == 0
                    && idle >= ttl.as_millis() as u64
                {
                    let _decide = self.loading.lock().await;
                    // Decided again under the lock: a request may have arrived meanwhile.
                    let now = self.started.elapsed().as_millis() as u64;
                    if m.unload_if_unused(Some((ttl, now))).await {
                        tracing::info!(model = %m.id, idle_s = idle / 1000, "unloaded an idle model");
                    }
                }
            }
        }
    }

    pub fn models(&self) -> &[Arc<ModelEntry>] {
        &self.models
    }

    /// The model a request names: by id or alias first, then by alias pattern (models in
    /// configuration order), then the default model when one is configured.
    pub fn resolve(&self, name: &str) -> Result<Arc<ModelEntry>, ApiError> {
        let found = self
            .models
            .iter()
            .find(|m| m.answers_to(name))
            .or_else(|| self.models.iter().find(|m| m.matches_pattern(name)))
            .or(self.default_model.as_ref());
        if let Some(m) = found {
            if m.id != name && !m.aliases.iter().any(|a| a == name) {
                tracing::debug!(requested = name, model = %m.id, "model name routed by pattern or default");
            }
            return Ok(m.clone());
        }
        let known: Vec<&str> = self.models.iter().map(|m| m.id.as_str()).collect();
        Err(ApiError::new(
            ErrorKind::NotFound,
            format!(
                "model {name:?} does not exist; this server has: {} (set default_model or an alias pattern such as \"claude-*\" to route other names)",
                known.join(", ")
            ),
        )
        .param("model")
        .code("model_not_found"))
    }

    /// Names no model answers to go to `id` (which must be a configured model).
    pub fn with_default_model(mut self, id: Option<&str>) -> Result<Self, String> {
        self.default_model = match id {
            None => None,
            Some(id) => Some(
                self.models
                    .iter()
                    .find(|m| m.answers_to(id))
                    .cloned()
                    .ok_or_else(|| format!("default_model {id:?} is not a configured model"))?,
            ),
        };
        Ok(self)
    }

    /// By model id or worker name (the admin API accepts both).
    pub fn find(&self, name: &str) -> Option<Arc<ModelEntry>> {
        self.models
            .iter()
            .find(|m| m.id == name || m.worker_name() == name)
            .cloned()
    }

    /// Stops every worker (gateway shutdown).
    /// Stops every worker, all at once (each gets its own stop grace, not one after another).
    pub async fn unload_all(&self) {
        let stops: Vec<_> = self
            .models
            .iter()
            .map(|m| {
                let m = m.clone();
                tokio::spawn(async move { m.unload().await })
            })
            .collect();
        for s in stops {
            let _ = s.await;
        }
    }
}

/// Whether `name` matches `pattern`, where `*` stands for any run of characters. Alias
/// patterns are this small (`claude-*`, `gpt-*-mini`); a glob crate would add path rules
/// that do not apply to model names.
pub(crate) fn wildcard_match(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = name.strip_prefix(first) else {
        return false;
    };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else {
        return rest.is_empty();
    };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

#[cfg(test)]
mod pattern_tests {
    use super::wildcard_match;

    #[test]
    fn alias_patterns_match_with_wildcards_only_where_they_stand() {
        assert!(wildcard_match("claude-*", "claude-opus-5-5"));
        assert!(wildcard_match("claude-*", "claude-"));
        assert!(!wildcard_match("claude-*", "gpt-4o"));
        assert!(wildcard_match("gpt-*-mini", "gpt-4o-mini"));
        assert!(!wildcard_match("gpt-*-mini", "gpt-4o"));
        assert!(wildcard_match("*", "anything"));
        assert!(wildcard_match("a*b*c", "a-x-b-y-c"));
        assert!(!wildcard_match("a*b*c", "a-x-c-y-b"));
        assert!(wildcard_match("exact", "exact"));
        assert!(!wildcard_match("exact", "exact2"));
    }
}

#[cfg(test)]
mod unload_tests {
    use super::*;
    use crate::supervisor::{Backoff, ChildKind};

    /// A model whose "worker" is `sleep`: it never answers health, which is enough to be
    /// loaded (supervised) and stopped.
    fn entry(dir: &std::path::Path) -> Arc<ModelEntry> {
        let spec = ChildSpec {
            name: "sleeper".into(),
            kind: ChildKind::Worker,
            program: "sleep".into(),
            args: vec!["60".into()],
            socket: dir.join("sleeper.sock"),
            envs: Vec::new(),
            backoff: Backoff::default(),
        };
        Arc::new(ModelEntry::new(
            "m".into(),
            Vec::new(),
            ModelKind::Llm,
            false,
            dir.to_owned(),
            spec,
        ))
    }

    #[tokio::test]
    async fn a_model_a_request_holds_is_not_unloaded_under_it() {
        let dir = tempfile::tempdir().unwrap();
        let m = entry(dir.path());
        assert!(m.load());
        let request = m.enter();
        // The idle unloader and the budget both decide under the lock: the request wins.
        assert!(!m.unload_if_unused(None).await);
        assert!(!m.unload_if_unused(Some((Duration::ZERO, u64::MAX))).await);
        assert!(m.is_loaded());
        drop(request);
        assert!(m.unload_if_unused(Some((Duration::ZERO, u64::MAX))).await);
        assert!(!m.is_loaded());
        // A request that comes after the decision finds the model unloaded (and loads it).
        let _late = m.enter();
        assert!(!m.is_loaded());
    }

    #[tokio::test]
    async fn a_recently_used_model_is_not_unloaded_as_idle() {
        let dir = tempfile::tempdir().unwrap();
        let m = entry(dir.path());
        assert!(m.load());
        m.last_used_ms.store(1_000, Ordering::Relaxed);
        assert!(
            !m.unload_if_unused(Some((Duration::from_secs(5), 2_000)))
                .await
        );
        assert!(
            m.unload_if_unused(Some((Duration::from_secs(5), 7_000)))
                .await
        );
    }
}
