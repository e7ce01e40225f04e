//! L1: blocks in RAM, least recently used first out, bounded by payload bytes.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use strata_proto::kvcache::Block;

use crate::block::BlockKey;

struct Entry {
    block: Arc<Block>,
    bytes: u64,
    tick: u64,
    /// Already on disk: evicting it loses nothing.
    persisted: bool,
    /// In the disk writer's queue now.
    queued: bool,
    /// The disk tier refused it by policy (budget, quota, size): not tried again.
    skipped: bool,
}

pub struct RamTier {
    limit_bytes: u64,
    used_bytes: u64,
    tick: u64,
    entries: HashMap<BlockKey, Entry>,
    /// tick -> key, oldest first.
    order: BTreeMap<u64, BlockKey>,
    /// Evictions per namespace, for Stats.
    evictions_by_namespace: HashMap<String, u64>,
}

/// What `insert` had to push out to make room.
#[derive(Debug, Default)]
pub struct Evicted {
    pub blocks: u64,
    /// Evicted before they reached the disk (lost from the cache).
    pub unpersisted: u64,
}

pub fn block_bytes(block: &Block) -> u64 {
    block.payload.len() as u64 + 256 // header and bookkeeping, roughly
}

impl RamTier {
    pub fn new(limit_bytes: u64) -> Self {
        Self {
            limit_bytes,
            used_bytes: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            evictions_by_namespace: HashMap::new(),
        }
    }

    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The block, marked as just used.
    pub fn get(&mut self, key: &BlockKey) -> Option<Arc<Block>> {
        self.tick += 1;
        let tick = self.tick;
        let e = self.entries.get_mut(key)?;
        self.order.remove(&e.tick);
        e.tick = tick;
        self.order.insert(tick, *key);
        Some(e.block.clone())
    }

    /// The block, without marking a use.
    pub fn peek(&self, key: &BlockKey) -> Option<&Arc<Block>> {
        self.entries.get(key).map(|e| &e.block)
    }

    /// Whether the block is held and already written to disk (without marking a use).
    pub fn is_persisted(&self, key: &BlockKey) -> bool {
        self.entries.get(key).is_some_and(|e| e.persisted)
    }

    /// Keeps `block`, evicting least recently used blocks (those already on disk first) until
    /// it fits. Returns None if the block alone is larger than the tier.
    pub fn insert(&mut self, key: BlockKey, block: Arc<Block>, persisted: bool) -> Option<Evicted> {
        let bytes = block_bytes(&block);
        if bytes > self.limit_bytes {
            return None;
        }
        self.remove(&key);
        let mut evicted = Evicted::default();
        while self.used_bytes + bytes > self.limit_bytes {
            let victim = self
                .order
                .values()
                .find(|k| self.entries.get(*k).is_some_and(|e| e.persisted))
                .or_else(|| self.order.values().next())
                .copied();
            let Some(victim) = victim else { break };
            if let Some(e) = self.remove(&victim) {
                evicted.blocks += 1;
                if let Some(h) = e.block.header.as_ref() {
                    super::count_bounded(&mut self.evictions_by_namespace, h.namespace.clone(), 1);
                }
                if !e.persisted {
                    evicted.unpersisted += 1;
                }
            }
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.used_bytes += bytes;
        self.entries.insert(
            key,
            Entry {
                block,
                bytes,
                tick: self.tick,
                persisted,
                queued: false,
                skipped: false,
            },
        );
        Some(evicted)
    }

    pub fn set_queued(&mut self, key: &BlockKey, queued: bool) {
        if let Some(e) = self.entries.get_mut(key) {
            e.queued = queued;
        }
    }

    pub fn mark_skipped(&mut self, key: &BlockKey) {
        if let Some(e) = self.entries.get_mut(key) {
            e.skipped = true;
            e.queued = false;
        }
    }

    /// Up to `max` blocks still to be written (not on disk, not queued, not refused), oldest
    /// first: those the writer could not take when they arrived.
    pub fn unwritten(&self, max: usize) -> Vec<(BlockKey, Arc<Block>)> {
        self.order
            .values()
            .filter_map(|k| {
                let e = self.entries.get(k)?;
                (!e.persisted && !e.queued && !e.skipped).then(|| (*k, e.block.clone()))
            })
            .take(max)
            .collect()
    }

    pub fn mark_persisted(&mut self, key: &BlockKey) {
        if let Some(e) = self.entries.get_mut(key) {
            e.persisted = true;
            e.queued = false;
        }
    }

    fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.order.remove(&e.tick);
        self.used_bytes -= e.bytes;
        Some(e)
    }

    /// (blocks, bytes, evictions) per namespace.
    pub fn by_namespace(&self) -> HashMap<String, (u64, u64, u64)> {
        let mut out: HashMap<String, (u64, u64, u64)> = HashMap::new();
        for e in self.entries.values() {
            if let Some(h) = e.block.header.as_ref() {
                let u = out.entry(h.namespace.clone()).or_default();
                u.0 += 1;
                u.1 += e.bytes;
            }
        }
        for (ns, n) in &self.evictions_by_namespace {
            out.entry(ns.clone()).or_default().2 = *n;
        }
        out
    }

    /// Drops every block of the namespace family `namespace` (all when empty; see
    /// `store::in_family`); returns how many.
    pub fn clear(&mut self, namespace: &str) -> u64 {
        let doomed: Vec<BlockKey> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                namespace.is_empty()
                    || e.block
                        .header
                        .as_ref()
                        .is_some_and(|h| super::in_family(&h.namespace, namespace))
            })
            .map(|(k, _)| *k)
            .collect();
        for k in &doomed {
            self.remove(k);
        }
        doomed.len() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block::make_block;

    fn block(token: u32) -> (BlockKey, Arc<Block>) {
        let b = make_block(
            "ns",
            None,
            vec![token],
            (1, 1, 16, "float32"),
            vec![0u8; 128],
        );
        (BlockKey::chain("ns", None, &[token]), Arc::new(b))
    }

    #[test]
    fn evicts_least_recently_used_by_bytes_preferring_persisted_blocks() {
        let one = block_bytes(&block(0).1);
        let mut ram = RamTier::new(3 * one);
        for t in 0..3 {
            let (k, b) = block(t);
            ram.insert(k, b, t != 0).unwrap();
        }
        // Touch block 1: block 2 is now the least recently used persisted one; 0 is older but
        // not yet on disk, so it stays.
        ram.get(&block(1).0).unwrap();
        let ev = ram.insert(block(3).0, block(3).1, false).unwrap();
        assert_eq!(ev.blocks, 1);
        assert_eq!(ev.unpersisted, 0);
        assert!(ram.contains(&block(0).0));
        assert!(!ram.contains(&block(2).0));
        assert!(ram.used_bytes() <= 3 * one);
        // Nothing persisted left but block 1: it goes next, then the oldest unpersisted.
        ram.insert(block(4).0, block(4).1, false).unwrap();
        assert!(!ram.contains(&block(1).0));
        let ev = ram.insert(block(5).0, block(5).1, false).unwrap();
        assert_eq!(ev.unpersisted, 1);
        assert!(!ram.contains(&block(0).0));
        assert_eq!(ram.len(), 3);
    }

    #[test]
    fn a_block_larger_than_the_tier_is_refused() {
        let mut ram = RamTier::new(10);
        assert!(ram.insert(block(0).0, block(0).1, false).is_none());
        assert!(ram.is_empty());
    }
}
