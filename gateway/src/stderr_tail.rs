//! A worker's stderr, passed through to the gateway's own and remembered, so that a worker that
//! exits on its own (a model file it cannot load, a bad option) is reported in its own words in
//! `/health`, `/admin` and the API's "not ready" errors, not as a bare exit status.
//! Only workers: the cache service outlives gateway restarts and must not write into a pipe
//! whose reader is gone.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::ChildStderr;
use tokio::task::JoinHandle;

/// Lines kept: enough for an error with its causes, before any backtrace.
const KEPT_LINES: usize = 64;
/// The longest reason reported.
const MAX_REASON: usize = 600;

pub struct StderrTail {
    lines: Arc<Mutex<VecDeque<String>>>,
    task: JoinHandle<()>,
}

impl StderrTail {
    pub fn follow(stderr: ChildStderr) -> Self {
        let lines = Arc::new(Mutex::new(VecDeque::with_capacity(KEPT_LINES)));
        let kept = lines.clone();
        let task = tokio::spawn(async move {
            let mut reader = BufReader::new(stderr);
            let mut out = tokio::io::stderr();
            let mut line = Vec::new();
            while let Ok(n) = reader.read_until(b'\n', &mut line).await {
                if n == 0 {
                    break;
                }
                let _ = out.write_all(&line).await;
                let text = String::from_utf8_lossy(&line).trim_end().to_string();
                if let Ok(mut kept) = kept.lock() {
                    if kept.len() == KEPT_LINES {
                        kept.pop_front();
                    }
                    kept.push_back(text);
                }
                line.clear();
            }
        });
        Self { lines, task }
    }

    /// The fatal error the child printed last, once its stderr is closed (or after a second).
    pub async fn reason(self) -> Option<String> {
        let _ = tokio::time::timeout(Duration::from_secs(1), self.task).await;
        let lines: Vec<String> = self.lines.lock().ok()?.iter().cloned().collect();
        fatal_reason(&lines)
    }
}

/// The last `Error: ...` report (as `anyhow` prints it from `main`) with its causes, on one
/// line; the backtrace, if any, is left out.
fn fatal_reason(lines: &[String]) -> Option<String> {
    let start = lines.iter().rposition(|l| l.starts_with("Error: "))?;
    let mut parts = Vec::new();
    for line in &lines[start..] {
        let line = line.trim();
        if line.starts_with("Stack backtrace:") {
            break;
        }
        if line.is_empty() || line == "Caused by:" {
            continue;
        }
        let line = line.strip_prefix("Error: ").unwrap_or(line);
        // Several causes are numbered "0: ...", "1: ...".
        let line = match line.split_once(": ") {
            Some((n, rest)) if n.chars().all(|c| c.is_ascii_digit()) => rest,
            _ => line,
        };
        parts.push(line);
    }
    let mut reason = parts.join(": ");
    if reason.len() > MAX_REASON {
        let mut cut = MAX_REASON;
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        reason.truncate(cut);
        reason.push('…');
    }
    Some(reason)
}

#[cfg(test)]
mod tests {
    use super::fatal_reason;

    fn lines(text: &str) -> Vec<String> {
        text.lines().map(str::to_string).collect()
    }

    #[test]
    fn an_anyhow_report_becomes_one_line_without_its_backtrace() {
        let report = lines(
            "2026-11-30 INFO loading\nError: loading /m/bad.gguf\n\nCaused by:\n    cannot read \
             the model: tensor 'w' has 0 dimensions\n\nStack backtrace:\n   0: anyhow::x\n",
        );
        assert_eq!(
            fatal_reason(&report).as_deref(),
            Some("loading /m/bad.gguf: cannot read the model: tensor 'w' has 0 dimensions")
        );
    }

    #[test]
    fn numbered_causes_are_kept_in_order() {
        let report = lines("Error: a\n\nCaused by:\n    0: b\n    1: c: d\n");
        assert_eq!(fatal_reason(&report).as_deref(), Some("a: b: c: d"));
    }

    #[test]
    fn no_report_no_reason_and_long_reports_are_cut() {
        assert_eq!(fatal_reason(&lines("INFO fine\nWARN slow")), None);
        let long = lines(&format!("Error: {}", "é".repeat(1000)));
        let reason = fatal_reason(&long).unwrap();
        assert!(reason.len() <= 600 + '…'.len_utf8() && reason.ends_with('…'));
    }
}
