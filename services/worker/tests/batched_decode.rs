//! A decode step of several sequences on MLX's kernels (the GPU's and Metal's path) runs as
//! one batch: RoPE over every row at its own position, then each sequence's cache append and
//! attention. It must give each sequence the logits of a step taken alone. Checked on the
//! families whose RoPE differs (Qwen3's q/k norms, Llama 3.2's scaled periods, Phi-3's partial
//! rotary with longrope, SmolLM3's layers without RoPE), random weights, f32 on the CPU.

mod common;

use std::path::PathBuf;

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::generate::EngineOptions;
use strata_worker::engine::kv::KvCache;
use strata_worker::engine::llama::SeqChunk;
use strata_worker::engine::loader::{self, LoadedModel};
use strata_worker::engine::sample::argmax;

/// The same f32 kernels on the same rows; only RoPE's position comes as an array instead of a
/// constant, and attention and products see other batch shapes. What differs is rounding in
/// the order of a few ulps; 1e-5 of the largest logit (at least 1) is far below any greedy
/// margin and far above what that rounding sums to over 2-4 layers.
const RELATIVE_TOLERANCE: f32 = 1e-5;

fn open(family: &str) -> LoadedModel {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/families")
        .join(family);
    let mut m = loader::open(&dir, DtypePolicy::F32, 64).unwrap();
    m.model.use_mlx_kernels();
    m
}

/// Two prompts of other lengths (so the rows sit at other positions), from the fixtures.
fn prompts() -> [Vec<u32>; 2] {
    let reference = common::fixture("families/reference.json");
    let first = common::ids(&reference["families"]["qwen3"]["cases"][0]["input_ids"]);
    let short: Vec<u32> = first
        .iter()
        .take(first.len() / 2 + 3)
        .map(|t| t % 200 + 3)
        .collect();
    [first.iter().map(|t| t % 200 + 3).collect(), short]
}

fn prefilled(m: &LoadedModel, prompt: &[u32]) -> (KvCache, u32) {
    let mut cache = m.model.new_cache(16);
    let logits = m
        .prefill(&mut cache, prompt, &EngineOptions::default(), |_| Ok(()))
        .unwrap();
    (cache, argmax(&logits) as u32)
}

fn step(m: &LoadedModel, chunks: &mut [SeqChunk<'_>]) -> Vec<f32> {
    let out = m.model.forward(chunks).unwrap();
    out.eval().unwrap();
    out.as_slice::<f32>().to_vec()
}

#[test]
fn a_batched_decode_step_gives_each_sequence_its_own_steps_logits() {
    let prompts = prompts();
    for family in ["qwen3", "llama3_2", "phi3", "smollm3"] {
        let m = open(family);
        // Alone: three greedy steps of each sequence.
        let mut alone = Vec::new();
        for prompt in &prompts {
            let (mut cache, mut token) = prefilled(&m, prompt);
            let mut rows = Vec::new();
            for _ in 0..3 {
                let logits = step(
                    &m,
                    &mut [SeqChunk {
                        tokens: &[token],
                        cache: &mut cache,
                    }],
                );
                token = argmax(&logits) as u32;
                rows.push(logits);
            }
            alone.push(rows);
        }
        let steps: Vec<Vec<&Vec<f32>>> = (0..3)
            .map(|s| alone.iter().map(|rows| &rows[s]).collect())
            .collect();
        // Together: the same steps as one batch each.
        let (mut a, mut ta) = prefilled(&m, &prompts[0]);
        let (mut b, mut tb) = prefilled(&m, &prompts[1]);
        for (s, expected) in steps.iter().enumerate() {
            let mut chunks = [
                SeqChunk {
                    tokens: &[ta],
                    cache: &mut a,
                },
                SeqChunk {
                    tokens: &[tb],
                    cache: &mut b,
                },
            ];
            assert!(
                m.model.decodes_as_one_batch(&chunks),
                "{family}: the step did not take the batched path"
            );
            let logits = step(&m, &mut chunks);
            let vocab = logits.len() / 2;
            for (i, row) in logits.chunks(vocab).enumerate() {
                let theirs = expected[i];
                let largest = theirs.iter().fold(1f32, |x, &y| x.max(y.abs()));
                let worst = row
                    .iter()
                    .zip(theirs)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0f32, f32::max);
                assert!(
                    worst <= RELATIVE_TOLERANCE * largest,
                    "{family}, sequence {i}, step {s}: logits differ by {worst}"
                );
            }
            ta = argmax(&logits[..vocab]) as u32;
            tb = argmax(&logits[vocab..]) as u32;
        }
    }
}
