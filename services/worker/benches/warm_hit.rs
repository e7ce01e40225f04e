//! The engine's part of a warm hit on SmolLM2-135M (f32 on CPU): importing a 4K-token prefix,
//! computing chunks of 4-48 tokens after it (new questions) and one decode step at that context,
//! beside a decode step after a 64-token prompt (where the weights, not the KV, are read).
//! `cargo bench -p strata-worker --bench warm_hit [-- ROUNDS]`; prints medians of the rounds.
//! The 4K prefix is computed once at the start (about 20 s).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use strata_worker::engine::DtypePolicy;
use strata_worker::engine::llama::SeqChunk;
use strata_worker::engine::loader;

/// `STRATA_BENCH_MODEL` (a GGUF file or model folder) in place of SmolLM2, and
/// `STRATA_BENCH_PREFIX` tokens in place of 4096 (and `STRATA_BENCH_BF16=1`, below).
fn model_path() -> PathBuf {
    if let Some(path) = std::env::var_os("STRATA_BENCH_MODEL") {
        return PathBuf::from(path);
    }
    let cache = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))
        .expect("STRATA_CACHE or HOME is set");
    cache.join("models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf")
}

/// New tokens after the 4K prefix: a few (speculative drafts), a short question, a longer one.
const CHUNKS: [usize; 4] = [4, 13, 25, 48];

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn main() {
    strata_worker::mlx_device::keep_freed_memory_mapped();
    // `STRATA_BENCH_BF16=1`: chunks of 8+ rows in bf16, as `--cpu-products bf16`.
    let bf16 = std::env::var("STRATA_BENCH_BF16").is_ok_and(|v| v == "1");
    if bf16 != strata_cpu_kernels::packed::set_bf16_products(bf16) {
        eprintln!("this CPU has no AVX-512 BF16: products stay f32");
    }
    let rounds: u32 = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(15);
    let loaded = loader::open(&model_path(), DtypePolicy::F32, 256).expect("SmolLM2 loads");
    let model = &loaded.model;
    let prefix: usize = std::env::var("STRATA_BENCH_PREFIX")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4096);
    let prompt: Vec<u32> = (0..prefix as u32)
        .map(|i| 100 + (i * 7919) % 40000)
        .collect();
    let mut cache = model.new_cache(256);
    for chunk in prompt.chunks(256) {
        let mut batch = [SeqChunk {
            tokens: chunk,
            cache: &mut cache,
        }];
        model
            .forward(&mut batch)
            .expect("prefill")
            .eval()
            .expect("eval");
    }
    let bytes = cache.export(0, prefix).expect("export");
    let mut short = model.new_cache(256);
    let mut batch = [SeqChunk {
        tokens: &prompt[..64],
        cache: &mut short,
    }];
    model
        .forward(&mut batch)
        .expect("prefill")
        .eval()
        .expect("eval");
    let (mut imports, mut steps) = (Vec::new(), Vec::new());
    let mut chunks: Vec<Vec<Duration>> = CHUNKS.iter().map(|_| Vec::new()).collect();
    let mut short_steps = Vec::new();
    for round in 0..rounds {
        let t = Instant::now();
        let mut c = model.new_cache(256);
        c.import_all(&[(&bytes, prefix)], 1).expect("import");
        imports.push(t.elapsed());
        for (n, times) in CHUNKS.iter().zip(chunks.iter_mut()) {
            let question: Vec<u32> = (0..*n as u32).map(|i| 500 + i + round).collect();
            let t = Instant::now();
            let mut batch = [SeqChunk {
                tokens: &question,
                cache: &mut c,
            }];
            model
                .forward(&mut batch)
                .expect("chunk")
                .eval()
                .expect("eval");
            times.push(t.elapsed());
            c.truncate(prefix).expect("truncate");
        }
        let t = Instant::now();
        let mut batch = [SeqChunk {
            tokens: &[7],
            cache: &mut c,
        }];
        model
            .forward(&mut batch)
            .expect("decode")
            .eval()
            .expect("eval");
        steps.push(t.elapsed());
        let t = Instant::now();
        let mut batch = [SeqChunk {
            tokens: &[7],
            cache: &mut short,
        }];
        model
            .forward(&mut batch)
            .expect("decode")
            .eval()
            .expect("eval");
        short_steps.push(t.elapsed());
    }
    let ms = |v: Vec<Duration>| format!("{:.1} ms", median(v).as_secs_f64() * 1e3);
    let heads: Vec<String> = CHUNKS.iter().map(|n| format!("{n}-token chunk")).collect();
    println!(
        "| {prefix}-token prefix, median of {rounds} | import | {} | decode step | decode step at 64 |",
        heads.join(" | ")
    );
    println!("|---|---|{}---|---|", "---|".repeat(CHUNKS.len()));
    let chunk_cells: Vec<String> = chunks.into_iter().map(ms).collect();
    println!(
        "| {} | {} | {} | {} | {} |",
        model_path()
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
        ms(imports),
        chunk_cells.join(" | "),
        ms(steps),
        ms(short_steps)
    );
}
