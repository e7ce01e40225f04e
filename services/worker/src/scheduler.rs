//! The engine thread and its queue. MLX state lives on one thread; request handlers hand it
//! jobs through a bounded queue and read token events back from a channel per job. A full
//! queue is refused at once (the gateway answers 429 with Retry-After), never waited on.
//!
//! Jobs run one after another for now; continuous batching replaces the loop body with the
//! batched step (issue [5 of 11]) without changing this interface.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::engine::EngineError;
use crate::engine::generate::{EngineOptions, GenerateRequest, Generation, Prefix, TokenEvent};
use crate::engine::loader::LoadedModel;
use crate::prefix_cache::Prepared;

/// Token events buffered per job before the engine waits for the reader.
const EVENTS_PER_JOB: usize = 64;

pub enum JobEvent {
    Token(TokenEvent),
    /// The last event of a job. `queued` is how long it waited for the engine.
    Done {
        result: Result<Generation, EngineError>,
        queued: Duration,
    },
}

struct Job {
    request: GenerateRequest,
    prefix: Option<Prepared>,
    events: mpsc::Sender<JobEvent>,
    enqueued: Instant,
}

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the worker's queue is full ({0} requests waiting)")]
    Busy(usize),
    #[error("the engine has stopped")]
    Stopped,
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct Scheduler {
    jobs: SyncSender<Job>,
    pub counters: Arc<Counters>,
    pub capacity: usize,
}

impl Scheduler {
    /// Moves `model` onto its own thread and starts taking jobs.
    pub fn start(model: LoadedModel, options: EngineOptions, capacity: usize) -> Self {
        let (jobs, rx) = sync_channel::<Job>(capacity);
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                for job in rx {
                    c.queued.fetch_sub(1, Ordering::Relaxed);
                    run(&model, &options, job, &c);
                }
            })
            .ok();
        Self {
            jobs,
            counters,
            capacity,
        }
    }

    /// Queues a generation; its events arrive on the returned channel. Dropping the receiver
    /// cancels the job (before it starts, or at the next token).
    pub fn submit(
        &self,
        request: GenerateRequest,
        prefix: Option<Prepared>,
    ) -> Result<mpsc::Receiver<JobEvent>, SubmitError> {
        let (events, rx) = mpsc::channel(EVENTS_PER_JOB);
        let job = Job {
            request,
            prefix,
            events,
            enqueued: Instant::now(),
        };
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        match self.jobs.try_send(job) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.counters.queued.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    TrySendError::Full(_) => SubmitError::Busy(self.capacity),
                    TrySendError::Disconnected(_) => SubmitError::Stopped,
                })
            }
        }
    }
}

fn run(model: &LoadedModel, options: &EngineOptions, job: Job, c: &Counters) {
    let queued = job.enqueued.elapsed();
    if job.events.is_closed() {
        // The client left while the job waited.
        return;
    }
    c.requests.fetch_add(1, Ordering::Relaxed);
    c.running.fetch_add(1, Ordering::Relaxed);
    let (cached_blocks, mut sink) = match job.prefix {
        Some(p) => (p.cached, Some(p.sink)),
        None => (Vec::new(), None),
    };
    let cached: Vec<&[u8]> = cached_blocks.iter().map(|b| b.as_ref()).collect();
    let engine_prefix = Prefix {
        cached: &cached,
        on_block: sink
            .as_mut()
            .map(|s| &mut **s as &mut (dyn FnMut(usize, Vec<u8>) + Send)),
    };
    let result = model.generate_with_prefix(&job.request, options, engine_prefix, |event| {
        job.events
            .blocking_send(JobEvent::Token(event.clone()))
            .is_ok()
    });
    c.running.fetch_sub(1, Ordering::Relaxed);
    match &result {
        Ok(g) => {
            c.prompt_tokens
                .fetch_add(g.prompt_tokens as u64, Ordering::Relaxed);
            c.generated_tokens
                .fetch_add(g.tokens.len() as u64, Ordering::Relaxed);
        }
        Err(_) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    let _ = job.events.blocking_send(JobEvent::Done { result, queued });
}
