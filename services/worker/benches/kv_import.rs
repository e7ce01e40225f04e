//! What it costs to turn fetched KV blocks into a sequence's live cache: `import_all` (the
//! copy into MLX arrays) and the first evaluation of those arrays, for SmolLM2-135M's layout
//! (f32 on CPU) at 1K, 2K and 4K tokens. `cargo bench -p strata-worker --bench kv_import`.
//! Prints one row per prompt length, medians of several runs. The worker's allocator tuning
//! (`mlx_device::keep_freed_memory_mapped`) is on unless `--malloc-defaults` is given.

use std::time::Instant;

use mlx_rs::Dtype;
use strata_worker::engine::KvCache;
use strata_worker::engine::kv::KvLayout;

const LAYOUT: KvLayout = KvLayout {
    num_layers: 30,
    kv_heads: 3,
    head_dim: 64,
    dtype: Dtype::Float32,
    window: None,
    recurrent: None,
};
const BLOCK: usize = 256;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    if std::env::args().all(|a| a != "--malloc-defaults") {
        strata_worker::mlx_device::keep_freed_memory_mapped();
    }
    println!(
        "| tokens | MB | first import in this process ms | import_all ms | first eval ms | first append ms | total ms | GB/s |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for tokens in [1024usize, 2048, 4096] {
        let block_bytes = BLOCK * LAYOUT.bytes_per_token();
        let blocks: Vec<Vec<u8>> = (0..tokens / BLOCK)
            .map(|b| (0..block_bytes).map(|i| ((i + b) % 251) as u8).collect())
            .collect();
        let parts: Vec<(&[u8], usize)> = blocks.iter().map(|b| (b.as_slice(), BLOCK)).collect();
        let (mut imports, mut evals, mut appends) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..7 {
            let mut cache = KvCache::new(LAYOUT, 256);
            let t = Instant::now();
            cache.import_all(&parts, 1).expect("import");
            imports.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            cache.eval().expect("eval");
            evals.push(t.elapsed().as_secs_f64() * 1e3);
            // The next token's K and V written after the imported ones, as the first step does.
            let one = mlx_rs::ops::zeros_dtype(&[1, 3, 1, 64], Dtype::Float32).expect("zeros");
            let t = Instant::now();
            let mut views = Vec::new();
            for layer in 0..LAYOUT.num_layers {
                views.push(cache.append(layer, &one, &one).expect("append"));
            }
            cache.advance(1);
            for (k, v) in &views {
                k.eval().expect("eval");
                v.eval().expect("eval");
            }
            appends.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let first = imports[0];
        let (i, e, a) = (median(imports), median(evals), median(appends));
        let mb = (tokens * LAYOUT.bytes_per_token()) as f64 / 1e6;
        println!(
            "| {tokens} | {mb:.0} | {first:.1} | {i:.1} | {e:.1} | {a:.1} | {:.1} | {:.2} |",
            i + e + a,
            mb / (i + e + a)
        );
    }
}
