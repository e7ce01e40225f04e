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

/// Runs a server until SIGTERM/SIGINT, then lets it drain for at most `grace`. A client that
/// keeps its connection open (workers hold theirs for their whole life) would otherwise hold a
/// graceful shutdown open forever.
///
/// `serve` gets the future that tells the server to stop accepting and start draining.
pub async fn serve_until_signal<F, E>(
    name: &str,
    grace: std::time::Duration,
    serve: impl FnOnce(std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>) -> F,
) -> Result<(), E>
where
    F: std::future::Future<Output = Result<(), E>>,
{
    let (tx, mut rx) = tokio::sync::watch::channel(false);
    let drain = Box::pin(async move {
        let _ = rx.changed().await;
    });
    let server = serve(drain);
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => result,
        signal = signal_received() => {
            tracing::info!(signal, "{name} shutting down");
            let _ = tx.send(true);
            match tokio::time::timeout(grace, &mut server).await {
                Ok(result) => result,
                Err(_) => {
                    tracing::warn!("{name}: connections still open after {grace:?}; closing them");
                    Ok(())
                }
            }
        }
    }
}
