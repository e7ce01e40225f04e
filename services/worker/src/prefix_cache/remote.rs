//! The cache service's side of a prepare: one Lookup, then one streamed Fetch of what is
//! missing; and the task that stores finished blocks there behind the requests.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use strata_kvblock::block::{BlockKey, carries_snapshots, root_of, snapshot_bytes};
use strata_kvblock::client::{CacheClient, Snapshots};
use strata_proto::kvcache::{Block, Tier};
use tokio::sync::mpsc;
use tracing::Instrument;

use super::{InFlight, LOOKUP_DEADLINE, PrefixCache, PrefixStats, lock};

impl PrefixCache {
    /// What the cache service adds to the `have` leading blocks of `keys` found in L0: the
    /// next held blocks, then maybe the block continuing them (by the reuse rule), each with
    /// its tier. One Lookup over the whole chain (so the service can match under the last
    /// block), then one streamed Fetch of what is missing, unless the cost model says
    /// recomputing it is faster. `have_rows`: the rows L0's own continuation gives;
    /// `parked`: the tokens a parked cache holds (nothing is fetched that gives no more).
    pub(super) async fn fetch(
        &self,
        prompt: &[u32],
        keys: &[BlockKey],
        have: usize,
        have_rows: usize,
        parked: usize,
    ) -> Remote {
        let mut out = Remote::default();
        let Some(client) = &self.client else {
            return out;
        };
        let b = self.block_tokens;
        let body = prompt.len().saturating_sub(1);
        // Everything reusable is in L0 already.
        if keys.len() == have && body == have * b + have_rows {
            return out;
        }
        self.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut client = client.clone();
        let mut req = tonic::Request::new(self.lookup_request(keys, &prompt[..body]));
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
        let rows = found.partial_tokens as usize;
        let start = held * b;
        // The continuing block is worth fetching if it continues blocks the service adds, or
        // gives more rows than L0's. Its tokens are checked once it is here.
        let next = found
            .partial
            .as_ref()
            .and_then(|p| BlockKey::from_slice(&p.key).map(|k| (k, p.tier)))
            .filter(|_| held > have || rows > have_rows)
            .filter(|_| rows > 0 && rows <= b && start + rows <= body);
        if let Some((key, tier)) = next {
            wanted.push(key);
            tiers.push(Tier::try_from(tier).unwrap_or(Tier::Ram));
        }
        if wanted.is_empty() {
            return out;
        }
        if held * b + next.map_or(0, |_| rows) <= parked {
            // A parked cache holds as much: resuming from it moves nothing.
            return out;
        }
        let tokens = (held - have) * b + next.map_or(0, |_| rows);
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
        // A hybrid model resumes its recurrent layers from the last block's snapshot: the
        // blocks before it come without theirs.
        let snapshots = if self.recurrent.is_some() {
            Snapshots::LastOnly
        } else {
            Snapshots::Every
        };
        let blocks = match client
            .fetch_prefix(&self.namespace, &wanted, deadline, snapshots)
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
        tracing::info!(
            blocks = blocks.len(),
            bytes = fetched_bytes,
            ms = took.as_secs_f64() * 1e3,
            "prefix fetched"
        );
        let whole = held - have;
        let parent = self.parent_of(keys, held);
        for (i, (block, tier)) in blocks.into_iter().zip(tiers).enumerate() {
            if i < whole {
                let with_snapshots = carries_snapshots(&block);
                if let Some(h) = block.header.as_ref().filter(|_| !with_snapshots) {
                    self.stats
                        .snapshot_bytes_skipped
                        .fetch_add(snapshot_bytes(h), Ordering::Relaxed);
                }
                out.blocks.push((block.payload, tier, with_snapshots));
                continue;
            }
            let Some((key, _)) = next else { break };
            // The block verified against its key; that it hangs under this prefix and that its
            // leading rows are these tokens is checked here: the worker trusts only what it saw.
            let tokens = block.header.map(|h| (h.parent, h.token_ids));
            match tokens {
                Some((p, ids))
                    if parent_matches(&p, &parent, &self.namespace)
                        && self.reuse.continuation(b).rows(&ids, &prompt[start..body]) >= rows =>
                {
                    out.next = Some(Next {
                        bytes: block.payload,
                        rows,
                        key,
                        tokens: ids,
                        tier,
                    });
                }
                _ => tracing::warn!(
                    "the cache service's continuing block does not continue this prompt; computing from there"
                ),
            }
        }
        // The continuing block was not used, so the last whole block is where the recurrent
        // layers resume: it was read without its snapshot, so it is read again, whole.
        if out.next.is_none()
            && let Some(at) = out.blocks.len().checked_sub(1)
            && !out.blocks[at].2
        {
            let key = keys[have + at];
            match client
                .fetch_prefix(&self.namespace, &[key], deadline, Snapshots::Every)
                .await
            {
                Ok(mut again) if again.len() == 1 => {
                    let block = again.remove(0);
                    out.blocks[at] = (block.payload, out.blocks[at].1, true);
                }
                outcome => {
                    let why = match outcome {
                        Err(e) => e.to_string(),
                        Ok(_) => "it is no longer held".to_string(),
                    };
                    tracing::warn!(%why, "the last cached block's snapshot could not be read; computing the prompt");
                    out.notice = Some(format!(
                        "the recurrent state at the end of the cached prefix could not be read ({why}): the prompt was computed"
                    ));
                    out.blocks.clear();
                }
            }
        }
        out
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

pub(super) fn tier_name(tier: Option<i32>) -> &'static str {
    match tier.and_then(|t| Tier::try_from(t).ok()) {
        Some(Tier::Ram) => "l1",
        Some(Tier::Disk) => "l2",
        _ => "none",
    }
}

/// What the cache service had for a prompt beyond L0.
#[derive(Default)]
pub(super) struct Remote {
    /// Whole blocks: payload, tier, and whether the payload carries its recurrent snapshots
    /// (a hybrid model's blocks before the last come with their K/V part only).
    pub blocks: Vec<(Bytes, Tier, bool)>,
    pub next: Option<Next>,
    /// Why the service's blocks were not used, if it failed or the fetch was skipped.
    pub notice: Option<String>,
}

/// The block that continues the fetched whole blocks: its leading `rows` are the prompt's.
pub(super) struct Next {
    pub bytes: Bytes,
    pub rows: usize,
    pub key: BlockKey,
    /// All its tokens (L0 keeps it under them).
    pub tokens: Vec<u32>,
    pub tier: Tier,
}

/// Whether a header's parent (empty for a chain's first block) is `expected`.
fn parent_matches(parent: &[u8], expected: &BlockKey, namespace: &str) -> bool {
    match BlockKey::from_slice(parent) {
        Some(p) => p == *expected,
        None => parent.is_empty() && *expected == root_of(namespace),
    }
}

/// In a debug build, `STRATA_TEST_STORE_DELAY_MS` delays every Store call: the fault tests use
/// it to hold blocks in the worker's queue at shutdown. A release build ignores it.
pub const TEST_STORE_DELAY_ENV: &str = "STRATA_TEST_STORE_DELAY_MS";

fn test_store_delay() -> Option<Duration> {
    if !cfg!(debug_assertions) {
        return None;
    }
    let ms: u64 = std::env::var(TEST_STORE_DELAY_ENV).ok()?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// Sends stored blocks to the cache service, as many per Store call as are waiting.
pub(super) async fn store_loop(
    mut client: CacheClient,
    mut rx: mpsc::Receiver<(BlockKey, Block, tracing::Span)>,
    stats: Arc<PrefixStats>,
    in_flight: InFlight,
) {
    while let Some((key, first, parent)) = rx.recv().await {
        let mut keys = vec![key];
        let mut batch = vec![first];
        while batch.len() < 32 {
            match rx.try_recv() {
                Ok((k, b, _)) => {
                    keys.push(k);
                    batch.push(b);
                }
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
            if let Some(delay) = test_store_delay() {
                tokio::time::sleep(delay).await;
            }
            client.rpc().store(req).await
        }
        .instrument(span)
        .await;
        stats.blocks_store_pending.fetch_sub(n, Ordering::Relaxed);
        // Stored or not, the service has answered: lookups go there (or miss) from now on.
        {
            let mut held = lock(&in_flight);
            for k in &keys {
                held.remove(k);
            }
        }
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
