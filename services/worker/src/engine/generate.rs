//! One generation from start to end: validation, chunked prefill (chunk boundaries on block
//! boundaries, so every finished block can be stored as it is computed), decode with sampling,
//! stop tokens and stop strings, incremental detokenisation, usage and timings.

use std::time::Duration;

use super::kv::KvCache;
use super::llama::SeqChunk;
use super::loader::LoadedModel;
use super::multimodal::PromptImage;
use super::sample::{Sampled, SamplingParams};
use super::sequence::{CachedKv, FinishedBlock, ParkedKv, Resume, Sequence, decode_step};
use super::{EngineError, Result};

/// Prefill this many tokens per forward pass by default (rounded down to whole blocks).
pub const DEFAULT_PREFILL_CHUNK_TOKENS: usize = 256;

/// Query-key pairs one prefill pass may score: 2^28, 6.4 GB of f16 scores over 12 heads where
/// the attention materialises them. A GPU's 4096-token pass stays whole up to a 64K prompt
/// and halves as the prompt doubles past it (a 131K prompt in 4096-token passes did not finish
/// within the call on an 80 GB H100); the CPU's 256-token passes are not touched below 1M.
pub const MAX_PASS_SCORES: usize = 1 << 28;

#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends before any of these strings; they are not part of the output.
    pub stop: Vec<String>,
    /// Generation ends after any of these tokens (besides the model's own stop tokens).
    pub stop_token_ids: Vec<u32>,
    /// Keep going past the model's EOS (benchmarks).
    pub ignore_eos: bool,
    /// Extra prefill chunk ends (absolute positions). A warm run that resumed from a partial
    /// block ends a chunk where that block ended; a cold run given the same breaks repeats
    /// its arithmetic exactly (used to verify partial-tail hits).
    pub prefill_breaks: Vec<usize>,
    /// Where the prompt's chat messages end (token positions), for hybrid models: their
    /// recurrent states are snapshotted there and a partial block stored, so that a later
    /// prompt that shares the conversation up to a message end resumes exactly there.
    pub message_ends: Vec<usize>,
    /// Images whose features fill the prompt's image positions, in order (VLMs).
    pub images: Vec<PromptImage>,
    /// Structured output: only tokens this grammar allows are sampled.
    pub grammar: Option<crate::grammar::Guide>,
    /// Speculative decoding: None follows the model's configuration (on when it has a
    /// draft), false turns it off, true asks for it (a notice says when it cannot apply).
    pub speculative: Option<bool>,
    /// SpecPrefill: prefill only this fraction of the prompt, chosen by the draft model
    /// (None: the whole prompt). Changes outputs by design; opt-in.
    pub prune_keep_ratio: Option<f32>,
}

impl GenerateRequest {
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            prefill_breaks: Vec::new(),
            message_ends: Vec::new(),
            images: Vec::new(),
            grammar: None,
            speculative: None,
            prune_keep_ratio: None,
        }
    }
}

/// An optional feature that was asked for (by the request or the model's configuration) but
/// did not apply, or applied only in part, and why: reported in the response, the log, the
/// metrics and `/admin`, never silent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    pub feature: String,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The caller stopped listening.
    Cancelled,
}

/// One generated token, as streamed.
#[derive(Debug, Clone)]
pub struct TokenEvent {
    pub token: u32,
    /// Text this token completes; may be empty (part of a character, or held back because it
    /// may begin a stop string).
    pub text: String,
    pub sampled: Sampled,
}

#[derive(Debug, Clone, Default)]
pub struct Timings {
    pub prefill: Duration,
    pub decode: Duration,
    pub time_to_first_token: Duration,
    pub phases: PrefillPhases,
}

/// Where a request's prefill time went, for the log, the trace and `bench_gpu.py`: turning
/// cached KV into the sequence's cache (import of blocks, or cutting back a parked cache), the
/// forward passes (device time included, as each pass ends by evaluating its output), reading
/// finished blocks' KV back from the device, and handing them to the cache (checksum, L0).
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefillPhases {
    pub import: Duration,
    pub passes: usize,
    pub compute: Duration,
    pub export: Duration,
    pub store: Duration,
    pub blocks: usize,
    /// Bytes of KV copied into bigger buffers during the passes.
    pub grown_bytes: usize,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub timings: Timings,
    /// Log-probabilities of each generated token, when asked for.
    pub logprobs: Vec<Sampled>,
    /// Prompt tokens whose KV was imported instead of computed.
    pub cached_tokens: usize,
    /// Features asked for that did not (fully) apply.
    pub notices: Vec<Notice>,
    /// How speculative decoding went, when it ran.
    pub speculation: Option<super::speculative::SpecStats>,
    /// Prompt tokens SpecPrefill left out of the target's prefill.
    pub pruned_tokens: usize,
}

/// KV blocks a cache holds for the prompt's leading full blocks, and where the blocks this
/// prefill completes go (index of the block in the prompt, its bytes in `KvCache::export`'s
/// layout).
#[derive(Default)]
pub struct Prefix<'a> {
    pub cached: &'a [CachedKv<'a>],
    pub on_block: Option<&'a mut (dyn FnMut(FinishedBlock) + Send)>,
    /// A parked cache to resume from instead of `cached` (see `ParkedKv`).
    pub resume: Option<Resume>,
}

/// Options of the engine itself (not of one request).
#[derive(Debug, Clone, Copy)]
pub struct EngineOptions {
    pub prefill_chunk_tokens: usize,
    /// KV buffers grow by this many tokens at a time.
    pub kv_step_tokens: usize,
    /// Also store blocks of generated tokens (opt-in; see `Sequence::finish_blocks`).
    pub store_decode_kv: bool,
    /// The prompt's last token runs in a pass of its own, so that a warm run whose whole body
    /// is cached repeats a cold run's chunks exactly (`cache.exact`). Otherwise it joins the
    /// last chunk of the body: one pass over the weights fewer for every prompt.
    pub last_token_alone: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            prefill_chunk_tokens: DEFAULT_PREFILL_CHUNK_TOKENS,
            kv_step_tokens: 256,
            store_decode_kv: false,
            last_token_alone: true,
        }
    }
}

impl LoadedModel {
    /// Checks a request against this model before anything is computed.
    pub fn validate(&self, req: &GenerateRequest) -> Result<()> {
        let invalid = |m: String| Err(EngineError::InvalidRequest(m));
        let context = self.model.config().context_length;
        if req.prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if req.max_tokens == 0 {
            return invalid("max_tokens must be at least 1".into());
        }
        if req.prompt.len() >= context {
            return invalid(format!(
                "the prompt has {} tokens; this model's context is {context}",
                req.prompt.len()
            ));
        }
        if req.prompt.len() + req.max_tokens > context {
            return invalid(format!(
                "prompt ({} tokens) plus max_tokens ({}) exceeds the context of {context} tokens",
                req.prompt.len(),
                req.max_tokens
            ));
        }
        let vocab = self.model.config().vocab_size;
        if let Some(bad) = req
            .prompt
            .iter()
            .chain(&req.stop_token_ids)
            .find(|&&t| t as usize >= vocab)
        {
            return invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            ));
        }
        if let Some(ratio) = req.prune_keep_ratio {
            super::spec_prefill::validate_ratio(ratio).map_err(EngineError::InvalidRequest)?;
        }
        req.sampling.validate().map_err(EngineError::InvalidRequest)
    }

    /// The largest multiple of `block_tokens` not above the configured chunk (at least one block).
    pub fn prefill_chunk(&self, options: &EngineOptions) -> usize {
        let b = self.block_tokens;
        (options.prefill_chunk_tokens / b).max(1) * b
    }

    /// The pass for a prompt of `prompt_tokens`: `prefill_chunk`, shortened (in whole blocks)
    /// so that one pass scores at most `MAX_PASS_SCORES` query-key pairs.
    pub fn prefill_chunk_for(&self, options: &EngineOptions, prompt_tokens: usize) -> usize {
        let b = self.block_tokens;
        let fits = MAX_PASS_SCORES / prompt_tokens.max(1) / b * b;
        self.prefill_chunk(options).min(fits.max(b))
    }

    /// Prefills `tokens` after what `cache` holds, in chunks whose ends fall on multiples of
    /// the chunk size (a multiple of the block size), and returns the last position's logits.
    pub fn prefill(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        options: &EngineOptions,
        mut on_chunk: impl FnMut(&KvCache) -> Result<()>,
    ) -> Result<Vec<f32>> {
        let chunk = self.prefill_chunk(options);
        let mut done = 0;
        let mut logits = None;
        while done < tokens.len() {
            let at = cache.len();
            let end_abs = ((at / chunk) + 1) * chunk;
            let n = (end_abs - at).min(tokens.len() - done);
            let out = self.model.forward(&mut [SeqChunk {
                tokens: &tokens[done..done + n],
                cache,
            }])?;
            out.eval()?;
            done += n;
            on_chunk(cache)?;
            logits = Some(out);
        }
        let logits =
            logits.ok_or_else(|| EngineError::InvalidRequest("nothing to prefill".into()))?;
        Ok(logits.as_slice::<f32>().to_vec())
    }

    /// Runs one request to the end, calling `on_token` for each token (return false to stop).
    pub fn generate(
        &self,
        req: &GenerateRequest,
        options: &EngineOptions,
        on_token: impl FnMut(&TokenEvent) -> bool,
    ) -> Result<Generation> {
        self.generate_with_prefix(req, options, Prefix::default(), on_token)
    }

    /// `generate`, starting from cached KV blocks for the prompt's leading full blocks and
    /// handing every block the prefill completes to `prefix.on_block`. Prefill chunks end on
    /// the same absolute positions with or without cached blocks, so the output is identical.
    pub fn generate_with_prefix(
        &self,
        req: &GenerateRequest,
        options: &EngineOptions,
        prefix: Prefix<'_>,
        on_token: impl FnMut(&TokenEvent) -> bool,
    ) -> Result<Generation> {
        self.generate_parking(req, options, prefix, on_token)
            .map(|(g, _)| g)
    }

    /// `generate_with_prefix`, also giving back the sequence's KV cache to park (see
    /// `Sequence::into_parts`).
    pub fn generate_parking(
        &self,
        req: &GenerateRequest,
        options: &EngineOptions,
        prefix: Prefix<'_>,
        mut on_token: impl FnMut(&TokenEvent) -> bool,
    ) -> Result<(Generation, Option<ParkedKv>)> {
        let mut seq = Sequence::new(self, req.clone(), options, prefix.cached, prefix.resume)?;
        let mut on_block = prefix.on_block;
        while seq.needs_prefill() {
            seq.prefill_step(
                self,
                on_block
                    .as_mut()
                    .map(|f| &mut **f as &mut (dyn FnMut(FinishedBlock) + Send)),
            )?;
        }
        let logits = seq
            .take_prefill_logits()
            .ok_or_else(|| EngineError::InvalidRequest("nothing to prefill".into()))?;
        seq.advance(self, &logits, &mut on_token)?;
        while !seq.is_finished() {
            let stepped = decode_step(self, &mut [&mut seq], &mut |_, e| on_token(e))?;
            if let Some((_, e)) = stepped.failed.into_iter().next() {
                return Err(e);
            }
        }
        seq.finish_blocks(
            on_block
                .as_mut()
                .map(|f| &mut **f as &mut (dyn FnMut(FinishedBlock) + Send)),
        )?;
        seq.into_parts()
    }
}

/// Finds stop strings in streamed text. Text that might be the start of a stop string is held
/// back until it is clear either way, so a stop string never reaches the caller.
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds text; returns what may be released and whether a stop string was found (in which
    /// case the released text ends right before it).
    pub fn push(&mut self, delta: &str) -> (String, bool) {
        self.held.push_str(delta);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .filter(|&n| s.is_char_boundary(n))
                    .find(|&n| self.held.ends_with(&s[..n]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let release = self.held.len() - keep;
        let out = self.held[..release].to_string();
        self.held.drain(..release);
        (out, false)
    }

    /// At the end: everything still held (it can no longer become a stop string), plus `tail`.
    pub fn finish(&mut self, tail: String) -> String {
        let (mut out, hit) = self.push(&tail);
        if !hit {
            out.push_str(&self.held);
        }
        self.held.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_cut_and_never_streamed() {
        let mut m = StopMatcher::new(&["\n\nUser:".to_string()]);
        assert_eq!(m.push("Hello"), ("Hello".into(), false));
        assert_eq!(m.push(" there\n"), (" there".into(), false));
        assert_eq!(m.push("\nUs"), ("".into(), false));
        assert_eq!(m.push("er: hi"), ("".into(), true));
    }

    #[test]
    fn held_text_is_released_when_it_diverges_or_ends() {
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("the E"), ("the ".into(), false));
        assert_eq!(m.push("ND"), ("".into(), true));
        let mut m = StopMatcher::new(&["END".to_string()]);
        assert_eq!(m.push("the E"), ("the ".into(), false));
        assert_eq!(m.push("xit"), ("Exit".into(), false));
        assert_eq!(m.push(" E"), (" ".into(), false));
        assert_eq!(m.finish(String::new()), "E");
    }
}
