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
use strata_kvcache::block::{BlockKey, make_block_of, root_of};
use strata_kvcache::client::CacheClient;

use strata_proto::kvcache::{Block, LookupRequest, Tier};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::engine::kv::KvLayout;
use crate::engine::sequence::FinishedBlock;
use crate::kv_quant::{self, KvQuant};

/// How long a lookup may take before the prompt is computed instead.
const LOOKUP_DEADLINE: Duration = Duration::from_secs(1);
/// Blocks waiting to be stored; when full, new ones are dropped (decode never waits).
const STORE_QUEUE_BLOCKS: usize = 256;

#[derive(Default)]
pub struct PrefixStats {
    pub lookups: AtomicU64,
    pub lookup_failures: AtomicU64,
    pub blocks_fetched: AtomicU64,
    pub partial_hits: AtomicU64,
    pub blocks_stored: AtomicU64,
    pub blocks_store_dropped: AtomicU64,
    pub store_failures: AtomicU64,
    /// Service hits not fetched because recomputing them was estimated to be faster.
    pub fetches_skipped_by_cost: AtomicU64,
}

/// Fetch or recompute: a hit in the cache service is fetched only if moving its bytes is
/// expected to take less time than computing its tokens, from what this worker measured
/// (fetch bandwidth of its own fetches, lookup included, and prefill speed of its own
/// requests). With nothing measured yet, hits are fetched. On a CPU, computing a block takes
/// seconds and fetching it milliseconds; the rule matters on fast accelerators, where a few
/// small blocks can be cheaper to recompute than to ask for.
#[derive(Debug, Default, Clone, Copy)]
pub struct CostModel {
    fetch_bytes_per_sec: Option<f64>,
    prefill_tokens_per_sec: Option<f64>,
}

impl CostModel {
    /// Weight of a new measurement in the running averages.
    const ALPHA: f64 = 0.3;

    fn blend(old: Option<f64>, new: f64) -> Option<f64> {
        Some(match old {
            Some(o) => o * (1.0 - Self::ALPHA) + new * Self::ALPHA,
            None => new,
        })
    }

    pub fn record_fetch(&mut self, bytes: u64, took: Duration) {
        let secs = took.as_secs_f64();
        if bytes > 0 && secs > 0.0 {
            self.fetch_bytes_per_sec = Self::blend(self.fetch_bytes_per_sec, bytes as f64 / secs);
        }
    }

    pub fn record_prefill(&mut self, tokens: usize, took: Duration) {
        let secs = took.as_secs_f64();
        if tokens > 0 && secs > 0.0 {
            self.prefill_tokens_per_sec =
                Self::blend(self.prefill_tokens_per_sec, tokens as f64 / secs);
        }
    }

    /// Whether fetching `bytes` beats computing `tokens`.
    pub fn worth_fetching(&self, tokens: usize, bytes: u64) -> bool {
        match (self.fetch_bytes_per_sec, self.prefill_tokens_per_sec) {
            (Some(bw), Some(tps)) => bytes as f64 / bw < tokens as f64 / tps,
            _ => true,
        }
    }
}

/// L0: blocks this worker computed or fetched recently, least recently used out first.
struct L0 {
    limit_bytes: u64,
    used_bytes: u64,
    tick: u64,
    entries: HashMap<BlockKey, (Bytes, u64)>,
    order: BTreeMap<u64, BlockKey>,
    /// Partial blocks by parent: (token ids, key). Entries whose block was evicted are
    /// skipped and pruned on lookup.
    partials: HashMap<BlockKey, Vec<(Vec<u32>, BlockKey)>>,
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

    fn insert_partial(&mut self, parent: BlockKey, tokens: Vec<u32>, key: BlockKey, bytes: Bytes) {
        self.insert(key, bytes);
        if !self.entries.contains_key(&key) {
            return;
        }
        let list = self.partials.entry(parent).or_default();
        if !list.iter().any(|(_, k)| *k == key) {
            list.push((tokens, key));
        }
    }

    /// The longest held partial block under `parent` whose tokens start `tail`.
    fn find_partial(
        &mut self,
        parent: &BlockKey,
        tail: &[u32],
    ) -> Option<(Bytes, usize, BlockKey)> {
        let list = self.partials.get_mut(parent)?;
        list.retain(|(_, k)| self.entries.contains_key(k));
        let (tokens, key) = list
            .iter()
            .filter(|(t, _)| tail.starts_with(t))
            .max_by_key(|(t, _)| t.len())?
            .clone();
        let bytes = self.get(&key)?;
        Some((bytes, tokens.len(), key))
    }
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
    /// Blocks to store, each with the span of the request that computed it.
    store: mpsc::Sender<(Block, tracing::Span)>,
    pub stats: Arc<PrefixStats>,
    cost: Arc<Mutex<CostModel>>,
}

/// Receives each KV block a sequence finishes.
pub type BlockSinkFn = Box<dyn FnMut(FinishedBlock) + Send>;

/// What a job takes to the engine: the cached KV (payload, tokens), whole blocks then maybe
/// a partial one, and where to send new blocks.
pub struct Prepared {
    pub cached: Vec<(Bytes, usize)>,
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
                partials: HashMap::new(),
            })),
            namespace: namespace.into(),
            block_tokens,
            dtype: layout.dtype,
            quant,
            layout: (
                layout.num_layers as u32,
                layout.kv_heads as u32,
                layout.head_dim as u32,
                dtype_name(layout.dtype),
            ),
            store,
            stats,
            cost: Arc::new(Mutex::new(CostModel::default())),
        }
    }

    pub fn stats_message(&self) -> strata_proto::worker::PrefixCacheStats {
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
            fetch_bytes_per_sec: cost.fetch_bytes_per_sec.unwrap_or(0.0),
            prefill_tokens_per_sec: cost.prefill_tokens_per_sec.unwrap_or(0.0),
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

    /// Looks up and fetches the KV that can be reused for `prompt`: its leading whole blocks
    /// and then the longest partial block that continues them, from L0 first, then from the
    /// cache service (one Lookup). The last prompt token is never covered (the engine computes
    /// it for the first token's logits). Also prepares the sink for the blocks the sequence
    /// will finish.
    pub async fn prepare(&self, prompt: &[u32]) -> Prepared {
        let b = self.block_tokens;
        let keys = self.keys(prompt);
        let body = prompt.len().saturating_sub(1);
        let reusable = (body / b).min(keys.len());
        let mut cached = Vec::new();
        let mut tiers = Tiers::default();
        let mut l0_partial = None;
        {
            let mut l0 = lock(&self.l0);
            for k in &keys[..reusable] {
                match l0.get(k) {
                    Some(bytes) => cached.push((bytes, b)),
                    None => break,
                }
            }
            let h = cached.len();
            if body > h * b {
                let parent = self.parent_of(&keys, h);
                l0_partial = l0.find_partial(&parent, &prompt[h * b..body]);
            }
        }
        tiers.l0 = cached.len() * b;
        let in_l0 = cached.len();
        let l0_partial_tokens = l0_partial.as_ref().map_or(0, |(_, n, _)| *n);
        let remote = self
            .fetch(prompt, &keys[..reusable], in_l0, l0_partial_tokens)
            .await;
        let notice = remote.notice.clone();
        let mut l0 = lock(&self.l0);
        for (i, (bytes, tier)) in remote.blocks.into_iter().enumerate() {
            tiers.add(tier, b);
            l0.insert(keys[in_l0 + i], bytes.clone());
            cached.push((bytes, b));
        }
        // The longer partial of L0's and the service's (only one can continue the blocks).
        let h = cached.len();
        match (remote.partial, l0_partial) {
            (Some((bytes, n, key, tier)), local)
                if h > in_l0 || local.as_ref().is_none_or(|(_, m, _)| n > *m) =>
            {
                tiers.add(tier, n);
                let parent = self.parent_of(&keys, h);
                l0.insert_partial(
                    parent,
                    prompt[h * b..h * b + n].to_vec(),
                    key,
                    bytes.clone(),
                );
                cached.push((bytes, n));
                self.stats.partial_hits.fetch_add(1, Ordering::Relaxed);
            }
            (_, Some((bytes, n, _))) if h == in_l0 => {
                tiers.l0 += n;
                cached.push((bytes, n));
                self.stats.partial_hits.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        drop(l0);
        Prepared {
            cached: self.expand(cached),
            tiers,
            sink: self.sink(prompt, keys),
            notice,
        }
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

    /// Where a sequence's finished blocks go: L0 at once, the cache service asynchronously
    /// (dropped, and counted, if the store queue is full: decode never waits). The chain of
    /// keys grows with blocks of generated tokens in the opt-in mode.
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
            let payload = match this.quant {
                None => block.bytes,
                Some(q) => match kv_quant::encode(q, this.dtype, &block.bytes) {
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
            {
                let mut l0 = lock(&this.l0);
                if partial {
                    let parent = parent.unwrap_or_else(|| root_of(&this.namespace));
                    l0.insert_partial(parent, block.tokens, key, made.payload.clone());
                } else {
                    l0.insert(key, made.payload.clone());
                }
            }
            tracing::trace!(index = block.index, partial, prompt_len, "block finished");
            if this.client.is_none() {
                return;
            }
            if this.store.try_send((made, request_span.clone())).is_err() {
                this.stats
                    .blocks_store_dropped
                    .fetch_add(1, Ordering::Relaxed);
            }
        })
    }

    /// Where each full block of `prompt` is now: "l0", "l1", "l2" or "none" (one lookup per
    /// block not in L0, so blocks past a gap are reported too); and the partial block a
    /// request would resume from after the body's full blocks, if all of them are cached.
    pub async fn probe(
        &self,
        prompt: &[u32],
    ) -> (Vec<&'static str>, Option<(&'static str, usize)>) {
        let b = self.block_tokens;
        let keys = self.keys(prompt);
        let body = prompt.len().saturating_sub(1);
        let h = (body / b).min(keys.len());
        let (in_l0, l0_partial) = {
            let mut l0 = lock(&self.l0);
            let held: Vec<bool> = keys.iter().map(|k| l0.entries.contains_key(k)).collect();
            let parent = self.parent_of(&keys, h);
            let partial = if body > h * b {
                l0.find_partial(&parent, &prompt[h * b..body])
                    .map(|(_, n, _)| n)
            } else {
                None
            };
            (held, partial)
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
        let mut partial = l0_partial.map(|n| ("l0", n));
        let all_held = out[..h].iter().all(|t| *t != "none");
        if let (Some(client), true) = (&self.client, all_held && body > h * b) {
            let mut req = tonic::Request::new(LookupRequest {
                namespace: self.namespace.to_string(),
                keys: keys[..h].iter().map(|k| k.0.to_vec()).collect(),
                prompt_tokens: prompt[..body].to_vec(),
                block_tokens: b as u32,
            });
            req.set_timeout(LOOKUP_DEADLINE);
            if let Ok(r) = client.clone().rpc().lookup(req).await {
                let r = r.into_inner();
                let n = r.partial_tokens as usize;
                if r.blocks.len() == h && n > partial.map_or(0, |(_, m)| m) {
                    partial = Some((tier_name(r.partial.map(|p| p.tier)), n));
                }
            }
        }
        (out, partial.filter(|_| all_held))
    }

    /// What the cache service adds to the `have` leading blocks of `keys` found in L0: the
    /// next held blocks, then maybe a partial block continuing them, each with its tier. One
    /// Lookup over the whole chain (so the service can match a partial under the last block),
    /// then one streamed Fetch of what is missing, unless the cost model says recomputing it
    /// is faster.
    async fn fetch(
        &self,
        prompt: &[u32],
        keys: &[BlockKey],
        have: usize,
        have_partial: usize,
    ) -> Remote {
        let mut out = Remote::default();
        let Some(client) = &self.client else {
            return out;
        };
        let b = self.block_tokens;
        let body = prompt.len().saturating_sub(1);
        // Everything reusable is in L0 already.
        if keys.len() == have && body == have * b + have_partial {
            return out;
        }
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut client = client.clone();
        let mut req = tonic::Request::new(LookupRequest {
            namespace: self.namespace.to_string(),
            keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            prompt_tokens: prompt[..body].to_vec(),
            block_tokens: b as u32,
        });
        req.set_timeout(LOOKUP_DEADLINE);
        let lookup_span = tracing::info_span!(
            "cache.lookup",
            keys = keys.len(),
            in_l0 = have,
            held = tracing::field::Empty,
            partial_tokens = tracing::field::Empty,
        );
        let found = match async {
            strata_runtime::logging::inject(&mut req);
            client.rpc().lookup(req).await
        }
        .instrument(lookup_span.clone())
        .await
        {
            Ok(r) => r.into_inner(),
            Err(e) => {
                self.stats.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e.message(), "cache service lookup failed; computing the prompt");
                out.notice = Some(format!(
                    "the cache service did not answer the lookup ({}): its blocks were not used and the prompt was computed",
                    e.message()
                ));
                return out;
            }
        };
        let held = found.blocks.len();
        lookup_span.record("held", held);
        lookup_span.record("partial_tokens", found.partial_tokens);
        if held < have {
            // The service holds less than L0: nothing to add.
            return out;
        }
        let mut wanted: Vec<BlockKey> = keys[have..held].to_vec();
        let mut tiers: Vec<Tier> = found.blocks[have..]
            .iter()
            .map(|l| Tier::try_from(l.tier).unwrap_or(Tier::Ram))
            .collect();
        let partial_tokens = found.partial_tokens as usize;
        // A partial block is worth fetching if it continues blocks the service adds, or is
        // longer than the one L0 has.
        let partial_useful = held > have || partial_tokens > have_partial;
        let partial = found
            .partial
            .as_ref()
            .and_then(|p| BlockKey::from_slice(&p.key).map(|k| (k, p.tier)))
            .filter(|_| partial_useful)
            .filter(|(key, _)| {
                // Only a partial block of exactly these tokens under this parent.
                let start = held * b;
                partial_tokens > 0
                    && partial_tokens < b
                    && start + partial_tokens <= body
                    && *key
                        == BlockKey::chain(
                            &self.namespace,
                            held.checked_sub(1).map(|i| &keys[i]),
                            &prompt[start..start + partial_tokens],
                        )
            });
        if let Some((key, tier)) = partial {
            wanted.push(key);
            tiers.push(Tier::try_from(tier).unwrap_or(Tier::Ram));
        }
        if wanted.is_empty() {
            return out;
        }
        let tokens = (held - have) * b + partial.map_or(0, |_| partial_tokens);
        let bytes = tokens as u64 * self.bytes_per_token();
        if !lock(&self.cost).worth_fetching(tokens, bytes) {
            self.stats
                .fetches_skipped_by_cost
                .fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                tokens,
                bytes,
                "cached blocks not fetched: recomputing them is estimated to be faster"
            );
            out.notice = Some(format!(
                "{tokens} cached tokens were not fetched from the cache service: recomputing them was estimated to be faster"
            ));
            return out;
        }
        // Generous for big prefixes, bounded for a stuck service: 1 s plus 100 ms per block.
        let deadline = Duration::from_secs(1) + Duration::from_millis(100) * wanted.len() as u32;
        let fetch_span = tracing::info_span!(
            "cache.fetch",
            blocks = wanted.len(),
            tokens,
            bytes,
            tier = tier_label(&tiers),
        );
        let blocks = match client
            .fetch_prefix(&self.namespace, &wanted, deadline)
            .instrument(fetch_span)
            .await
        {
            Ok(blocks) => blocks,
            Err(e) => {
                self.stats.lookup_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "cache service fetch failed; computing the prompt");
                out.notice = Some(format!(
                    "fetching {tokens} cached tokens from the cache service failed ({e}): the prompt was computed"
                ));
                return out;
            }
        };
        let took = started.elapsed();
        let fetched_bytes: u64 = blocks.iter().map(|b| b.payload.len() as u64).sum();
        lock(&self.cost).record_fetch(fetched_bytes, took);
        self.stats
            .blocks_fetched
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        tracing::debug!(
            blocks = blocks.len(),
            ms = took.as_millis() as u64,
            "prefix fetched"
        );
        let whole = held - have;
        for (i, (block, tier)) in blocks.into_iter().zip(tiers).enumerate() {
            if i < whole {
                out.blocks.push((block.payload, tier));
            } else if let Some((key, _)) = partial {
                out.partial = Some((block.payload, partial_tokens, key, tier));
            }
        }
        out
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

/// The tiers a fetch reads from, for its span: "l1", "l2" or "l1+l2".
fn tier_label(tiers: &[Tier]) -> &'static str {
    let ram = tiers.iter().any(|t| *t != Tier::Disk);
    let disk = tiers.contains(&Tier::Disk);
    match (ram, disk) {
        (true, true) => "l1+l2",
        (false, true) => "l2",
        _ => "l1",
    }
}

fn tier_name(tier: Option<i32>) -> &'static str {
    match tier.and_then(|t| Tier::try_from(t).ok()) {
        Some(Tier::Ram) => "l1",
        Some(Tier::Disk) => "l2",
        _ => "none",
    }
}

/// What the cache service had for a prompt beyond L0.
#[derive(Default)]
struct Remote {
    blocks: Vec<(Bytes, Tier)>,
    /// (payload, tokens, key, tier)
    partial: Option<(Bytes, usize, BlockKey, Tier)>,
    /// Why the service's blocks were not used, if it failed or the fetch was skipped.
    notice: Option<String>,
}

/// Sends stored blocks to the cache service, as many per Store call as are waiting.
async fn store_loop(
    mut client: CacheClient,
    mut rx: mpsc::Receiver<(Block, tracing::Span)>,
    stats: Arc<PrefixStats>,
) {
    while let Some((first, parent)) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < 32 {
            match rx.try_recv() {
                Ok((b, _)) => batch.push(b),
                Err(_) => break,
            }
        }
        let n = batch.len() as u64;
        let bytes: u64 = batch.iter().map(|b| b.payload.len() as u64).sum();
        // A child of the request whose block came first (a batch may hold several requests').
        let span = tracing::info_span!(parent: &parent, "cache.store", blocks = n, bytes);
        let mut req = tonic::Request::new(tokio_stream::iter(batch));
        req.set_timeout(Duration::from_secs(30));
        let stored = async {
            strata_runtime::logging::inject(&mut req);
            client.rpc().store(req).await
        }
        .instrument(span)
        .await;
        match stored {
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
            bytes: bytes.clone(),
        });
        let stored = lock(&q8.l0).used_bytes as usize;
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

    #[test]
    fn hits_are_fetched_until_both_speeds_are_measured() {
        let mut m = CostModel::default();
        assert!(m.worth_fetching(256, 1 << 30));
        m.record_fetch(1 << 20, Duration::from_millis(1));
        assert!(
            m.worth_fetching(256, 1 << 30),
            "prefill speed not known yet"
        );
    }

    #[test]
    fn the_cheaper_of_fetching_and_recomputing_wins() {
        let mut m = CostModel::default();
        // 1 GB/s fetches, 1000 tokens/s prefill.
        m.record_fetch(1_000_000_000, Duration::from_secs(1));
        m.record_prefill(1000, Duration::from_secs(1));
        // 256 tokens: 0.256 s to compute; 12 MB take 0.012 s to fetch.
        assert!(m.worth_fetching(256, 12_000_000));
        // A huge block for few tokens (slow disk, tiny model on a fast chip): recompute.
        assert!(!m.worth_fetching(16, 100_000_000));
    }

    #[test]
    fn measurements_are_averaged_not_replaced() {
        let mut m = CostModel::default();
        m.record_prefill(1000, Duration::from_secs(1));
        m.record_prefill(3000, Duration::from_secs(1));
        let tps = m.prefill_tokens_per_sec.unwrap();
        assert!(tps > 1000.0 && tps < 3000.0, "{tps}");
        // Nothing measured in no time (or of nothing) changes nothing.
        m.record_prefill(0, Duration::from_secs(1));
        m.record_fetch(10, Duration::ZERO);
        assert_eq!(m.prefill_tokens_per_sec.unwrap(), tps);
        assert!(m.fetch_bytes_per_sec.is_none());
    }

    #[test]
    fn l0_finds_the_longest_partial_that_starts_the_tail_and_forgets_evicted_ones() {
        let mut l0 = L0 {
            limit_bytes: 100,
            used_bytes: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            partials: HashMap::new(),
        };
        let parent = root_of("ns");
        let short = BlockKey::chain("ns", None, &[1, 2]);
        let long = BlockKey::chain("ns", None, &[1, 2, 3]);
        let other = BlockKey::chain("ns", None, &[1, 9]);
        l0.insert_partial(parent, vec![1, 2], short, Bytes::from(vec![0u8; 30]));
        l0.insert_partial(parent, vec![1, 2, 3], long, Bytes::from(vec![0u8; 30]));
        l0.insert_partial(parent, vec![1, 9], other, Bytes::from(vec![0u8; 30]));
        let hit = l0
            .find_partial(&parent, &[1, 2, 3, 4])
            .map(|(_, n, k)| (n, k));
        assert_eq!(hit, Some((3, long)));
        assert_eq!(
            l0.find_partial(&parent, &[1, 2]).map(|(_, n, _)| n),
            Some(2)
        );
        assert!(l0.find_partial(&parent, &[5]).is_none());
        // Room for three: a fourth block evicts the least recently used partial (`other`).
        l0.insert(
            BlockKey::chain("ns", None, &[7]),
            Bytes::from(vec![0u8; 30]),
        );
        assert!(l0.find_partial(&parent, &[1, 9, 9]).is_none());
        assert_eq!(
            l0.partials[&parent].len(),
            2,
            "the evicted partial is pruned"
        );
    }
}
