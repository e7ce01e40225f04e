//! Fetch or recompute: the cost model that decides whether a hit in the cache service is
//! worth moving.

use std::time::Duration;

/// Fetch or recompute: a hit in the cache service is fetched only if moving its bytes is
/// expected to take less time than computing its tokens, from what this worker measured
/// (fetch bandwidth of its own fetches, lookup included, and prefill speed of its own
/// requests). With nothing measured yet, hits are fetched. On a CPU, computing a block takes
/// seconds and fetching it milliseconds; the rule matters on fast accelerators, where a few
/// small blocks can be cheaper to recompute than to ask for.
#[derive(Debug, Default, Clone, Copy)]
pub struct CostModel {
    pub(super) fetch_bytes_per_sec: Option<f64>,
    pub(super) prefill_tokens_per_sec: Option<f64>,
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
