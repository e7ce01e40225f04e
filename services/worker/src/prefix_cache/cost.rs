//! Fetch or recompute: the cost model that decides whether a hit in the cache service is
//! worth moving.

use std::time::Duration;

/// Fetch or recompute: a hit in the cache service is fetched only if moving its bytes is
/// expected to take less time than computing its tokens, from what this worker measured
/// (fetch bandwidth of its own fetches, lookup included, and prefill speed of its own
/// requests). With nothing measured yet, hits are fetched. On a CPU, computing a block takes
/// seconds and fetching it milliseconds; the rule matters on fast accelerators, where a few
/// small blocks can be cheaper to recompute than to ask for.
///
/// Two guards keep one unlucky measurement from turning the cache off for good (seen on an
/// H100: the first fetch after a restart, one block over a fresh connection, measured 16 MB/s
/// and every later hit was recomputed): bandwidth is learnt only from fetches large enough
/// for their bytes, not the round trip, to dominate; and after a run of skipped fetches the
/// next one is made anyway, so that the estimate is measured again.
#[derive(Debug, Default, Clone, Copy)]
pub struct CostModel {
    pub(super) fetch_bytes_per_sec: Option<f64>,
    pub(super) prefill_tokens_per_sec: Option<f64>,
    skipped_in_a_row: u32,
}

impl CostModel {
    /// Weight of a new measurement in the running averages.
    const ALPHA: f64 = 0.3;
    /// Fetches smaller than this measure the round trip more than the bandwidth.
    pub const MIN_BANDWIDTH_SAMPLE: u64 = 32 << 20;
    /// After this many fetches skipped in a row, the next one is made to measure again.
    pub const RECHECK_AFTER_SKIPS: u32 = 8;

    fn blend(old: Option<f64>, new: f64) -> Option<f64> {
        Some(match old {
            Some(o) => o * (1.0 - Self::ALPHA) + new * Self::ALPHA,
            None => new,
        })
    }

    pub fn record_fetch(&mut self, bytes: u64, took: Duration) {
        self.skipped_in_a_row = 0;
        let secs = took.as_secs_f64();
        if bytes >= Self::MIN_BANDWIDTH_SAMPLE && secs > 0.0 {
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

    /// Whether to fetch `bytes` rather than compute `tokens`: if it is expected to be faster,
    /// or to measure again after `RECHECK_AFTER_SKIPS` skips in a row.
    pub fn worth_fetching(&mut self, tokens: usize, bytes: u64) -> bool {
        let faster = match (self.fetch_bytes_per_sec, self.prefill_tokens_per_sec) {
            (Some(bw), Some(tps)) => bytes as f64 / bw < tokens as f64 / tps,
            _ => true,
        };
        if faster || self.skipped_in_a_row >= Self::RECHECK_AFTER_SKIPS {
            return true;
        }
        self.skipped_in_a_row += 1;
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_are_fetched_until_both_speeds_are_measured() {
        let mut m = CostModel::default();
        assert!(m.worth_fetching(256, 1 << 30));
        m.record_fetch(1 << 30, Duration::from_millis(100));
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
        m.record_fetch(1 << 30, Duration::ZERO);
        assert_eq!(m.prefill_tokens_per_sec.unwrap(), tps);
        assert!(m.fetch_bytes_per_sec.is_none());
    }

    #[test]
    fn a_small_fetch_measures_the_round_trip_not_the_bandwidth() {
        let mut m = CostModel::default();
        m.record_prefill(15_000, Duration::from_secs(1));
        // One 7 MB block over a fresh connection in 0.44 s (16 MB/s) teaches nothing...
        m.record_fetch(7 << 20, Duration::from_millis(440));
        assert!(m.fetch_bytes_per_sec.is_none());
        // ...so an 8K-token hit of 235 MB is still fetched.
        assert!(m.worth_fetching(8191, 235_000_000));
        // A large one does: 256 MiB in 0.128 s.
        m.record_fetch(256 << 20, Duration::from_millis(128));
        let bw = m.fetch_bytes_per_sec.unwrap();
        assert!((bw - (256u64 << 20) as f64 / 0.128).abs() < 1e3, "{bw}");
    }

    #[test]
    fn after_a_run_of_skips_the_next_fetch_measures_again() {
        let mut m = CostModel::default();
        // A slow disk measured once: 100 MB/s, against 15K tokens/s of prefill.
        m.record_fetch(1 << 30, Duration::from_millis(10_737));
        m.record_prefill(15_000, Duration::from_secs(1));
        for _ in 0..CostModel::RECHECK_AFTER_SKIPS {
            assert!(!m.worth_fetching(8191, 235_000_000));
        }
        assert!(m.worth_fetching(8191, 235_000_000), "measured again");
        // That fetch found the disk fast now: hits are fetched again.
        m.record_fetch(235_000_000, Duration::from_millis(100));
        m.record_fetch(235_000_000, Duration::from_millis(100));
        m.record_fetch(235_000_000, Duration::from_millis(100));
        assert!(m.worth_fetching(8191, 235_000_000));
    }
}
