//! The worker's side of prefix caching: a prompt's full blocks get chain keys (namespace = the
//! model fingerprint), the leading ones the cache service holds are fetched before the job is
//! queued, and every block the prefill completes is sent back asynchronously. The cache
//! service being down or slow never fails a request: lookups and fetches have short deadlines,
//! and on any failure the prompt is simply computed. The gRPC channel reconnects by itself
//! when the service comes back.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use strata_kvcache::block::{BlockKey, make_block_of};
use strata_kvcache::client::CacheClient;
use strata_proto::kvcache::{Block, LookupRequest};
use tokio::sync::mpsc;

use crate::engine::kv::KvLayout;

/// How long a lookup may take before the prompt is computed instead.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(1);
/// Blocks waiting to be stored; when full, new ones are dropped (decode never waits).
const STORE_QUEUE_BLOCKS: usize = 256;

#[derive(Default)]
pub struct PrefixStats {
    pub lookups: AtomicU64,
    pub lookup_failures: AtomicU64,
    pub blocks_fetched: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_store_dropped: AtomicU64,
    pub store_failures: AtomicU64,
}

#[derive(Clone)]
pub struct PrefixCache {
    client: CacheClient,
    namespace: Arc<str>,
    block_tokens: usize,
    layout: (u32, u32, u32, &'static str),
    store: mpsc::Sender<Block>,
    pub stats: Arc<PrefixStats>,
}

/// What a job takes to the engine: the cached blocks' payloads, and where to send new blocks.
pub struct Prepared {
    pub cached: Vec<Bytes>,
    pub sink: Box<dyn FnMut(usize, Vec<u8>) + Send>,
}

fn dtype_name(d: mlx_rs::Dtype) -> &'static str {
    match d {
        mlx_rs::Dtype::Float16 => "float16",
        mlx_rs::Dtype::Bfloat16 => "bfloat16",
        _ => "float32",
    }
}

impl PrefixCache {
    /// Must be called inside the tokio runtime (it starts the store task).
    pub fn new(socket: &Path, namespace: &str, block_tokens: usize, layout: KvLayout) -> Self {
        let client = CacheClient::connect(socket, Duration::from_secs(1));
        let (store, rx) = mpsc::channel(STORE_QUEUE_BLOCKS);
        let stats = Arc::new(PrefixStats::default());
        tokio::spawn(store_loop(client.clone(), rx, stats.clone()));
        Self {
            client,
            namespace: namespace.into(),
            block_tokens,
            layout: (
                layout.num_layers as u32,
                layout.kv_heads as u32,
                layout.head_dim as u32,
                dtype_name(layout.dtype),
            ),
            store,
            stats,
        }
    }

    /// Chain keys of the prompt's full blocks.
    pub fn keys(&self, prompt: &[u32]) -> Vec<BlockKey> {
        let mut parent: Option<BlockKey> = None;
        prompt
            .chunks_exact(self.block_tokens)
            .map(|tokens| {
                let k = BlockKey::chain(&self.namespace, parent.as_ref(), tokens);
                parent = Some(k);
                k
            })
            .collect()
    }

    /// Looks up and fetches the leading blocks of `prompt` that can be reused (at least one
    /// token is always left to compute, for the first token's logits), and prepares the sink
    /// for the blocks the prefill will complete.
    pub async fn prepare(&self, prompt: &[u32]) -> Prepared {
        let keys = self.keys(prompt);
        let reusable = (prompt.len().saturating_sub(1)) / self.block_tokens;
        let cached = self.fetch(&keys[..reusable.min(keys.len())]).await;
        let this = self.clone();
        let tokens = prompt.to_vec();
        let sink = Box::new(move |index: usize, bytes: Vec<u8>| {
            let b = this.block_tokens;
            let Some(ids) = tokens.get(index * b..(index + 1) * b) else {
                return;
            };
            let parent = index.checked_sub(1).and_then(|i| keys.get(i));
            let block = make_block_of(
                &this.namespace,
                parent,
                ids.to_vec(),
                b as u32,
                this.layout,
                bytes,
            );
            if this.store.try_send(block).is_err() {
                this.stats
                    .blocks_store_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        });
        Prepared { cached, sink }
    }

    async fn fetch(&self, keys: &[BlockKey]) -> Vec<Bytes> {
        if keys.is_empty() {
            return Vec::new();
        }
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut client = self.client.clone();
        let mut req = tonic::Request::new(LookupRequest {
            namespace: self.namespace.to_string(),
            keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            ..Default::default()
        });
        req.set_timeout(LOOKUP_DEADLINE);
        let held = match client.rpc().lookup(req).await {
            Ok(r) => r.into_inner().blocks.len(),
            Err(e) => {
                self.stats.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e.message(), "cache service lookup failed; computing the prompt");
                return Vec::new();
            }
        };
        if held == 0 {
            return Vec::new();
        }
        // Generous for big prefixes, bounded for a stuck service: 1 s plus 100 ms per block.
        let deadline = Duration::from_secs(1) + Duration::from_millis(100) * held as u32;
        match client
            .fetch_prefix(&self.namespace, &keys[..held], deadline)
            .await
        {
            Ok(blocks) => {
                self.stats
                    .blocks_fetched
                    .fetch_add(blocks.len() as u64, Ordering::Relaxed);
                tracing::debug!(
                    blocks = blocks.len(),
                    ms = started.elapsed().as_millis() as u64,
                    "prefix fetched"
                );
                blocks.into_iter().map(|b| b.payload).collect()
            }
            Err(e) => {
                self.stats.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "cache service fetch failed; computing the prompt");
                Vec::new()
            }
        }
    }
}

/// Sends stored blocks to the cache service, as many per Store call as are waiting.
async fn store_loop(
    mut client: CacheClient,
    mut rx: mpsc::Receiver<Block>,
    stats: Arc<PrefixStats>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 32 {
            match rx.try_recv() {
                Ok(b) => batch.push(b),
                Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let mut req = tonic::Request::new(tokio_stream::iter(batch));
        req.set_timeout(Duration::from_secs(30));
        match client.rpc().store(req).await {
            Ok(r) => {
                let r = r.into_inner();
                stats
                    .blocks_stored
                    .fetch_add(u64::from(r.accepted), Ordering::Relaxed);
                if r.refused > 0 {
                    tracing::warn!(refused = r.refused, why = ?r.refusals, "cache service refused blocks");
                }
            }
            Err(e) => {
                stats.store_failures.fetch_add(n, Ordering::Relaxed);
                tracing::warn!(error = %e.message(), blocks = n, "storing blocks failed; they stay uncached");
            }
        }
    }
}
