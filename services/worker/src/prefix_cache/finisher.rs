//! Finishing blocks off the engine thread.
//!
//! A block the engine hands over still has to be checksummed, quantised where blocks are
//! stored quantised, put in L0 and queued for the cache service. Done in the engine thread,
//! that work came before the first token: on an H100 the 33 blocks of an 8K-token prompt
//! (241 MB) took 38 ms of a 300 ms cold request, and decode steps waited on it too. Here one
//! thread does it in the order the blocks came, and every reader of L0 or of the blocks in
//! flight first waits until what was handed over before it is done (`idle`), so a prompt that
//! follows sees every block of the one before, as when it was done in place.

use std::sync::mpsc::{SyncSender, sync_channel};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send>;

/// Blocks waiting to be finished before the engine waits for room (about 2 GB of Qwen2.5-1.5B
/// f16 blocks: the finisher is much faster than a prefill, so this is only a backstop).
const QUEUE_BLOCKS: usize = 256;

#[derive(Clone)]
pub struct Finisher {
    jobs: SyncSender<Job>,
    /// (jobs handed over, jobs done).
    progress: Arc<(Mutex<(u64, u64)>, Condvar)>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Finisher {
    pub fn start() -> Self {
        let (jobs, rx) = sync_channel::<Job>(QUEUE_BLOCKS);
        let progress = Arc::new((Mutex::new((0u64, 0u64)), Condvar::new()));
        let done = progress.clone();
        let spawned = std::thread::Builder::new()
            .name("kv-finisher".into())
            .spawn(move || {
                for job in rx {
                    job();
                    let (m, cv) = &*done;
                    lock(m).1 += 1;
                    cv.notify_all();
                }
            });
        if let Err(e) = spawned {
            // Jobs then run in place (see `submit`): slower first tokens, nothing lost.
            tracing::warn!(error = %e, "no block finisher thread; blocks are finished in place");
        }
        Self { jobs, progress }
    }

    /// Runs `job` on the finisher thread after every job handed over before it (in place if
    /// that thread is gone).
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) {
        let (m, cv) = &*self.progress;
        lock(m).0 += 1;
        if let Err(returned) = self.jobs.send(Box::new(job)) {
            (returned.0)();
            lock(m).1 += 1;
            cv.notify_all();
        }
    }

    /// Waits until every job handed over before this call is done.
    pub fn idle_blocking(&self) {
        let (m, cv) = &*self.progress;
        let mut p = lock(m);
        let target = p.0;
        while p.1 < target {
            p = cv.wait(p).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// `idle_blocking` for async callers: polls, so that no runtime thread blocks.
    pub async fn idle(&self) {
        let target = lock(&self.progress.0).0;
        while lock(&self.progress.0).1 < target {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Jobs run in the order given, and idle waits for all handed over before it.
    #[tokio::test]
    async fn idle_waits_for_every_job_handed_over_before_it() {
        let f = Finisher::start();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let count = Arc::new(AtomicUsize::new(0));
        for i in 0..20 {
            let (seen, count) = (seen.clone(), count.clone());
            f.submit(move || {
                std::thread::sleep(Duration::from_millis(2));
                lock(&seen).push(i);
                count.fetch_add(1, Ordering::SeqCst);
            });
        }
        f.idle().await;
        assert_eq!(count.load(Ordering::SeqCst), 20);
        let c = count.clone();
        f.submit(move || {
            std::thread::sleep(Duration::from_millis(5));
            c.fetch_add(1, Ordering::SeqCst);
        });
        f.idle_blocking();
        assert_eq!(count.load(Ordering::SeqCst), 21);
        assert_eq!(*lock(&seen), (0..20).collect::<Vec<_>>());
    }
}
