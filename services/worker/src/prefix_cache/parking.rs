//! Parked KV caches: when a sequence ends, its live KV cache stays where it was computed
//! (device memory on a GPU, MLX buffers on a CPU) with the token ids it holds, so that the
//! next prompt sharing its start (a chat's next turn, the same prefix with a new question)
//! resumes from it without copying anything: the cache is cut back to the common prefix.
//! Blocks in L0, L1 and L2 are bytes on the host that a hit imports into new buffers, which
//! on a GPU cost more than the prefill they save (0.125 s for 8K tokens on an H100, where
//! mlx_lm.server, which keeps its caches live, answers in 0.045 s).
//!
//! Parked caches count against the worker's memory budget (each holds a reservation) and
//! give way to requests: the oldest go first when the byte budget is full, and all but the
//! one a request resumes from when it finds the memory taken.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::admission::{Admission, Refusal, Reservation};
use crate::engine::sequence::{ParkedKv, Resume};

/// Receives a finished sequence's KV cache (the scheduler calls it when the sequence ends).
pub type ParkFn = Box<dyn FnOnce(ParkedKv) + Send>;

struct Entry {
    /// The prefix cache's namespace (model, KV scheme, tenant): a cache resumes only
    /// prompts of the same one.
    namespace: Arc<str>,
    kv: ParkedKv,
    bytes: u64,
    /// Released with the entry, or when a request needs the memory first.
    reservation: Option<Reservation>,
}

#[derive(Default)]
pub struct ParkingStats {
    pub parked: AtomicU64,
    /// Prompts resumed from a parked cache, and the tokens they took from it.
    pub resumed: AtomicU64,
    pub resumed_tokens: AtomicU64,
    /// Caches dropped for room (byte budget or a request's memory).
    pub evicted: AtomicU64,
    /// Caches not parked: larger than the budget, or no memory left for them.
    pub refused: AtomicU64,
}

#[derive(Clone)]
pub struct Parking {
    entries: Arc<Mutex<Vec<Entry>>>,
    budget_bytes: u64,
    admission: Option<Admission>,
    pub stats: Arc<ParkingStats>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Tokens `a` and `b` share from the start.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Parking {
    /// Keeps parked caches up to `budget_bytes` in all, each reserved from `admission`.
    pub fn new(budget_bytes: u64, admission: Option<Admission>) -> Self {
        Self {
            entries: Default::default(),
            budget_bytes,
            admission,
            stats: Default::default(),
        }
    }

    /// (caches parked, bytes they hold).
    pub fn held(&self) -> (usize, u64) {
        let entries = lock(&self.entries);
        (entries.len(), entries.iter().map(|e| e.bytes).sum())
    }

    /// Parks a finished sequence's cache under `namespace`, making room by dropping the
    /// oldest; a cache whose tokens the new one continues is dropped too (the new one
    /// serves every prompt it would).
    pub fn park(&self, namespace: Arc<str>, kv: ParkedKv) {
        let bytes = kv.bytes();
        if bytes == 0 || bytes > self.budget_bytes {
            self.stats.refused.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut entries = lock(&self.entries);
        let before = entries.len();
        entries.retain(|e| !(e.namespace == namespace && kv.tokens.starts_with(&e.kv.tokens)));
        let superseded = before - entries.len();
        let mut used: u64 = entries.iter().map(|e| e.bytes).sum();
        while used + bytes > self.budget_bytes && !entries.is_empty() {
            used -= entries.remove(0).bytes;
            self.stats.evicted.fetch_add(1, Ordering::Relaxed);
        }
        let reservation = match &self.admission {
            None => None,
            Some(a) => {
                let mut r = a.reserve_bytes(bytes, "a parked KV cache");
                // Older parked caches give way to the newest, when that makes room (not when
                // it could never fit).
                while matches!(r, Err(Refusal::Busy { .. })) && !entries.is_empty() {
                    entries.remove(0);
                    self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                    r = a.reserve_bytes(bytes, "a parked KV cache");
                }
                match r {
                    Ok(r) => Some(r),
                    Err(e) => {
                        tracing::debug!("KV cache not parked: {e}");
                        self.stats.refused.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                }
            }
        };
        tracing::debug!(
            tokens = kv.tokens.len(),
            bytes,
            superseded,
            "KV cache parked"
        );
        entries.push(Entry {
            namespace,
            kv,
            bytes,
            reservation,
        });
        self.stats.parked.fetch_add(1, Ordering::Relaxed);
    }

    /// Drops every parked cache (the cache is cleared).
    pub fn clear(&self) {
        lock(&self.entries).clear();
    }

    /// Takes the parked cache of `namespace` that holds the most of `prompt` (at least
    /// `at_least` tokens), to resume `prompt` from: it leaves the parking (and its
    /// reservation: the request holds its own). `count_resume` once it is used; `park` it
    /// again if not.
    pub fn take(&self, namespace: &str, prompt: &[u32], at_least: usize) -> Option<Resume> {
        let mut entries = lock(&self.entries);
        let (i, tokens) = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| &*e.namespace == namespace)
            .map(|(i, e)| (i, common_prefix(&e.kv.tokens, prompt)))
            .max_by_key(|&(_, n)| n)
            .filter(|&(_, n)| n > 0 && n >= at_least)?;
        let entry = entries.remove(i);
        Some(Resume {
            parked: entry.kv,
            tokens,
        })
    }

    /// The most tokens of `prompt` a parked cache of `namespace` holds from the start.
    pub fn peek(&self, namespace: &str, prompt: &[u32]) -> usize {
        lock(&self.entries)
            .iter()
            .filter(|e| &*e.namespace == namespace)
            .map(|e| common_prefix(&e.kv.tokens, prompt))
            .max()
            .unwrap_or(0)
    }

    /// Counts a prompt resumed from a taken cache.
    pub fn count_resume(&self, tokens: usize) {
        self.stats.resumed.fetch_add(1, Ordering::Relaxed);
        self.stats
            .resumed_tokens
            .fetch_add(tokens as u64, Ordering::Relaxed);
    }

    /// A request found the memory taken: drops every parked cache but the one that holds
    /// the most of `prompt` (which it is about to resume from), and that one's reservation.
    /// Returns whether anything was released.
    pub fn make_room(&self, namespace: &str, prompt: &[u32]) -> bool {
        let mut entries = lock(&self.entries);
        let best = entries
            .iter()
            .enumerate()
            .filter(|(_, e)| &*e.namespace == namespace)
            .map(|(i, e)| (i, common_prefix(&e.kv.tokens, prompt)))
            .filter(|&(_, n)| n > 0)
            .max_by_key(|&(_, n)| n)
            .map(|(i, _)| i);
        let mut released = false;
        let mut i = 0;
        entries.retain_mut(|e| {
            let keep = Some(i) == best;
            i += 1;
            if keep {
                released |= e.reservation.take().is_some();
            } else {
                released = true;
                self.stats.evicted.fetch_add(1, Ordering::Relaxed);
            }
            keep
        });
        released
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::kv::{KvCache, KvLayout};
    use mlx_rs::Array;

    fn parked(tokens: &[u32]) -> ParkedKv {
        let layout = KvLayout {
            num_layers: 1,
            kv_heads: 1,
            head_dim: 4,
            dtype: mlx_rs::Dtype::Float32,
            window: None,
            recurrent: None,
        };
        let mut cache = KvCache::new(layout, 8);
        let t = tokens.len() as i32;
        let rows = Array::from_slice(&vec![0.5f32; tokens.len() * 4], &[1, 1, t, 4]);
        cache.append(0, &rows, &rows).unwrap();
        cache.advance(tokens.len());
        ParkedKv {
            tokens: tokens.to_vec(),
            cache,
            stored_blocks: 0,
        }
    }

    #[test]
    fn a_prompt_resumes_from_the_cache_that_holds_most_of_it_in_its_own_namespace() {
        let parking = Parking::new(1 << 20, None);
        parking.park("a".into(), parked(&[1, 2, 3, 4]));
        parking.park("a".into(), parked(&[1, 2, 9]));
        parking.park("b".into(), parked(&[1, 2, 3, 4, 5, 6]));
        assert_eq!(parking.held().0, 3);
        assert_eq!(parking.peek("a", &[1, 2, 3, 7]), 3);
        assert_eq!(parking.peek("c", &[1, 2, 3, 7]), 0);
        // Not enough for the caller: nothing taken.
        assert!(parking.take("a", &[1, 2, 3, 7], 4).is_none());
        let r = parking.take("a", &[1, 2, 3, 7], 2).unwrap();
        assert_eq!(
            (r.tokens, r.parked.tokens.as_slice()),
            (3, &[1, 2, 3, 4][..])
        );
        // Taken means gone.
        assert_eq!(parking.peek("a", &[1, 2, 3, 7]), 2);
        assert_eq!(parking.held().0, 2);
        assert!(parking.take("a", &[5, 6], 0).is_none());
    }

    #[test]
    fn the_oldest_give_way_and_a_continued_cache_is_superseded() {
        let one = parked(&[1; 8]).bytes();
        let parking = Parking::new(2 * one, None);
        parking.park("a".into(), parked(&[1, 2, 3, 4, 5, 6, 7, 8]));
        // Continues the first: replaces it.
        parking.park("a".into(), parked(&[1, 2, 3, 4, 5, 6, 7, 8]));
        assert_eq!(parking.held(), (1, one));
        parking.park("a".into(), parked(&[2; 8]));
        parking.park("a".into(), parked(&[3; 8]));
        assert_eq!(parking.held(), (2, 2 * one));
        assert_eq!(parking.peek("a", &[1, 2]), 0, "the oldest went first");
        assert_eq!(parking.stats.evicted.load(Ordering::Relaxed), 1);
        // Too big for the budget: not parked at all.
        Parking::new(one - 1, None).park("a".into(), parked(&[1; 8]));
    }

    #[test]
    fn parked_caches_hold_memory_and_give_it_back_to_a_request() {
        let one = parked(&[1; 8]).bytes();
        let admission = Admission::of_bytes_for_tests(10 * one);
        let parking = Parking::new(100 * one, Some(admission.clone()));
        parking.park("a".into(), parked(&[1; 8]));
        parking.park("a".into(), parked(&[2; 8]));
        assert_eq!(admission.reserved_bytes(), 2 * one);
        // A request about to resume from the second needs the memory: the first goes, the
        // second stays without its reservation.
        assert!(parking.make_room("a", &[2, 2, 2]));
        assert_eq!(parking.held(), (1, one));
        assert_eq!(admission.reserved_bytes(), 0);
        assert_eq!(parking.take("a", &[2, 2, 2], 1).unwrap().tokens, 3);
        // With no room in the budget the newest still parks: the older ones give way.
        let _taken = admission.reserve_bytes(9 * one, "a request").unwrap();
        parking.park("a".into(), parked(&[4; 8]));
        parking.park("a".into(), parked(&[5; 8]));
        assert_eq!(parking.held(), (1, one));
        assert_eq!(parking.peek("a", &[5]), 1);
        // One larger than the whole budget is refused without evicting the others.
        let small = Parking::new(100 * one, Some(Admission::of_bytes_for_tests(one * 3 / 2)));
        small.park("a".into(), parked(&[6; 8]));
        small.park("a".into(), parked(&[7; 16]));
        assert_eq!(small.held(), (1, one));
        assert_eq!(small.stats.refused.load(Ordering::Relaxed), 1);
    }
}
