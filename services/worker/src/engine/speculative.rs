//! Speculative decoding with a draft model: a small model with the target's tokenizer
//! proposes `k` tokens one at a time, the target scores all of them in one forward pass, and
//! the longest run the target agrees with is kept, plus one token of the target's own.
//!
//! Acceptance is exact rejection sampling (Leviathan et al., 2023): a drafted token `d` drawn
//! from the draft's distribution `q` is kept with probability `min(1, p(d) / q(d))`, and on
//! rejection the replacement is drawn from `max(0, p - q)` renormalised, so every output
//! token is distributed as the target alone would draw it. Greedy decoding is the special case
//! where `p` and `q` put all mass on their argmax: a drafted token is kept exactly when it is
//! the target's argmax, so the output is the target's greedy output.
//!
//! It runs only for a sequence decoding alone: in a batched step the draft would run once
//! per sequence, for tokens the batch produces anyway. A sequence that shares decode steps
//! with others decodes normally in them, and its response says for how many steps.

use std::path::{Path, PathBuf};

use super::generate::GenerateRequest;
use super::kv::KvCache;
use super::llama::{Model, SeqChunk};
use super::loader::{self, LoadedModel};
use super::policy::DtypePolicy;
use super::sample::{Distribution, Sampled, Sampler};
use super::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// Tokens drafted per step by default: with a draft about a third of the target's size,
/// acceptance falls off after a handful of tokens.
pub const DEFAULT_DRAFT_TOKENS: usize = 4;
/// More per step would mostly be rejected work.
pub const MAX_DRAFT_TOKENS: usize = 16;

/// The feature name in notices, metrics and `/admin`.
pub const FEATURE: &str = "speculative_decoding";

/// A draft model, held next to the target it drafts for.
pub struct Draft {
    pub model: Model,
    pub path: PathBuf,
    /// Tokens proposed per step.
    pub tokens: usize,
}

impl Draft {
    /// Loads the draft and refuses one whose tokenizer is not the target's: drafted ids would
    /// mean other text to the target.
    pub fn open(
        path: &Path,
        policy: DtypePolicy,
        tokens: usize,
        target: &LoadedModel,
    ) -> Result<Self> {
        if !(1..=MAX_DRAFT_TOKENS).contains(&tokens) {
            return Err(EngineError::Config(format!(
                "draft tokens must be 1 to {MAX_DRAFT_TOKENS}, got {tokens}"
            )));
        }
        let loaded = loader::open(path, policy, target.block_tokens)?;
        if loaded.vision.is_some() {
            return Err(EngineError::Config(format!(
                "the draft model {} reads images; a draft must be a text model",
                path.display()
            )));
        }
        check_same_tokenizer(&target.tokenizer, &loaded.tokenizer).map_err(|why| {
            EngineError::Config(format!(
                "draft model {} cannot draft for {}: {why}",
                path.display(),
                target.path.display()
            ))
        })?;
        Ok(Self {
            model: loaded.model,
            path: path.to_path_buf(),
            tokens,
        })
    }
}

/// Ok when both tokenizers map the same strings to the same ids (added and special tokens
/// included); otherwise names one difference.
pub fn check_same_tokenizer(target: &Tokenizer, draft: &Tokenizer) -> Result<(), String> {
    let t = target.library().get_vocab(true);
    let d = draft.library().get_vocab(true);
    if t == d {
        return Ok(());
    }
    let mut differing: Vec<(&String, &u32)> =
        t.iter().filter(|(s, id)| d.get(*s) != Some(id)).collect();
    differing.sort_by_key(|(_, id)| **id);
    let example = match differing.first() {
        Some((text, id)) => match d.get(*text) {
            Some(other) => format!("{text:?} is id {id} for the target and {other} for the draft"),
            None => format!("{text:?} (id {id}) is missing from the draft's vocabulary"),
        },
        None => "the draft has tokens the target does not".to_string(),
    };
    Err(format!(
        "the tokenizers differ ({} tokens against {}; {} of the target's map differently, e.g. {example}); speculative decoding needs the same tokenizer",
        t.len(),
        d.len(),
        differing.len()
    ))
}

/// Whether a request decodes speculatively.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// Not asked for (the request said no, or the model has no draft and the request did not
    /// ask).
    Off,
    On,
    /// Asked for (by the request or the model's configuration) but not applied, and why.
    NotApplied(String),
}

/// Decides, from the request alone, whether speculation applies to it.
pub fn plan(model: &LoadedModel, req: &GenerateRequest) -> Plan {
    if req.speculative == Some(false) {
        return Plan::Off;
    }
    let Some(draft) = &model.draft else {
        return match req.speculative {
            Some(true) => Plan::NotApplied("this model has no draft model configured".into()),
            _ => Plan::Off,
        };
    };
    let s = &req.sampling;
    let why = if req.grammar.is_some() {
        "structured output: drafted tokens are not checked against the grammar"
    } else if s.logprobs.is_some() {
        "logprobs were asked for"
    } else if s.repetition_penalty != 1.0 || s.presence_penalty != 0.0 || s.frequency_penalty != 0.0
    {
        "repetition, presence and frequency penalties change with every accepted token"
    } else if !req.images.is_empty() {
        "the prompt has images, and the draft reads text only"
    } else if model.model.is_hybrid() || draft.model.is_hybrid() {
        "recurrent (linear-attention) layers cannot take back rejected drafts"
    } else if req.prompt.len() + req.max_tokens + draft.tokens > draft.model.config().context_length
    {
        return Plan::NotApplied(format!(
            "the prompt and max_tokens exceed the draft model's context of {} tokens",
            draft.model.config().context_length
        ));
    } else {
        return Plan::On;
    };
    Plan::NotApplied(why.to_string())
}

/// How speculation went for one sequence.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Speculative steps run (each one target forward pass).
    pub steps: usize,
    /// Tokens the draft proposed, and how many the target kept.
    pub drafted: usize,
    pub accepted: usize,
    /// Decode steps this sequence shared with others, run without the draft.
    pub batched_steps: usize,
}

/// A sequence's draft state: the draft's own KV cache, which trails the target's and catches
/// up at the next step.
pub struct Speculation {
    cache: KvCache,
    pub stats: SpecStats,
}

impl Speculation {
    pub fn new(draft: &Draft, kv_step_tokens: usize) -> Self {
        Self {
            cache: draft.model.new_cache(kv_step_tokens),
            stats: SpecStats::default(),
        }
    }

    /// Takes over a draft cache that already holds the prompt (SpecPrefill's).
    pub fn adopt_cache(&mut self, cache: KvCache) {
        self.cache = cache;
    }

    /// Forgets draft KV after `len` tokens (it never holds more than the target kept).
    pub fn cache_truncate(&mut self, len: usize) -> Result<()> {
        self.cache.truncate(len)
    }
}

/// What one speculative step decided: the tokens to output, in order, and how many of them
/// were drafted tokens the target kept (the last one is always the target's own).
pub struct Verdict {
    pub tokens: Vec<u32>,
    pub accepted: usize,
}

/// Drafts up to `k` tokens after `history` (everything the target holds, then the token to
/// feed next), catching the draft's cache up first. Returns the tokens and the distributions
/// they were drawn from.
pub fn propose(
    draft: &Draft,
    spec: &mut Speculation,
    history: &[u32],
    k: usize,
    target_vocab: usize,
    chunk: usize,
    sampler: &mut Sampler,
) -> Result<(Vec<u32>, Vec<Distribution>)> {
    let held = spec.cache.len().min(history.len() - 1);
    spec.cache.truncate(held)?;
    let mut feed = history[held..].to_vec();
    let mut tokens = Vec::with_capacity(k);
    let mut dists = Vec::with_capacity(k);
    for _ in 0..k {
        let mut out = None;
        for part in feed.chunks(chunk.max(1)) {
            let o = draft.model.forward(&mut [SeqChunk {
                tokens: part,
                cache: &mut spec.cache,
            }])?;
            o.eval()?;
            out = Some(o);
        }
        let logits = out.ok_or_else(|| EngineError::Config("nothing to draft from".into()))?;
        let q = sampler.distribution(logits.as_slice::<f32>());
        let d = if sampler.params().is_greedy() {
            q.tokens[0]
        } else {
            sampler.draw_from(&q)
        };
        // A draft with a larger embedding table may name ids the target does not have.
        if d >= target_vocab {
            break;
        }
        tokens.push(d as u32);
        dists.push(q);
        feed = vec![d as u32];
    }
    Ok((tokens, dists))
}

/// Exact acceptance: `rows` holds the target's logits after the fed token and after each
/// drafted token (`drafted.len() + 1` rows of `vocab`).
pub fn verify(
    sampler: &mut Sampler,
    drafted: &[u32],
    dists: &[Distribution],
    rows: &[f32],
    vocab: usize,
) -> Verdict {
    let mut tokens = Vec::with_capacity(drafted.len() + 1);
    for (i, (&d, q)) in drafted.iter().zip(dists).enumerate() {
        let p = sampler.distribution(&rows[i * vocab..(i + 1) * vocab]);
        let d = d as usize;
        let keep = if sampler.params().is_greedy() {
            p.tokens[0] == d
        } else {
            let (pd, qd) = (p.prob(d), q.prob(d));
            qd > 0.0 && sampler.uniform() < (pd / qd).min(1.0)
        };
        if keep {
            tokens.push(d as u32);
            continue;
        }
        let accepted = tokens.len();
        let replacement = if sampler.params().is_greedy() {
            p.tokens[0]
        } else {
            sampler.draw_from(&residual(&p, q))
        };
        tokens.push(replacement as u32);
        return Verdict { tokens, accepted };
    }
    // Every drafted token kept: the target's next token comes free with the same pass.
    let n = drafted.len();
    let p = sampler.distribution(&rows[n * vocab..(n + 1) * vocab]);
    let bonus = if sampler.params().is_greedy() {
        p.tokens[0]
    } else {
        sampler.draw_from(&p)
    };
    tokens.push(bonus as u32);
    Verdict {
        tokens,
        accepted: n,
    }
}

/// `max(0, p - q)`, renormalised: what a rejected draw is replaced from. Where it is empty
/// (p == q up to rounding), `p` itself.
fn residual(p: &Distribution, q: &Distribution) -> Distribution {
    let mut tokens = Vec::new();
    let mut probs = Vec::new();
    for (&t, &pt) in p.tokens.iter().zip(&p.probs) {
        let r = pt - q.prob(t);
        if r > 0.0 {
            tokens.push(t);
            probs.push(r);
        }
    }
    let total: f64 = probs.iter().sum();
    if total <= 0.0 {
        return p.clone();
    }
    probs.iter_mut().for_each(|x| *x /= total);
    Distribution { tokens, probs }
}

/// One decoded token without sampling information (speculative steps report none; requests
/// that ask for logprobs do not speculate).
pub fn plain(token: u32) -> Sampled {
    Sampled {
        token,
        logprob: None,
        top: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::sample::SamplingParams;

    fn rows(distributions: &[&[f32]]) -> Vec<f32> {
        distributions
            .iter()
            .flat_map(|r| r.iter().copied())
            .collect()
    }

    #[test]
    fn greedy_keeps_the_run_the_target_agrees_with_and_adds_its_token() {
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        let q = Distribution {
            tokens: vec![0],
            probs: vec![1.0],
        };
        // The target's argmax: 1, then 2, then 0 (the draft said 1, 2, 3).
        let r = rows(&[
            &[0.0, 5.0, 1.0, 0.0],
            &[0.0, 1.0, 5.0, 0.0],
            &[5.0, 0.0, 0.0, 1.0],
            &[0.0; 4],
        ]);
        let v = verify(
            &mut s,
            &[1, 2, 3],
            &[q.clone(), q.clone(), q.clone()],
            &r,
            4,
        );
        assert_eq!(v.tokens, vec![1, 2, 0]);
        assert_eq!(v.accepted, 2);
        // All agreed: the bonus token is the target's argmax after the last one.
        let r = rows(&[
            &[0.0, 5.0, 1.0, 0.0],
            &[0.0, 1.0, 5.0, 0.0],
            &[0.0, 0.0, 0.0, 9.0],
        ]);
        let v = verify(&mut s, &[1, 2], &[q.clone(), q], &r, 4);
        assert_eq!(v.tokens, vec![1, 2, 3]);
        assert_eq!(v.accepted, 2);
    }

    /// The output of one sampled step has the target's distribution, whatever the draft's:
    /// counted over many seeded steps with a draft that disagrees with the target.
    #[test]
    fn rejection_sampling_reproduces_the_target_distribution() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(11),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        let target: [f32; 3] = [0.0, (2.0f32).ln(), (7.0f32).ln()]; // p = 0.1, 0.2, 0.7
        let draft_logits: [f32; 3] = [(6.0f32).ln(), (3.0f32).ln(), 0.0]; // q = 0.6, 0.3, 0.1
        let q = s.distribution(&draft_logits);
        let r = rows(&[&target, &target]);
        let n = 60_000;
        let mut counts = [0usize; 3];
        for _ in 0..n {
            let d = s.draw_from(&q) as u32;
            let v = verify(&mut s, &[d], std::slice::from_ref(&q), &r, 3);
            counts[v.tokens[0] as usize] += 1;
        }
        for (c, p) in counts.iter().zip([0.1, 0.2, 0.7]) {
            let f = *c as f64 / n as f64;
            assert!(
                (f - p).abs() < 0.01,
                "frequency {f} against p {p}: {counts:?}"
            );
        }
    }

    #[test]
    fn residual_is_what_p_has_beyond_q() {
        let p = Distribution {
            tokens: vec![0, 1, 2],
            probs: vec![0.5, 0.3, 0.2],
        };
        let q = Distribution {
            tokens: vec![0, 2],
            probs: vec![0.8, 0.2],
        };
        let r = residual(&p, &q);
        assert_eq!(r.tokens, vec![1]);
        assert!((r.probs[0] - 1.0).abs() < 1e-12);
        assert_eq!(residual(&p, &p), p);
    }
}
