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
    #[error("socket path {path}: {why}")]
    Unsafe { path: PathBuf, why: String },
}

/// The uid this process runs as.
fn my_uid() -> u32 {
    // SAFETY: getuid(2) cannot fail.
    unsafe { libc::getuid() }
}

/// The socket's directory must be a real directory of this user; it is made 0700. A symbolic
/// link (in place of the directory or of the socket) could point another user's way.
fn check_socket_dir(path: &Path) -> Result<(), UdsError> {
    use std::os::unix::fs::MetadataExt;
    let unsafe_path = |why: String| UdsError::Unsafe {
        path: path.to_owned(),
        why,
    };
    let dir = path
        .parent()
        .ok_or_else(|| unsafe_path("no parent directory".into()))?;
    let meta = std::fs::symlink_metadata(dir)
        .map_err(|e| unsafe_path(format!("{}: {e}", dir.display())))?;
    if !meta.is_dir() {
        return Err(unsafe_path(format!(
            "{} is not a directory (a symbolic link is refused)",
            dir.display()
        )));
    }
    if meta.uid() != my_uid() {
        return Err(unsafe_path(format!(
            "{} belongs to uid {}, not to this user ({})",
            dir.display(),
            meta.uid(),
            my_uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| unsafe_path(format!("make {} private: {e}", dir.display())))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            Err(unsafe_path("the socket path is a symbolic link".into()))
        }
        _ => Ok(()),
    }
}

/// Whether the peer of an accepted connection runs as this user (SO_PEERCRED / getpeereid):
/// the socket's mode already says so, this holds even if a mode were changed.
fn peer_is_this_user(stream: &UnixStream) -> bool {
    match stream.peer_cred() {
        Ok(cred) if cred.uid() == my_uid() => true,
        Ok(cred) => {
            tracing::warn!(uid = cred.uid(), "refused a connection from another user");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "refused a connection whose peer is unknown");
            false
        }
    }
}

/// Binds a listening socket at `path` with mode 0600, in a directory of this user's (made
/// 0700; symbolic links refused). A stale socket file left by a process that died is removed;
/// a socket that still answers is refused, so two servers never share it. Connections from
/// other users are dropped as they are accepted.
pub async fn bind(
    path: &Path,
) -> Result<impl tokio_stream::Stream<Item = io::Result<UnixStream>>, UdsError> {
    use tokio_stream::StreamExt;
    let io_err = |source| UdsError::Io {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io_err)?;
    }
    check_socket_dir(path)?;
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
    Ok(
        UnixListenerStream::new(listener).filter(|accepted| match accepted {
            Ok(stream) => peer_is_this_user(stream),
            Err(_) => true,
        }),
    )
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
        let _again = bind(&path).await.unwrap();
        // Its directory was made private.
        let dir_mode = std::fs::metadata(path.parent().unwrap())
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(dir_mode & 0o777, 0o700);
    }

    #[tokio::test]
    async fn symbolic_links_are_refused_and_peers_are_this_user() {
        use tokio_stream::StreamExt;
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("real");
        std::fs::create_dir(&real).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert!(matches!(
            bind(&link.join("s.sock")).await,
            Err(UdsError::Unsafe { .. })
        ));
        std::os::unix::fs::symlink("/tmp/elsewhere.sock", real.join("l.sock")).unwrap();
        assert!(matches!(
            bind(&real.join("l.sock")).await,
            Err(UdsError::Unsafe { .. })
        ));
        // A connection from this user is let through.
        let path = real.join("ok.sock");
        let mut incoming = Box::pin(bind(&path).await.unwrap());
        let _client = UnixStream::connect(&path).await.unwrap();
        assert!(incoming.next().await.unwrap().is_ok());
    }
}
