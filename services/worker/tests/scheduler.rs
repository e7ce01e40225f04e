//! The engine thread's discipline, on the real SmolLM2: a client that stops reading stalls no
//! one, and a client that leaves during its prefill stops it there.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::generate::{EngineOptions, FinishReason, GenerateRequest};
use strata_worker::engine::loader;
use strata_worker::scheduler::{JobEvent, Scheduler};
use tokio::sync::mpsc::UnboundedReceiver;

fn scheduler() -> Scheduler {
    let model = loader::open(&common::smollm2_gguf(), DtypePolicy::F32, 256).unwrap();
    Scheduler::start(model, EngineOptions::default(), 8, 8)
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    let mut req = GenerateRequest::greedy(prompt, max_tokens);
    req.ignore_eos = true;
    req
}

/// Reads a job to its end: (tokens streamed, finish reason). A guard against a hang, not a
/// speed bound: either job alone takes seconds.
async fn drain(rx: &mut UnboundedReceiver<JobEvent>) -> (usize, FinishReason) {
    let read = async {
        let mut tokens = 0;
        while let Some(event) = rx.recv().await {
            match event {
                JobEvent::Token(_) => tokens += 1,
                JobEvent::Done { result, .. } => return (tokens, result.unwrap().finish),
            }
        }
        panic!("the job ended without its last event");
    };
    tokio::time::timeout(Duration::from_secs(300), read)
        .await
        .expect("the engine stalled")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_stalls_no_other_request() {
    let s = scheduler();
    // More tokens than a bounded per-job channel would have buffered (it held 64).
    let (n, m) = (96, 80);
    let mut idle = s
        .submit(request(vec![1, 2, 3, 4], n), None, tracing::Span::none())
        .unwrap();
    let mut reader = s
        .submit(request(vec![5, 6, 7, 8], m), None, tracing::Span::none())
        .unwrap();
    assert_eq!(drain(&mut reader).await, (m, FinishReason::Length));
    // The one that was not read kept all its events.
    assert_eq!(drain(&mut idle).await, (n, FinishReason::Length));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_leaves_during_its_prefill_stops_it_before_its_first_token() {
    let s = scheduler();
    // 2000 prompt tokens: 8 chunks of 256, seconds of work on a CPU.
    let long: Vec<u32> = (0..2000).map(|i| 100 + (i % 5000)).collect();
    let gone = s
        .submit(request(long, 50), None, tracing::Span::none())
        .unwrap();
    // Admitted at once (the engine is idle), then left while its chunks are computed.
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(gone);
    let mut next = s
        .submit(request(vec![5, 6, 7, 8], 8), None, tracing::Span::none())
        .unwrap();
    assert_eq!(drain(&mut next).await, (8, FinishReason::Length));
    let c = &s.counters;
    assert_eq!(c.cancelled.load(Ordering::Relaxed), 1);
    // Only the second job's tokens were generated: the first never reached its first token.
    assert_eq!(c.generated_tokens.load(Ordering::Relaxed), 8);
    assert_eq!(c.failed.load(Ordering::Relaxed), 0);
    assert!(s.is_running());
}
