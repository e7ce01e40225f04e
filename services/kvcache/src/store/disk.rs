//! L2: blocks on the chosen SSD directory. One file per block under `blocks/` (large
//! sequential reads and writes, no compaction), and a sled index beside them (`index/`) holding
//! each block's size, namespace and last access, so LRU order survives restarts.
//!
//! `--disk` is a hard limit on bytes on disk counted from the files themselves: block files
//! plus sled's own files (which shrink late), re-measured as they change.
//! Crash safety: a block file is written under a temporary name and renamed into place before
//! the index names it; at open, temporary files and files the index does not name are removed,
//! and entries whose file is missing are dropped. Every read re-verifies header and checksum.
//! An index sled cannot open or read (corrupt) is set aside and rebuilt from the block files,
//! which carry everything it holds. With `fsync`, a block is on stable storage (file, its
//! directory entry, its index entry) before the store acknowledges it to the disk writer.

use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::bytes::Bytes;
use strata_proto::kvcache::Block;

use crate::block::{self, BlockKey};

/// sled's page cache: its default of 1 GiB would dwarf the RAM goal of the service.
const SLED_CACHE_BYTES: u64 = 16 << 20;
/// Room kept for the index to grow between two measurements: sled extends its file one
/// 512 KiB segment at a time, so with this reserve the limit holds at every moment.
pub const INDEX_GROWTH_RESERVE: u64 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("index: {0}")]
    Index(#[from] sled::Error),
    #[error("block of {size} bytes cannot fit under the disk limit of {limit} bytes")]
    TooLarge { size: u64, limit: u64 },
    #[error("today's SSD write budget of {budget} bytes is spent")]
    BudgetSpent { budget: u64 },
    #[error("block larger than the disk quota of namespace {namespace} ({quota} bytes)")]
    OverQuota { namespace: String, quota: u64 },
}

/// Disk bytes a namespace may hold: one model's cache cannot push out every other's.
#[derive(Debug, Clone, Default)]
pub struct Quotas {
    /// For namespaces not named in `per_namespace`; None = only the disk limit applies.
    pub default: Option<u64>,
    pub per_namespace: HashMap<String, u64>,
}

impl Quotas {
    pub fn of(&self, namespace: &str) -> Option<u64> {
        self.per_namespace.get(namespace).copied().or(self.default)
    }
}

struct Tracked {
    size: u64,
    last_access: u64,
    namespace: Arc<str>,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> DiskError + '_ {
    move |source| DiskError::Io {
        path: path.to_owned(),
        source,
    }
}

struct IndexEntry {
    size: u64,
    last_access: u64,
    namespace: String,
    /// The parent and the token ids, so that a block can be found by common prefix under its
    /// parent after a restart without reading the files. Entries written before round 2 have
    /// it for partial (tail) blocks only; their full blocks are found by chain key alone.
    child: Option<(BlockKey, Vec<u32>)>,
}

impl IndexEntry {
    fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(20 + self.namespace.len());
        v.extend_from_slice(&self.size.to_le_bytes());
        v.extend_from_slice(&self.last_access.to_le_bytes());
        v.extend_from_slice(&(self.namespace.len() as u32).to_le_bytes());
        v.extend_from_slice(self.namespace.as_bytes());
        if let Some((parent, tokens)) = &self.child {
            v.extend_from_slice(&parent.0);
            for t in tokens {
                v.extend_from_slice(&t.to_le_bytes());
            }
        }
        v
    }

    fn decode(v: &[u8]) -> Option<Self> {
        let u64_at = |i: usize| Some(u64::from_le_bytes(v.get(i..i + 8)?.try_into().ok()?));
        let ns_len = u32::from_le_bytes(v.get(16..20)?.try_into().ok()?) as usize;
        let namespace = String::from_utf8(v.get(20..20 + ns_len)?.to_vec()).ok()?;
        let rest = v.get(20 + ns_len..)?;
        let child = if rest.is_empty() {
            None
        } else {
            let parent = BlockKey::from_slice(rest.get(..32)?)?;
            let tokens = rest.get(32..)?;
            if tokens.len() % 4 != 0 {
                return None;
            }
            let tokens = tokens
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            Some((parent, tokens))
        };
        Some(Self {
            size: u64_at(0)?,
            last_access: u64_at(8)?,
            namespace,
            child,
        })
    }
}

/// A block as the children index knows it: (key, parent, token ids).
pub type ChildEntry = (BlockKey, BlockKey, Vec<u32>);

fn child_of(block: &Block) -> Option<(BlockKey, Vec<u32>)> {
    let h = block.header.as_ref()?;
    let parent = if h.parent.is_empty() {
        block::root_of(&h.namespace)
    } else {
        BlockKey::from_slice(&h.parent)?
    };
    Some((parent, h.token_ids.clone()))
}

/// What a disk read found.
pub enum ReadOutcome {
    Hit(Box<Block>),
    Miss,
    /// The file failed verification; it has been deleted.
    Corrupt(String),
}

pub struct DiskTier {
    dir: PathBuf,
    index: sled::Db,
    limit_bytes: u64,
    block_bytes: u64,
    /// (last access, key), oldest first.
    lru: BTreeMap<(u64, BlockKey), ()>,
    tracked: HashMap<BlockKey, Tracked>,
    /// (blocks, bytes) per namespace.
    usage: HashMap<Arc<str>, (u64, u64)>,
    evictions_by_namespace: HashMap<Arc<str>, u64>,
    quotas: Quotas,
    clock: u64,
    sled_bytes: u64,
    sled_measured: Instant,
    pub evictions: u64,
    pub bytes_written: u64,
    /// Bytes a day this tier may write (SSD wear); None = unlimited.
    write_budget: Option<u64>,
    /// (day number, bytes written that day), persisted so a restart does not reset it.
    written_today: (u64, u64),
    meta: sled::Tree,
    /// Days since the epoch, UTC; replaceable in tests.
    today: fn() -> u64,
    /// Partial blocks found at open, for the store's prefix index.
    children_at_open: Vec<ChildEntry>,
    /// Sync every block file, its directory and the index before a write counts as done.
    fsync: bool,
}

const WRITTEN_TODAY: &[u8] = b"written_today";

fn utc_day() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() / 86_400)
        .unwrap_or(0)
}

impl DiskTier {
    pub fn open(dir: &Path, limit_bytes: u64) -> Result<Self, DiskError> {
        Self::open_with_budget(dir, limit_bytes, None)
    }

    pub fn open_with_budget(
        dir: &Path,
        limit_bytes: u64,
        write_budget: Option<u64>,
    ) -> Result<Self, DiskError> {
        let blocks = dir.join("blocks");
        fs::create_dir_all(&blocks).map_err(io(&blocks))?;
        // Blocks hold prompts' token ids: a tree an older version left readable is tightened.
        strata_runtime::private::tighten_tree(dir).map_err(io(dir))?;
        match Self::open_index_and_files(dir, limit_bytes, write_budget) {
            Err(DiskError::Index(e)) if index_is_damaged(&e) => {
                // Everything the index holds is in the block files too (header: namespace,
                // parent, tokens; size from the file): set it aside and adopt every file.
                // Only the LRU order and today's write count are lost.
                let index = dir.join("index");
                let aside = dir.join("index.corrupt");
                let _ = fs::remove_dir_all(&aside);
                fs::rename(&index, &aside).map_err(io(&index))?;
                tracing::warn!(error = %e, set_aside = %aside.display(), "the disk index is corrupt; rebuilding it from the block files");
                let tier = Self::open_index_and_files(dir, limit_bytes, write_budget)?;
                tracing::info!(blocks = tier.len(), "disk index rebuilt");
                Ok(tier)
            }
            other => other,
        }
    }

    fn open_index_and_files(
        dir: &Path,
        limit_bytes: u64,
        write_budget: Option<u64>,
    ) -> Result<Self, DiskError> {
        let index = open_index(&dir.join("index"))?;
        // Bookkeeping lives in its own tree: the default tree holds only block keys.
        let meta = index.open_tree("meta")?;
        let written_today = meta
            .get(WRITTEN_TODAY)?
            .and_then(|v| {
                let day = u64::from_le_bytes(v.get(0..8)?.try_into().ok()?);
                let bytes = u64::from_le_bytes(v.get(8..16)?.try_into().ok()?);
                Some((day, bytes))
            })
            .unwrap_or((0, 0));
        let mut tier = Self {
            dir: dir.to_owned(),
            index,
            limit_bytes,
            block_bytes: 0,
            lru: BTreeMap::new(),
            tracked: HashMap::new(),
            usage: HashMap::new(),
            evictions_by_namespace: HashMap::new(),
            quotas: Quotas::default(),
            clock: 0,
            sled_bytes: 0,
            sled_measured: Instant::now(),
            evictions: 0,
            bytes_written: 0,
            write_budget,
            written_today,
            meta,
            today: utc_day,
            children_at_open: Vec::new(),
            fsync: false,
        };
        tier.recover()?;
        tier.measure_sled();
        Ok(tier)
    }

    /// Brings the index and the files into agreement after any kind of stop.
    fn recover(&mut self) -> Result<(), DiskError> {
        let mut named = std::collections::HashSet::new();
        for item in self.index.iter() {
            let (k, v) = item?;
            let (Some(key), Some(entry)) = (BlockKey::from_slice(&k), IndexEntry::decode(&v))
            else {
                self.index.remove(k)?;
                continue;
            };
            let path = self.path_of(&key);
            match fs::metadata(&path) {
                Ok(m) if m.len() == entry.size => {
                    named.insert(path);
                    if let Some((parent, tokens)) = entry.child.clone() {
                        self.children_at_open.push((key, parent, tokens));
                    }
                    self.clock = self.clock.max(entry.last_access + 1);
                    self.track(key, entry.size, entry.last_access, &entry.namespace);
                }
                _ => {
                    self.index.remove(k)?;
                    let _ = fs::remove_file(&path);
                }
            }
        }
        // Files the index does not name: temporary files of interrupted writes are deleted;
        // complete block files written just before a crash (the index flushes behind the
        // files) are verified in full and indexed again, or deleted if they fail.
        let blocks = self.dir.join("blocks");
        let mut adopted = 0;
        for shard in fs::read_dir(&blocks).map_err(io(&blocks))?.flatten() {
            for file in fs::read_dir(shard.path()).into_iter().flatten().flatten() {
                let path = file.path();
                if named.contains(&path) {
                    continue;
                }
                match self.adopt(&path)? {
                    true => adopted += 1,
                    false => {
                        let _ = fs::remove_file(&path);
                    }
                }
            }
        }
        if adopted > 0 {
            tracing::info!(adopted, "re-indexed block files written just before a stop");
        }
        Ok(())
    }

    /// Indexes a complete, valid block file found without an index entry.
    fn adopt(&mut self, path: &Path) -> Result<bool, DiskError> {
        if path.extension().is_none_or(|e| e != "blk") {
            return Ok(false);
        }
        let Ok(bytes) = fs::read(path) else {
            return Ok(false);
        };
        let file_bytes = bytes.len() as u64;
        let Ok(block) = block::decode_file(Bytes::from(bytes)) else {
            return Ok(false);
        };
        let Ok(key) = block::verify(&block) else {
            return Ok(false);
        };
        if self.path_of(&key) != path {
            return Ok(false);
        }
        self.clock += 1;
        let child = child_of(&block);
        if let Some((parent, tokens)) = child.clone() {
            self.children_at_open.push((key, parent, tokens));
        }
        let entry = IndexEntry {
            size: file_bytes,
            last_access: self.clock,
            namespace: block.header.map(|h| h.namespace).unwrap_or_default(),
            child,
        };
        self.index.insert(key.0, entry.encode())?;
        self.track(key, entry.size, entry.last_access, &entry.namespace);
        Ok(true)
    }

    fn track(&mut self, key: BlockKey, size: u64, last_access: u64, namespace: &str) {
        self.untrack(&key);
        let namespace: Arc<str> = match self.usage.get_key_value(namespace) {
            Some((ns, _)) => ns.clone(),
            None => namespace.into(),
        };
        let u = self.usage.entry(namespace.clone()).or_default();
        u.0 += 1;
        u.1 += size;
        self.tracked.insert(
            key,
            Tracked {
                size,
                last_access,
                namespace,
            },
        );
        self.lru.insert((last_access, key), ());
        self.block_bytes += size;
    }

    fn untrack(&mut self, key: &BlockKey) {
        if let Some(t) = self.tracked.remove(key) {
            self.lru.remove(&(t.last_access, *key));
            self.block_bytes -= t.size;
            if let Some(u) = self.usage.get_mut(&t.namespace) {
                u.0 -= 1;
                u.1 -= t.size;
                if u.0 == 0 {
                    self.usage.remove(&t.namespace);
                }
            }
        }
    }

    /// Evicts `victim` to make room, counted per namespace.
    fn evict(&mut self, victim: &BlockKey) -> Result<(), DiskError> {
        if let Some(t) = self.tracked.get(victim) {
            super::count_bounded(&mut self.evictions_by_namespace, t.namespace.clone(), 1);
        }
        self.remove(victim)?;
        self.evictions += 1;
        Ok(())
    }

    /// `cache.fsync`: blocks survive power loss once written, at the cost of a sync per block.
    pub fn set_fsync(&mut self, on: bool) {
        self.fsync = on;
    }

    pub fn set_quotas(&mut self, quotas: Quotas) {
        self.quotas = quotas;
    }

    /// Per namespace: (blocks, bytes, evictions, quota).
    pub fn by_namespace(&self) -> HashMap<String, (u64, u64, u64, Option<u64>)> {
        let mut out: HashMap<String, (u64, u64, u64, Option<u64>)> = HashMap::new();
        for (ns, &(blocks, bytes)) in &self.usage {
            let e = out.entry(ns.to_string()).or_default();
            e.0 = blocks;
            e.1 = bytes;
        }
        for (ns, &n) in &self.evictions_by_namespace {
            out.entry(ns.to_string()).or_default().2 = n;
        }
        for (ns, e) in out.iter_mut() {
            e.3 = self.quotas.of(ns);
        }
        out
    }

    fn path_of(&self, key: &BlockKey) -> PathBuf {
        let hex = key.hex();
        self.dir
            .join("blocks")
            .join(&hex[..2])
            .join(format!("{hex}.blk"))
    }

    /// sled's files, measured from the file system (at most once a second).
    fn measure_sled(&mut self) {
        fn walk(p: &Path) -> u64 {
            match fs::metadata(p) {
                Ok(m) if m.is_dir() => fs::read_dir(p)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| walk(&e.path()))
                    .sum(),
                Ok(m) => m.len(),
                Err(_) => 0,
            }
        }
        self.sled_bytes = walk(&self.dir.join("index"));
        self.sled_measured = Instant::now();
    }

    /// Bytes on disk now: block files plus the index (re-measured at most once a second).
    pub fn used_bytes(&mut self) -> u64 {
        if self.sled_measured.elapsed() > Duration::from_secs(1) {
            self.measure_sled();
        }
        self.block_bytes + self.sled_bytes
    }

    pub fn limit_bytes(&self) -> u64 {
        self.limit_bytes
    }

    pub fn len(&self) -> usize {
        self.tracked.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.tracked.contains_key(key)
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Writes a verified block, evicting least recently used blocks to stay under the limit.
    pub fn write(&mut self, key: BlockKey, block: &Block) -> Result<(), DiskError> {
        if self.contains(&key) {
            return Ok(());
        }
        let prefix = block::encode_file_prefix(block);
        let size = (prefix.len() + block.payload.len()) as u64;
        if let Some(budget) = self.write_budget
            && self.written_today() + size > budget
        {
            return Err(DiskError::BudgetSpent { budget });
        }
        // Decide on fresh numbers: the index is measured now, and may grow by one segment.
        self.measure_sled();
        let fixed = self.sled_bytes + INDEX_GROWTH_RESERVE;
        if size + fixed > self.limit_bytes {
            return Err(DiskError::TooLarge {
                size,
                limit: self.limit_bytes,
            });
        }
        let namespace = block
            .header
            .as_ref()
            .map(|h| h.namespace.clone())
            .unwrap_or_default();
        if let Some(quota) = self.quotas.of(&namespace) {
            if size > quota {
                return Err(DiskError::OverQuota { namespace, quota });
            }
            // The namespace's own least recently used blocks make room under its quota.
            while self.usage.get(namespace.as_str()).map_or(0, |u| u.1) + size > quota {
                let victim = self.lru.keys().map(|(_, k)| *k).find(|k| {
                    self.tracked
                        .get(k)
                        .is_some_and(|t| *t.namespace == *namespace)
                });
                let Some(victim) = victim else { break };
                self.evict(&victim)?;
            }
        }
        while self.block_bytes + fixed + size > self.limit_bytes {
            let Some((&(_, victim), _)) = self.lru.iter().next() else {
                break;
            };
            self.evict(&victim)?;
        }
        let path = self.path_of(&key);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(io(parent))?;
        }
        let tmp = path.with_extension("tmp");
        let mut f = fs::File::create(&tmp).map_err(io(&tmp))?;
        let written = f
            .write_all(&prefix)
            .and_then(|()| f.write_all(&block.payload))
            .and_then(|()| if self.fsync { f.sync_all() } else { Ok(()) });
        drop(f);
        if let Err(e) = written {
            // A full disk, most often: leave nothing half-written behind.
            let _ = fs::remove_file(&tmp);
            return Err(io(&tmp)(e));
        }
        fs::rename(&tmp, &path).map_err(io(&path))?;
        if self.fsync
            && let Some(shard) = path.parent()
        {
            // The rename is durable only once its directory is.
            fs::File::open(shard)
                .and_then(|d| d.sync_all())
                .map_err(io(shard))?;
        }
        self.clock += 1;
        let entry = IndexEntry {
            size,
            last_access: self.clock,
            namespace,
            child: child_of(block),
        };
        self.index.insert(key.0, entry.encode())?;
        self.track(key, size, self.clock, &entry.namespace);
        self.bytes_written += size;
        let day = (self.today)();
        self.written_today = (day, self.written_today() + size);
        let mut v = day.to_le_bytes().to_vec();
        v.extend_from_slice(&self.written_today.1.to_le_bytes());
        self.meta.insert(WRITTEN_TODAY, v)?;
        if self.fsync {
            self.index.flush()?;
        }
        Ok(())
    }

    /// The blocks (parent, tokens) found when the tier was opened (once).
    pub fn take_children(&mut self) -> Vec<ChildEntry> {
        std::mem::take(&mut self.children_at_open)
    }

    /// Bytes written to this tier since midnight UTC.
    pub fn written_today(&self) -> u64 {
        if self.written_today.0 == (self.today)() {
            self.written_today.1
        } else {
            0
        }
    }

    pub fn write_budget(&self) -> Option<u64> {
        self.write_budget
    }

    /// Where block `key` lives, if this tier holds it. Reading the file needs no lock on the
    /// tier: files are renamed into place complete and never modified; one deleted meanwhile
    /// fails to open, which is a miss.
    pub fn locate(&self, key: &BlockKey) -> Option<(PathBuf, u64)> {
        let t = self.tracked.get(key)?;
        Some((self.path_of(key), t.size))
    }

    /// Reads and re-verifies a block; a bad file is deleted and reported.
    pub fn read(&mut self, key: &BlockKey) -> Result<ReadOutcome, DiskError> {
        let Some((path, _)) = self.locate(key) else {
            return Ok(ReadOutcome::Miss);
        };
        let outcome = read_located(&path, key);
        self.settle(key, outcome)
    }

    /// Records the result of a read made without the lock: a hit is a use (LRU), a bad file
    /// is deleted.
    pub fn settle(
        &mut self,
        key: &BlockKey,
        outcome: ReadOutcome,
    ) -> Result<ReadOutcome, DiskError> {
        match &outcome {
            ReadOutcome::Hit(_) => self.touch(key)?,
            ReadOutcome::Corrupt(_) if self.contains(key) => self.remove(key)?,
            // The index names a file that is gone (deleted behind our back): forget it.
            ReadOutcome::Miss
                if self.contains(key) && self.locate(key).is_some_and(|(p, _)| !p.exists()) =>
            {
                self.remove(key)?;
                return Ok(ReadOutcome::Corrupt("file missing".into()));
            }
            _ => {}
        }
        Ok(outcome)
    }

    /// The namespace the index records for block `key`.
    pub fn namespace_of(&self, key: &BlockKey) -> Result<Option<String>, DiskError> {
        Ok(self
            .index
            .get(key.0)?
            .and_then(|v| IndexEntry::decode(&v))
            .map(|e| e.namespace))
    }

    /// Records a use, persistently, so that LRU order survives restarts.
    pub fn touch(&mut self, key: &BlockKey) -> Result<(), DiskError> {
        let Some(t) = self.tracked.get(key) else {
            return Ok(());
        };
        let (size, namespace) = (t.size, t.namespace.clone());
        self.clock += 1;
        let clock = self.clock;
        if let Some(v) = self.index.get(key.0)?
            && let Some(mut entry) = IndexEntry::decode(&v)
        {
            entry.last_access = clock;
            self.index.insert(key.0, entry.encode())?;
        }
        self.track(*key, size, clock, &namespace);
        Ok(())
    }

    pub fn remove(&mut self, key: &BlockKey) -> Result<(), DiskError> {
        self.index.remove(key.0)?;
        let _ = fs::remove_file(self.path_of(key));
        self.untrack(key);
        Ok(())
    }

    /// Drops every block of the namespace family `namespace` (all when empty; see
    /// `store::in_family`).
    pub fn clear(&mut self, namespace: &str) -> Result<u64, DiskError> {
        let mut doomed = Vec::new();
        for item in self.index.iter() {
            let (k, v) = item?;
            if let (Some(key), Some(e)) = (BlockKey::from_slice(&k), IndexEntry::decode(&v))
                && super::in_family(&e.namespace, namespace)
            {
                doomed.push(key);
            }
        }
        for k in &doomed {
            self.remove(k)?;
        }
        Ok(doomed.len() as u64)
    }

    pub fn flush(&self) -> Result<(), DiskError> {
        self.index.flush()?;
        Ok(())
    }
}

/// Reads and verifies the file of block `key` (no lock held). A file that vanished was evicted
/// meanwhile: a miss, not corruption.
pub fn read_located(path: &Path, key: &BlockKey) -> ReadOutcome {
    match block::read_file_verified(path, key) {
        Ok(b) => ReadOutcome::Hit(Box::new(b)),
        Err(block::FileReadError::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
            ReadOutcome::Miss
        }
        Err(e) => ReadOutcome::Corrupt(e.to_string()),
    }
}

/// Opens sled, waiting briefly for a previous owner (a process still exiting, or an earlier
/// handle in this process whose flusher thread has not stopped yet) to release its lock.
/// Whether sled's error means its files are damaged (rebuild from the block files), not that
/// another process holds them or the disk refuses (then rebuilding would lose a live index
/// or fail the same way).
fn index_is_damaged(e: &sled::Error) -> bool {
    match e {
        // Unsupported: what sled says of a file it cannot parse at all (or of another sled
        // version's); either way only a rebuild gets the tier back.
        sled::Error::Corruption { .. }
        | sled::Error::ReportableBug(_)
        | sled::Error::Unsupported(_) => true,
        sled::Error::Io(io) => matches!(
            io.kind(),
            std::io::ErrorKind::InvalidData | std::io::ErrorKind::UnexpectedEof
        ),
        _ => false,
    }
}

fn open_index(path: &Path) -> Result<sled::Db, DiskError> {
    let started = Instant::now();
    loop {
        match sled::Config::new()
            .path(path)
            .cache_capacity(SLED_CACHE_BYTES)
            .flush_every_ms(Some(200))
            .open()
        {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && started.elapsed() < Duration::from_secs(5) =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return Ok(other?),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::make_block;

    fn block(token: u32, bytes: usize) -> (BlockKey, Block) {
        let b = make_block(
            "ns",
            None,
            vec![token],
            (1, 1, bytes as u32 / 8, "float32"),
            vec![token as u8; bytes],
        );
        (BlockKey::chain("ns", None, &[token]), b)
    }

    #[test]
    fn blocks_survive_reopen_and_lru_order_is_persisted() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
            for t in 0..3 {
                let (k, b) = block(t, 4096);
                d.write(k, &b).unwrap();
            }
            // Block 0 used last: after reopening, block 1 must be the oldest.
            assert!(matches!(
                d.read(&block(0, 4096).0).unwrap(),
                ReadOutcome::Hit(_)
            ));
            d.flush().unwrap();
        }
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        assert_eq!(d.len(), 3);
        let oldest = d.lru.keys().next().unwrap().1;
        assert_eq!(oldest, block(1, 4096).0);
        match d.read(&block(2, 4096).0).unwrap() {
            ReadOutcome::Hit(b) => assert_eq!(*b, block(2, 4096).1),
            _ => panic!("block 2 lost"),
        }
    }

    /// Every way of damaging sled's files tried here ends in a rebuilt index holding every
    /// block, never in a tier that refuses to open.
    #[test]
    fn a_corrupt_index_is_rebuilt_from_the_block_files() {
        type Damage = fn(&Path);
        let damages: [(&str, Damage); 3] = [
            ("garbage over every file", |index| {
                for f in fs::read_dir(index).unwrap().flatten() {
                    if f.path().is_file() {
                        fs::write(f.path(), vec![0xA5u8; 4096]).unwrap();
                    }
                }
            }),
            ("truncated files", |index| {
                for f in fs::read_dir(index).unwrap().flatten() {
                    if f.path().is_file() {
                        let len = fs::metadata(f.path()).unwrap().len();
                        let file = fs::OpenOptions::new().write(true).open(f.path()).unwrap();
                        file.set_len(len / 3).unwrap();
                    }
                }
            }),
            ("the config file garbled", |index| {
                fs::write(index.join("conf"), b"not a sled config").unwrap();
            }),
        ];
        for (what, damage) in damages {
            let dir = tempfile::tempdir().unwrap();
            {
                let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
                for t in 0..5 {
                    let (k, b) = block(t, 4096);
                    d.write(k, &b).unwrap();
                }
                d.flush().unwrap();
            }
            damage(&dir.path().join("index"));
            let mut d =
                DiskTier::open(dir.path(), 1 << 30).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(d.len(), 5, "{what}");
            for t in 0..5 {
                match d.read(&block(t, 4096).0).unwrap() {
                    ReadOutcome::Hit(b) => assert_eq!(*b, block(t, 4096).1, "{what}"),
                    _ => panic!("{what}: block {t} lost"),
                }
            }
            // The rebuilt index is a working one: it takes writes and survives a reopen.
            let (k, b) = block(99, 4096);
            d.write(k, &b).unwrap();
            d.flush().unwrap();
            drop(d);
            assert_eq!(
                DiskTier::open(dir.path(), 1 << 30).unwrap().len(),
                6,
                "{what}"
            );
        }
    }

    #[test]
    fn with_fsync_blocks_are_written_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        d.set_fsync(true);
        let (k, b) = block(7, 4096);
        d.write(k, &b).unwrap();
        drop(d);
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        match d.read(&k).unwrap() {
            ReadOutcome::Hit(read) => assert_eq!(*read, b),
            _ => panic!("block lost"),
        }
    }

    #[test]
    fn the_limit_holds_counting_the_files_themselves() {
        let dir = tempfile::tempdir().unwrap();
        // sled's footprint moves as it opens and writes: size the limit from what it takes
        // after a reopen, twice over, plus room for three blocks.
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        d.write(block(1000, 4096).0, &block(1000, 4096).1).unwrap();
        d.flush().unwrap();
        drop(d);
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        d.measure_sled();
        let limit = 2 * d.sled_bytes + INDEX_GROWTH_RESERVE + 3 * 4500;
        drop(d);
        let mut d = DiskTier::open(dir.path(), limit).unwrap();
        for t in 0..400 {
            let (k, b) = block(t, 4096);
            d.write(k, &b).unwrap();
            d.measure_sled();
            assert!(d.used_bytes() <= limit, "over the limit after block {t}");
        }
        assert!(d.evictions >= 100, "{} evictions", d.evictions);
        let on_disk: u64 = walk_files(&dir.path().join("blocks"));
        assert_eq!(on_disk, d.block_bytes());
        assert!(matches!(
            d.write(block(99, 1 << 20).0, &block(99, 1 << 20).1),
            Err(DiskError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_corrupted_file_is_a_miss_and_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        let (k, b) = block(5, 4096);
        d.write(k, &b).unwrap();
        let path = d.path_of(&k);
        let mut bytes = fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xFF;
        fs::write(&path, &bytes).unwrap();
        assert!(matches!(d.read(&k).unwrap(), ReadOutcome::Corrupt(_)));
        assert!(!path.exists());
        assert!(matches!(d.read(&k).unwrap(), ReadOutcome::Miss));
    }

    #[test]
    fn block_files_the_index_missed_are_verified_and_adopted() {
        let dir = tempfile::tempdir().unwrap();
        let (k, b) = block(3, 4096);
        let path = {
            let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
            d.write(k, &b).unwrap();
            let path = d.path_of(&k);
            // As after a crash before the index flushed: the file exists, its entry does not.
            d.index.remove(k.0).unwrap();
            d.flush().unwrap();
            path
        };
        let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        assert!(path.exists());
        match d.read(&k).unwrap() {
            ReadOutcome::Hit(got) => assert_eq!(*got, b),
            _ => panic!("not adopted"),
        }
    }

    #[test]
    fn the_daily_write_budget_holds_across_restarts_and_renews_the_next_day() {
        let dir = tempfile::tempdir().unwrap();
        let budget = Some(10_000);
        {
            let mut d = DiskTier::open_with_budget(dir.path(), 1 << 30, budget).unwrap();
            d.write(block(1, 4096).0, &block(1, 4096).1).unwrap();
            d.write(block(2, 4096).0, &block(2, 4096).1).unwrap();
            let third = d.write(block(3, 4096).0, &block(3, 4096).1);
            assert!(matches!(
                third,
                Err(DiskError::BudgetSpent { budget: 10_000 })
            ));
            d.flush().unwrap();
        }
        let mut d = DiskTier::open_with_budget(dir.path(), 1 << 30, budget).unwrap();
        assert!(d.written_today() > 8000);
        assert!(d.write(block(3, 4096).0, &block(3, 4096).1).is_err());
        d.today = || utc_day() + 1;
        assert_eq!(d.written_today(), 0);
        d.write(block(3, 4096).0, &block(3, 4096).1).unwrap();
    }

    #[test]
    fn stray_and_temporary_files_are_cleaned_at_open() {
        let dir = tempfile::tempdir().unwrap();
        {
            let mut d = DiskTier::open(dir.path(), 1 << 30).unwrap();
            let (k, b) = block(1, 4096);
            d.write(k, &b).unwrap();
            d.flush().unwrap();
        }
        let stray = dir.path().join("blocks/ab/abc.tmp");
        fs::create_dir_all(stray.parent().unwrap()).unwrap();
        fs::write(&stray, b"half a block").unwrap();
        let d = DiskTier::open(dir.path(), 1 << 30).unwrap();
        assert!(!stray.exists());
        assert_eq!(d.len(), 1);
    }

    fn walk_files(p: &Path) -> u64 {
        fs::read_dir(p)
            .unwrap()
            .flatten()
            .map(|e| {
                let m = e.metadata().unwrap();
                if m.is_dir() {
                    walk_files(&e.path())
                } else {
                    m.len()
                }
            })
            .sum()
    }
}
