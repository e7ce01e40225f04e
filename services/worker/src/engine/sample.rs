//! Choosing the next token from the logits: greedy or sampled (temperature, top-k, top-p,
//! min-p), with repetition / presence / frequency penalties, seeded for reproducibility, and
//! log-probabilities with top alternatives. Runs on the host over one row of logits.

use std::collections::HashMap;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng, SeedableRng};

/// What a request asks of sampling. Defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    /// Hugging Face semantics, over prompt and output tokens (1 = off).
    pub repetition_penalty: f32,
    /// OpenAI semantics, over output tokens: subtract once per token present...
    pub presence_penalty: f32,
    /// ...and once per occurrence.
    pub frequency_penalty: f32,
    /// Same seed, same output. Without one, a seed is drawn from the clock.
    pub seed: Option<u64>,
    /// How many alternatives to report with each token's log-probability (None = no logprobs).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
        }
    }
}

/// The most alternatives a caller may ask for (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: usize = 20;

impl SamplingParams {
    /// Rejects values that make no sense, naming the parameter.
    pub fn validate(&self) -> Result<(), String> {
        let finite = |name: &str, v: f32| {
            if v.is_finite() {
                Ok(())
            } else {
                Err(format!("{name} must be a finite number"))
            }
        };
        finite("temperature", self.temperature)?;
        finite("top_p", self.top_p)?;
        finite("min_p", self.min_p)?;
        finite("repetition_penalty", self.repetition_penalty)?;
        finite("presence_penalty", self.presence_penalty)?;
        finite("frequency_penalty", self.frequency_penalty)?;
        if self.temperature < 0.0 {
            return Err("temperature must be >= 0".into());
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err("top_p must be in (0, 1]".into());
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err("min_p must be in [0, 1]".into());
        }
        if self.repetition_penalty <= 0.0 {
            return Err("repetition_penalty must be > 0".into());
        }
        if !(-2.0..=2.0).contains(&self.presence_penalty) {
            return Err("presence_penalty must be in [-2, 2]".into());
        }
        if !(-2.0..=2.0).contains(&self.frequency_penalty) {
            return Err("frequency_penalty must be in [-2, 2]".into());
        }
        if self.logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
            return Err(format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}"));
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// One chosen token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// log p(token) under the model's own distribution (before penalties and temperature).
    pub logprob: Option<f32>,
    /// The most likely alternatives with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// Occurrences of each token in the output so far (presence / frequency penalties).
    output_counts: HashMap<u32, u32>,
    /// Tokens of the prompt and the output (repetition penalty).
    seen: std::collections::HashSet<u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
            output_counts: HashMap::new(),
            seen: prompt.iter().copied().collect(),
            params,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from one row of logits and records it.
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        self.sample_allowed(logits, None)
    }

    /// As `sample`, among the tokens `allowed` lets through (structured output); the
    /// log-probabilities reported are still the model's own.
    pub fn sample_allowed(
        &mut self,
        logits: &[f32],
        allowed: Option<&dyn Fn(usize) -> bool>,
    ) -> Sampled {
        let p = &self.params;
        let (logprob_of, top) = match p.logprobs {
            Some(n) => {
                let lse = log_sum_exp(logits);
                let top = top_indices(logits, n)
                    .into_iter()
                    .map(|i| (i as u32, logits[i] - lse))
                    .collect();
                (Some(lse), top)
            }
            None => (None, Vec::new()),
        };

        let mut scores = logits.to_vec();
        self.apply_penalties(&mut scores);
        if let Some(allowed) = allowed {
            for (i, s) in scores.iter_mut().enumerate() {
                if !allowed(i) {
                    *s = f32::NEG_INFINITY;
                }
            }
        }
        let token = if p.is_greedy() {
            argmax(&scores)
        } else {
            self.draw(&scores)
        };
        *self.output_counts.entry(token as u32).or_default() += 1;
        self.seen.insert(token as u32);
        Sampled {
            token: token as u32,
            logprob: logprob_of.map(|lse| logits[token] - lse),
            top,
        }
    }

    fn apply_penalties(&self, scores: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            for &t in &self.seen {
                if let Some(s) = scores.get_mut(t as usize) {
                    *s = if *s > 0.0 {
                        *s / p.repetition_penalty
                    } else {
                        *s * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &count) in &self.output_counts {
                if let Some(s) = scores.get_mut(t as usize) {
                    *s -= p.presence_penalty + p.frequency_penalty * count as f32;
                }
            }
        }
    }

    /// Temperature, then top-k, min-p and top-p filtering, then a seeded draw.
    fn draw(&mut self, scores: &[f32]) -> usize {
        let dist = self.filtered(scores);
        self.draw_from(&dist)
    }

    /// The distribution a token is drawn from, given one row of logits: temperature, top-k,
    /// min-p and top-p applied; greedy is all mass on the argmax. Penalties are not applied
    /// (speculative decoding, its one user, runs only without them).
    pub fn distribution(&self, logits: &[f32]) -> Distribution {
        if self.params.is_greedy() {
            return Distribution {
                tokens: vec![argmax(logits)],
                probs: vec![1.0],
            };
        }
        self.filtered(logits)
    }

    fn filtered(&self, scores: &[f32]) -> Distribution {
        let p = &self.params;
        let k = if p.top_k == 0 {
            scores.len()
        } else {
            p.top_k.min(scores.len())
        };
        let mut candidates = top_indices(scores, k);
        let max = scores[candidates[0]];
        let mut probs: Vec<f64> = candidates
            .iter()
            .map(|&i| (((scores[i] - max) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        // min-p: relative to the most likely token (probs[0]).
        if p.min_p > 0.0 {
            let floor = probs[0] * f64::from(p.min_p);
            let keep = probs.iter().take_while(|&&x| x >= floor).count().max(1);
            candidates.truncate(keep);
            probs.truncate(keep);
        }
        // top-p: the smallest prefix (most likely first) reaching the mass.
        if p.top_p < 1.0 {
            let mut mass = 0.0;
            let mut keep = 0;
            for x in &probs {
                mass += x;
                keep += 1;
                if mass >= f64::from(p.top_p) {
                    break;
                }
            }
            candidates.truncate(keep.max(1));
            probs.truncate(keep.max(1));
        }
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        Distribution {
            tokens: candidates,
            probs,
        }
    }

    /// A seeded draw from `dist` (whose probabilities add up to 1, up to rounding).
    pub fn draw_from(&mut self, dist: &Distribution) -> usize {
        let total: f64 = dist.probs.iter().sum();
        let u = self.uniform() * total;
        let mut acc = 0.0;
        let mut last_possible = 0;
        for (i, x) in dist.probs.iter().enumerate() {
            acc += x;
            if u < acc {
                return dist.tokens[i];
            }
            if *x > 0.0 {
                last_possible = i;
            }
        }
        // Rounding left `u` past the sum: the last token that could be drawn (never one a
        // mask ruled out, whose probability is 0).
        dist.tokens[last_possible]
    }

    /// A seeded uniform number in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A sparse distribution over tokens: ids and their probabilities, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct Distribution {
    pub tokens: Vec<usize>,
    pub probs: Vec<f64>,
}

impl Distribution {
    /// The probability of `token` (0 outside the support).
    pub fn prob(&self, token: usize) -> f64 {
        self.tokens
            .iter()
            .position(|&t| t == token)
            .map_or(0.0, |i| self.probs[i])
    }
}

/// Index of the largest value; the lowest index wins a tie (as numpy's argmax).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

fn log_sum_exp(values: &[f32]) -> f32 {
    let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = values.iter().map(|&v| f64::from(v - max).exp()).sum();
    max + sum.ln() as f32
}

/// Indices of the `k` largest values, largest first (ties: lower index first).
fn top_indices(values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<usize> = (0..values.len()).collect();
    let cmp = |a: &usize, b: &usize| values[*b].total_cmp(&values[*a]).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 3.0, -1.0, 0.5]
    }

    #[test]
    fn greedy_takes_the_first_maximum() {
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        assert_eq!(s.sample(&logits()).token, 1);
    }

    #[test]
    fn repetition_penalty_moves_greedy_away_from_seen_tokens() {
        let params = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[1]);
        // 3.0 / 2 = 1.5 for token 1; token 3 (3.0) now wins.
        assert_eq!(s.sample(&logits()).token, 3);
    }

    #[test]
    fn presence_and_frequency_penalties_count_output_tokens() {
        let params = SamplingParams {
            frequency_penalty: 0.6,
            presence_penalty: 0.5,
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        assert_eq!(s.sample(&logits()).token, 1);
        // Token 1 now scores 3 - 0.5 - 0.6 = 1.9: token 3 wins, then 2 (2.0 > 1.9).
        assert_eq!(s.sample(&logits()).token, 3);
        assert_eq!(s.sample(&logits()).token, 2);
    }

    #[test]
    fn same_seed_same_tokens_and_top_k_one_is_greedy() {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |params: SamplingParams| {
            let mut s = Sampler::new(params, &[]);
            (0..50)
                .map(|_| s.sample(&logits()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(params.clone()), draw(params.clone()));
        let spread = draw(params.clone());
        assert!(
            spread.iter().any(|&t| t != spread[0]),
            "temperature 1 should vary"
        );
        let top1 = draw(SamplingParams {
            top_k: 1,
            ..params.clone()
        });
        assert!(top1.iter().all(|&t| t == 1));
        let min_p = draw(SamplingParams {
            min_p: 0.9,
            ..params
        });
        // Only tokens within 90% of the best survive: 1 and 3 (equal logits).
        assert!(min_p.iter().all(|&t| t == 1 || t == 3));
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_with_the_mass() {
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        for _ in 0..50 {
            // p(1) = p(3) ~ 0.39 each: 1 alone is < 0.5, {1, 3} reaches it.
            assert!(matches!(s.sample(&logits()).token, 1 | 3));
        }
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let params = SamplingParams {
            logprobs: Some(3),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[]);
        let out = s.sample(&logits());
        let total: f32 = logits()
            .iter()
            .map(|&l| (l - log_sum_exp(&logits())).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(
            out.top.iter().map(|t| t.0).collect::<Vec<_>>(),
            vec![1, 3, 2]
        );
        assert_eq!(out.logprob, Some(out.top[0].1));
    }

    #[test]
    fn a_mask_limits_greedy_and_sampled_choices() {
        let only_even = |i: usize| i.is_multiple_of(2);
        let mut s = Sampler::new(SamplingParams::default(), &[]);
        // Tokens 1 and 3 lead, but only even ones are allowed: 2 (2.0) wins.
        assert_eq!(s.sample_allowed(&logits(), Some(&only_even)).token, 2);
        let mut s = Sampler::new(
            SamplingParams {
                temperature: 1.0,
                seed: Some(3),
                ..Default::default()
            },
            &[],
        );
        for _ in 0..50 {
            assert!(
                s.sample_allowed(&logits(), Some(&only_even))
                    .token
                    .is_multiple_of(2)
            );
        }
    }

    #[test]
    fn invalid_parameters_are_named() {
        let bad = |p: SamplingParams| p.validate().unwrap_err();
        assert!(
            bad(SamplingParams {
                temperature: -1.0,
                ..Default::default()
            })
            .contains("temperature")
        );
        assert!(
            bad(SamplingParams {
                top_p: 0.0,
                ..Default::default()
            })
            .contains("top_p")
        );
        assert!(
            bad(SamplingParams {
                logprobs: Some(21),
                ..Default::default()
            })
            .contains("top_logprobs")
        );
        assert!(
            bad(SamplingParams {
                temperature: f32::NAN,
                ..Default::default()
            })
            .contains("finite")
        );
    }
}
