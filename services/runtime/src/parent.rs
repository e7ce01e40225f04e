//! A child that must not outlive its parent, on every platform: the parent holds the write end
//! of a pipe for its whole life and each child inherits the read end; when the parent dies,
//! however it dies, the kernel closes the write end and the child's read returns end of file.
//! Linux also has `PR_SET_PDEATHSIG`; macOS has nothing like it, and a pipe needs neither
//! kqueue nor polling. (Written here because it is a few system calls: no crate does just this.)

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// Names the inherited read end in the child's environment.
pub const PARENT_FD_ENV: &str = "STRATA_PARENT_FD";

/// The parent's side: both ends, close-on-exec, so that no child inherits them by accident.
pub struct LifeLine {
    read: OwnedFd,
    _write: OwnedFd,
}

fn set_cloexec(fd: RawFd, on: bool) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor this process owns; no memory is passed.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    let flags = if on {
        flags | libc::FD_CLOEXEC
    } else {
        flags & !libc::FD_CLOEXEC
    };
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, flags) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

impl LifeLine {
    pub fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` has room for the two descriptors pipe writes.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe just returned these two descriptors; nothing else owns them.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        set_cloexec(read.as_raw_fd(), true)?;
        set_cloexec(write.as_raw_fd(), true)?;
        Ok(Self {
            read,
            _write: write,
        })
    }

    /// The environment variable that tells a child which descriptor to watch.
    pub fn env(&self) -> (String, String) {
        (PARENT_FD_ENV.to_string(), self.read.as_raw_fd().to_string())
    }

    /// To run in the forked child before exec (`pre_exec`): keeps the read end open across
    /// exec in that child only. Async-signal-safe (fcntl only).
    pub fn keep_in_child(&self) -> impl FnMut() -> io::Result<()> + Send + Sync + 'static {
        let fd = self.read.as_raw_fd();
        move || set_cloexec(fd, false)
    }
}

/// In a child: if the parent passed a life line, watches it on a thread of its own and calls
/// `on_parent_gone` once the parent has died. Returns whether a line was found.
pub fn watch_parent(on_parent_gone: impl FnOnce() + Send + 'static) -> bool {
    let Some(fd) = std::env::var(PARENT_FD_ENV)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok())
    else {
        return false;
    };
    // The descriptor must be an open pipe: an inherited variable without its descriptor (a
    // shell that exported it) is ignored rather than watched.
    // SAFETY: fcntl only queries the descriptor.
    if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
        return false;
    }
    // Not inherited further by anything this process starts.
    let _ = set_cloexec(fd, true);
    let spawned = std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            wait_for_eof(fd);
            on_parent_gone();
        });
    spawned.is_ok()
}

fn wait_for_eof(fd: RawFd) {
    let mut byte = [0u8; 1];
    loop {
        // SAFETY: reads at most one byte into `byte`; the descriptor stays open (it is
        // never closed by this process).
        let n = unsafe { libc::read(fd, byte.as_mut_ptr().cast(), 1) };
        if n == 0 {
            return;
        }
        if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
        // The parent never writes; a byte would be a stray one, ignored.
    }
}

/// What a child does when its parent is gone: the same stop as `kill -TERM`, so that it
/// drains what it holds (a worker stores its last blocks), then a hard exit if that hangs.
pub fn terminate_self(grace: std::time::Duration) {
    tracing::warn!("the parent process is gone; stopping");
    // SAFETY: sends a signal to this very process.
    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    std::thread::sleep(grace);
    tracing::error!("did not stop within {grace:?} of its parent's death; exiting");
    std::process::exit(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Duration;

    #[test]
    fn the_watch_fires_when_the_write_end_closes_and_not_before() {
        let line = LifeLine::new().unwrap();
        let fd = line.read.as_raw_fd();
        // What watch_parent does after reading the environment.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            wait_for_eof(fd);
            let _ = tx.send(());
        });
        assert!(rx.recv_timeout(Duration::from_millis(300)).is_err());
        let LifeLine { read, _write } = line;
        drop(_write);
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        drop(read);
    }

    #[test]
    fn both_ends_are_close_on_exec_in_the_parent() {
        let line = LifeLine::new().unwrap();
        for fd in [line.read.as_raw_fd(), line._write.as_raw_fd()] {
            let flags = unsafe { libc::fcntl(fd, libc::F_GETFD) };
            assert!(flags & libc::FD_CLOEXEC != 0);
        }
        assert_eq!(line.env().0, PARENT_FD_ENV);
    }
}
