//! The two tiers together: RAM (L1) in front of the disk (L2), a background writer that
//! persists stored blocks without making the caller wait, and the counters behind `Stats`.

pub mod disk;
pub mod ram;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use strata_proto::kvcache::{Block, BlockFile, NamespaceStats, StatsResponse, Tier, TierStats};

use crate::block::{self, BlockKey, Continuation};
use disk::{DiskError, DiskTier, ReadOutcome};
use ram::RamTier;

/// Blocks waiting for the disk writer. When it is full, new blocks stay in RAM only.
const WRITE_QUEUE_BLOCKS: usize = 256;
/// Payload bytes waiting for the disk writer. A queued block that the RAM tier evicts meanwhile
/// is held only by the queue, outside `--ram`: this bounds that memory.
pub const WRITE_QUEUE_BYTES: u64 = 16 << 20;
/// After this long without new blocks, the writer writes the RAM blocks it had to pass over
/// (queue full, disk failing), CATCH_UP_BLOCKS at a time.
const CATCH_UP_AFTER: Duration = Duration::from_millis(100);
const CATCH_UP_BLOCKS: usize = 8;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dir: PathBuf,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
    /// Bytes a day the disk tier may write; None = unlimited.
    pub disk_write_budget: Option<u64>,
    pub quotas: disk::Quotas,
    /// Sync each block to stable storage before it counts as written (`cache.fsync`).
    pub fsync: bool,
}

#[derive(Default)]
struct Counters {
    ram_hits: AtomicU64,
    disk_hits: AtomicU64,
    misses: AtomicU64,
    ram_evictions: AtomicU64,
    corrupt: AtomicU64,
    refused: AtomicU64,
    write_failures: AtomicU64,
    /// Blocks evicted from RAM before they were written.
    evicted_unwritten: AtomicU64,
    /// Blocks the writer could not take on arrival (written later, when it catches up).
    writes_deferred: AtomicU64,
    /// Blocks not persisted because today's write budget was spent.
    budget_skips: AtomicU64,
}

/// Every block by parent: (key, token ids), so that the block continuing a held prefix can be
/// found by its tokens: a partial (tail) block whose tokens start the rest of a prompt, or, at
/// token granularity, any block sharing a common prefix with it. Entries whose block has since
/// left both tiers are skipped at lookup and pruned.
type ChildIndex = std::collections::HashMap<BlockKey, Vec<(BlockKey, Vec<u32>)>>;

/// A block that continues a held prefix: its leading `tokens` rows are the prompt's next
/// tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildMatch {
    pub key: BlockKey,
    pub tier: Tier,
    pub tokens: usize,
}

#[derive(Clone, Copy)]
enum Counted {
    RamHit,
    DiskHit,
    Miss,
}

/// Namespaces come from requests (tenants' salts): past this many, per-namespace counters keep
/// counting only the namespaces they already hold, and the totals count everything.
pub const MAX_COUNTED_NAMESPACES: usize = 1024;
/// Namespaces a Stats reply lists, the largest first; the rest are counted in
/// `namespaces_omitted`. 256 entries are about 40 KB of reply, far below gRPC's 4 MiB limit
/// whatever the number of namespaces held.
pub const MAX_REPORTED_NAMESPACES: usize = 256;
/// The child index is swept of blocks that left both tiers once it holds this many entries
/// more than twice the blocks held (a sweep costs one pass; amortised over the stores since).
const CHILD_INDEX_SLACK: usize = 4096;

/// Adds `n` to `namespace`'s counter unless the map is full and does not hold it yet.
pub fn count_bounded<K>(map: &mut std::collections::HashMap<K, u64>, namespace: K, n: u64)
where
    K: std::hash::Hash + Eq,
{
    if map.len() >= MAX_COUNTED_NAMESPACES && !map.contains_key(&namespace) {
        return;
    }
    *map.entry(namespace).or_default() += n;
}

/// Hits and misses of one namespace: (RAM hits, disk hits, misses).
type NamespaceCounters = std::collections::HashMap<String, (u64, u64, u64)>;

struct Inner {
    /// Payload bytes in the writer's queue.
    queued_bytes: AtomicU64,
    /// Why the disk tier is not taking writes, if it is not.
    degraded: Mutex<Option<String>>,
    children: Mutex<ChildIndex>,
    /// Entries in `children`, all parents together.
    child_entries: AtomicU64,
    by_namespace: Mutex<NamespaceCounters>,
    ram: Mutex<RamTier>,
    disk: Mutex<DiskTier>,
    counters: Counters,
    config: StoreConfig,
}

impl Inner {
    /// Writes one block to disk and records the outcome. Returns false when the disk failed
    /// (full, I/O error), so that a catch-up pass stops there.
    fn persist(&self, key: BlockKey, block: &Block) -> bool {
        let result = lock(&self.disk).write(key, block);
        // Budget, size and quota refusals are policy, not a degraded disk.
        let disk_failed = matches!(result, Err(DiskError::Io { .. } | DiskError::Index(_)));
        if result.is_ok() || disk_failed {
            self.set_degraded(result.as_ref().err());
        }
        let mut ram = lock(&self.ram);
        match result {
            Ok(()) => ram.mark_persisted(&key),
            Err(DiskError::BudgetSpent { .. }) => {
                // Expected once the budget is spent: counted, no log line per block.
                ram.mark_skipped(&key);
                self.counters.budget_skips.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) if disk_failed => {
                // Tried again by a later catch-up pass, once the disk takes writes.
                ram.set_queued(&key, false);
                self.counters.write_failures.fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                ram.mark_skipped(&key);
                self.counters.write_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
        !disk_failed
    }

    /// Writes up to `max` RAM blocks that never reached the disk. Returns how many it wrote.
    fn catch_up(&self, max: usize) -> usize {
        let todo = lock(&self.ram).unwritten(max);
        let mut written = 0;
        for (key, block) in todo {
            if !self.persist(key, &block) {
                break;
            }
            written += 1;
        }
        written
    }

    /// Records the outcome of a disk write; logs only the changes (a full disk would otherwise
    /// log once per block).
    fn set_degraded(&self, error: Option<&DiskError>) {
        let mut degraded = lock(&self.degraded);
        match (error, degraded.is_some()) {
            (Some(e), false) => {
                tracing::warn!(error = %e, "disk tier degraded: new blocks stay in RAM only");
                *degraded = Some(e.to_string());
            }
            (None, true) => {
                tracing::info!("disk tier writes again");
                *degraded = None;
            }
            _ => {}
        }
    }
}

enum WriteJob {
    Persist(BlockKey, Arc<Block>),
    /// Everything queued before this is written; then the writer stops.
    Stop,
}

/// A cheap handle; clones share the store.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
    writer: SyncSender<WriteJob>,
}

/// Owns the writer thread; `shutdown` drains what is queued, within a bound. (Store handles
/// may outlive it, held by connections still open; they only stop reaching the disk.)
pub struct Writer {
    thread: std::thread::JoinHandle<()>,
    jobs: SyncSender<WriteJob>,
    done: Receiver<()>,
}

/// Whether namespace `ns` belongs to `family` (all when empty): the model's fingerprint itself,
/// its quantised variants (`fp~kv-…`) and its tenants' salted views (`fp+…`, `fp~kv-…+…`).
/// Clearing a model's cache clears all of them.
pub fn in_family(ns: &str, family: &str) -> bool {
    family.is_empty()
        || ns
            .strip_prefix(family)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('~') || rest.starts_with('+'))
}

fn in_namespace(b: &Block, namespace: &str) -> bool {
    b.header.as_ref().is_some_and(|h| h.namespace == namespace)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the tiers inconsistent in a way a reader
    // could observe as a wrong block (every read re-verifies), so poisoning is ignored.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Store {
    pub fn open(config: StoreConfig) -> Result<(Self, Writer), DiskError> {
        let mut disk =
            DiskTier::open_with_budget(&config.dir, config.disk_bytes, config.disk_write_budget)?;
        disk.set_quotas(config.quotas.clone());
        disk.set_fsync(config.fsync);
        let mut children = ChildIndex::new();
        let mut child_entries = 0;
        for (key, parent, tokens) in disk.take_children() {
            children.entry(parent).or_default().push((key, tokens));
            child_entries += 1;
        }
        let inner = Arc::new(Inner {
            degraded: Mutex::new(None),
            queued_bytes: AtomicU64::new(0),
            children: Mutex::new(children),
            child_entries: AtomicU64::new(child_entries),
            by_namespace: Mutex::new(NamespaceCounters::new()),
            ram: Mutex::new(RamTier::new(config.ram_bytes)),
            disk: Mutex::new(disk),
            counters: Counters::default(),
            config,
        });
        let (tx, rx) = sync_channel::<WriteJob>(WRITE_QUEUE_BLOCKS);
        let (done_tx, done) = sync_channel(1);
        let writer_inner = inner.clone();
        let thread = std::thread::Builder::new()
            .name("kv-disk-writer".into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(CATCH_UP_AFTER) {
                        Ok(WriteJob::Persist(key, block)) => {
                            let queued = block.payload.len() as u64;
                            writer_inner.persist(key, &block);
                            drop(block);
                            writer_inner
                                .queued_bytes
                                .fetch_sub(queued, Ordering::Relaxed);
                        }
                        // Idle: write what arrived while the queue was full.
                        Err(RecvTimeoutError::Timeout) => {
                            writer_inner.catch_up(CATCH_UP_BLOCKS);
                        }
                        // Stopping: everything still unwritten goes to disk now (the caller
                        // bounds how long it waits).
                        Ok(WriteJob::Stop) | Err(RecvTimeoutError::Disconnected) => {
                            while writer_inner.catch_up(CATCH_UP_BLOCKS) > 0 {}
                            break;
                        }
                    }
                }
                let _ = lock(&writer_inner.disk).flush();
                let _ = done_tx.send(());
            })
            .map_err(|e| DiskError::Io {
                path: "writer thread".into(),
                source: e,
            })?;
        let writer = Writer {
            thread,
            jobs: tx.clone(),
            done,
        };
        Ok((Self { inner, writer: tx }, writer))
    }

    /// Verifies and keeps a block. Returns once it is in RAM; the disk write follows.
    pub fn store(&self, block: Block) -> Result<(), String> {
        let key = match block::verify(&block) {
            Ok(k) => k,
            Err(e) => {
                self.inner.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Err(e.to_string());
            }
        };
        if let Some(h) = block.header.as_ref() {
            let parent =
                BlockKey::from_slice(&h.parent).unwrap_or_else(|| block::root_of(&h.namespace));
            let mut children = lock(&self.inner.children);
            let list = children.entry(parent).or_default();
            if !list.iter().any(|(k, _)| *k == key) {
                list.push((key, h.token_ids.clone()));
                self.inner.child_entries.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sweep_children_if_due();
        // The payload may be a slice of a larger receive buffer; kept as it is, the whole buffer
        // would stay alive with it and the RAM tier would hold more than it counts.
        let block = Arc::new(Block {
            payload: prost::bytes::Bytes::copy_from_slice(&block.payload),
            ..block
        });
        let evicted = lock(&self.inner.ram).insert(key, block.clone(), false);
        match evicted {
            Some(ev) => {
                let c = &self.inner.counters;
                c.ram_evictions.fetch_add(ev.blocks, Ordering::Relaxed);
                c.evicted_unwritten
                    .fetch_add(ev.unpersisted, Ordering::Relaxed);
            }
            None => {
                self.inner.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Err("block larger than the RAM tier".into());
            }
        }
        let size = block.payload.len() as u64;
        let queued = &self.inner.queued_bytes;
        let room = queued.fetch_add(size, Ordering::Relaxed) + size <= WRITE_QUEUE_BYTES.max(size);
        let sent = if room {
            lock(&self.inner.ram).set_queued(&key, true);
            self.writer.try_send(WriteJob::Persist(key, block))
        } else {
            Err(TrySendError::Full(WriteJob::Persist(key, block)))
        };
        if sent.is_err() {
            queued.fetch_sub(size, Ordering::Relaxed);
            lock(&self.inner.ram).set_queued(&key, false);
        }
        if let Err(TrySendError::Full(_)) = sent {
            // The writer is behind: the block waits in RAM for its catch-up pass (or is lost
            // to RAM eviction first, which `Evicted::unpersisted` counts).
            self.inner
                .counters
                .writes_deferred
                .fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    fn tier_of(&self, key: &BlockKey) -> Option<Tier> {
        if lock(&self.inner.ram).contains(key) {
            Some(Tier::Ram)
        } else if lock(&self.inner.disk).contains(key) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// The payload size of a held block, without reading it.
    pub fn payload_size(&self, key: &BlockKey) -> Option<u64> {
        if let Some(b) = lock(&self.inner.ram).peek(key) {
            return Some(b.payload.len() as u64);
        }
        lock(&self.inner.disk).locate(key).map(|(_, size)| size)
    }

    /// The longest held prefix of `keys`, with each block's tier.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<(BlockKey, Tier)> {
        keys.iter()
            .map_while(|k| self.tier_of(k).map(|t| (*k, t)))
            .collect()
    }

    /// The block under `parent` that continues `tail` furthest, by the rule `how`, with the
    /// number of its leading tokens that do. Blocks that left both tiers are pruned.
    pub fn find_child(
        &self,
        parent: &BlockKey,
        tail: &[u32],
        how: Continuation,
    ) -> Option<ChildMatch> {
        let candidates: Vec<(BlockKey, usize)> = lock(&self.inner.children)
            .get(parent)?
            .iter()
            .filter_map(|(k, tokens)| {
                let n = how.rows(tokens, tail);
                (n > 0).then_some((*k, n))
            })
            .collect();
        let mut best: Option<ChildMatch> = None;
        let mut gone = Vec::new();
        for (key, tokens) in candidates {
            match self.tier_of(&key) {
                // The longest; on a tie, one in RAM.
                Some(tier)
                    if best.as_ref().is_none_or(|b| {
                        tokens > b.tokens
                            || (tokens == b.tokens && tier == Tier::Ram && b.tier == Tier::Disk)
                    }) =>
                {
                    best = Some(ChildMatch { key, tier, tokens });
                }
                Some(_) => {}
                None => gone.push(key),
            }
        }
        if !gone.is_empty() {
            let mut children = lock(&self.inner.children);
            if let Some(list) = children.get_mut(parent) {
                let before = list.len();
                list.retain(|(k, _)| !gone.contains(k));
                let removed = (before - list.len()) as u64;
                if list.is_empty() {
                    children.remove(parent);
                }
                self.inner
                    .child_entries
                    .fetch_sub(removed, Ordering::Relaxed);
            }
        }
        best
    }

    /// Entries in the child index (for tests and bounds).
    pub fn child_index_len(&self) -> usize {
        self.inner.child_entries.load(Ordering::Relaxed) as usize
    }

    /// Drops the child index's entries for blocks that left both tiers, once the index has
    /// grown well past the blocks held. Without it, the entries of parents never looked up
    /// again would stay forever (one per block ever stored, token ids included).
    fn sweep_children_if_due(&self) {
        let held = lock(&self.inner.ram).len() + lock(&self.inner.disk).len();
        if self.child_index_len() <= 2 * held + CHILD_INDEX_SLACK {
            return;
        }
        let mut children = lock(&self.inner.children);
        let mut kept = 0;
        children.retain(|_, list| {
            list.retain(|(k, _)| self.tier_of(k).is_some());
            kept += list.len();
            !list.is_empty()
        });
        self.inner
            .child_entries
            .store(kept as u64, Ordering::Relaxed);
    }

    /// One block of `namespace`, from RAM or from disk (then kept in RAM). Blocks that fail
    /// verification are dropped and counted; they are misses. The disk lock is not held while
    /// the file is read, so several fetches read in parallel.
    pub fn fetch(&self, namespace: &str, key: &BlockKey) -> Result<Option<Arc<Block>>, DiskError> {
        let c = &self.inner.counters;
        if let Some(b) = self.ram_answer(namespace, key) {
            return Ok(b);
        }
        let located = lock(&self.inner.disk).locate(key);
        let outcome = match located {
            Some((path, _)) => disk::read_located(&path, key),
            None => ReadOutcome::Miss,
        };
        let outcome = lock(&self.inner.disk).settle(key, outcome)?;
        match outcome {
            ReadOutcome::Hit(b) if in_namespace(&b, namespace) => {
                self.count(namespace, Counted::DiskHit);
                let b = Arc::new(*b);
                if let Some(ev) = lock(&self.inner.ram).insert(*key, b.clone(), true) {
                    c.ram_evictions.fetch_add(ev.blocks, Ordering::Relaxed);
                    c.evicted_unwritten
                        .fetch_add(ev.unpersisted, Ordering::Relaxed);
                }
                Ok(Some(b))
            }
            ReadOutcome::Corrupt(why) => {
                c.corrupt.fetch_add(1, Ordering::Relaxed);
                self.count(namespace, Counted::Miss);
                tracing::warn!(key = ?key, why, "corrupt block dropped");
                Ok(None)
            }
            _ => {
                self.count(namespace, Counted::Miss);
                Ok(None)
            }
        }
    }

    /// Checks the file of `key` after a client reported it bad: a corrupt file is dropped and
    /// counted (the client's word alone drops nothing). Returns whether it was dropped.
    pub fn verify_reported(&self, key: &BlockKey) -> Result<bool, DiskError> {
        let located = lock(&self.inner.disk).locate(key);
        let Some((path, _)) = located else {
            return Ok(false);
        };
        let outcome = disk::read_located(&path, key);
        let outcome = lock(&self.inner.disk).settle(key, outcome)?;
        match outcome {
            ReadOutcome::Corrupt(why) => {
                self.inner.counters.corrupt.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = ?key, why, "corrupt block reported by a client dropped");
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// Like `fetch`, but a block that is on disk comes back as a reference to its file, for a
    /// caller on this host to read and verify itself: the zero-copy path. A block in RAM that
    /// is also on disk is sent as a file too, since its file is then almost always in the
    /// page cache (just written or just read) and one file read beats the gRPC copies; only
    /// RAM-only blocks (not yet written, or kept off disk by the budget or a full disk) come
    /// as payloads. Disk-only blocks are not promoted to RAM (the caller keeps its own copy).
    pub fn fetch_or_locate(
        &self,
        namespace: &str,
        key: &BlockKey,
    ) -> Result<Option<Arc<Block>>, DiskError> {
        let in_ram = {
            let ram = lock(&self.inner.ram);
            ram.contains(key).then(|| ram.is_persisted(key))
        };
        if in_ram == Some(false) {
            return Ok(self.ram_answer(namespace, key).flatten());
        }
        let mut disk = lock(&self.inner.disk);
        match disk.locate(key) {
            Some((path, size)) if disk.namespace_of(key)?.as_deref() == Some(namespace) => {
                disk.touch(key)?;
                if in_ram.is_some() {
                    lock(&self.inner.ram).get(key);
                    self.count(namespace, Counted::RamHit);
                } else {
                    self.count(namespace, Counted::DiskHit);
                }
                Ok(Some(Arc::new(Block {
                    header: None,
                    payload: Default::default(),
                    file: Some(BlockFile {
                        path: path.to_string_lossy().into_owned(),
                        size,
                    }),
                })))
            }
            // Evicted from disk meanwhile, still in RAM: send the payload.
            _ if in_ram.is_some() => {
                drop(disk);
                Ok(self.ram_answer(namespace, key).flatten())
            }
            _ => {
                self.count(namespace, Counted::Miss);
                Ok(None)
            }
        }
    }

    fn count(&self, namespace: &str, what: Counted) {
        let c = &self.inner.counters;
        match what {
            Counted::RamHit => &c.ram_hits,
            Counted::DiskHit => &c.disk_hits,
            Counted::Miss => &c.misses,
        }
        .fetch_add(1, Ordering::Relaxed);
        let mut by_ns = lock(&self.inner.by_namespace);
        // Namespaces come from requests: past this many, only the totals count.
        if by_ns.len() >= MAX_COUNTED_NAMESPACES && !by_ns.contains_key(namespace) {
            return;
        }
        let e = by_ns.entry(namespace.to_string()).or_default();
        match what {
            Counted::RamHit => e.0 += 1,
            Counted::DiskHit => e.1 += 1,
            Counted::Miss => e.2 += 1,
        }
    }

    /// Some(answer) when RAM decides: the block, or a miss because it belongs to another
    /// namespace. None: not in RAM.
    fn ram_answer(&self, namespace: &str, key: &BlockKey) -> Option<Option<Arc<Block>>> {
        let b = lock(&self.inner.ram).get(key)?;
        if in_namespace(&b, namespace) {
            self.count(namespace, Counted::RamHit);
            Some(Some(b))
        } else {
            self.count(namespace, Counted::Miss);
            Some(None)
        }
    }

    pub fn clear(&self, namespace: &str) -> Result<u64, DiskError> {
        let ram = lock(&self.inner.ram).clear(namespace);
        let disk = lock(&self.inner.disk).clear(namespace)?;
        Ok(ram.max(disk))
    }

    pub fn stats(&self) -> StatsResponse {
        let c = &self.inner.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (ram_blocks, ram_bytes, ram_by_ns) = {
            let r = lock(&self.inner.ram);
            (r.len() as u64, r.used_bytes(), r.by_namespace())
        };
        let mut d = lock(&self.inner.disk);
        let (namespaces, namespaces_omitted) = self.namespace_stats(&ram_by_ns, &d);
        StatsResponse {
            ram: Some(TierStats {
                blocks: ram_blocks,
                bytes: ram_bytes,
                hits: get(&c.ram_hits),
                evictions: get(&c.ram_evictions),
            }),
            disk: Some(TierStats {
                blocks: d.len() as u64,
                bytes: d.used_bytes(),
                hits: get(&c.disk_hits),
                evictions: d.evictions,
            }),
            misses: get(&c.misses),
            corrupt_blocks: get(&c.corrupt),
            disk_bytes_written: d.bytes_written,
            ram_limit_bytes: self.inner.config.ram_bytes,
            disk_limit_bytes: d.limit_bytes(),
            stores_refused: get(&c.refused),
            disk_write_failures: get(&c.write_failures),
            disk_bytes_written_today: d.written_today(),
            disk_write_budget_bytes: d.write_budget().unwrap_or(0),
            disk_write_budget_left: d
                .write_budget()
                .map(|b| b.saturating_sub(d.written_today()))
                .unwrap_or(u64::MAX),
            blocks_ram_only_budget_spent: get(&c.budget_skips),
            namespaces,
            namespaces_omitted,
            disk_degraded: lock(&self.inner.degraded).clone().unwrap_or_default(),
            writes_deferred: get(&c.writes_deferred),
            evicted_unwritten: get(&c.evicted_unwritten),
        }
    }
}

impl Store {
    fn namespace_stats(
        &self,
        ram: &std::collections::HashMap<String, (u64, u64, u64)>,
        disk: &DiskTier,
    ) -> (Vec<NamespaceStats>, u64) {
        let disk = disk.by_namespace();
        let counters = lock(&self.inner.by_namespace).clone();
        let mut names: Vec<&String> = ram
            .keys()
            .chain(disk.keys())
            .chain(counters.keys())
            .collect();
        names.sort();
        names.dedup();
        let omitted = names.len().saturating_sub(MAX_REPORTED_NAMESPACES) as u64;
        if omitted > 0 {
            // The largest namespaces (bytes held, then lookups) are the ones worth listing.
            let weight = |ns: &String| {
                let r = ram.get(ns).map_or(0, |r| r.1);
                let d = disk.get(ns).map_or(0, |d| d.1);
                let h = counters.get(ns).map_or(0, |h| h.0 + h.1 + h.2);
                (r + d, h)
            };
            names.sort_by_key(|ns| std::cmp::Reverse(weight(ns)));
            names.truncate(MAX_REPORTED_NAMESPACES);
            names.sort();
        }
        let listed = names
            .into_iter()
            .map(|ns| {
                let r = ram.get(ns).copied().unwrap_or_default();
                let d = disk.get(ns).cloned().unwrap_or_default();
                let h = counters.get(ns).copied().unwrap_or_default();
                NamespaceStats {
                    namespace: ns.clone(),
                    ram: Some(TierStats {
                        blocks: r.0,
                        bytes: r.1,
                        hits: h.0,
                        evictions: r.2,
                    }),
                    disk: Some(TierStats {
                        blocks: d.0,
                        bytes: d.1,
                        hits: h.1,
                        evictions: d.2,
                    }),
                    misses: h.2,
                    disk_quota_bytes: d.3.unwrap_or(0),
                }
            })
            .collect();
        (listed, omitted)
    }
}

impl Writer {
    /// Stops accepting writes and waits up to `within` for queued blocks to reach the disk.
    pub fn shutdown(self, within: Duration) -> bool {
        let started = Instant::now();
        // Behind every block already queued; waits for room if the queue is full.
        let _ = self.jobs.send(WriteJob::Stop);
        let finished = self.done.recv_timeout(within).is_ok();
        if finished {
            let _ = self.thread.join();
        } else {
            tracing::warn!(waited = ?started.elapsed(), "disk writer did not drain in time");
        }
        finished
    }
}

#[cfg(test)]
mod family_tests {
    use super::in_family;

    #[test]
    fn a_model_family_holds_its_quantised_and_salted_namespaces_only() {
        for ns in [
            "fp",
            "fp~kv-affine-q8-g64",
            "fp+0123abcd",
            "fp~kv-f16+0123abcd",
        ] {
            assert!(in_family(ns, "fp"), "{ns}");
            assert!(in_family(ns, ""), "{ns}");
        }
        for ns in ["fp2", "other~kv", "xfp"] {
            assert!(!in_family(ns, "fp"), "{ns}");
        }
    }
}

#[cfg(test)]
mod bound_tests {
    use super::*;
    use crate::block::make_block;

    fn store_in(dir: &std::path::Path, ram_bytes: u64, disk_bytes: u64) -> (Store, Writer) {
        Store::open(StoreConfig {
            dir: dir.to_owned(),
            ram_bytes,
            disk_bytes,
            disk_write_budget: None,
            quotas: disk::Quotas::default(),
            fsync: false,
        })
        .unwrap()
    }

    fn block(namespace: &str, token: u32) -> Block {
        make_block(
            namespace,
            None,
            vec![token, token + 1],
            (1, 1, 4, "float32"),
            vec![1u8; 2 * 2 * 4 * 4],
        )
    }

    #[test]
    fn a_stats_reply_lists_a_bounded_number_of_namespaces_largest_first() {
        let dir = tempfile::tempdir().unwrap();
        let (store, writer) = store_in(dir.path(), 64 << 20, 64 << 20);
        let namespaces = MAX_REPORTED_NAMESPACES + 300;
        for i in 0..namespaces {
            store.store(block(&format!("salted+{i:05}"), 0)).unwrap();
        }
        // One namespace holds more than any other: it must be among those listed.
        for t in 1..6 {
            store.store(block("big", t * 10)).unwrap();
        }
        // Lookups of namespaces that hold nothing count too, within their own bound.
        for i in 0..2 * MAX_COUNTED_NAMESPACES {
            let key = BlockKey::chain("asked", None, &[i as u32]);
            assert!(store.fetch(&format!("asked+{i}"), &key).unwrap().is_none());
        }
        let stats = store.stats();
        assert_eq!(stats.namespaces.len(), MAX_REPORTED_NAMESPACES);
        let held_or_counted = namespaces + 1 + MAX_COUNTED_NAMESPACES;
        assert_eq!(
            stats.namespaces_omitted as usize,
            held_or_counted - MAX_REPORTED_NAMESPACES
        );
        assert!(stats.namespaces.iter().any(|n| n.namespace == "big"));
        let names: Vec<&str> = stats.namespaces.iter().map(|n| &*n.namespace).collect();
        assert!(names.windows(2).all(|w| w[0] < w[1]), "sorted by name");
        assert_eq!(stats.misses as usize, 2 * MAX_COUNTED_NAMESPACES);
        assert!(writer.shutdown(Duration::from_secs(10)));
    }

    #[test]
    fn the_child_index_forgets_blocks_that_left_both_tiers() {
        let dir = tempfile::tempdir().unwrap();
        let one = ram::block_bytes(&block("ns", 0));
        // Room for 8 blocks in RAM and none on disk: every older block leaves both tiers.
        let (store, writer) = store_in(dir.path(), 8 * one, 0);
        let stored = 3 * CHILD_INDEX_SLACK;
        for t in 0..stored as u32 {
            store.store(block("ns", 2 * t)).unwrap();
        }
        let held = store.stats().ram.map_or(0, |r| r.blocks) as usize;
        assert!(held <= 8);
        let entries = store.child_index_len();
        assert!(
            entries <= 2 * held + CHILD_INDEX_SLACK + 1,
            "{entries} entries for {held} blocks held after {stored} stores"
        );
        // What is still held is still found by its tokens.
        let last = 2 * (stored as u32 - 1);
        let root = block::root_of("ns");
        let found = store
            .find_child(&root, &[last, last + 1], Continuation::CommonPrefix)
            .unwrap();
        assert_eq!(found.tokens, 2);
        writer.shutdown(Duration::from_secs(10));
    }
}
