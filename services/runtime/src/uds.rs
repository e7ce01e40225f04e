//! gRPC between Strata's processes runs over Unix domain sockets with 0600 permissions
//! (DESIGN.md section 1): only the user who runs Strata can talk to its workers and cache.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::{Channel, Endpoint};

#[derive(Debug, thiserror::Error)]
pub enum UdsError {
    #[error("socket path {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("socket {path} is in use by a live process")]
    InUse { path: PathBuf },
}

/// Binds a listening socket at `path` with mode 0600. A stale socket file left by a process
/// that died is removed; a socket that still answers is refused, so two servers never share it.
pub async fn bind(path: &Path) -> Result<UnixListenerStream, UdsError> {
    let io_err = |source| UdsError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    if path.exists() {
        if UnixStream::connect(path).await.is_ok() {
            return Err(UdsError::InUse {
                path: path.to_owned(),
            });
        }
        std::fs::remove_file(path).map_err(io_err)?;
    }
    let listener = UnixListener::bind(path).map_err(io_err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io_err)?;
    Ok(UnixListenerStream::new(listener))
}

/// HTTP/2 flow-control windows. The defaults (64 KiB) make a reader of multi-megabyte KV
/// blocks wait for a window update every 64 KiB; on a local socket there is no reason to.
pub const STREAM_WINDOW_BYTES: u32 = 16 << 20;
pub const CONNECTION_WINDOW_BYTES: u32 = 64 << 20;
/// The largest frame HTTP/2 allows (default 16 KiB): fewer frames, fewer syscalls per block.
pub const MAX_FRAME_BYTES: u32 = (1 << 24) - 1;

/// What a server lets each client send ahead before it reads it: small, since every
/// connection's unread data is memory the server holds (clients receive with large windows).
pub const SERVER_STREAM_WINDOW_BYTES: u32 = 2 << 20;
pub const SERVER_CONNECTION_WINDOW_BYTES: u32 = 4 << 20;

/// A gRPC server with large frames and bounded receive windows.
pub fn server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(SERVER_STREAM_WINDOW_BYTES)
        .initial_connection_window_size(SERVER_CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES)
}

/// A lazily connecting gRPC channel to the server listening at `path`.
pub fn channel(path: &Path, connect_timeout: Duration) -> Channel {
    let socket = path.to_owned();
    // The URI is required by tonic but unused: the connector below dials the socket.
    let endpoint = Endpoint::from_static("http://localhost")
        .connect_timeout(connect_timeout)
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .initial_connection_window_size(CONNECTION_WINDOW_BYTES)
        .max_frame_size(MAX_FRAME_BYTES);
    endpoint.connect_with_connector_lazy(tower::service_fn(move |_| {
        let socket = socket.clone();
        async move { UnixStream::connect(socket).await.map(TokioIo::new) }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bound_socket_is_private_and_not_stolen_while_alive() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a/b.sock");
        let listener = bind(&path).await.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(matches!(bind(&path).await, Err(UdsError::InUse { .. })));
        drop(listener);
        // The file is left behind by the dropped listener, as after a crash: binding again works.
        assert!(path.exists());
        bind(&path).await.unwrap();
    }
}
