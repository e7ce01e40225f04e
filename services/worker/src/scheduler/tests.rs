//! The engine loop's rules, against a fake model: who is admitted and batched, who prefills
//! first, what a failure ends, what a departed or silent client costs the others.
//!
//! The fake reads its instructions from the prompt: token 0 names the sequence, token 1 says
//! how it misbehaves (`Script`). Prefill runs 4 tokens a chunk; every token a sequence
//! generates is `name * 1000 + its index`, so tests can tell whose tokens arrived.

use std::sync::Mutex;

use super::*;
use crate::engine::generate::{FinishReason, Timings};
use crate::engine::sample::Sampled;
use crate::engine::sequence::{BlockSink, ParkedKv, Resume, Stepped};

const CHUNK: usize = 4;

#[derive(Clone, Copy, PartialEq, Debug)]
enum Script {
    Plain = 0,
    /// Its own part of its third decode step fails (its sampling, say); the pass goes on.
    FailsAlone = 1,
    /// The whole decode pass fails when it feeds its third token (an MLX error).
    FailsThePass = 2,
    /// `start` refuses the request.
    Refused = 3,
    /// The engine thread panics in its first prefill chunk.
    Panics = 4,
}

impl Script {
    fn of(code: u32) -> Self {
        match code {
            1 => Self::FailsAlone,
            2 => Self::FailsThePass,
            3 => Self::Refused,
            4 => Self::Panics,
            _ => Self::Plain,
        }
    }
}

/// What the fake did, in order.
#[derive(Clone, PartialEq, Debug)]
enum Step {
    Start(u32),
    Prefill(u32),
    Decode(Vec<u32>),
}

#[derive(Default)]
struct Shared {
    log: Mutex<Vec<Step>>,
    /// While set, `start` waits: jobs pile up in the queue, so that a test decides what the
    /// loop finds when it next admits.
    hold: AtomicBool,
    /// `start` calls begun (the first one may be waiting on `hold`).
    starts: AtomicUsize,
    prefill_chunks: AtomicUsize,
}

struct Fake {
    shared: Arc<Shared>,
    /// Time each prefill chunk takes.
    chunk_time: Duration,
}

struct FakeSeq {
    name: u32,
    script: Script,
    prompt: usize,
    prefilled: usize,
    cached: usize,
    max_tokens: usize,
    tokens: Vec<u32>,
    pending: bool,
    finish: Option<FinishReason>,
}

impl FakeSeq {
    /// Takes the next token: streams it, then ends at the length limit or when the client
    /// has gone, or waits to be fed.
    fn take(&mut self, emit: &mut dyn FnMut(&TokenEvent) -> bool) {
        let token = self.name * 1000 + self.tokens.len() as u32;
        self.tokens.push(token);
        let event = TokenEvent {
            token,
            text: String::new(),
            sampled: Sampled {
                token,
                logprob: None,
                top: Vec::new(),
            },
        };
        self.pending = false;
        if !emit(&event) {
            self.finish = Some(FinishReason::Cancelled);
        } else if self.tokens.len() >= self.max_tokens {
            self.finish = Some(FinishReason::Length);
        } else {
            self.pending = true;
        }
    }
}

impl BatchSeq for FakeSeq {
    fn prefill_left(&self) -> usize {
        self.prompt - self.prefilled
    }
    fn wants_decode(&self) -> bool {
        self.finish.is_none() && self.pending
    }
    fn is_finished(&self) -> bool {
        self.finish.is_some()
    }
    fn cancel(&mut self) {
        self.finish.get_or_insert(FinishReason::Cancelled);
        self.pending = false;
    }
}

impl Fake {
    fn log(&self, step: Step) {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(step);
    }
}

impl BatchModel for Fake {
    type Seq = FakeSeq;

    fn start(
        &self,
        request: GenerateRequest,
        _options: &EngineOptions,
        cached: &[CachedKv<'_>],
        _resume: Option<Resume>,
    ) -> Result<FakeSeq, EngineError> {
        self.shared.starts.fetch_add(1, Ordering::SeqCst);
        while self.shared.hold.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let name = request.prompt[0];
        self.log(Step::Start(name));
        let script = Script::of(request.prompt[1]);
        if script == Script::Refused {
            return Err(EngineError::InvalidRequest("refused by the script".into()));
        }
        Ok(FakeSeq {
            name,
            script,
            prompt: request.prompt.len(),
            prefilled: 0,
            cached: cached.iter().map(|c| c.tokens).sum(),
            max_tokens: request.max_tokens,
            tokens: Vec::new(),
            pending: false,
            finish: None,
        })
    }

    fn prefill_chunk(
        &self,
        seq: &mut FakeSeq,
        _sink: BlockSink<'_>,
        emit: &mut dyn FnMut(&TokenEvent) -> bool,
    ) -> Result<bool, EngineError> {
        if seq.script == Script::Panics {
            panic!("a bug in the engine");
        }
        std::thread::sleep(self.chunk_time);
        self.log(Step::Prefill(seq.name));
        self.shared.prefill_chunks.fetch_add(1, Ordering::SeqCst);
        seq.prefilled += seq.prefill_left().min(CHUNK);
        if seq.needs_prefill() {
            return Ok(false);
        }
        seq.take(emit);
        Ok(true)
    }

    fn decode(
        &self,
        batch: &mut [&mut FakeSeq],
        emit: &mut dyn FnMut(usize, &TokenEvent) -> bool,
    ) -> Result<Stepped, EngineError> {
        let ready: Vec<usize> = (0..batch.len())
            .filter(|&i| batch[i].wants_decode())
            .collect();
        if ready.is_empty() {
            return Ok(Stepped::default());
        }
        self.log(Step::Decode(ready.iter().map(|&i| batch[i].name).collect()));
        let third = |s: &FakeSeq, script| s.script == script && s.tokens.len() == 2;
        if ready.iter().any(|&i| third(batch[i], Script::FailsThePass)) {
            return Err(EngineError::Mlx("the forward pass failed".into()));
        }
        let mut failed = Vec::new();
        for &i in &ready {
            if third(batch[i], Script::FailsAlone) {
                failed.push((i, EngineError::InvalidRequest("its sampling failed".into())));
            } else {
                batch[i].take(&mut |e| emit(i, e));
            }
        }
        Ok(Stepped {
            ran: ready.len(),
            failed,
        })
    }

    fn finish(
        &self,
        seq: FakeSeq,
        _sink: BlockSink<'_>,
    ) -> Result<(Generation, Option<ParkedKv>), EngineError> {
        let generation = Generation {
            prompt_tokens: seq.prompt,
            cached_tokens: seq.cached,
            finish: seq
                .finish
                .ok_or_else(|| EngineError::Config("taken before it finished".into()))?,
            tokens: seq.tokens,
            text: String::new(),
            timings: Timings::default(),
            logprobs: Vec::new(),
            notices: Vec::new(),
            speculation: None,
            pruned_tokens: 0,
        };
        Ok((generation, None))
    }
}

struct Harness {
    scheduler: Scheduler,
    shared: Arc<Shared>,
}

impl Harness {
    fn new(capacity: usize, max_batch: usize, chunk_time: Duration) -> Self {
        let shared = Arc::new(Shared::default());
        let fake = Fake {
            shared: shared.clone(),
            chunk_time,
        };
        let scheduler = Scheduler::start(fake, EngineOptions::default(), capacity, max_batch);
        Self { scheduler, shared }
    }

    /// A request named `name` of `prompt` tokens that generates `max_tokens`.
    fn submit(
        &self,
        name: u32,
        script: Script,
        prompt: usize,
        max_tokens: usize,
    ) -> mpsc::UnboundedReceiver<JobEvent> {
        self.try_submit(name, script, prompt, max_tokens)
            .unwrap_or_else(|e| panic!("job {name} not queued: {e}"))
    }

    fn try_submit(
        &self,
        name: u32,
        script: Script,
        prompt: usize,
        max_tokens: usize,
    ) -> Result<mpsc::UnboundedReceiver<JobEvent>, SubmitError> {
        assert!(prompt >= 2, "the fake reads its script from the prompt");
        let mut tokens = vec![0; prompt];
        tokens[0] = name;
        tokens[1] = script as u32;
        let request = GenerateRequest::greedy(tokens, max_tokens);
        self.scheduler.submit(request, None, tracing::Span::none())
    }

    fn hold(&self) {
        self.shared.hold.store(true, Ordering::SeqCst);
    }

    fn release(&self) {
        self.shared.hold.store(false, Ordering::SeqCst);
    }

    fn log(&self) -> Vec<Step> {
        self.shared
            .log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// Waits for `cond`; the deadline guards against a hang, it bounds no speed.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Reads a job to its end: its tokens and its result.
fn drain(
    rx: &mut mpsc::UnboundedReceiver<JobEvent>,
) -> (Vec<u32>, Result<Generation, EngineError>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut tokens = Vec::new();
    loop {
        match rx.try_recv() {
            Ok(JobEvent::Token(e)) => tokens.push(e.token),
            Ok(JobEvent::Done { result, .. }) => return (tokens, *result),
            Err(mpsc::error::TryRecvError::Empty) => {
                assert!(Instant::now() < deadline, "the job did not end");
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(mpsc::error::TryRecvError::Disconnected) => {
                panic!("the job ended without its last event")
            }
        }
    }
}

fn tokens_of(name: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| name * 1000 + i).collect()
}

/// Position in the log of the last step that involved `name`'s decoding.
fn last_decode(log: &[Step], name: u32) -> usize {
    log.iter()
        .rposition(|s| matches!(s, Step::Decode(names) if names.contains(&name)))
        .unwrap_or_else(|| panic!("{name} never decoded"))
}

#[test]
fn decoding_sequences_share_one_pass_up_to_the_batch_limit() {
    let h = Harness::new(8, 3, Duration::ZERO);
    h.hold();
    let mut rxs: Vec<_> = (1..=5).map(|n| h.submit(n, Script::Plain, 4, 5)).collect();
    h.release();
    for (n, rx) in (1..=5).zip(rxs.iter_mut()) {
        let (tokens, result) = drain(rx);
        assert_eq!(tokens, tokens_of(n, 5));
        let generation = result.unwrap();
        assert_eq!(generation.finish, FinishReason::Length);
        assert_eq!(generation.tokens, tokens);
    }
    let log = h.log();
    let widest = log
        .iter()
        .filter_map(|s| match s {
            Step::Decode(names) => Some(names.len()),
            _ => None,
        })
        .max();
    // The first three were admitted together and decoded together; no pass ran more.
    assert_eq!(widest, Some(3), "{log:?}");
    let batches = h.scheduler.counters.decode_batches.lock().unwrap().clone();
    assert!(batches.keys().all(|&k| k <= 3), "{batches:?}");
    assert_eq!(h.scheduler.counters.requests.load(Ordering::SeqCst), 5);
    assert_eq!(
        h.scheduler.counters.generated_tokens.load(Ordering::SeqCst),
        25
    );
}

#[test]
fn a_sequence_that_fails_alone_is_retired_and_its_slot_goes_to_the_next() {
    let h = Harness::new(8, 2, Duration::ZERO);
    h.hold();
    let mut a = h.submit(1, Script::FailsAlone, 4, 10);
    let mut b = h.submit(2, Script::Plain, 4, 10);
    let mut c = h.submit(3, Script::Plain, 4, 10);
    h.release();
    let (a_tokens, a_result) = drain(&mut a);
    assert_eq!(a_tokens, tokens_of(1, 2));
    assert!(matches!(a_result, Err(EngineError::InvalidRequest(_))));
    for (n, rx) in [(2, &mut b), (3, &mut c)] {
        let (tokens, result) = drain(rx);
        assert_eq!(tokens, tokens_of(n, 10));
        assert!(result.is_ok());
    }
    // The third job took the failed one's slot while the second was still decoding.
    let log = h.log();
    assert!(
        log.iter()
            .any(|s| matches!(s, Step::Decode(names) if names.contains(&2) && names.contains(&3))),
        "{log:?}"
    );
    let counters = &h.scheduler.counters;
    assert_eq!(counters.failed.load(Ordering::SeqCst), 1);
    wait_until("the batch is empty", || {
        counters.running.load(Ordering::SeqCst) == 0
    });
}

#[test]
fn a_failed_pass_fails_the_sequences_in_it_and_spares_one_still_prefilling() {
    let h = Harness::new(8, 2, Duration::ZERO);
    h.hold();
    let mut a = h.submit(1, Script::FailsThePass, 4, 10);
    let mut b = h.submit(2, Script::Plain, 40, 3);
    h.release();
    let (a_tokens, a_result) = drain(&mut a);
    assert_eq!(a_tokens, tokens_of(1, 2));
    assert!(matches!(a_result, Err(EngineError::Mlx(_))), "{a_result:?}");
    let (b_tokens, b_result) = drain(&mut b);
    assert_eq!(b_tokens, tokens_of(2, 3));
    assert!(b_result.is_ok());
    // The failed pass held only the decoding sequence.
    let log = h.log();
    let failed_pass = last_decode(&log, 1);
    assert_eq!(log[failed_pass], Step::Decode(vec![1]));
    assert!(log[failed_pass..].contains(&Step::Prefill(2)));
}

#[test]
fn a_short_request_is_not_held_behind_a_long_prompt() {
    let h = Harness::new(8, 2, Duration::ZERO);
    h.hold();
    let mut long = h.submit(1, Script::Plain, 40, 1);
    let mut short = h.submit(2, Script::Plain, 4, 3);
    h.release();
    assert_eq!(drain(&mut short).0, tokens_of(2, 3));
    assert_eq!(drain(&mut long).0, tokens_of(1, 1));
    let log = h.log();
    // The short prompt prefilled first, and its answer was done while the long prompt still
    // had chunks to run: one chunk of prefill per step, decode steps in between.
    let first_prefill = log.iter().position(|s| matches!(s, Step::Prefill(_)));
    assert_eq!(first_prefill.map(|i| &log[i]), Some(&Step::Prefill(2)));
    let last_long_chunk = log.iter().rposition(|s| *s == Step::Prefill(1));
    assert!(Some(last_decode(&log, 2)) < last_long_chunk, "{log:?}");
}

#[test]
fn a_job_whose_client_left_while_queued_is_never_started() {
    let h = Harness::new(8, 1, Duration::ZERO);
    h.hold();
    let mut a = h.submit(1, Script::Plain, 4, 3);
    let b = h.submit(2, Script::Plain, 4, 3);
    drop(b);
    h.release();
    assert!(drain(&mut a).1.is_ok());
    let counters = &h.scheduler.counters;
    wait_until("the queue is empty", || {
        counters.queued.load(Ordering::SeqCst) == 0
    });
    assert!(!h.log().contains(&Step::Start(2)));
    assert_eq!(counters.requests.load(Ordering::SeqCst), 1);
}

#[test]
fn a_client_that_leaves_during_its_prefill_stops_it_at_the_next_chunk() {
    let h = Harness::new(8, 2, Duration::from_millis(5));
    // 100 chunks of 5 ms.
    let a = h.submit(1, Script::Plain, 400, 3);
    let shared = h.shared.clone();
    wait_until("two chunks ran", || {
        shared.prefill_chunks.load(Ordering::SeqCst) >= 2
    });
    drop(a);
    let left_after = shared.prefill_chunks.load(Ordering::SeqCst);
    let counters = &h.scheduler.counters;
    wait_until("the job is cancelled", || {
        counters.cancelled.load(Ordering::SeqCst) == 1
    });
    // At most the chunk in flight when the client left.
    let ran = shared.prefill_chunks.load(Ordering::SeqCst);
    assert!(
        ran <= left_after + 1,
        "{ran} chunks ran, {left_after} before the client left"
    );
    // The gauge is refreshed by the loop's next turn after the cancellation (asserting it at
    // once failed under load: 1 instead of 0).
    wait_until("no job runs", || {
        counters.running.load(Ordering::SeqCst) == 0
    });
}

#[test]
fn a_client_that_reads_nothing_stalls_no_one() {
    let h = Harness::new(8, 2, Duration::ZERO);
    h.hold();
    let mut silent = h.submit(1, Script::Plain, 4, 500);
    let mut reader = h.submit(2, Script::Plain, 4, 5);
    h.release();
    let (tokens, result) = drain(&mut reader);
    assert_eq!(tokens, tokens_of(2, 5));
    assert!(result.is_ok());
    // Nothing of the silent client's answer was lost meanwhile.
    let (tokens, result) = drain(&mut silent);
    assert_eq!(tokens, tokens_of(1, 500));
    assert!(result.is_ok());
}

#[test]
fn a_full_queue_is_refused_at_once() {
    let h = Harness::new(1, 1, Duration::ZERO);
    h.hold();
    let mut a = h.submit(1, Script::Plain, 4, 2);
    let shared = h.shared.clone();
    // The engine holds the first job: the queue's one place is free.
    wait_until("the engine took the first job", || {
        shared.starts.load(Ordering::SeqCst) == 1
    });
    let mut b = h.submit(2, Script::Plain, 4, 2);
    let refused = h.try_submit(3, Script::Plain, 4, 2);
    assert!(matches!(refused, Err(SubmitError::Busy(1))));
    h.release();
    assert!(drain(&mut a).1.is_ok());
    assert!(drain(&mut b).1.is_ok());
}

#[test]
fn a_refused_request_gets_its_error_and_the_others_go_on() {
    let h = Harness::new(8, 2, Duration::ZERO);
    h.hold();
    let mut a = h.submit(1, Script::Refused, 4, 2);
    let mut b = h.submit(2, Script::Plain, 4, 2);
    h.release();
    let (tokens, result) = drain(&mut a);
    assert!(tokens.is_empty());
    assert!(matches!(result, Err(EngineError::InvalidRequest(_))));
    assert_eq!(drain(&mut b).0, tokens_of(2, 2));
    assert_eq!(h.scheduler.counters.failed.load(Ordering::SeqCst), 1);
}

#[test]
fn a_dead_engine_thread_is_reported_and_refuses_new_jobs() {
    let h = Harness::new(8, 2, Duration::ZERO);
    let mut a = h.submit(1, Script::Panics, 4, 2);
    wait_until("the engine thread is seen dead", || {
        !h.scheduler.is_running()
    });
    // The job's channel closes without a last event; the gateway reports it as an error.
    assert!(matches!(
        a.try_recv(),
        Err(mpsc::error::TryRecvError::Disconnected)
    ));
    let refused = h.try_submit(2, Script::Plain, 4, 2);
    assert!(matches!(refused, Err(SubmitError::Stopped)));
}

#[test]
fn the_alive_flag_falls_when_the_engine_thread_panics() {
    let engine_alive = Arc::new(AtomicBool::new(true));
    let flag = AliveFlag(engine_alive.clone());
    let joined = std::thread::spawn(move || {
        let _flag = flag;
        panic!("an engine bug");
    })
    .join();
    assert!(joined.is_err());
    assert!(!engine_alive.load(Ordering::SeqCst));
}
