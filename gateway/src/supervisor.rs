//! Supervision of child processes (the cache service and one worker per model): spawn, wait for
//! gRPC health, restart with exponential backoff when one dies, stop them on shutdown.
//! Each child is owned by one task; others see its state through a `watch` channel.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde::Serialize;
use strata_proto::kvcache::kv_cache_client::KvCacheClient;
use strata_proto::worker::worker_client::WorkerClient;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

use crate::stderr_tail::StderrTail;

/// Which gRPC service a child answers health checks on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ChildKind {
    KvCache,
    Worker,
}

/// How to start one child process.
#[derive(Debug, Clone)]
pub struct ChildSpec {
    pub name: String,
    pub kind: ChildKind,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub socket: PathBuf,
    /// Environment variables set for the child (e.g. where to export traces).
    pub envs: Vec<(String, String)>,
    /// How long to wait before each restart.
    pub backoff: Backoff,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    Starting,
    Ready,
    Restarting,
    Stopped,
}

/// What the rest of the gateway can see of a child.
#[derive(Debug, Clone, Serialize)]
pub struct ChildState {
    pub name: String,
    pub kind: ChildKind,
    pub phase: Phase,
    pub pid: Option<u32>,
    pub restarts: u32,
    /// The last exit status or start failure, for operators.
    pub last_error: Option<String>,
    /// What the child reported in its last health answer (e.g. MLX version and device).
    pub detail: Option<String>,
    /// When it last became ready (Unix seconds), for its uptime.
    pub ready_since_unix: Option<u64>,
}

/// Restart delays: 0.5 s doubling to 30 s; a child that stayed up a minute starts over at 0.5 s.
#[derive(Debug, Clone)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
    pub stable_after: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(500),
            max: Duration::from_secs(30),
            stable_after: Duration::from_secs(60),
        }
    }
}

impl Backoff {
    fn next(&self, current: Duration, uptime: Duration) -> Duration {
        if uptime >= self.stable_after {
            self.initial
        } else {
            (current * 2).min(self.max)
        }
    }
}

/// The pipe whose closing tells workers that the gateway is gone; one for the gateway's life.
fn life_line() -> Option<&'static strata_runtime::parent::LifeLine> {
    static LINE: std::sync::OnceLock<Option<strata_runtime::parent::LifeLine>> =
        std::sync::OnceLock::new();
    LINE.get_or_init(|| strata_runtime::parent::LifeLine::new().ok())
        .as_ref()
}

/// In a debug build, `STRATA_TEST_NO_PDEATHSIG=1` leaves the Linux parent-death signal off, so
/// that a test shows the life line alone stops orphaned workers (as on macOS).
#[cfg(target_os = "linux")]
fn test_without_pdeathsig() -> bool {
    cfg!(debug_assertions) && std::env::var_os("STRATA_TEST_NO_PDEATHSIG").is_some_and(|v| v == "1")
}

/// How long a child gets to answer its first health check, and to exit after SIGTERM.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Requests from the admin API to a supervised child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// Stop the child (SIGTERM, then SIGKILL) and start it again at once.
    Restart,
}

/// A supervised child, as the rest of the gateway holds it.
pub struct Supervised {
    pub state: watch::Receiver<ChildState>,
    pub control: mpsc::Sender<Control>,
    pub task: tokio::task::JoinHandle<()>,
}

/// How often a ready child is asked for its health, and how many answers in a row may fail
/// before it is taken for hung, killed and restarted.
const HEALTH_EVERY: Duration = Duration::from_secs(2);
const HEALTH_FAILURES_ALLOWED: u32 = 3;

/// Starts supervising `spec` in its own task. The task stops the child and returns when
/// `shutdown` turns true.
pub fn supervise(spec: ChildSpec, mut shutdown: watch::Receiver<bool>) -> Supervised {
    let backoff = spec.backoff.clone();
    let (control_tx, mut control) = mpsc::channel(4);
    let (state_tx, state_rx) = watch::channel(ChildState {
        name: spec.name.clone(),
        kind: spec.kind,
        phase: Phase::Starting,
        pid: None,
        restarts: 0,
        last_error: None,
        detail: None,
        ready_since_unix: None,
    });
    let task = tokio::spawn(async move {
        let mut delay = backoff.initial;
        loop {
            let started = Instant::now();
            let result = run_once(&spec, &state_tx, &mut shutdown, &mut control).await;
            if *shutdown.borrow() {
                break;
            }
            let error = match result {
                Down::Requested => {
                    tracing::info!(child = %spec.name, "restarting on request");
                    state_tx.send_modify(|s| {
                        s.phase = Phase::Restarting;
                        s.pid = None;
                        s.restarts += 1;
                        s.last_error = Some("restarted on request".into());
                    });
                    delay = backoff.initial;
                    continue;
                }
                Down::Failed(e) => e,
            };
            tracing::warn!(child = %spec.name, error = %error, "child down; restarting in {delay:?}");
            state_tx.send_modify(|s| {
                s.phase = Phase::Restarting;
                s.pid = None;
                s.restarts += 1;
                s.last_error = Some(error);
            });
            tokio::select! {
                _ = tokio::time::sleep(delay) => {}
                _ = shutdown.changed() => break,
            }
            delay = backoff.next(delay, started.elapsed());
        }
        state_tx.send_modify(|s| {
            s.phase = Phase::Stopped;
            s.pid = None;
        });
    });
    Supervised {
        state: state_rx,
        control: control_tx,
        task,
    }
}

/// Why a run of the child ended other than by its own exit.
enum Down {
    Failed(String),
    /// Restart asked for through the admin API.
    Requested,
}

/// Runs the child once: spawn, wait for health, wait for exit or shutdown; says why it ended.
async fn run_once(
    spec: &ChildSpec,
    state: &watch::Sender<ChildState>,
    shutdown: &mut watch::Receiver<bool>,
    control: &mut mpsc::Receiver<Control>,
) -> Down {
    match run_child(spec, state, shutdown, control).await {
        Ok(down) => down,
        Err(e) => Down::Failed(e),
    }
}

async fn run_child(
    spec: &ChildSpec,
    state: &watch::Sender<ChildState>,
    shutdown: &mut watch::Receiver<bool>,
    control: &mut mpsc::Receiver<Control>,
) -> Result<Down, String> {
    let mut command = Command::new(&spec.program);
    command
        .args(&spec.args)
        .envs(spec.envs.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        // Own process group: a terminal Ctrl-C reaches only the gateway, which stops children in order.
        .process_group(0)
        .kill_on_drop(true);
    if spec.kind == ChildKind::Worker {
        command.stderr(Stdio::piped());
    }
    if spec.kind == ChildKind::Worker {
        // A worker must not outlive a gateway that was killed outright (kill_on_drop cannot
        // run then). On every platform it watches the gateway's life line (a pipe whose
        // write end only the gateway holds); on Linux the kernel also sends it SIGTERM when
        // the gateway dies. The cache service is left running on purpose; it outlives
        // gateway restarts.
        match life_line() {
            Some(line) => {
                let (k, v) = line.env();
                command.env(k, v);
                // SAFETY: the closure only calls fcntl on a descriptor number, which is
                // async-signal-safe.
                unsafe { command.pre_exec(line.keep_in_child()) };
            }
            None => {
                tracing::warn!(child = %spec.name, "no life line for the worker (pipe failed): it relies on the parent-death signal")
            }
        }
        #[cfg(target_os = "linux")]
        if !test_without_pdeathsig() {
            // SAFETY: prctl is async-signal-safe and touches only the calling (child) process.
            unsafe {
                command.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("spawn {}: {e}", spec.program.display()))?;
    let tail = child.stderr.take().map(StderrTail::follow);
    let pid = child.id();
    state.send_modify(|s| {
        s.phase = Phase::Starting;
        s.pid = pid;
    });
    tracing::info!(child = %spec.name, pid, "started");

    let ready = wait_ready(spec, &mut child, shutdown);
    match ready.await {
        Ok(detail) => {
            tracing::info!(child = %spec.name, %detail, "ready");
            state.send_modify(|s| {
                s.phase = Phase::Ready;
                s.detail = Some(detail);
                s.ready_since_unix = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .ok()
                    .map(|d| d.as_secs());
            });
        }
        Err(e) => {
            stop(&spec.name, &mut child).await;
            return Ok(Down::Failed(in_its_words(e, tail).await));
        }
    }

    let mut health = tokio::time::interval(HEALTH_EVERY);
    health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // One channel for the child's life: a probe needs no new socket (and so no descriptor)
    // unless the connection broke.
    let channel = strata_runtime::uds::channel(&spec.socket, Duration::from_secs(1));
    let mut failures = 0;
    loop {
        tokio::select! {
            status = child.wait() => {
                let status = status.map_err(|e| format!("wait: {e}"))?;
                return Ok(Down::Failed(in_its_words(format!("exited: {status}"), tail).await));
            }
            _ = shutdown.changed() => {
                stop(&spec.name, &mut child).await;
                return Ok(Down::Failed("stopped".into()));
            }
            Some(Control::Restart) = control.recv() => {
                stop(&spec.name, &mut child).await;
                return Ok(Down::Requested);
            }
            _ = health.tick() => {
                match probe_on(spec, channel.clone()).await {
                    Ok(_) => failures = 0,
                    Err(e) if gateway_out_of_descriptors() => {
                        // The gateway's own shortage, not the child's fault: not counted.
                        tracing::warn!(child = %spec.name, error = %e, "health check not made: the gateway is out of file descriptors");
                    }
                    Err(e) => {
                        failures += 1;
                        tracing::warn!(child = %spec.name, failures, error = %e, "health check failed");
                        if failures >= HEALTH_FAILURES_ALLOWED {
                            // Hung: it will not stop politely either.
                            let _ = child.kill().await;
                            return Ok(Down::Failed(format!(
                                "killed after {failures} failed health checks ({})",
                                e.message()
                            )));
                        }
                    }
                }
            }
        }
    }
}

/// `what` happened, with the fatal error the child printed, if it printed one.
async fn in_its_words(what: String, tail: Option<StderrTail>) -> String {
    match tail {
        Some(tail) => match tail.reason().await {
            Some(reason) => format!("{what}: {reason}"),
            None => what,
        },
        None => what,
    }
}

/// Polls the child's Health RPC until it answers, the child exits, or the timeout passes.
async fn wait_ready(
    spec: &ChildSpec,
    child: &mut Child,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<String, String> {
    let deadline = Instant::now() + READY_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            return Err(format!("exited before ready: {status}"));
        }
        if let Ok(detail) = probe(spec).await {
            return Ok(detail);
        }
        if Instant::now() > deadline {
            return Err(format!("not healthy after {READY_TIMEOUT:?}"));
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(100)) => {}
            _ = shutdown.changed() => return Err("shutdown while starting".into()),
        }
    }
}

/// Whether this process has no file descriptor left to open (EMFILE or ENFILE).
fn gateway_out_of_descriptors() -> bool {
    match std::fs::File::open("/dev/null") {
        Ok(_) => false,
        Err(e) => matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)),
    }
}

/// One health check over the child's Unix socket, with a deadline, on a new channel.
pub async fn probe(spec: &ChildSpec) -> Result<String, tonic::Status> {
    let channel = strata_runtime::uds::channel(&spec.socket, Duration::from_secs(1));
    probe_on(spec, channel).await
}

/// One health check on `channel`.
async fn probe_on(
    spec: &ChildSpec,
    channel: tonic::transport::Channel,
) -> Result<String, tonic::Status> {
    let deadline = Duration::from_secs(2);
    match spec.kind {
        ChildKind::KvCache => {
            let mut req = tonic::Request::new(strata_proto::kvcache::HealthRequest {});
            req.set_timeout(deadline);
            let r = KvCacheClient::new(channel).health(req).await?.into_inner();
            Ok(format!("{} v{}", r.status, r.version))
        }
        ChildKind::Worker => {
            let mut req = tonic::Request::new(strata_proto::worker::HealthRequest {});
            req.set_timeout(deadline);
            let r = WorkerClient::new(channel).health(req).await?.into_inner();
            let mut detail = format!(
                "{} v{}, mlx {} on {}",
                r.status, r.version, r.mlx_version, r.device
            );
            if r.prefill_chunk_tokens > 0 {
                detail += &format!(", prefill passes of {} tokens", r.prefill_chunk_tokens);
            }
            Ok(detail)
        }
    }
}

/// SIGTERM, then SIGKILL if the child has not exited after the grace period.
async fn stop(name: &str, child: &mut Child) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped yet.
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        match tokio::time::timeout(STOP_GRACE, child.wait()).await {
            Ok(status) => {
                tracing::info!(child = %name, status = ?status.ok(), "stopped");
                return;
            }
            Err(_) => tracing::warn!(child = %name, "did not stop after SIGTERM; killing"),
        }
    }
    let _ = child.kill().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap_and_resets_when_stable() {
        let b = Backoff::default();
        let short = Duration::from_secs(1);
        assert_eq!(
            b.next(Duration::from_millis(500), short),
            Duration::from_secs(1)
        );
        assert_eq!(
            b.next(Duration::from_secs(20), short),
            Duration::from_secs(30)
        );
        assert_eq!(
            b.next(Duration::from_secs(30), short),
            Duration::from_secs(30)
        );
        assert_eq!(
            b.next(Duration::from_secs(30), Duration::from_secs(61)),
            b.initial
        );
    }
}
