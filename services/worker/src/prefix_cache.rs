//! The worker's side of prefix caching: a prompt's full blocks get chain keys (namespace = the
//! model fingerprint); the leading ones are taken from L0 (this worker's recent blocks, an LRU
//! by bytes) and then from the cache service (its RAM, L1, or disk, L2) before the job is
//! queued; every block the prefill completes goes into L0 and, asynchronously, to the service. The cache
//! service being down or slow never fails a request: lookups and fetches have short deadlines,
//! and on any failure the prompt is simply computed. The gRPC channel reconnects by itself
//! when the service comes back.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use strata_kvcache::block::{BlockKey, make_block_of};
use strata_kvcache::client::CacheClient;

use strata_proto::kvcache::{Block, LookupRequest, Tier};
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

/// L0: blocks this worker computed or fetched recently, least recently used out first.
struct L0 {
    limit_bytes: u64,
    used_bytes: u64,
    tick: u64,
    entries: HashMap<BlockKey, (Bytes, u64)>,
    order: BTreeMap<u64, BlockKey>,
}

impl L0 {
    fn get(&mut self, key: &BlockKey) -> Option<Bytes> {
        self.tick += 1;
        let (bytes, tick) = self.entries.get_mut(key)?;
        self.order.remove(tick);
        *tick = self.tick;
        self.order.insert(self.tick, *key);
        Some(bytes.clone())
    }

    fn insert(&mut self, key: BlockKey, bytes: Bytes) {
        let size = bytes.len() as u64;
        if size > self.limit_bytes || self.entries.contains_key(&key) {
            return;
        }
        while self.used_bytes + size > self.limit_bytes {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            if let Some((b, _)) = self.entries.remove(&victim) {
                self.used_bytes -= b.len() as u64;
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.entries.insert(key, (bytes, self.tick));
        self.used_bytes += size;
    }
}

/// Cached blocks of one prompt by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tiers {
    pub l0: usize,
    pub l1: usize,
    pub l2: usize,
}

#[derive(Clone)]
pub struct PrefixCache {
    client: Option<CacheClient>,
    l0: Arc<Mutex<L0>>,
    namespace: Arc<str>,
    block_tokens: usize,
    layout: (u32, u32, u32, &'static str),
    store: mpsc::Sender<Block>,
    pub stats: Arc<PrefixStats>,
}

/// Receives each KV block a prefill completes: (block index in the prompt, bytes).
pub type BlockSinkFn = Box<dyn FnMut(usize, Vec<u8>) + Send>;

/// What a job takes to the engine: the cached blocks' payloads, and where to send new blocks.
pub struct Prepared {
    pub cached: Vec<Bytes>,
    /// Where each of `cached` came from, in blocks.
    pub tiers: Tiers,
    pub sink: BlockSinkFn,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn dtype_name(d: mlx_rs::Dtype) -> &'static str {
    match d {
        mlx_rs::Dtype::Float16 => "float16",
        mlx_rs::Dtype::Bfloat16 => "bfloat16",
        _ => "float32",
    }
}

impl PrefixCache {
    /// Must be called inside the tokio runtime (it starts the store task). Without a socket,
    /// only L0 is used.
    pub fn new(
        socket: Option<&Path>,
        l0_bytes: u64,
        namespace: &str,
        block_tokens: usize,
        layout: KvLayout,
    ) -> Self {
        let client = socket.map(|s| CacheClient::connect(s, Duration::from_secs(1)));
        let (store, rx) = mpsc::channel(STORE_QUEUE_BLOCKS);
        let stats = Arc::new(PrefixStats::default());
        if let Some(c) = &client {
            tokio::spawn(store_loop(c.clone(), rx, stats.clone()));
        }
        Self {
            client,
            l0: Arc::new(Mutex::new(L0 {
                limit_bytes: l0_bytes,
                used_bytes: 0,
                tick: 0,
                entries: HashMap::new(),
                order: BTreeMap::new(),
            })),
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

    /// The same cache seen by one tenant: the namespace gains a salt (hashed, so the salt
    /// itself is never stored), and no other tenant's blocks can match its keys.
    pub fn for_tenant(&self, salt: &str) -> Self {
        if salt.is_empty() {
            return self.clone();
        }
        let mut view = self.clone();
        let hash = blake3::hash(salt.as_bytes()).to_hex();
        view.namespace = format!("{}+{}", self.namespace, &hash[..16]).into();
        view
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
        let reusable = ((prompt.len().saturating_sub(1)) / self.block_tokens).min(keys.len());
        let mut cached = Vec::new();
        {
            let mut l0 = lock(&self.l0);
            for k in &keys[..reusable] {
                match l0.get(k) {
                    Some(b) => cached.push(b),
                    None => break,
                }
            }
        }
        let mut tiers = Tiers {
            l0: cached.len(),
            ..Tiers::default()
        };
        if cached.len() < reusable {
            let from = cached.len();
            let fetched = self.fetch(&keys[from..reusable]).await;
            let mut l0 = lock(&self.l0);
            for (i, (bytes, tier)) in fetched.into_iter().enumerate() {
                match tier {
                    Tier::Disk => tiers.l2 += 1,
                    _ => tiers.l1 += 1,
                }
                l0.insert(keys[from + i], bytes.clone());
                cached.push(bytes);
            }
        }
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
            lock(&this.l0).insert(keys[index], block.payload.clone());
            if this.client.is_none() {
                return;
            }
            if this.store.try_send(block).is_err() {
                this.stats
                    .blocks_store_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        });
        Prepared {
            cached,
            tiers,
            sink,
        }
    }

    /// Where each full block of `prompt` is now: "l0", "l1", "l2" or "none" (one lookup per
    /// block not in L0, so blocks past a gap are reported too).
    pub async fn probe(&self, prompt: &[u32]) -> Vec<&'static str> {
        let keys = self.keys(prompt);
        let in_l0: Vec<bool> = {
            let l0 = lock(&self.l0);
            keys.iter().map(|k| l0.entries.contains_key(k)).collect()
        };
        let mut out = Vec::with_capacity(keys.len());
        for (k, l0) in keys.iter().zip(in_l0) {
            if l0 {
                out.push("l0");
                continue;
            }
            let Some(client) = &self.client else {
                out.push("none");
                continue;
            };
            let mut req = tonic::Request::new(LookupRequest {
                namespace: self.namespace.to_string(),
                keys: vec![k.0.to_vec()],
                ..Default::default()
            });
            req.set_timeout(LOOKUP_DEADLINE);
            let tier = match client.clone().rpc().lookup(req).await {
                Ok(r) => r.into_inner().blocks.first().map(|b| b.tier),
                Err(_) => None,
            };
            out.push(match tier.and_then(|t| Tier::try_from(t).ok()) {
                Some(Tier::Ram) => "l1",
                Some(Tier::Disk) => "l2",
                _ => "none",
            });
        }
        out
    }

    /// The leading blocks of `keys` the cache service holds, with the tier each came from.
    async fn fetch(&self, keys: &[BlockKey]) -> Vec<(Bytes, Tier)> {
        let Some(client) = &self.client else {
            return Vec::new();
        };
        if keys.is_empty() {
            return Vec::new();
        }
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut client = client.clone();
        let mut req = tonic::Request::new(LookupRequest {
            namespace: self.namespace.to_string(),
            keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            ..Default::default()
        });
        req.set_timeout(LOOKUP_DEADLINE);
        let tiers: Vec<Tier> = match client.rpc().lookup(req).await {
            Ok(r) => r
                .into_inner()
                .blocks
                .iter()
                .map(|b| Tier::try_from(b.tier).unwrap_or(Tier::Ram))
                .collect(),
            Err(e) => {
                self.stats.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e.message(), "cache service lookup failed; computing the prompt");
                return Vec::new();
            }
        };
        let held = tiers.len();
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
                blocks
                    .into_iter()
                    .zip(tiers)
                    .map(|(b, t)| (b.payload, t))
                    .collect()
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
