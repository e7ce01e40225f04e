//! The HTTP accept loop. `axum::serve` would do, but it gives connections no timer, so a
//! client that sends its headers a byte at a time (slow-loris) holds a connection forever.
//! This loop is axum's, plus hyper's header read timeout, and it puts each connection's peer
//! address into the request as `ConnectInfo` (the admin routes answer only loopback peers).
//!
//! Every phase of a connection has a deadline: the first bytes that tell HTTP/1 from HTTP/2
//! (`DETECT_TIMEOUT`), HTTP/1 headers (`HEADER_READ_TIMEOUT`), HTTP/2 liveness (pings), bodies
//! (`generation::BODY_READ_TIMEOUT`). Connections are capped (`connection_cap`): past the cap
//! the loop stops accepting until one closes (mini-redis's semaphore), so idle sockets cannot
//! use up the file descriptors the gateway needs for its workers.

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
/// A new connection must have sent enough to tell its protocol within this long.
pub const DETECT_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 connections are pinged this often and closed when a ping goes unanswered this long.
const H2_PING_EVERY: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// The HTTP/2 connection preface; any other first bytes are HTTP/1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Open connections allowed at once: the descriptors this process may open, less a reserve for
/// its own sockets and files (workers, cache service, health checks, model files). The soft
/// limit is raised to the hard one first.
pub fn connection_cap() -> usize {
    const RESERVE: u64 = 256;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit with a valid pointer to a local struct.
    let soft = unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            1024
        } else {
            let wanted = limit.rlim_max.min(65_536);
            if wanted > limit.rlim_cur {
                let raised = libc::rlimit {
                    rlim_cur: wanted,
                    rlim_max: limit.rlim_max,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                    limit.rlim_cur = wanted;
                }
            }
            limit.rlim_cur
        }
    };
    soft.saturating_sub(RESERVE).clamp(64, 16_384) as usize
}

/// Waits until the client has sent enough to choose HTTP/1 or HTTP/2 (any byte that departs
/// from the HTTP/2 preface, or the whole preface), or the deadline passes.
/// Each connection's kernel send buffer (`SO_SNDBUF`), fixed rather than autotuned.
const SEND_BUFFER_BYTES: usize = 256 << 10;

async fn protocol_known(stream: &tokio::net::TcpStream) -> bool {
    let detect = async {
        let mut buf = [0u8; 24];
        loop {
            match stream.peek(&mut buf).await {
                Ok(0) | Err(_) => return false,
                Ok(n) if n == H2_PREFACE.len() || buf[..n] != H2_PREFACE[..n] => return true,
                // Part of the preface: wait for the rest.
                Ok(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        }
    };
    tokio::time::timeout(DETECT_TIMEOUT, detect)
        .await
        .unwrap_or(false)
}

/// Serves `app` on `listener` with at most `cap` connections open at once until `shutdown`
/// turns true, then lets open connections finish their requests (the caller bounds how long
/// it waits).
pub async fn serve_capped(
    listener: TcpListener,
    app: Router,
    mut shutdown: watch::Receiver<bool>,
    cap: usize,
) {
    tracing::info!(connections = cap, "accepting connections");
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(cap));
    // Every connection task holds a receiver; closing `stop` asks them to wind down, and
    // `done` closes once the last one has.
    let (stop, stop_rx) = watch::channel(());
    let (done, done_rx) = watch::channel(());
    loop {
        // Backpressure: past the cap, wait for a connection to close before accepting.
        let slot = tokio::select! {
            slot = slots.clone().acquire_owned() => match slot {
                Ok(slot) => slot,
                Err(_) => break,
            },
            _ = async { shutdown.wait_for(|s| *s).await.map(|_| ()) } => break,
        };
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
        // A fixed send buffer: the kernel's autotuning lets one socket queue up to 4 MiB for a
        // client that stopped reading (thousands of them would pin gigabytes of kernel
        // memory), and a stream to such a client is noticed only once the buffer is full.
        // 256 KiB still moves gigabytes a second on loopback.
        if let Err(e) = socket2::SockRef::from(&stream).set_send_buffer_size(SEND_BUFFER_BYTES) {
            tracing::debug!(%peer, error = %e, "could not bound the send buffer");
        }
        tokio::spawn(async move {
            let _slot = slot;
            if !protocol_known(&stream).await {
                tracing::debug!(%peer, "connection closed before its protocol was known");
                drop(done);
                return;
            }
            let mut builder = Builder::new(TokioExecutor::new());
            builder
                .http1()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_READ_TIMEOUT);
            builder
                .http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(H2_PING_EVERY)
                .keep_alive_timeout(H2_PING_TIMEOUT);
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
