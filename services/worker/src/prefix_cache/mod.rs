//! The worker's side of prefix caching: a prompt's full blocks get chain keys (namespace = the
//! model fingerprint); the leading ones are taken from L0 (this worker's recent blocks, an LRU
//! by bytes) and then from the cache service (its RAM, L1, or disk, L2) before the job is
//! queued; every block the prefill completes goes into L0 and, asynchronously, to the service. The cache
//! service being down or slow never fails a request: lookups and fetches have short deadlines,
//! and on any failure the prompt is simply computed. The gRPC channel reconnects by itself
//! when the service comes back.

mod cost;
mod finisher;
mod l0;
mod parking;
mod remote;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::bytes::Bytes;
use strata_kvblock::block::{BlockKey, Continuation, make_block_of, root_of, with_recurrent_state};
use strata_kvblock::client::CacheClient;
use strata_proto::kvcache::{Block, LookupRequest, Tier};
use tokio::sync::mpsc;

use crate::engine::kv::KvLayout;
use crate::engine::sequence::{FinishedBlock, Resume};
use crate::kv_quant::{self, KvQuant};
pub use cost::CostModel;
use finisher::Finisher;
use l0::L0;
pub use parking::{ParkFn, Parking};
use remote::{store_loop, tier_name};

/// How long a lookup may take before the prompt is computed instead.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(1);
/// The fewest tokens a prompt takes a parked cache for (see `prepare`).
const MIN_PARKED_RESUME: usize = 64;
/// Blocks waiting to be stored; when full, new ones are dropped (decode never waits).
const STORE_QUEUE_BLOCKS: usize = 256;

/// How much of a held prefix a hit reuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reuse {
    /// The longest common prefix at any token (the default): also the leading rows of a held
    /// block whose later tokens differ, full or partial. The tokens after the hit are computed
    /// in a chunk of another shape than a cold run's, so the result equals a cold run within
    /// floating-point rounding, not bit for bit.
    CommonPrefix,
    /// `cache.exact`: whole blocks, and partial (tail) blocks whose tokens all continue the
    /// prompt. With the engine's chunk ends fixed by position, a hit is bit-identical with a
    /// cold run that has the same boundaries.
    Exact,
    /// Hybrid models (recurrent layers): whole blocks and partial ones whose tokens all
    /// continue the prompt, as `Exact`, since a recurrent state resumes only where a snapshot
    /// of it was taken (every block end, and the end of each stored partial tail). A hit
    /// equals a cold run within rounding.
    AtSnapshots,
}

impl Reuse {
    fn continuation(self, block_tokens: usize) -> Continuation {
        match self {
            Reuse::CommonPrefix => Continuation::CommonPrefix,
            Reuse::Exact | Reuse::AtSnapshots => Continuation::WholePartial { block_tokens },
        }
    }

    pub fn describe(self) -> &'static str {
        match self {
            Reuse::CommonPrefix => {
                "reuse at token granularity (a hit equals a cold run within floating-point rounding)"
            }
            Reuse::Exact => "block-granular reuse (cache.exact: hits are bit-identical)",
            Reuse::AtSnapshots => {
                "reuse at stored block ends (a hybrid model's recurrent states resume only at \
                 their snapshots; token-granular reuse does not apply)"
            }
        }
    }
}

#[derive(Default)]
pub struct PrefixStats {
    pub lookups: AtomicU64,
    pub lookup_failures: AtomicU64,
    pub blocks_fetched: AtomicU64,
    pub partial_hits: AtomicU64,
    pub blocks_stored: AtomicU64,
    /// Blocks handed to the store task and not yet answered by the cache service.
    pub blocks_store_pending: AtomicU64,
    pub blocks_store_dropped: AtomicU64,
    pub store_failures: AtomicU64,
    /// Service hits not fetched because recomputing them was estimated to be faster.
    pub fetches_skipped_by_cost: AtomicU64,
    /// Hybrid models: snapshot bytes a hit did not read (see `Snapshots::LastOnly`).
    pub snapshot_bytes_skipped: AtomicU64,
}

/// Cached tokens of one prompt by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Tiers {
    pub l0: usize,
    pub l1: usize,
    pub l2: usize,
}

impl Tiers {
    pub fn total(&self) -> usize {
        self.l0 + self.l1 + self.l2
    }

    fn add(&mut self, tier: Tier, tokens: usize) {
        match tier {
            Tier::Disk => self.l2 += tokens,
            _ => self.l1 += tokens,
        }
    }
}

#[derive(Clone)]
pub struct PrefixCache {
    client: Option<CacheClient>,
    l0: Arc<Mutex<L0>>,
    namespace: Arc<str>,
    block_tokens: usize,
    layout: (u32, u32, u32, &'static str),
    /// The live KV dtype, which quantised blocks decode to.
    dtype: mlx_rs::Dtype,
    /// Blocks are stored quantised with this scheme (None: in the live dtype).
    quant: Option<KvQuant>,
    /// Hybrid models: (recurrent layers, floats of each one's state), whose snapshots end
    /// every block's payload.
    recurrent: Option<(u32, u64)>,
    /// Blocks to store, each with its key and the span of the request that computed it.
    store: mpsc::Sender<(BlockKey, Block, tracing::Span)>,
    /// Whole blocks handed to the store task and not yet answered by the cache service: a
    /// prompt that follows at once (a chat's next turn, a long prompt L0 cannot hold) finds
    /// them here instead of missing them while they travel.
    in_flight: InFlight,
    pub stats: Arc<PrefixStats>,
    cost: Arc<Mutex<CostModel>>,
    reuse: Reuse,
    /// Finished sequences' live KV caches, resumed before any block is fetched (see
    /// `parking`). None in `cache.exact` and for models whose caches cannot be cut back.
    parking: Option<Parking>,
    /// Finishes the blocks sequences hand over, off the engine thread; readers of `l0` and
    /// `in_flight` wait for it first.
    finisher: Finisher,
}

/// Payloads of blocks on their way to the cache service, by key.
pub(crate) type InFlight = Arc<Mutex<std::collections::HashMap<BlockKey, Bytes>>>;

/// Receives each KV block a sequence finishes.
pub type BlockSinkFn = Box<dyn FnMut(FinishedBlock) + Send>;

/// What a job takes to the engine: the cached KV (payload, the number of its leading rows
/// to use), whole blocks then maybe the leading rows of one more, and where to send new blocks.
pub struct Prepared {
    pub cached: Vec<(Bytes, usize)>,
    /// A parked cache to resume from instead (then `cached` is empty).
    pub resume: Option<Resume>,
    /// Where the sequence's cache goes when it ends.
    pub park: Option<ParkFn>,
    /// Where the cached tokens came from.
    pub tiers: Tiers,
    pub sink: BlockSinkFn,
    /// Why the cache service's blocks were not used, when it failed or was skipped (for the
    /// response: a fallback is never silent).
    pub notice: Option<String>,
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
    /// With `quant`, blocks are stored quantised, under a namespace that names the scheme.
    pub fn new(
        socket: Option<&Path>,
        l0_bytes: u64,
        namespace: &str,
        block_tokens: usize,
        layout: KvLayout,
        quant: Option<KvQuant>,
    ) -> Self {
        let namespace = match quant {
            Some(q) => format!("{namespace}~kv-{}", q.scheme()),
            None => namespace.to_string(),
        };
        let client = socket.map(|s| CacheClient::connect(s, Duration::from_secs(1)));
        let (store, rx) = mpsc::channel(STORE_QUEUE_BLOCKS);
        let stats = Arc::new(PrefixStats::default());
        let in_flight = InFlight::default();
        if let Some(c) = &client {
            tokio::spawn(store_loop(c.clone(), rx, stats.clone(), in_flight.clone()));
        }
        Self {
            client,
            l0: Arc::new(Mutex::new(L0::new(l0_bytes))),
            namespace: namespace.into(),
            block_tokens,
            dtype: layout.dtype,
            quant,
            recurrent: layout
                .recurrent
                .map(|r| (r.layers as u32, r.floats() as u64)),
            layout: (
                layout.num_layers as u32,
                layout.kv_heads as u32,
                layout.head_dim as u32,
                dtype_name(layout.dtype),
            ),
            store,
            in_flight,
            stats,
            cost: Arc::new(Mutex::new(CostModel::default())),
            reuse: Reuse::CommonPrefix,
            parking: None,
            finisher: Finisher::start(),
        }
    }

    /// The same cache, parking finished sequences' live KV caches in `parking`.
    pub fn with_parking(mut self, parking: Parking) -> Self {
        self.parking = Some(parking);
        self
    }

    /// A request for `prompt` found the worker's memory taken: parked caches give it back,
    /// but for the one the prompt would resume from. Returns whether any was released.
    pub fn make_room_for(&self, prompt: &[u32]) -> bool {
        let body = prompt.len().saturating_sub(1);
        self.parking
            .as_ref()
            .is_some_and(|p| p.make_room(&self.namespace, &prompt[..body]))
    }

    /// Waits until every block handed to the store task has been answered by the cache
    /// service, for at most `within`: at shutdown, so that the blocks of the last requests are
    /// not lost with the process. Returns how many were still pending.
    pub async fn drain_stores(&self, within: Duration) -> u64 {
        let deadline = tokio::time::Instant::now() + within;
        self.finisher.idle().await;
        loop {
            let pending = self.stats.blocks_store_pending.load(Ordering::Relaxed);
            if pending == 0 || tokio::time::Instant::now() >= deadline {
                return pending;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The same cache with another reuse rule (`Reuse::CommonPrefix` unless told).
    pub fn with_reuse(mut self, reuse: Reuse) -> Self {
        self.reuse = reuse;
        self
    }

    pub fn reuse(&self) -> Reuse {
        self.reuse
    }

    pub fn stats_message(&self) -> strata_proto::worker::PrefixCacheStats {
        self.finisher.idle_blocking();
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let cost = *lock(&self.cost);
        strata_proto::worker::PrefixCacheStats {
            lookups: get(&s.lookups),
            lookup_failures: get(&s.lookup_failures),
            blocks_fetched: get(&s.blocks_fetched),
            partial_hits: get(&s.partial_hits),
            blocks_stored: get(&s.blocks_stored),
            blocks_store_dropped: get(&s.blocks_store_dropped),
            store_failures: get(&s.store_failures),
            fetches_skipped_by_cost: get(&s.fetches_skipped_by_cost),
            snapshot_bytes_skipped: get(&s.snapshot_bytes_skipped),
            fetch_bytes_per_sec: cost.fetch_bytes_per_sec.unwrap_or(0.0),
            prefill_tokens_per_sec: cost.prefill_tokens_per_sec.unwrap_or(0.0),
            ..self.parking_stats()
        }
    }

    fn parking_stats(&self) -> strata_proto::worker::PrefixCacheStats {
        let Some(p) = &self.parking else {
            return Default::default();
        };
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let (caches, bytes) = p.held();
        strata_proto::worker::PrefixCacheStats {
            parked_caches: caches as u64,
            parked_bytes: bytes,
            parked_resumes: get(&p.stats.resumed),
            parked_resumed_tokens: get(&p.stats.resumed_tokens),
            parked_evicted: get(&p.stats.evicted),
            parked_refused: get(&p.stats.refused),
            ..Default::default()
        }
    }

    /// Feeds the cost model with a finished request's prefill: `tokens` computed in `took`.
    pub fn record_prefill(&self, tokens: usize, took: Duration) {
        // Short prefills are dominated by fixed costs and would understate the speed.
        if tokens >= 64 {
            lock(&self.cost).record_prefill(tokens, took);
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

    /// Looks up and fetches the KV that can be reused for `prompt`: its leading whole blocks,
    /// then the held block that continues them furthest (by the reuse rule: a partial block
    /// whose tokens all start the rest, or any block by common prefix, of which the leading
    /// rows are used), from L0 first, then from the cache service (one Lookup). The last
    /// prompt token is never covered (the engine computes it for the first token's logits).
    /// Also prepares the sink for the blocks the sequence will finish.
    pub async fn prepare(&self, prompt: &[u32]) -> Prepared {
        let b = self.block_tokens;
        let keys = self.keys(prompt);
        let body = prompt.len().saturating_sub(1);
        // Blocks still being finished are waited for, unless a parked cache will be resumed:
        // the blocks a request hands over come from a cache that is parked when it ends, and
        // on a GPU their read-back (~120 ms for 8K tokens on an H100) would otherwise delay a
        // prompt that resends the same prefix at once.
        let parked_covers = self.parking.as_ref().is_some_and(|p| {
            p.peek(&self.namespace, &prompt[..body]) >= MIN_PARKED_RESUME.min(body).max(1)
        });
        if !parked_covers {
            self.finisher.idle().await;
        }
        let reusable = (body / b).min(keys.len());
        let how = self.reuse.continuation(b);
        let mut cached = Vec::new();
        // Where each part of `cached` came from (None: L0), for the tiers of a parked cache
        // topped up from blocks.
        let mut origins: Vec<Option<Tier>> = Vec::new();
        let mut tiers = Tiers::default();
        let mut l0_next = None;
        {
            let mut l0 = lock(&self.l0);
            for k in &keys[..reusable] {
                // This process's memory: L0, or a block still on its way to the service.
                match l0.get(k).or_else(|| lock(&self.in_flight).get(k).cloned()) {
                    Some(bytes) => cached.push((bytes, b)),
                    None => break,
                }
            }
            let h = cached.len();
            if body > h * b {
                let parent = self.parent_of(&keys, h);
                l0_next = l0.find_child(&parent, &prompt[h * b..body], how);
            }
        }
        tiers.l0 = cached.len() * b;
        origins.resize(cached.len(), None);
        let in_l0 = cached.len();
        let l0_rows = l0_next.as_ref().map_or(0, |c| c.rows);
        // A parked cache holding at least half of what L0 gives is claimed now (a concurrent
        // request cannot take it while this one fetches); no block it covers is fetched, and
        // blocks that give more are appended to it. It must hold `MIN_PARKED_RESUME` tokens at
        // least (or the whole body): another conversation's cache is not cut down to the few
        // tokens of a chat template's start that every prompt shares.
        let mut resume = self.parking.as_ref().and_then(|p| {
            p.take(
                &self.namespace,
                &prompt[..body],
                ((in_l0 * b + l0_rows) / 2)
                    .max(MIN_PARKED_RESUME.min(body))
                    .max(1),
            )
        });
        let parked = resume.as_ref().map_or(0, |r| r.tokens);
        let remote = self
            .fetch(prompt, &keys[..reusable], in_l0, l0_rows, parked)
            .await;
        let notice = remote.notice.clone();
        let mut l0 = lock(&self.l0);
        for (i, (bytes, tier, with_snapshots)) in remote.blocks.into_iter().enumerate() {
            let at = in_l0 + i;
            tiers.add(tier, b);
            // L0 keeps whole blocks only: any of its blocks may end a later hit.
            if with_snapshots {
                let parent = self.parent_of(&keys, at);
                l0.insert(
                    parent,
                    prompt[at * b..(at + 1) * b].to_vec(),
                    keys[at],
                    bytes.clone(),
                );
            }
            cached.push((bytes, b));
            origins.push(Some(tier));
        }
        // The longer continuation of L0's and the service's (only one can continue the
        // blocks: L0's only if the service added none).
        let h = cached.len();
        match (remote.next, l0_next) {
            (Some(next), local)
                if h > in_l0 || local.as_ref().is_none_or(|c| next.rows > c.rows) =>
            {
                tiers.add(next.tier, next.rows);
                l0.insert(
                    self.parent_of(&keys, h),
                    next.tokens,
                    next.key,
                    next.bytes.clone(),
                );
                cached.push((next.bytes, next.rows));
                origins.push(Some(next.tier));
                self.stats.partial_hits.fetch_add(1, Ordering::Relaxed);
            }
            (_, Some(local)) if h == in_l0 => {
                tiers.l0 += local.rows;
                cached.push((local.bytes, local.rows));
                origins.push(None);
                self.stats.partial_hits.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        drop(l0);
        // The parked cache is resumed in place: cut back to the common prefix, and if the
        // blocks give more, their further rows are appended into its buffers (the engine's
        // `append_from_parts`). Importing the blocks whole would fill fresh buffers for the
        // whole prefix: on the 2-core VM, fresh pages for a 4K-token SmolLM2 prefix (189 MB)
        // took 340-380 ms to fault in and zero, where the same import into a new process
        // took 62 ms.
        let from_blocks: usize = cached.iter().map(|(_, t)| t).sum();
        if let (Some(p), Some(r)) = (&self.parking, resume.take()) {
            p.count_resume(r.tokens);
            resume = Some(r);
        }
        if let Some(r) = &resume {
            tracing::debug!(
                tokens = r.tokens,
                from_blocks,
                "resuming from a parked KV cache"
            );
            let mut resumed = Tiers {
                l0: r.tokens,
                ..Tiers::default()
            };
            if r.tokens >= from_blocks {
                cached.clear();
            } else {
                // Tokens past the parked ones count in the tier of the block they come from.
                let mut start = 0;
                for ((_, tokens), origin) in cached.iter().zip(&origins) {
                    let end = start + tokens;
                    let rows = end.saturating_sub(start.max(r.tokens));
                    match origin {
                        None => resumed.l0 += rows,
                        Some(tier) => resumed.add(*tier, rows),
                    }
                    start = end;
                }
            }
            tiers = resumed;
        }
        Prepared {
            cached: self.expand(cached),
            resume,
            park: self.parker(),
            tiers,
            sink: self.sink(prompt, keys),
            notice,
        }
    }

    /// Where a sequence of this namespace parks its cache when it ends.
    fn parker(&self) -> Option<ParkFn> {
        let parking = self.parking.clone()?;
        let namespace = self.namespace.clone();
        Some(Box::new(move |kv| parking.park(namespace, kv)))
    }

    /// Cached payloads as the engine imports them: quantised ones decoded to the live dtype.
    /// One that does not decode ends the hit there (the rest is computed).
    fn expand(&self, cached: Vec<(Bytes, usize)>) -> Vec<(Bytes, usize)> {
        let Some(q) = self.quant else {
            return cached;
        };
        let _span = tracing::info_span!("kv.dequantize", blocks = cached.len()).entered();
        let mut out = Vec::with_capacity(cached.len());
        for (bytes, tokens) in cached {
            match kv_quant::decode(q, self.dtype, &bytes) {
                Ok(v) => out.push((Bytes::from(v), tokens)),
                Err(e) => {
                    tracing::warn!(error = %e, "cached block does not decode; computing from there");
                    break;
                }
            }
        }
        out
    }

    /// The key a block at `index` hangs under (the namespace's root for the first).
    fn parent_of(&self, keys: &[BlockKey], index: usize) -> BlockKey {
        match index.checked_sub(1).and_then(|i| keys.get(i)) {
            Some(k) => *k,
            None => root_of(&self.namespace),
        }
    }

    /// Where a sequence's finished blocks go: L0 as soon as the finisher thread has them (every
    /// reader waits for it), the cache service asynchronously (dropped, and counted, if the
    /// store queue is full: decode never waits). The chain of keys grows with blocks of
    /// generated tokens.
    fn sink(&self, prompt: &[u32], mut chain: Vec<BlockKey>) -> BlockSinkFn {
        let this = self.clone();
        let prompt_len = prompt.len();
        let request_span = tracing::Span::current();
        Box::new(move |block: FinishedBlock| {
            let b = this.block_tokens;
            if block.index > chain.len() || block.tokens.is_empty() || block.tokens.len() > b {
                return;
            }
            let parent = block.index.checked_sub(1).map(|i| chain[i]);
            let key = BlockKey::chain(&this.namespace, parent.as_ref(), &block.tokens);
            let partial = block.tokens.len() < b;
            if !partial && block.index == chain.len() {
                chain.push(key);
            }
            if !partial && chain[block.index] != key {
                // Not this prompt's block: never store it under another key.
                return;
            }
            // The rest (checksum, quantising, L0, the store queue) is the finisher's: the
            // engine goes on at once (see `finisher`).
            let cache = this.clone();
            let request_span = request_span.clone();
            this.finisher.submit(move || {
                let this = cache;
                // On CUDA this is where the block leaves the device.
                let bytes = match block.bytes.into_vec() {
                    Ok(b) => b,
                    Err(e) => {
                        tracing::warn!(error = %e, "block not cached: reading it back failed");
                        return;
                    }
                };
                let payload = match this.quant {
                    None => bytes,
                    Some(q) => match kv_quant::encode(q, this.dtype, &bytes) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::warn!(error = %e, "block not cached: quantising it failed");
                            return;
                        }
                    },
                };
                let mut made = make_block_of(
                    &this.namespace,
                    parent.as_ref(),
                    block.tokens.clone(),
                    b as u32,
                    this.layout,
                    payload,
                );
                if let (Some(q), Some(h)) = (this.quant, made.header.as_mut()) {
                    h.kv_quant = q.scheme().to_string();
                }
                if let Some((layers, floats)) = this.recurrent {
                    made = with_recurrent_state(made, layers, floats);
                }
                let under = parent.unwrap_or_else(|| root_of(&this.namespace));
                lock(&this.l0).insert(under, block.tokens, key, made.payload.clone());
                tracing::trace!(index = block.index, partial, prompt_len, "block finished");
                if this.client.is_none() {
                    return;
                }
                this.stats
                    .blocks_store_pending
                    .fetch_add(1, Ordering::Relaxed);
                if !partial {
                    lock(&this.in_flight).insert(key, made.payload.clone());
                }
                if this
                    .store
                    .try_send((key, made, request_span.clone()))
                    .is_err()
                {
                    if !partial {
                        lock(&this.in_flight).remove(&key);
                    }
                    this.stats
                        .blocks_store_pending
                        .fetch_sub(1, Ordering::Relaxed);
                    this.stats
                        .blocks_store_dropped
                        .fetch_add(1, Ordering::Relaxed);
                }
            });
        })
    }

    /// Drops every block of L0 (shared by all tenant views) and every parked cache; returns
    /// how many blocks went.
    pub fn clear_l0(&self) -> u64 {
        self.finisher.idle_blocking();
        if let Some(p) = &self.parking {
            p.clear();
        }
        lock(&self.l0).clear()
    }

    /// Where each full block of `prompt` is now: "l0", "l1", "l2" or "none" (one lookup per
    /// block not in L0, so blocks past a gap are reported too); and the block a request would
    /// continue from after the body's full blocks (tier, tokens), if all of them are cached.
    pub async fn probe(
        &self,
        prompt: &[u32],
    ) -> (Vec<&'static str>, Option<(&'static str, usize)>) {
        self.finisher.idle().await;
        let b = self.block_tokens;
        let keys = self.keys(prompt);
        let body = prompt.len().saturating_sub(1);
        let h = (body / b).min(keys.len());
        let (in_l0, l0_next) = {
            let mut l0 = lock(&self.l0);
            let held: Vec<bool> = keys.iter().map(|k| l0.contains(k)).collect();
            let parent = self.parent_of(&keys, h);
            let next = if body > h * b {
                l0.find_child(&parent, &prompt[h * b..body], self.reuse.continuation(b))
                    .map(|c| c.rows)
            } else {
                None
            };
            (held, next)
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
            out.push(tier_name(tier));
        }
        let mut next = l0_next.map(|n| ("l0", n));
        let all_held = out[..h].iter().all(|t| *t != "none");
        if let (Some(client), true) = (&self.client, all_held && body > h * b) {
            let mut req = tonic::Request::new(self.lookup_request(&keys[..h], &prompt[..body]));
            req.set_timeout(LOOKUP_DEADLINE);
            if let Ok(r) = client.clone().rpc().lookup(req).await {
                let r = r.into_inner();
                let n = r.partial_tokens as usize;
                if r.blocks.len() == h && n > next.map_or(0, |(_, m)| m) {
                    next = Some((tier_name(r.partial.map(|p| p.tier)), n));
                }
            }
        }
        (out, next.filter(|_| all_held))
    }

    /// A Lookup of the chain `keys` and the prompt's body, by this cache's reuse rule.
    fn lookup_request(&self, keys: &[BlockKey], body: &[u32]) -> LookupRequest {
        LookupRequest {
            namespace: self.namespace.to_string(),
            keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            prompt_tokens: body.to_vec(),
            block_tokens: self.block_tokens as u32,
            common_prefix: self.reuse == Reuse::CommonPrefix,
        }
    }

    /// Bytes a block holds per token, as stored (what a fetch moves).
    fn bytes_per_token(&self) -> u64 {
        let (layers, heads, dim, dtype) = self.layout;
        let values = 2 * u64::from(layers) * u64::from(heads) * u64::from(dim);
        match (self.quant, dtype) {
            (Some(q), _) => q.encoded_len(values as usize) as u64,
            (None, "float32") => values * 4,
            (None, _) => values * 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Quantised blocks live under their own namespace (never a full-precision hit, nor one of
    /// another scheme) and come back decoded to the live dtype, close to what was stored.
    #[tokio::test]
    async fn quantised_blocks_are_isolated_and_decode_to_the_live_dtype() {
        let layout = KvLayout {
            num_layers: 2,
            kv_heads: 1,
            head_dim: 64,
            dtype: mlx_rs::Dtype::Float32,
            window: None,
            recurrent: None,
        };
        let cache = |q| PrefixCache::new(None, 1 << 20, "model", 4, layout, q);
        let (plain, q8, q4) = (
            cache(None),
            cache(Some(KvQuant::Q8)),
            cache(Some(KvQuant::Q4)),
        );
        let prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let keys = [plain.keys(&prompt), q8.keys(&prompt), q4.keys(&prompt)];
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != keys[2]);

        let values: Vec<f32> = (0..layout.bytes_per_token() / 4 * 4)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let mut sink = q8.prepare(&prompt).await.sink;
        sink(FinishedBlock {
            index: 0,
            tokens: prompt[..4].to_vec(),
            bytes: bytes.clone().into(),
        });
        q8.finisher.idle().await;
        let stored = lock(&q8.l0).used_bytes() as usize;
        assert_eq!(stored, KvQuant::Q8.encoded_len(values.len()));
        assert!(stored * 3 < bytes.len());
        let hit = q8.prepare(&prompt).await;
        assert_eq!(hit.cached.len(), 1);
        let back = &hit.cached[0].0;
        assert_eq!(back.len(), bytes.len());
        for (a, b) in values.iter().zip(back.chunks_exact(4)) {
            let b = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            assert!((a - b).abs() < 2.0 / 255.0, "{a} vs {b}");
        }
        // The full-precision cache of the same model does not see it.
        assert!(plain.prepare(&prompt).await.cached.is_empty());
    }
}
