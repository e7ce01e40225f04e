//! The engine thread and its queue. MLX state lives on one thread; request handlers hand it
//! jobs through a bounded queue and read token events back from a channel per job. A full
//! queue is refused at once (the gateway answers 429 with Retry-After), never waited on.
//!
//! Continuous batching: sequences join and leave the running batch between steps. Each step
//! runs one prefill chunk (of the sequence with the least prompt left, so a short request is
//! not stuck behind a long prompt) and then one decode step for every sequence that has a
//! token to feed, in a single forward pass. A long prefill is thus interleaved with the
//! tokens of running streams instead of stalling them.
//!
//! The engine thread never waits on a client: each job's events go into an unbounded channel
//! (at most `max_tokens` events, so bounded by the request), and a client that stops reading
//! holds only its own events. A client that leaves is noticed between prefill chunks and at
//! every token. A failure belongs to the sequences it happened to: a forward pass that fails
//! fails the sequences in it, a sampling error fails its own sequence, and each is retired at
//! once (its reservation with it) while the others go on.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError, sync_channel};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::engine::EngineError;
use crate::engine::generate::{EngineOptions, GenerateRequest, Generation, TokenEvent};
use crate::engine::sequence::{CachedKv, FinishedBlock};
use crate::prefix_cache::{BlockSinkFn, ParkFn, Prepared};

mod model;
#[cfg(test)]
mod tests;

pub use model::{BatchModel, BatchSeq};

pub enum JobEvent {
    Token(TokenEvent),
    /// The last event of a job. `queued` is how long it waited for the engine.
    Done {
        /// Boxed: a generation is large beside a token event.
        result: Box<Result<Generation, EngineError>>,
        queued: Duration,
    },
}

struct Job {
    request: GenerateRequest,
    prefix: Option<Prepared>,
    events: mpsc::UnboundedSender<JobEvent>,
    enqueued: Instant,
    /// The request's span, and its child that lasts while the job waits for the engine.
    span: tracing::Span,
    queue_span: tracing::Span,
}

#[derive(Default)]
pub struct Counters {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    /// Jobs whose client left after they started (queued ones are dropped uncounted).
    pub cancelled: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    /// How many sequences each decode forward pass ran together: counts by batch size.
    pub decode_batches: std::sync::Mutex<std::collections::BTreeMap<u32, u64>>,
    /// Speculative decoding so far: tokens drafted and accepted.
    pub drafted: AtomicU64,
    pub accepted: AtomicU64,
    /// Prompt tokens SpecPrefill left out, and requests it pruned.
    pub pruned_tokens: AtomicU64,
    pub pruned_requests: AtomicU64,
    /// The load-time warm-up (`Scheduler::start_after`): milliseconds it took once done
    /// (0 before), and whether it failed.
    pub warmup_ms: AtomicU64,
    pub warmup_failed: AtomicBool,
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
    engine: Arc<EngineThread>,
    pub counters: Arc<Counters>,
    pub capacity: usize,
    pub max_batch: usize,
    /// False once the engine thread has ended (it returns only when every handle is gone, so
    /// while handles exist this means it panicked or never started).
    engine_alive: Arc<AtomicBool>,
}

/// The engine thread's queue and its join handle, shared by every handle. The last handle to
/// go closes the queue and waits for the thread to end: MLX's arrays are freed on that thread,
/// and a process that exits while it still runs frees them under MLX's static destructors
/// (seen as heap corruption at the end of a test binary).
struct EngineThread {
    jobs: Option<SyncSender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for EngineThread {
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(thread) = self.thread.take() {
            // A handle dropped on the engine thread itself cannot wait for it.
            if thread.thread().id() != std::thread::current().id() {
                // A panic there was already reported by the panic hook; only the wait matters.
                let _ = thread.join();
            }
        }
    }
}

/// Clears `engine_alive` when the engine thread ends, by return or by panic.
struct AliveFlag(Arc<AtomicBool>);

impl Drop for AliveFlag {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

impl Scheduler {
    /// Moves `model` onto its own thread and starts taking jobs.
    pub fn start<M: BatchModel>(
        model: M,
        options: EngineOptions,
        capacity: usize,
        max_batch: usize,
    ) -> Self {
        Self::start_after(model, options, capacity, max_batch, |_, _| {})
    }

    /// As `start`, running `first` on the engine thread before the first job (the load-time
    /// warm-up): jobs submitted meanwhile wait in the queue.
    pub fn start_after<M: BatchModel>(
        model: M,
        options: EngineOptions,
        capacity: usize,
        max_batch: usize,
        first: impl FnOnce(&M, &Counters) + Send + 'static,
    ) -> Self {
        let (jobs, rx) = sync_channel::<Job>(capacity);
        let counters = Arc::new(Counters::default());
        let c = counters.clone();
        let engine_alive = Arc::new(AtomicBool::new(true));
        let flag = AliveFlag(engine_alive.clone());
        let spawned = std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || {
                let _flag = flag;
                first(&model, &c);
                run(&model, &options, rx, max_batch.max(1), &c)
            });
        let thread = match spawned {
            Ok(thread) => Some(thread),
            Err(e) => {
                tracing::error!(error = %e, "the engine thread could not start");
                engine_alive.store(false, Ordering::SeqCst);
                None
            }
        };
        Self {
            engine: Arc::new(EngineThread {
                jobs: Some(jobs),
                thread,
            }),
            counters,
            capacity,
            max_batch,
            engine_alive,
        }
    }

    /// Whether the engine thread is alive (Health reports a dead one, so that the
    /// supervisor restarts the worker).
    pub fn is_running(&self) -> bool {
        self.engine_alive.load(Ordering::SeqCst)
    }

    /// Queues a generation; its events arrive on the returned channel. Dropping the receiver
    /// cancels the job (before it starts, or at the next token).
    pub fn submit(
        &self,
        request: GenerateRequest,
        prefix: Option<Prepared>,
        span: tracing::Span,
    ) -> Result<mpsc::UnboundedReceiver<JobEvent>, SubmitError> {
        if !self.is_running() {
            return Err(SubmitError::Stopped);
        }
        let (events, rx) = mpsc::unbounded_channel();
        let job = Job {
            request,
            prefix,
            events,
            enqueued: Instant::now(),
            queue_span: tracing::info_span!(parent: &span, "queue"),
            span,
        };
        let Some(jobs) = self.engine.jobs.as_ref() else {
            return Err(SubmitError::Stopped);
        };
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        match jobs.try_send(job) {
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

/// A sequence in the running batch, with where its events and finished blocks go.
struct Active<S> {
    seq: S,
    events: mpsc::UnboundedSender<JobEvent>,
    sink: Option<BlockSinkFn>,
    /// Where its KV cache goes when it ends (see `prefix_cache::Parking`).
    park: Option<ParkFn>,
    queued: Duration,
    failed: Option<EngineError>,
    /// The request's span; prefill (entered for each chunk) and decode (from the first token
    /// to the end) are its children.
    span: tracing::Span,
    prefill_span: Option<tracing::Span>,
    decode_span: Option<tracing::Span>,
}

fn run<M: BatchModel>(
    model: &M,
    options: &EngineOptions,
    rx: std::sync::mpsc::Receiver<Job>,
    max_batch: usize,
    c: &Counters,
) {
    let mut active: Vec<Active<M::Seq>> = Vec::new();
    loop {
        // Admit: wait when idle, otherwise take what is waiting, up to the batch limit.
        if active.is_empty() {
            match rx.recv() {
                Ok(job) => admit(model, options, job, c, &mut active),
                Err(_) => return,
            }
        }
        while active.len() < max_batch {
            match rx.try_recv() {
                Ok(job) => admit(model, options, job, c, &mut active),
                Err(_) => break,
            }
        }
        c.running.store(active.len(), Ordering::Relaxed);

        // A client that left ends its sequence here, before another chunk is computed for it.
        for a in active.iter_mut() {
            if a.events.is_closed() && !a.seq.is_finished() {
                a.seq.cancel();
            }
        }

        // One prefill chunk: the sequence with the least prompt left goes first.
        if let Some(a) = active
            .iter_mut()
            .filter(|a| a.failed.is_none() && !a.seq.is_finished() && a.seq.needs_prefill())
            .min_by_key(|a| a.seq.prefill_left())
        {
            let prefill_span = a
                .prefill_span
                .get_or_insert_with(|| {
                    tracing::info_span!(parent: &a.span, "prefill", tokens = a.seq.prefill_left())
                })
                .clone();
            let entered = prefill_span.enter();
            let sink = a
                .sink
                .as_mut()
                .map(|f| &mut **f as &mut (dyn FnMut(FinishedBlock) + Send));
            let events = a.events.clone();
            let mut emit = |e: &TokenEvent| events.send(JobEvent::Token(e.clone())).is_ok();
            let stepped = model.prefill_chunk(&mut a.seq, sink, &mut emit);
            drop(entered);
            match stepped {
                Ok(true) => {
                    a.prefill_span = None;
                    a.decode_span = Some(tracing::info_span!(parent: &a.span, "decode"));
                }
                Ok(false) => {}
                Err(e) => a.failed = Some(e),
            }
        }

        // One decode step for everyone with a token to feed (batch index -> its events).
        let in_step: Vec<usize> = (0..active.len())
            .filter(|&i| active[i].failed.is_none() && active[i].seq.wants_decode())
            .collect();
        let senders: Vec<mpsc::UnboundedSender<JobEvent>> =
            in_step.iter().map(|&i| active[i].events.clone()).collect();
        let mut batch: Vec<&mut M::Seq> = active
            .iter_mut()
            .enumerate()
            .filter(|(i, _)| in_step.contains(i))
            .map(|(_, a)| &mut a.seq)
            .collect();
        let stepped = model.decode(&mut batch, &mut |i, e| {
            senders[i].send(JobEvent::Token(e.clone())).is_ok()
        });
        drop(batch);
        match stepped {
            Ok(stepped) => {
                if stepped.ran > 0 {
                    let mut h = c.decode_batches.lock().unwrap_or_else(|p| p.into_inner());
                    *h.entry(stepped.ran as u32).or_default() += 1;
                }
                for (i, e) in stepped.failed {
                    tracing::warn!(error = %e, "a sequence failed in a decode step; the others go on");
                    active[in_step[i]].failed = Some(e);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "decode step failed; failing its sequences");
                for &i in &in_step {
                    active[i].failed = Some(EngineError::Mlx(e.to_string()));
                }
            }
        }

        // Retire the finished and the failed.
        let mut i = 0;
        while i < active.len() {
            if active[i].failed.is_some() || active[i].seq.is_finished() {
                let a = active.swap_remove(i);
                retire(model, a, c);
            } else {
                i += 1;
            }
        }
        // Before the loop may block on an empty queue: an idle engine reports none running.
        c.running.store(active.len(), Ordering::Relaxed);
    }
}

/// Starts a job's sequence (validation, cached blocks), or answers it with its error.
fn admit<M: BatchModel>(
    model: &M,
    options: &EngineOptions,
    job: Job,
    c: &Counters,
    active: &mut Vec<Active<M::Seq>>,
) {
    c.queued.fetch_sub(1, Ordering::Relaxed);
    let queued = job.enqueued.elapsed();
    if job.events.is_closed() {
        // The client left while the job waited.
        return;
    }
    c.requests.fetch_add(1, Ordering::Relaxed);
    let (cached_blocks, sink, resume, park) = match job.prefix {
        Some(p) => (p.cached, Some(p.sink), p.resume, p.park),
        None => (Vec::new(), None, None, None),
    };
    drop(job.queue_span);
    let cached: Vec<CachedKv<'_>> = cached_blocks
        .iter()
        .map(|(bytes, tokens)| CachedKv {
            bytes: bytes.as_ref(),
            tokens: *tokens,
        })
        .collect();
    let cached_tokens: usize =
        cached.iter().map(|c| c.tokens).sum::<usize>() + resume.as_ref().map_or(0, |r| r.tokens);
    let started = {
        // Validation and the import of cached KV into the sequence's buffers.
        let span = tracing::info_span!(parent: &job.span, "kv.import", tokens = cached_tokens);
        let _entered = span.enter();
        model.start(job.request, options, &cached, resume)
    };
    match started {
        Ok(seq) => active.push(Active {
            seq,
            events: job.events,
            sink,
            park,
            queued,
            failed: None,
            span: job.span,
            prefill_span: None,
            decode_span: None,
        }),
        Err(e) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
            let _ = job.events.send(JobEvent::Done {
                result: Box::new(Err(e)),
                queued,
            });
        }
    }
}

/// Sends a sequence's last event and counts it.
fn retire<M: BatchModel>(model: &M, mut a: Active<M::Seq>, c: &Counters) {
    let result = match a.failed {
        Some(e) => Err(e),
        None => {
            let sink = a
                .sink
                .as_mut()
                .map(|f| &mut **f as &mut (dyn FnMut(FinishedBlock) + Send));
            model.finish(a.seq, sink).map(|(g, parked)| {
                if let (Some(park), Some(kv)) = (a.park.take(), parked) {
                    park(kv);
                }
                g
            })
        }
    };
    match &result {
        Ok(g) => {
            if g.finish == crate::engine::generate::FinishReason::Cancelled {
                c.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            if let Some(s) = &g.speculation {
                c.drafted.fetch_add(s.drafted as u64, Ordering::Relaxed);
                c.accepted.fetch_add(s.accepted as u64, Ordering::Relaxed);
            }
            if g.pruned_tokens > 0 {
                c.pruned_tokens
                    .fetch_add(g.pruned_tokens as u64, Ordering::Relaxed);
                c.pruned_requests.fetch_add(1, Ordering::Relaxed);
            }
            let p = g.timings.phases;
            if p.passes > 0 {
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                tracing::info!(
                    prompt_tokens = g.prompt_tokens,
                    cached_tokens = g.cached_tokens,
                    prefill_ms = ms(g.timings.prefill),
                    import_ms = ms(p.import),
                    passes = p.passes,
                    compute_ms = ms(p.compute),
                    export_ms = ms(p.export),
                    store_ms = ms(p.store),
                    blocks = p.blocks,
                    grown_mb = p.grown_bytes as f64 / 1e6,
                    "prefill phases"
                );
            }
            c.prompt_tokens
                .fetch_add(g.prompt_tokens as u64, Ordering::Relaxed);
            c.generated_tokens
                .fetch_add(g.tokens.len() as u64, Ordering::Relaxed);
        }
        Err(_) => {
            c.failed.fetch_add(1, Ordering::Relaxed);
        }
    }
    let _ = a.events.send(JobEvent::Done {
        result: Box::new(result),
        queued: a.queued,
    });
}
