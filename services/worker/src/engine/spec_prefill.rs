//! SpecPrefill-style prompt pruning (opt-in per request): the draft model reads the whole
//! prompt, its last tokens (where the question usually is) score every earlier position by
//! the attention they pay it, and the target prefills only the best-scoring chunks, each at
//! its own position in the full prompt (RoPE positions are kept, the skipped ones are simply
//! absent from the KV). Time to first token drops with the target's share of the work; the
//! answer can change, by design, so it is never on by default and every response says how
//! much was pruned.
//!
//! A pruned prompt neither reads nor writes the prefix cache: its KV is not the prompt's KV.

use std::ops::Range;

use super::generate::GenerateRequest;
use super::kv::KvCache;
use super::llama::SeqChunk;
use super::loader::LoadedModel;
use super::speculative::Draft;
use super::{EngineError, Result};

/// The feature name in notices, metrics and `/admin`.
pub const FEATURE: &str = "prompt_pruning";
/// Shorter prompts are prefilled whole: there is little to save.
pub const MIN_PROMPT_TOKENS: usize = 512;
/// Prompt tokens are kept or dropped in chunks of this many (phrases, not scattered tokens).
pub const CHUNK_TOKENS: usize = 32;
/// The prompt's last tokens score the others, and are always kept, as is its first chunk
/// (instructions and the attention sink).
pub const QUERY_TOKENS: usize = 64;

/// Whether a request's prompt is pruned, and how much of it is kept.
#[derive(Debug, Clone, PartialEq)]
pub enum Plan {
    Off,
    Keep(f32),
    /// Asked for and not applied, and why.
    NotApplied(String),
}

/// Checks the keep ratio a request asks for.
pub fn validate_ratio(ratio: f32) -> Result<(), String> {
    if ratio.is_finite() && ratio > 0.0 && ratio <= 1.0 {
        Ok(())
    } else {
        Err(format!(
            "prompt_pruning.keep_ratio must be in (0, 1], got {ratio}"
        ))
    }
}

pub fn plan(model: &LoadedModel, req: &GenerateRequest) -> Plan {
    let Some(ratio) = req.prune_keep_ratio else {
        return Plan::Off;
    };
    let n = req.prompt.len();
    let why = match &model.draft {
        None => "this model has no draft model to score the prompt with".to_string(),
        Some(_) if !req.images.is_empty() => {
            "the prompt has images, and the draft reads text only".to_string()
        }
        // Skipped positions and attention scores over the whole prompt do not fit layers
        // that keep only a window of it.
        Some(d)
            if model.model.config().sliding_window.is_some()
                || d.model.config().sliding_window.is_some() =>
        {
            "the model has sliding-window layers".to_string()
        }
        Some(d) if model.model.is_hybrid() || d.model.is_hybrid() => {
            "the model has recurrent (linear-attention) layers, which read every token".to_string()
        }
        Some(_) if n < MIN_PROMPT_TOKENS => {
            format!("the prompt has {n} tokens; pruning starts at {MIN_PROMPT_TOKENS}")
        }
        Some(d) if n > d.model.config().context_length => format!(
            "the prompt exceeds the draft model's context of {} tokens",
            d.model.config().context_length
        ),
        Some(_) if ratio >= 1.0 => return Plan::Off,
        Some(_) => return Plan::Keep(ratio),
    };
    Plan::NotApplied(why)
}

/// The draft reading a prompt to score it, one chunk per engine step (so that a long
/// prompt's scoring is interleaved with other sequences' decode steps, like a prefill).
pub struct Scoring {
    cache: KvCache,
    keep_ratio: f32,
}

/// What a scoring step left: more to read, or the chosen ranges and the draft's KV cache,
/// which then holds the whole prompt (speculative decoding goes on from it).
pub enum Scored {
    Reading(Scoring),
    Chosen(Vec<Range<usize>>, KvCache),
}

impl Scoring {
    pub fn new(draft: &Draft, keep_ratio: f32, kv_step_tokens: usize) -> Self {
        Self {
            cache: draft.model.new_cache(kv_step_tokens),
            keep_ratio,
        }
    }

    /// Reads the next `chunk` tokens of the prompt's body; once the body is read, runs the
    /// last `QUERY_TOKENS` through the attention-scoring pass and chooses what the target
    /// prefills: ranges of prompt positions, in order, the first chunk and the last
    /// `QUERY_TOKENS` always among them.
    pub fn step(mut self, draft: &Draft, prompt: &[u32], chunk: usize) -> Result<Scored> {
        let n = prompt.len();
        let body = n - QUERY_TOKENS.min(n / 2);
        let at = self.cache.len();
        if at < body {
            let end = (at + chunk.max(1)).min(body);
            draft
                .model
                .forward(&mut [SeqChunk {
                    tokens: &prompt[at..end],
                    cache: &mut self.cache,
                }])?
                .eval()?;
            return Ok(Scored::Reading(self));
        }
        let weights = draft.model.attention_to_positions(SeqChunk {
            tokens: &prompt[body..],
            cache: &mut self.cache,
        })?;
        weights.eval()?;
        let weights = weights.as_slice::<f32>();
        if weights.len() != n {
            return Err(EngineError::Mlx(format!(
                "attention scores for {} positions, expected {n}",
                weights.len()
            )));
        }
        Ok(Scored::Chosen(
            choose(weights, self.keep_ratio, body),
            self.cache,
        ))
    }
}

/// The chunks to keep, as merged ranges: the first chunk and everything from `tail_start`,
/// then the chunks with the highest mean weight until `keep_ratio` of the positions are kept.
pub fn choose(weights: &[f32], keep_ratio: f32, tail_start: usize) -> Vec<Range<usize>> {
    let n = weights.len();
    let chunks = n.div_ceil(CHUNK_TOKENS);
    let range = |c: usize| c * CHUNK_TOKENS..((c + 1) * CHUNK_TOKENS).min(n);
    let mut keep = vec![false; chunks];
    keep[0] = true;
    for (c, k) in keep.iter_mut().enumerate() {
        if range(c).end > tail_start {
            *k = true;
        }
    }
    // Less a hair: 0.3f32 is 0.30000001, and 30% of 320 must not round up to 97.
    let budget = (f64::from(keep_ratio) * n as f64 - 1e-3).ceil().max(0.0) as usize;
    let mut kept: usize = (0..chunks)
        .filter(|&c| keep[c])
        .map(|c| range(c).len())
        .sum();
    let mut order: Vec<(usize, f32)> = (0..chunks)
        .filter(|&c| !keep[c])
        .map(|c| {
            let r = range(c);
            let mean = weights[r.clone()].iter().sum::<f32>() / r.len() as f32;
            (c, mean)
        })
        .collect();
    // Highest weight first; earlier chunks first among equals.
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    for (c, _) in order {
        if kept >= budget {
            break;
        }
        keep[c] = true;
        kept += range(c).len();
    }
    let mut out: Vec<Range<usize>> = Vec::new();
    for c in (0..chunks).filter(|&c| keep[c]) {
        let r = range(c);
        match out.last_mut() {
            Some(last) if last.end == r.start => last.end = r.end,
            _ => out.push(r),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_head_the_tail_and_the_heaviest_chunks() {
        let n = 10 * CHUNK_TOKENS;
        let mut weights = vec![0.001f32; n];
        // Chunk 4 matters most, then chunk 7.
        for w in &mut weights[4 * CHUNK_TOKENS..5 * CHUNK_TOKENS] {
            *w = 0.05;
        }
        for w in &mut weights[7 * CHUNK_TOKENS..8 * CHUNK_TOKENS] {
            *w = 0.02;
        }
        let tail = n - CHUNK_TOKENS;
        let c = |i: usize| i * CHUNK_TOKENS;
        // 40%: head + tail + chunks 4 and 7.
        assert_eq!(
            choose(&weights, 0.4, tail),
            vec![0..c(1), c(4)..c(5), c(7)..c(8), c(9)..n]
        );
        // 30%: only chunk 4 besides the head and the tail.
        assert_eq!(
            choose(&weights, 0.3, tail),
            vec![0..c(1), c(4)..c(5), c(9)..n]
        );
        // Everything: one range.
        assert_eq!(choose(&weights, 1.0, tail), vec![0..n]);
        // A tiny ratio still keeps the head and the tail.
        assert_eq!(choose(&weights, 0.01, tail), vec![0..c(1), c(9)..n]);
    }

    #[test]
    fn ratios_outside_zero_to_one_are_refused() {
        assert!(validate_ratio(0.5).is_ok() && validate_ratio(1.0).is_ok());
        for bad in [0.0, -0.1, 1.5, f32::NAN] {
            assert!(validate_ratio(bad).is_err());
        }
    }
}
