//! `x · Wᵀ` for 1-16 rows on SmolLM2-135M's weight shapes: MLX's product (OpenBLAS) beside
//! `strata_cpu_kernels::matmul::x_wt`, which the engine uses up to `MAX_ROWS` rows on a CPU.
//! `cargo bench -p strata-worker --bench few_rows`; medians of 20 calls, in ms.

use std::time::Instant;

use mlx_rs::Array;
use strata_cpu_kernels::matmul::{MAX_ROWS, x_wt};

fn values(len: usize, seed: u32) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        })
        .collect()
}

fn median_ms(f: &dyn Fn()) -> f64 {
    f();
    let mut runs: Vec<f64> = (0..20)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[runs.len() / 2]
}

fn main() {
    println!("kernel used up to {MAX_ROWS} rows");
    println!("| weights (n x k) | rows | MLX ms | kernel ms |");
    println!("|---|---|---|---|");
    for (n, k) in [(576usize, 576usize), (1536, 576), (576, 1536), (49152, 576)] {
        let w = values(n * k, 2);
        let wa = Array::from_slice(&w, &[n as i32, k as i32]);
        wa.eval().expect("eval");
        for rows in [1usize, 4, 8, 12, 16] {
            let x = values(rows * k, 1);
            let xa = Array::from_slice(&x, &[rows as i32, k as i32]);
            xa.eval().expect("eval");
            let mlx = median_ms(&|| {
                xa.matmul(wa.t())
                    .and_then(|y| y.eval())
                    .expect("MLX product");
            });
            let ours = median_ms(&|| {
                std::hint::black_box(x_wt(&x, rows, &w, n, k));
            });
            println!("| {n} x {k} | {rows} | {mlx:.3} | {ours:.3} |");
        }
    }
}
