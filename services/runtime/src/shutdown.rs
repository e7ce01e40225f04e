//! The stop signal of a process: SIGTERM (service managers, the gateway stopping a worker) or
//! SIGINT (Ctrl-C). Every server awaits it and then drains, as in tokio's mini-redis.

use tokio::signal::unix::{SignalKind, signal};

/// Resolves when the process receives SIGTERM or SIGINT, and names the signal.
pub async fn signal_received() -> &'static str {
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    match (term, int) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        }
        // Without signal handlers we can only wait forever; the default disposition then kills
        // the process, which is still a clean exit for a service manager.
        _ => std::future::pending().await,
    }
}
