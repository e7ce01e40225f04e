//! Memory admission: a request is refused, with the numbers, before anything is allocated
//! when its KV cache and prefill activations cannot fit in the worker's memory budget next to
//! the model. A worker must never die of a request it accepted.

use crate::engine::ModelConfig;
use crate::engine::kv::KvLayout;

/// What one request would need, and what the worker has. Running requests hold
/// reservations, so that concurrent sequences share the budget instead of each seeing all
/// of it.
#[derive(Debug, Clone)]
pub struct Admission {
    reserved: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The worker's whole memory budget.
    pub budget_bytes: u64,
    /// Resident memory with the model loaded and warmed up, before any request.
    pub baseline_bytes: u64,
    kv_bytes_per_token: u64,
    kv_step_tokens: u64,
    prefill_chunk_tokens: u64,
    heads: u64,
    hidden: u64,
    intermediate: u64,
    vocab: u64,
    /// Hybrid models: bytes of one snapshot of every recurrent layer's state (a sequence
    /// holds its live states and the snapshots its blocks will carry), and the block size
    /// the snapshots are taken at.
    recurrent_state_bytes: u64,
    snapshot_every_tokens: u64,
    /// Every request admitted (see `skipped_for_tests`).
    pub skipped: bool,
}

/// The variable that lets a test build admit every request.
pub const SKIP_ENV: &str = "STRATA_TEST_SKIP_ADMISSION";

/// Debug builds only (the binaries the e2e tests run): `STRATA_TEST_SKIP_ADMISSION=1` admits
/// every request, so that a test can watch a worker run out of memory and the rest live.
/// Release builds ignore the variable.
pub fn skipped_for_tests() -> bool {
    cfg!(debug_assertions) && std::env::var_os(SKIP_ENV).is_some_and(|v| v == "1")
}

#[derive(Debug, thiserror::Error)]
#[error(
    "this request needs about {need_mib} MiB (KV cache for {tokens} tokens at {per_token} bytes each, plus prefill activations), but the worker's memory budget of {budget_mib} MiB leaves {left_mib} MiB next to the model; send a shorter prompt or a smaller max_tokens"
)]
pub struct TooBig {
    pub need_mib: u64,
    pub tokens: u64,
    pub per_token: u64,
    pub budget_mib: u64,
    pub left_mib: u64,
}

/// The current process's resident memory, from /proc (Linux) or getrusage (macOS: peak).
pub fn resident_bytes() -> u64 {
    #[cfg(target_os = "linux")]
    {
        std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmRSS:"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<u64>().ok())
            })
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    }
    #[cfg(not(target_os = "linux"))]
    {
        // SAFETY: getrusage fills the struct we own.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
        usage.ru_maxrss as u64
    }
}

/// Physical memory of the machine.
pub fn physical_bytes() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (pages.max(0) as u64) * (size.max(0) as u64)
}

impl Admission {
    pub fn new(
        budget_bytes: u64,
        baseline_bytes: u64,
        config: &ModelConfig,
        layout: KvLayout,
        kv_step_tokens: usize,
        prefill_chunk_tokens: usize,
    ) -> Self {
        Self {
            reserved: Default::default(),
            budget_bytes,
            baseline_bytes,
            kv_bytes_per_token: layout.bytes_per_token() as u64,
            kv_step_tokens: kv_step_tokens.max(1) as u64,
            prefill_chunk_tokens: prefill_chunk_tokens.max(1) as u64,
            heads: config.num_heads as u64,
            hidden: config.hidden_size as u64,
            intermediate: config.intermediate_size as u64,
            vocab: config.vocab_size as u64,
            recurrent_state_bytes: layout.recurrent.map_or(0, |r| r.snapshot_bytes() as u64),
            snapshot_every_tokens: 0,
            skipped: skipped_for_tests(),
        }
    }

    /// Hybrid models snapshot their recurrent states every `block_tokens` (block ends); a
    /// sequence keeps the snapshots of a prefill chunk until its blocks are stored, and those
    /// of its answer until it ends.
    pub fn with_snapshots_every(mut self, block_tokens: usize) -> Self {
        self.snapshot_every_tokens = block_tokens.max(1) as u64;
        self
    }

    /// A sequence's recurrent states: the live ones and the snapshots it may hold at once
    /// (a chunk's block ends and the body's end, then its answer's block ends).
    fn recurrent_need(&self, chunk: u64, max_tokens: u64) -> u64 {
        if self.recurrent_state_bytes == 0 {
            return 0;
        }
        let every = self.snapshot_every_tokens.max(1);
        let snapshots = chunk.div_ceil(every) + max_tokens.div_ceil(every) + 2;
        (1 + snapshots) * self.recurrent_state_bytes
    }

    /// Counts KV a draft model keeps next to the target's, per token (speculative decoding
    /// and SpecPrefill grow both caches together).
    pub fn with_draft_kv(mut self, bytes_per_token: u64) -> Self {
        self.kv_bytes_per_token += bytes_per_token;
        self
    }

    /// Bytes a request of this size needs beyond the baseline: its KV cache (grown in steps)
    /// and the peak of one prefill chunk (f32 attention scores over the whole context, MLP
    /// activations, the logits), with 25% for MLX's buffer reuse.
    pub fn need(&self, prompt_tokens: usize, max_tokens: usize) -> u64 {
        let tokens = (prompt_tokens + max_tokens) as u64;
        let kv_tokens = tokens.div_ceil(self.kv_step_tokens) * self.kv_step_tokens;
        let kv = kv_tokens * self.kv_bytes_per_token;
        let chunk = self
            .prefill_chunk_tokens
            .min(prompt_tokens.max(1) as u64)
            .min((crate::engine::generate::MAX_PASS_SCORES as u64 / tokens.max(1)).max(1));
        let scores = 2 * chunk * tokens * self.heads * 4;
        let mlp = chunk * (4 * self.hidden + 3 * self.intermediate) * 4;
        let logits = 2 * self.vocab * 4;
        let states = self.recurrent_need(chunk, max_tokens as u64);
        (kv + scores + mlp + logits + states) * 5 / 4
    }

    /// Reserves what a request needs for as long as the returned guard lives. `Busy` when it
    /// would fit alone but not next to the requests running now (retry later).
    pub fn reserve(&self, prompt_tokens: usize, max_tokens: usize) -> Result<Reservation, Refusal> {
        if self.skipped {
            return Ok(self.held(0));
        }
        let need = self
            .check(prompt_tokens, max_tokens)
            .map_err(Refusal::TooBig)?;
        self.take(need)
    }

    /// Reserves `bytes` of transient memory (decoding a request's images) for as long as the
    /// guard lives, under the same budget as the requests' KV: `Decode` when it cannot fit
    /// even alone, `Busy` when it cannot fit now.
    pub fn reserve_bytes(&self, bytes: u64, what: &str) -> Result<Reservation, Refusal> {
        if self.skipped || bytes == 0 {
            return Ok(self.held(0));
        }
        let left = self.budget_bytes.saturating_sub(self.baseline_bytes);
        if bytes > left {
            return Err(Refusal::Decode {
                what: what.to_string(),
                need_mib: bytes.div_ceil(1 << 20),
                left_mib: left >> 20,
            });
        }
        self.take(bytes)
    }

    /// Takes `bytes` from what the running requests leave of the budget, or `Busy`.
    fn take(&self, bytes: u64) -> Result<Reservation, Refusal> {
        let left = self.budget_bytes.saturating_sub(self.baseline_bytes);
        let taken = self
            .reserved
            .fetch_update(
                std::sync::atomic::Ordering::AcqRel,
                std::sync::atomic::Ordering::Acquire,
                |r| (r + bytes <= left).then_some(r + bytes),
            )
            .is_ok();
        if !taken {
            return Err(Refusal::Busy {
                need_mib: bytes.div_ceil(1 << 20),
                reserved_mib: self.reserved.load(std::sync::atomic::Ordering::Acquire) >> 20,
            });
        }
        Ok(self.held(bytes))
    }

    fn held(&self, bytes: u64) -> Reservation {
        Reservation {
            reserved: self.reserved.clone(),
            bytes,
        }
    }

    /// A budget of `budget_bytes` for reservations of bytes alone (other modules' tests).
    #[cfg(test)]
    pub(crate) fn of_bytes_for_tests(budget_bytes: u64) -> Self {
        Self {
            reserved: Default::default(),
            budget_bytes,
            baseline_bytes: 0,
            kv_bytes_per_token: 1,
            kv_step_tokens: 1,
            prefill_chunk_tokens: 1,
            heads: 1,
            hidden: 1,
            intermediate: 1,
            vocab: 1,
            recurrent_state_bytes: 0,
            snapshot_every_tokens: 0,
            skipped: false,
        }
    }

    pub fn reserved_bytes(&self) -> u64 {
        self.reserved.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn check(&self, prompt_tokens: usize, max_tokens: usize) -> Result<u64, TooBig> {
        let need = self.need(prompt_tokens, max_tokens);
        let left = self.budget_bytes.saturating_sub(self.baseline_bytes);
        if need <= left {
            return Ok(need);
        }
        Err(TooBig {
            need_mib: need >> 20,
            tokens: (prompt_tokens + max_tokens) as u64,
            per_token: self.kv_bytes_per_token,
            budget_mib: self.budget_bytes >> 20,
            left_mib: left >> 20,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error(transparent)]
    TooBig(TooBig),
    #[error(
        "the worker's memory is taken by running requests ({reserved_mib} MiB reserved; this one needs {need_mib} MiB); retry shortly"
    )]
    Busy { need_mib: u64, reserved_mib: u64 },
    #[error(
        "{what} needs about {need_mib} MiB to decode, but the worker's memory budget leaves {left_mib} MiB next to the model; send a smaller image"
    )]
    Decode {
        what: String,
        need_mib: u64,
        left_mib: u64,
    },
}

/// Memory held for a running request; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    reserved: std::sync::Arc<std::sync::atomic::AtomicU64>,
    bytes: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.reserved
            .fetch_sub(self.bytes, std::sync::atomic::Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(budget: u64) -> Admission {
        Admission {
            reserved: Default::default(),
            budget_bytes: budget,
            baseline_bytes: 500 << 20,
            kv_bytes_per_token: 46_080,
            kv_step_tokens: 256,
            prefill_chunk_tokens: 256,
            heads: 9,
            hidden: 576,
            intermediate: 1536,
            vocab: 49_152,
            recurrent_state_bytes: 0,
            snapshot_every_tokens: 0,
            skipped: false,
        }
    }

    /// A hybrid model's sequence holds its recurrent states and the snapshots of a chunk and
    /// of its answer: Qwen3.6-35B-A3B's 30 linear layers are ~66 MB a snapshot in f32, so a
    /// request that fits as KV alone can be refused for its states.
    #[test]
    fn recurrent_states_and_their_snapshots_are_counted() {
        let plain = admission(1 << 30);
        let hybrid = Admission {
            recurrent_state_bytes: 66 << 20,
            ..admission(1 << 30)
        }
        .with_snapshots_every(256);
        // Live states + 1 chunk snapshot + 1 answer snapshot + 2 = 5 snapshots of 66 MiB.
        let extra = hybrid.need(256, 100) - plain.need(256, 100);
        assert_eq!(extra, 5 * (66 << 20) * 5 / 4);
        // More answer blocks, more snapshots held until the end.
        assert!(hybrid.need(256, 1000) - plain.need(256, 1000) > extra);
        assert!(plain.check(256, 100).is_ok());
        assert!(hybrid.check(256, 2000).is_err());
    }

    #[test]
    fn need_grows_with_tokens_and_refusals_carry_the_numbers() {
        let a = admission(1 << 30);
        assert!(a.need(100, 100) < a.need(1000, 100));
        assert!(a.need(1000, 100) < a.need(1000, 4000));
        assert!(a.check(100, 100).is_ok());
        let e = a.check(4000, 4000).unwrap_err();
        assert_eq!(e.tokens, 8000);
        assert_eq!(e.left_mib, 524);
        let msg = e.to_string();
        assert!(
            msg.contains("8000 tokens") && msg.contains("1024 MiB"),
            "{msg}"
        );
        // A budget below the baseline refuses everything, clearly.
        assert!(admission(100 << 20).check(1, 1).is_err());
    }

    #[test]
    fn concurrent_requests_share_the_budget_and_give_it_back() {
        let a = admission(1 << 30);
        let need = a.need(2000, 2000);
        let n = (524 << 20) / need;
        let held: Vec<Reservation> = (0..n).map(|_| a.reserve(2000, 2000).unwrap()).collect();
        assert!(matches!(a.reserve(2000, 2000), Err(Refusal::Busy { .. })));
        drop(held);
        assert_eq!(a.reserved_bytes(), 0);
        assert!(a.reserve(2000, 2000).is_ok());
    }

    #[test]
    fn decoding_an_image_is_admitted_against_the_same_budget() {
        let a = admission(1 << 30);
        // 524 MiB left next to the model: a 50-megapixel decode (~350 MiB) fits alone...
        let image = 50_000_000 * 7;
        let decoding = a.reserve_bytes(image, "image 1").unwrap();
        // ...not twice at once, and not next to requests holding the rest.
        assert!(matches!(
            a.reserve_bytes(image, "image 1"),
            Err(Refusal::Busy { .. })
        ));
        drop(decoding);
        assert_eq!(a.reserved_bytes(), 0);
        let e = a.reserve_bytes(600 << 20, "image 3").unwrap_err();
        assert!(matches!(e, Refusal::Decode { .. }));
        let msg = e.to_string();
        assert!(msg.contains("image 3") && msg.contains("600 MiB"), "{msg}");
        assert!(a.reserve_bytes(0, "no image").is_ok());
    }
}
