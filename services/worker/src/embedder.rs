//! Serving an embedding model: tokenization with the model's own tokenizer, and one engine
//! thread that batches what is waiting. Inputs of the requests waiting together are sorted by
//! length and cut into batches of at most `MAX_BATCH`, so padding stays small; each request
//! gets its vectors back in its own order.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TrySendError};

use tokio::sync::oneshot;

use crate::engine::bert::BertEncoder;
use crate::engine::{EngineError, Result};

/// Inputs computed together in one forward pass.
pub const MAX_BATCH: usize = 32;

/// Padded tokens in one forward pass. Inputs are sorted by length and a pass stops growing
/// when its next (longest yet) input would pad it past this, so long inputs do not make many
/// short ones pad to their length. It matters on CPU: MLX's x86 build evaluates exp (softmax,
/// erf) one element at a time, so padding costs as much as real tokens. Measured on 2 cores,
/// 32 inputs of 3-239 tokens: 8.1 s as one pass, 1.3 s in passes of at most 2048 tokens.
pub const MAX_BATCH_TOKENS: usize = 2048;

/// One input: its token ids, special tokens included.
pub type TokenIds = Vec<u32>;

struct Job {
    inputs: Vec<TokenIds>,
    reply: oneshot::Sender<Result<Vec<Vec<f32>>>>,
}

#[derive(Default)]
pub struct EmbedCounters {
    pub requests: AtomicU64,
    pub failed: AtomicU64,
    pub inputs: AtomicU64,
    pub tokens: AtomicU64,
    /// Forward passes by how many inputs ran together in them.
    pub batches: std::sync::Mutex<std::collections::BTreeMap<u32, u64>>,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the embedding queue is full ({0} requests waiting); retry later")]
    Full(usize),
    #[error("the embedding engine has stopped")]
    Stopped,
}

/// A cheap handle to the engine thread.
#[derive(Clone)]
pub struct Embedder {
    tx: SyncSender<Job>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    pub counters: Arc<EmbedCounters>,
    pub dimensions: usize,
    pub max_tokens: usize,
    pub queue_capacity: usize,
    /// Token ids must be below this.
    pub vocab_size: usize,
    cls_sep: Option<(u32, u32)>,
    thread: Arc<std::sync::Mutex<Option<std::thread::JoinHandle<()>>>>,
}

impl Embedder {
    /// Stops the engine thread and waits for it, when this is the last handle. A process that
    /// exits while the thread is still freeing MLX arrays races MLX's own teardown, so tests
    /// call this before they return; a serving worker exits with the thread idle in `recv`.
    pub fn shutdown(self) {
        let Self { tx, thread, .. } = self;
        drop(tx);
        if let Ok(handle) = Arc::try_unwrap(thread) {
            let handle = handle.into_inner().unwrap_or_else(|p| p.into_inner());
            if let Some(h) = handle {
                let _ = h.join();
            }
        }
    }

    /// Loads the encoder and its tokenizer from `dir` and starts the engine thread.
    pub fn start(dir: &Path, queue: usize) -> Result<Self> {
        let encoder = BertEncoder::load(dir)?;
        let mut tokenizer = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json"))
            .map_err(|e| EngineError::Load(format!("tokenizer.json: {e}")))?;
        // The file's own padding and truncation are for another use (sentence-transformers
        // overrides them too): we pad per batch, and refuse over-long inputs.
        tokenizer.with_padding(None);
        tokenizer
            .with_truncation(None)
            .map_err(|e| EngineError::Load(format!("tokenizer.json: {e}")))?;
        let cls_sep = tokenizer
            .token_to_id("[CLS]")
            .zip(tokenizer.token_to_id("[SEP]"));
        let dimensions = encoder.dimensions();
        let vocab_size = encoder.vocab_size();
        let max_tokens = encoder.max_tokens;
        let counters = Arc::new(EmbedCounters::default());
        let (tx, rx) = mpsc::sync_channel::<Job>(queue.max(1));
        let c = counters.clone();
        let thread = std::thread::Builder::new()
            .name("embed-engine".into())
            .spawn(move || run(encoder, rx, c))
            .map_err(|e| EngineError::Config(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            tx,
            tokenizer: Arc::new(tokenizer),
            counters,
            dimensions,
            max_tokens,
            queue_capacity: queue.max(1),
            vocab_size,
            cls_sep,
            thread: Arc::new(std::sync::Mutex::new(Some(thread))),
        })
    }

    /// Token ids of a text, with the model's special tokens.
    pub fn tokenize(&self, text: &str) -> Result<TokenIds> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EngineError::InvalidRequest(format!("cannot tokenize: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Token ids given by a client, framed by [CLS] .. [SEP] as a text would be.
    pub fn frame(&self, ids: &[u32]) -> TokenIds {
        match self.cls_sep {
            Some((cls, sep)) => std::iter::once(cls)
                .chain(ids.iter().copied())
                .chain(std::iter::once(sep))
                .collect(),
            None => ids.to_vec(),
        }
    }

    /// Queues the inputs; the receiver yields one vector per input, in order.
    pub fn submit(
        &self,
        inputs: Vec<TokenIds>,
    ) -> Result<oneshot::Receiver<Result<Vec<Vec<f32>>>>, SubmitError> {
        let (reply, rx) = oneshot::channel();
        match self.tx.try_send(Job { inputs, reply }) {
            Ok(()) => Ok(rx),
            Err(TrySendError::Full(_)) => Err(SubmitError::Full(self.queue_capacity)),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::Stopped),
        }
    }
}

/// Cuts `sorted` (shortest first) into passes of at most `MAX_BATCH` inputs and
/// `MAX_BATCH_TOKENS` padded tokens (a longer input still gets a pass of its own).
fn passes<T>(sorted: &[T], len: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut out = Vec::new();
    let mut start = 0;
    for end in 1..=sorted.len() {
        let count = end - start;
        let padded = count * len(&sorted[end - 1]);
        if count > 1 && (count > MAX_BATCH || padded > MAX_BATCH_TOKENS) {
            out.push(&sorted[start..end - 1]);
            start = end - 1;
        }
    }
    if start < sorted.len() {
        out.push(&sorted[start..]);
    }
    out
}

/// The engine thread: takes every job waiting, computes their inputs in length-sorted
/// batches, answers each job.
fn run(encoder: BertEncoder, rx: mpsc::Receiver<Job>, c: Arc<EmbedCounters>) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while let Ok(job) = rx.try_recv() {
            jobs.push(job);
        }
        // (job, input) of every input, shortest first.
        let mut order: Vec<(usize, usize)> = jobs
            .iter()
            .enumerate()
            .flat_map(|(j, job)| (0..job.inputs.len()).map(move |i| (j, i)))
            .collect();
        order.sort_by_key(|&(j, i)| jobs[j].inputs[i].len());
        let mut results: Vec<Vec<Option<Vec<f32>>>> =
            jobs.iter().map(|j| vec![None; j.inputs.len()]).collect();
        // (invalid input?, why) of a job whose batch failed.
        let mut failed: Vec<Option<(bool, String)>> = vec![None; jobs.len()];
        for batch in passes(&order, |&(j, i)| jobs[j].inputs[i].len()) {
            let inputs: Vec<TokenIds> = batch
                .iter()
                .map(|&(j, i)| jobs[j].inputs[i].clone())
                .collect();
            match encoder.embed(&inputs) {
                Ok(vectors) => {
                    if let Ok(mut h) = c.batches.lock() {
                        *h.entry(batch.len() as u32).or_default() += 1;
                    }
                    for (&(j, i), v) in batch.iter().zip(vectors) {
                        results[j][i] = Some(v);
                    }
                }
                Err(e) => {
                    let invalid = matches!(e, EngineError::InvalidRequest(_));
                    for &(j, _) in batch {
                        failed[j] = Some((invalid, e.to_string()));
                    }
                }
            }
        }
        for ((job, vectors), failure) in jobs.into_iter().zip(results).zip(failed) {
            c.requests.fetch_add(1, Ordering::Relaxed);
            let answer = match failure {
                Some((invalid, why)) => {
                    c.failed.fetch_add(1, Ordering::Relaxed);
                    Err(if invalid {
                        EngineError::InvalidRequest(why)
                    } else {
                        EngineError::Mlx(why)
                    })
                }
                None => {
                    c.inputs
                        .fetch_add(job.inputs.len() as u64, Ordering::Relaxed);
                    c.tokens.fetch_add(
                        job.inputs.iter().map(|i| i.len() as u64).sum(),
                        Ordering::Relaxed,
                    );
                    Ok(vectors.into_iter().flatten().collect())
                }
            };
            // The client may have gone; nothing to do then.
            let _ = job.reply.send(answer);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_respect_the_input_and_token_limits() {
        let lens: Vec<usize> = vec![3; 40];
        let p = passes(&lens, |&l| l);
        assert_eq!(p.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![32, 8]);
        // 27 short inputs, then 5 of 239 tokens: the long ones pass together (5 x 239 < 2048).
        let mut lens = vec![20; 27];
        lens.extend([239; 5]);
        let p = passes(&lens, |&l| l);
        assert_eq!(p.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![27, 5]);
        // An input longer than the token budget still gets its pass.
        let p = passes(&[10, 5000], |&l| l);
        assert_eq!(p.iter().map(|p| p.len()).collect::<Vec<_>>(), vec![1, 1]);
        assert!(passes(&Vec::<usize>::new(), |&l| l).is_empty());
    }
}
