//! Logging set-up. `RUST_LOG` decides the filter (default `info`); logs go to stderr so that a
//! supervisor can capture a child's output. OTLP export joins here with the observability issue.

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls are ignored (tests call it repeatedly).
pub fn init(process: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let installed = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init()
        .is_ok();
    if installed {
        tracing::debug!(process, "logging initialised");
    }
}
