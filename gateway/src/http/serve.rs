//! The HTTP accept loop. `axum::serve` would do, but it gives connections no timer, so a
//! client that sends its headers a byte at a time (slow-loris) holds a connection forever.
//! This loop is axum's, plus hyper's header read timeout, and it puts each connection's peer
//! address into the request as `ConnectInfo` (the admin routes answer only loopback peers).

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tower::ServiceExt;

/// A client must have sent a request's headers within this long.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` turns true, then lets open connections finish
/// their requests (the caller bounds how long it waits).
pub async fn serve(listener: TcpListener, app: Router, mut shutdown: watch::Receiver<bool>) {
    // Every connection task holds a receiver; closing `stop` asks them to wind down, and
    // `done` closes once the last one has.
    let (stop, stop_rx) = watch::channel(());
    let (done, done_rx) = watch::channel(());
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: wait, as axum does, not spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => break,
        };
        let app = app
            .clone()
            .map_request(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(ConnectInfo(peer));
                req.map(axum::body::Body::new)
            });
        let service = TowerToHyperService::new(app);
        let mut stopping = stop_rx.clone();
        let done = done_rx.clone();
        tokio::spawn(async move {
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                result = conn.as_mut() => log_end(peer, result),
                _ = stopping.changed() => {
                    conn.as_mut().graceful_shutdown();
                    log_end(peer, conn.await);
                }
            }
            drop(done);
        });
    }
    drop(listener);
    drop(stop);
    drop(done_rx);
    done.closed().await;
}

fn log_end(peer: SocketAddr, result: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}
