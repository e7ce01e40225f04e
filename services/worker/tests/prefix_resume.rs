//! Resuming a prompt from cached KV on the real SmolLM2: whole blocks, a partial tail block of
//! the same prompt, a partial block of an earlier shorter prompt, and the opt-in storing of
//! generated tokens' blocks. A warm run must produce the cold run's tokens exactly.

mod common;

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::generate::{EngineOptions, GenerateRequest, Generation, Prefix};
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::sequence::{CachedKv, FinishedBlock, Resume};

const BLOCK: usize = 256;

fn model() -> LoadedModel {
    loader::open(&common::smollm2_gguf(), DtypePolicy::F32, BLOCK).unwrap()
}

/// Token ids of a long, varied text, cut to `n`.
fn prompt(m: &LoadedModel, n: usize) -> Vec<u32> {
    let text = (0..200)
        .map(|i| {
            format!(
                "Fact {i}: the sea at harbour {} is {} metres deep.",
                i * 7 % 13,
                i * 31 % 97
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    let ids = m.tokenizer.encode(&text).unwrap();
    assert!(ids.len() >= n, "{} tokens", ids.len());
    ids[..n].to_vec()
}

/// Runs `req` from `cached`, returning the generation and the blocks it handed out.
fn run(
    m: &LoadedModel,
    req: &GenerateRequest,
    options: &EngineOptions,
    cached: &[CachedKv<'_>],
) -> (Generation, Vec<FinishedBlock>) {
    let mut blocks = Vec::new();
    let mut sink = |b: FinishedBlock| blocks.push(b);
    let g = m
        .generate_with_prefix(
            req,
            options,
            Prefix {
                cached,
                on_block: Some(&mut sink),
                resume: None,
            },
            |_| true,
        )
        .unwrap();
    (g, blocks)
}

fn kv(blocks: &[FinishedBlock]) -> Vec<CachedKv<'_>> {
    blocks
        .iter()
        .map(|b| CachedKv {
            bytes: &b.bytes,
            tokens: b.tokens.len(),
        })
        .collect()
}

fn shape(blocks: &[FinishedBlock]) -> Vec<(usize, usize)> {
    blocks.iter().map(|b| (b.index, b.tokens.len())).collect()
}

#[test]
fn a_prompt_resumed_from_cached_blocks_gives_the_tokens_of_a_cold_run() {
    let m = model();
    // Three whole blocks and a tail of 100 tokens; the body (all but the last token) ends
    // 99 tokens into the fourth block.
    let prompt = prompt(&m, 3 * BLOCK + 100);
    let body = prompt.len() - 1;
    let req = GenerateRequest::greedy(prompt.clone(), 12);
    let options = EngineOptions::default();

    let (cold, blocks) = run(&m, &req, &options, &[]);
    assert_eq!(cold.cached_tokens, 0);
    assert_eq!(shape(&blocks), [(0, 256), (1, 256), (2, 256), (3, 99)]);
    assert_eq!(blocks[3].tokens, prompt[3 * BLOCK..body]);

    // From 1, 2 and 3 whole blocks, then with the partial tail too: the same tokens, and
    // only what it computed itself is handed out.
    for n in 1..=4 {
        let (warm, more) = run(&m, &req, &options, &kv(&blocks[..n]));
        assert_eq!(warm.tokens, cold.tokens, "with {n} cached blocks");
        let cached: usize = blocks[..n].iter().map(|b| b.tokens.len()).sum();
        assert_eq!(warm.cached_tokens, cached);
        let expected: Vec<(usize, usize)> = shape(&blocks)[n..].to_vec();
        assert_eq!(shape(&more), expected, "blocks handed out after {n} cached");
    }

    // KV of the wrong size is not used: the prompt is computed, the answer unchanged.
    let bad = vec![0u8; 10];
    let wrong = [CachedKv {
        bytes: &bad,
        tokens: BLOCK,
    }];
    let (fallback, _) = run(&m, &req, &options, &wrong);
    assert_eq!(fallback.cached_tokens, 0);
    assert_eq!(fallback.tokens, cold.tokens);

    // A partial block that would cover the last token is not imported (that token is always
    // computed, for the first token's logits).
    let short = GenerateRequest::greedy(prompt[..BLOCK + 10].to_vec(), 4);
    let (_, short_blocks) = run(&m, &short, &options, &[]);
    assert_eq!(shape(&short_blocks), [(0, 256), (1, 9)]);
    let shorter = GenerateRequest::greedy(prompt[..BLOCK + 9].to_vec(), 4);
    let (g, _) = run(&m, &shorter, &options, &kv(&short_blocks));
    assert_eq!(
        g.cached_tokens, BLOCK,
        "the 9-token tail would reach the last token"
    );
}

#[test]
fn the_partial_block_of_an_earlier_shorter_prompt_is_reused() {
    let m = model();
    let options = EngineOptions::default();
    let long = prompt(&m, 3 * BLOCK + 40);
    // The first turn: two whole blocks and a body tail of 100 tokens.
    let first = GenerateRequest::greedy(long[..2 * BLOCK + 101].to_vec(), 4);
    let (_, first_blocks) = run(&m, &first, &options, &[]);
    assert_eq!(shape(&first_blocks), [(0, 256), (1, 256), (2, 100)]);

    // The next turn extends it: it resumes 100 tokens into its third block.
    let mut next = GenerateRequest::greedy(long.clone(), 16);
    let (warm, stored) = run(&m, &next, &options, &kv(&first_blocks));
    assert_eq!(warm.cached_tokens, 2 * BLOCK + 100);
    // The block completed around the imported partial is handed out whole.
    assert_eq!(shape(&stored), [(2, 256), (3, 39)]);
    assert_eq!(stored[0].tokens, long[2 * BLOCK..3 * BLOCK]);

    // The cache-disabled run with the same chunk boundaries computes the same tokens.
    next.prefill_breaks = vec![2 * BLOCK + 100];
    let (cold, _) = run(&m, &next, &options, &[]);
    assert_eq!(cold.cached_tokens, 0);
    assert_eq!(warm.tokens, cold.tokens);
}

#[test]
fn blocks_of_generated_tokens_are_stored_only_when_opted_in() {
    let m = model();
    let mut req = GenerateRequest::greedy(prompt(&m, 240), 40);
    req.ignore_eos = true;
    let off = EngineOptions::default();
    let (g, blocks) = run(&m, &req, &off, &[]);
    assert_eq!(g.tokens.len(), 40);
    assert_eq!(shape(&blocks), [(0, 239)], "the prompt's partial tail only");

    let on = EngineOptions {
        store_decode_kv: true,
        ..EngineOptions::default()
    };
    let (g2, blocks) = run(&m, &req, &on, &[]);
    assert_eq!(g2.tokens, g.tokens, "storing changes nothing in the output");
    // The whole first block, then the partial tail holding the rest of the answer: every
    // generated token whose KV was computed (all but the last, never fed).
    let held = 240 + 40 - 1;
    assert_eq!(shape(&blocks), [(0, 239), (0, 256), (1, held - BLOCK)]);
    let all: Vec<u32> = req.prompt.iter().chain(&g.tokens).copied().collect();
    assert_eq!(blocks[1].tokens, all[..BLOCK]);
    assert_eq!(blocks[2].tokens, all[BLOCK..held]);
    assert_eq!(
        blocks[1].bytes.len(),
        BLOCK * m.model.kv_layout().bytes_per_token()
    );
}

/// A chat's next turn resumed from the previous turn's parked cache (its live KV: prompt and
/// answer, nothing copied): the greedy tokens of a cold run of the new prompt, each token's
/// log-probability within 1e-3 of the cold run's, and only the whole blocks not stored yet are
/// handed to the cache by the second.
///
/// Why 1e-3: the resumed rows of the answer were computed one token at a time (decode) and the
/// new tokens in a chunk of another shape than the cold run's, so the sums round differently;
/// in f32 on a CPU such differences in SmolLM2's logits measure around 1e-5 (host vs MLX passes,
/// tests/family_parity.rs), and a log-probability moves by at most twice a logit's change.
#[test]
fn the_next_turn_resumes_from_the_parked_cache_of_the_previous_one() {
    let m = model();
    // As `strata up` runs workers: blocks of generated tokens are cached too.
    let options = EngineOptions {
        store_decode_kv: true,
        ..EngineOptions::default()
    };
    let first = prompt(&m, BLOCK + 200);
    let mut req = GenerateRequest::greedy(first.clone(), 80);
    req.ignore_eos = true;
    let mut stored = Vec::new();
    let mut sink = |b: FinishedBlock| stored.push(b);
    let (turn1, parked) = m
        .generate_parking(
            &req,
            &options,
            Prefix {
                cached: &[],
                on_block: Some(&mut sink),
                resume: None,
            },
            |_| true,
        )
        .unwrap();
    let parked = parked.expect("a llama-family cache parks");
    // Every token whose KV was computed: the prompt and the answer but its last token.
    let held = first.len() + turn1.tokens.len() - 1;
    assert_eq!(parked.tokens.len(), held);
    assert_eq!(parked.tokens[..first.len()], first[..]);
    // The prompt's whole block, and the one its answer completed (stored at its end).
    assert_eq!(parked.stored_blocks, held / BLOCK);
    assert!(parked.bytes() as usize >= held * m.model.kv_layout().bytes_per_token());

    // The next turn: the whole conversation so far, then a new question.
    let mut next: Vec<u32> = first.iter().chain(&turn1.tokens).copied().collect();
    next.extend(prompt(&m, 300));
    let mut req2 = GenerateRequest::greedy(next.clone(), 16);
    req2.ignore_eos = true;
    req2.sampling.logprobs = Some(0);
    let (cold, _) = run(&m, &req2, &options, &[]);
    let mut handed = Vec::new();
    let mut sink = |b: FinishedBlock| handed.push(b);
    let resume = Resume {
        tokens: held,
        parked,
    };
    let warm = m
        .generate_with_prefix(
            &req2,
            &options,
            Prefix {
                cached: &[],
                on_block: Some(&mut sink),
                resume: Some(resume),
            },
            |_| true,
        )
        .unwrap();
    assert_eq!(warm.cached_tokens, held);
    assert_eq!(warm.tokens, cold.tokens);
    for (i, (w, c)) in warm.logprobs.iter().zip(&cold.logprobs).enumerate() {
        let (w, c) = (w.logprob.unwrap(), c.logprob.unwrap());
        assert!(
            (w - c).abs() < 1e-3,
            "token {i}: logprob {w} resumed, {c} cold"
        );
    }
    // The whole blocks after those stored go to the cache (the new question's).
    let whole: Vec<usize> = handed
        .iter()
        .filter(|b| b.tokens.len() == BLOCK)
        .map(|b| b.index)
        .collect();
    assert_eq!(
        whole,
        (held / BLOCK..(next.len() - 1) / BLOCK).collect::<Vec<_>>()
    );
    assert_eq!(handed[0].tokens, next[2 * BLOCK..3 * BLOCK]);

    // The same prompt resumed from a cache cut back to a shorter prefix (another question
    // after the first turn's prompt): still the cold run's tokens.
    let (_, parked) = m
        .generate_parking(&req, &options, Prefix::default(), |_| true)
        .unwrap();
    let mut other = first.clone();
    other.extend(prompt(&m, 30));
    let req3 = GenerateRequest::greedy(other, 8);
    let (cold3, _) = run(&m, &req3, &options, &[]);
    let (warm3, _) = m
        .generate_parking(
            &req3,
            &options,
            Prefix {
                resume: Some(Resume {
                    tokens: first.len(),
                    parked: parked.unwrap(),
                }),
                ..Prefix::default()
            },
            |_| true,
        )
        .unwrap();
    assert_eq!(warm3.cached_tokens, first.len());
    assert_eq!(warm3.tokens, cold3.tokens);

    // Without caching generated tokens, a parked cache offers the prompt's rows only.
    let (_, parked) = m
        .generate_parking(&req, &EngineOptions::default(), Prefix::default(), |_| true)
        .unwrap();
    assert_eq!(parked.unwrap().tokens, first);
}

/// A parked cache that holds fewer of a prompt's tokens than the cached blocks give takes the
/// rest from the blocks into its own buffers (no fresh import of the whole prefix), and the
/// answer is the cold run's.
#[test]
fn a_parked_cache_shorter_than_the_blocks_takes_the_rest_from_them() {
    let m = model();
    let options = EngineOptions::default();
    let first = prompt(&m, BLOCK + 200);
    let req = GenerateRequest::greedy(first.clone(), 4);
    let (_, blocks) = run(&m, &req, &options, &[]);
    assert_eq!(shape(&blocks), [(0, 256), (1, 199)]);
    let (_, parked) = m
        .generate_parking(&req, &options, Prefix::default(), |_| true)
        .unwrap();

    let mut next = first.clone();
    next.extend(prompt(&m, 40));
    let mut req2 = GenerateRequest::greedy(next, 12);
    req2.sampling.logprobs = Some(0);
    let (cold, _) = run(&m, &req2, &options, &[]);
    // Resumed at 100 tokens (as if another prompt had cut it back), inside the first block.
    let warm = m
        .generate_with_prefix(
            &req2,
            &options,
            Prefix {
                cached: &kv(&blocks),
                on_block: None,
                resume: Some(Resume {
                    tokens: 100,
                    parked: parked.expect("a llama-family cache parks"),
                }),
            },
            |_| true,
        )
        .unwrap();
    assert_eq!(warm.cached_tokens, BLOCK + 199);
    // Appended to the parked cache, not imported instead (that would say so).
    assert!(warm.notices.is_empty(), "{:?}", warm.notices);
    assert_eq!(warm.tokens, cold.tokens);
    for (i, (w, c)) in warm.logprobs.iter().zip(&cold.logprobs).enumerate() {
        let (w, c) = (w.logprob.unwrap(), c.logprob.unwrap());
        // As in the test above: another chunk shape rounds differently (~1e-5 measured).
        assert!(
            (w - c).abs() < 1e-3,
            "token {i}: logprob {w} resumed, {c} cold"
        );
    }
}
