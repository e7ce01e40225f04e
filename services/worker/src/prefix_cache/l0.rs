//! L0: the KV blocks this worker computed or fetched recently, an LRU by bytes. Blocks are
//! found by chain key (a prompt's whole blocks) and by their tokens under their parent (the
//! block that continues a held prefix: a partial tail, or at token granularity any block by
//! common prefix), so several branches of one prefix are held and found at once.

use std::collections::{BTreeMap, HashMap};

use prost::bytes::Bytes;
use strata_kvblock::block::{BlockKey, Continuation};

struct Entry {
    bytes: Bytes,
    tick: u64,
    parent: BlockKey,
}

pub(super) struct L0 {
    limit_bytes: u64,
    used_bytes: u64,
    tick: u64,
    entries: HashMap<BlockKey, Entry>,
    order: BTreeMap<u64, BlockKey>,
    /// Every held block by parent: (token ids, key). Kept in step with `entries` (an evicted
    /// block leaves its parent's list).
    children: HashMap<BlockKey, Vec<(Vec<u32>, BlockKey)>>,
}

/// A held block that continues a prompt: its payload and how many of its leading rows are
/// the prompt's.
pub(super) struct Continued {
    pub bytes: Bytes,
    pub rows: usize,
}

impl L0 {
    pub fn new(limit_bytes: u64) -> Self {
        Self {
            limit_bytes,
            used_bytes: 0,
            tick: 0,
            entries: HashMap::new(),
            order: BTreeMap::new(),
            children: HashMap::new(),
        }
    }

    /// Forgets every block; returns how many there were.
    pub fn clear(&mut self) -> u64 {
        let n = self.entries.len() as u64;
        *self = Self::new(self.limit_bytes);
        n
    }

    #[cfg(test)]
    pub fn used_bytes(&self) -> u64 {
        self.used_bytes
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.entries.contains_key(key)
    }

    /// The block of `key`, now the most recently used.
    pub fn get(&mut self, key: &BlockKey) -> Option<Bytes> {
        self.tick += 1;
        let entry = self.entries.get_mut(key)?;
        self.order.remove(&entry.tick);
        entry.tick = self.tick;
        self.order.insert(self.tick, *key);
        Some(entry.bytes.clone())
    }

    /// Keeps a block of `tokens` under `parent`, evicting the least recently used ones to make
    /// room. A block larger than L0 is not kept.
    pub fn insert(&mut self, parent: BlockKey, tokens: Vec<u32>, key: BlockKey, bytes: Bytes) {
        let size = bytes.len() as u64;
        if size > self.limit_bytes || self.entries.contains_key(&key) {
            return;
        }
        while self.used_bytes + size > self.limit_bytes {
            let Some((_, victim)) = self.order.pop_first() else {
                break;
            };
            self.forget(&victim);
        }
        self.tick += 1;
        self.order.insert(self.tick, key);
        self.entries.insert(
            key,
            Entry {
                bytes,
                tick: self.tick,
                parent,
            },
        );
        self.used_bytes += size;
        self.children.entry(parent).or_default().push((tokens, key));
    }

    fn forget(&mut self, key: &BlockKey) {
        let Some(entry) = self.entries.remove(key) else {
            return;
        };
        self.used_bytes -= entry.bytes.len() as u64;
        if let Some(list) = self.children.get_mut(&entry.parent) {
            list.retain(|(_, k)| k != key);
            if list.is_empty() {
                self.children.remove(&entry.parent);
            }
        }
    }

    /// The held block under `parent` that gives the most leading tokens of `tail` by `how`.
    pub fn find_child(
        &mut self,
        parent: &BlockKey,
        tail: &[u32],
        how: Continuation,
    ) -> Option<Continued> {
        let (rows, key) = self
            .children
            .get(parent)?
            .iter()
            .map(|(tokens, key)| (how.rows(tokens, tail), *key))
            .filter(|(rows, _)| *rows > 0)
            .max_by_key(|(rows, _)| *rows)?;
        let bytes = self.get(&key)?;
        Some(Continued { bytes, rows })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_kvblock::block::root_of;

    /// A 30-byte block whose bytes name it.
    fn block(tag: u8) -> Bytes {
        Bytes::from(vec![tag; 30])
    }

    #[test]
    fn the_longest_continuation_is_found_and_evicted_blocks_are_forgotten() {
        let mut l0 = L0::new(100);
        let parent = root_of("ns");
        let short = BlockKey::chain("ns", None, &[1, 2]);
        let long = BlockKey::chain("ns", None, &[1, 2, 3]);
        let other = BlockKey::chain("ns", None, &[1, 9]);
        let (short_tag, long_tag, other_tag) = (1, 2, 3);
        l0.insert(parent, vec![1, 2], short, block(1));
        l0.insert(parent, vec![1, 2, 3], long, block(2));
        l0.insert(parent, vec![1, 9], other, block(3));
        let whole = Continuation::WholePartial { block_tokens: 4 };
        let found = |l0: &mut L0, tail: &[u32], how| {
            l0.find_child(&parent, tail, how)
                .map(|c| (c.rows, c.bytes[0]))
        };
        assert_eq!(found(&mut l0, &[1, 2, 3, 4], whole), Some((3, long_tag)));
        assert_eq!(found(&mut l0, &[1, 2], whole), Some((2, short_tag)));
        assert_eq!(found(&mut l0, &[5], whole), None);
        // By common prefix, a block whose later tokens differ gives its leading rows.
        let common = Continuation::CommonPrefix;
        assert_eq!(found(&mut l0, &[1, 2, 3, 9], common), Some((3, long_tag)));
        assert_eq!(found(&mut l0, &[1, 9, 9], common), Some((2, other_tag)));
        // Room for three: a fourth block evicts the least recently used (`short`).
        l0.insert(parent, vec![7], BlockKey::chain("ns", None, &[7]), block(4));
        assert!(!l0.contains(&short));
        assert_eq!(found(&mut l0, &[1, 2], whole), None);
        assert_eq!(found(&mut l0, &[1, 2, 5], common), Some((2, long_tag)));
        assert_eq!(
            l0.children[&parent].len(),
            3,
            "the evicted block left the index"
        );
        assert_eq!(l0.used_bytes(), 90);
    }
}
