//! The two tiers together: RAM (L1) in front of the disk (L2), a background writer that
//! persists stored blocks without making the caller wait, and the counters behind `Stats`.

pub mod disk;
pub mod ram;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use strata_proto::kvcache::{Block, BlockFile, StatsResponse, Tier, TierStats};

use crate::block::{self, BlockKey};
use disk::{DiskError, DiskTier, ReadOutcome};
use ram::RamTier;

/// Blocks waiting for the disk writer. When it is full, new blocks stay in RAM only.
const WRITE_QUEUE_BLOCKS: usize = 256;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub dir: PathBuf,
    pub ram_bytes: u64,
    pub disk_bytes: u64,
    /// Bytes a day the disk tier may write; None = unlimited.
    pub disk_write_budget: Option<u64>,
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
    /// Blocks not persisted because today's write budget was spent.
    budget_skips: AtomicU64,
}

/// Partial (tail) blocks by parent: (key, token ids). Entries whose block has since left both
/// tiers are skipped at lookup and pruned.
type PartialIndex = std::collections::HashMap<BlockKey, Vec<(BlockKey, Vec<u32>)>>;

/// A partial block that continues a held prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialMatch {
    pub key: BlockKey,
    pub tier: Tier,
    pub tokens: usize,
}

struct Inner {
    partials: Mutex<PartialIndex>,
    ram: Mutex<RamTier>,
    disk: Mutex<DiskTier>,
    counters: Counters,
    config: StoreConfig,
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
        let mut partials = PartialIndex::new();
        for (key, parent, tokens) in disk.take_partials() {
            partials.entry(parent).or_default().push((key, tokens));
        }
        let inner = Arc::new(Inner {
            partials: Mutex::new(partials),
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
                for job in rx {
                    let WriteJob::Persist(key, block) = job else {
                        break;
                    };
                    let result = lock(&writer_inner.disk).write(key, &block);
                    match result {
                        Ok(()) => lock(&writer_inner.ram).mark_persisted(&key),
                        Err(DiskError::BudgetSpent { .. }) => {
                            // Expected once the budget is spent: counted, no log line per block.
                            writer_inner
                                .counters
                                .budget_skips
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            writer_inner
                                .counters
                                .write_failures
                                .fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(error = %e, "block kept in RAM only");
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
        if let Some(h) = block.header.as_ref().filter(|h| block::is_partial(h)) {
            let parent =
                BlockKey::from_slice(&h.parent).unwrap_or_else(|| block::root_of(&h.namespace));
            let mut partials = lock(&self.inner.partials);
            let list = partials.entry(parent).or_default();
            if !list.iter().any(|(k, _)| *k == key) {
                list.push((key, h.token_ids.clone()));
            }
        }
        // The payload may be a slice of a larger receive buffer; kept as it is, the whole buffer
        // would stay alive with it and the RAM tier would hold more than it counts.
        let block = Arc::new(Block {
            payload: prost::bytes::Bytes::copy_from_slice(&block.payload),
            ..block
        });
        let evicted = lock(&self.inner.ram).insert(key, block.clone(), false);
        match evicted {
            Some(ev) => {
                self.inner
                    .counters
                    .ram_evictions
                    .fetch_add(ev.blocks, Ordering::Relaxed);
            }
            None => {
                self.inner.counters.refused.fetch_add(1, Ordering::Relaxed);
                return Err("block larger than the RAM tier".into());
            }
        }
        match self.writer.try_send(WriteJob::Persist(key, block)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.inner
                    .counters
                    .write_failures
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!("disk writer behind: block kept in RAM only");
            }
            Err(TrySendError::Disconnected(_)) => {}
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

    /// The longest held prefix of `keys`, with each block's tier.
    pub fn lookup(&self, keys: &[BlockKey]) -> Vec<(BlockKey, Tier)> {
        keys.iter()
            .map_while(|k| self.tier_of(k).map(|t| (*k, t)))
            .collect()
    }

    /// The longest partial block stored under `parent` whose tokens start `tail`.
    pub fn find_partial(&self, parent: &BlockKey, tail: &[u32]) -> Option<PartialMatch> {
        let candidates: Vec<(BlockKey, usize)> = lock(&self.inner.partials)
            .get(parent)?
            .iter()
            .filter(|(_, tokens)| tokens.len() <= tail.len() && tail.starts_with(tokens))
            .map(|(k, tokens)| (*k, tokens.len()))
            .collect();
        let mut best: Option<PartialMatch> = None;
        let mut gone = Vec::new();
        for (key, tokens) in candidates {
            match self.tier_of(&key) {
                Some(tier) if best.as_ref().is_none_or(|b| tokens > b.tokens) => {
                    best = Some(PartialMatch { key, tier, tokens });
                }
                Some(_) => {}
                None => gone.push(key),
            }
        }
        if !gone.is_empty()
            && let Some(list) = lock(&self.inner.partials).get_mut(parent)
        {
            list.retain(|(k, _)| !gone.contains(k));
        }
        best
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
                c.disk_hits.fetch_add(1, Ordering::Relaxed);
                let b = Arc::new(*b);
                if let Some(ev) = lock(&self.inner.ram).insert(*key, b.clone(), true) {
                    c.ram_evictions.fetch_add(ev.blocks, Ordering::Relaxed);
                }
                Ok(Some(b))
            }
            ReadOutcome::Corrupt(why) => {
                c.corrupt.fetch_add(1, Ordering::Relaxed);
                c.misses.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(key = ?key, why, "corrupt block dropped");
                Ok(None)
            }
            _ => {
                c.misses.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
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
        let c = &self.inner.counters;
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
                    c.ram_hits.fetch_add(1, Ordering::Relaxed);
                } else {
                    c.disk_hits.fetch_add(1, Ordering::Relaxed);
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
                c.misses.fetch_add(1, Ordering::Relaxed);
                Ok(None)
            }
        }
    }

    /// Some(answer) when RAM decides: the block, or a miss because it belongs to another
    /// namespace. None: not in RAM.
    fn ram_answer(&self, namespace: &str, key: &BlockKey) -> Option<Option<Arc<Block>>> {
        let c = &self.inner.counters;
        let b = lock(&self.inner.ram).get(key)?;
        if in_namespace(&b, namespace) {
            c.ram_hits.fetch_add(1, Ordering::Relaxed);
            Some(Some(b))
        } else {
            c.misses.fetch_add(1, Ordering::Relaxed);
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
        let (ram_blocks, ram_bytes) = {
            let r = lock(&self.inner.ram);
            (r.len() as u64, r.used_bytes())
        };
        let mut d = lock(&self.inner.disk);
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
        }
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
