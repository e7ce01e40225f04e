//! `x · Wᵀ` for 1-32 rows on SmolLM2-135M's and Qwen2.5-1.5B's weight shapes: MLX's product
//! (OpenBLAS) on f32 weights beside `strata_cpu_kernels::matmul::x_wt` on the same f32 weights
//! and `strata_cpu_kernels::packed` on 8-bit and 4-bit codes with an f16 scale and bias per 32
//! (a Q8_0 or Q4_1 file's weights), which the engine uses up to `MAX_ROWS` / `PACKED_MAX_ROWS` rows on a
//! CPU. A second table: longer products (prefill chunks), MLX's on f32 weights beside the
//! BLAS on panels of codes dequantised as they go (`PackedMatrix::x_wt_long`), which is what a
//! matrix kept only as codes costs. `cargo bench -p strata-worker --bench few_rows`; medians
//! of 20 calls, in ms.

use std::time::Instant;

use mlx_rs::Array;
use strata_cpu_kernels::matmul::{MAX_ROWS, x_wt};
use strata_cpu_kernels::packed::PackedMatrix;
use strata_cpu_kernels::test_values::values;
use strata_worker::engine::weights::PACKED_MAX_ROWS;

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
    println!("f32 kernel used up to {MAX_ROWS} rows, codes up to {PACKED_MAX_ROWS}");
    println!(
        "| weights (n x k) | rows | MLX f32 ms | kernel f32 ms | kernel 8-bit codes ms | kernel 4-bit codes ms |"
    );
    println!("|---|---|---|---|---|---|");
    for (n, k) in [
        (576usize, 576usize),
        (1536, 576),
        (576, 1536),
        (49152, 576),
        (8960, 1536),
        (1536, 8960),
    ] {
        let group = 32;
        let words: Vec<u32> = values(n * k / 8, 3).iter().map(|v| v.to_bits()).collect();
        // f16 scales, as the files have them.
        let scales: Vec<f32> = values(n * k / group, 4)
            .iter()
            .map(|v| (v * 1024.0).round() / 65536.0)
            .collect();
        let packed = PackedMatrix::from_mlx_words(&words, 4, &scales, &scales, n, k, group)
            .expect("a valid matrix");
        let words8: Vec<u32> = values(n * k / 4, 5).iter().map(|v| v.to_bits()).collect();
        let packed8 = PackedMatrix::from_mlx_words(&words8, 8, &scales, &scales, n, k, group)
            .expect("a valid matrix");
        let w = packed.dequantize();
        let wa = Array::from_slice(&w, &[n as i32, k as i32]);
        wa.eval().expect("eval");
        for rows in [1usize, 4, 8, 16, 24, 32] {
            let x = values(rows * k, 1);
            let xa = Array::from_slice(&x, &[rows as i32, k as i32]);
            xa.eval().expect("eval");
            let mlx = median_ms(&|| {
                xa.matmul(wa.t())
                    .and_then(|y| y.eval())
                    .expect("MLX product");
            });
            let dense = median_ms(&|| {
                std::hint::black_box(x_wt(&x, rows, &w, n, k));
            });
            let codes8 = median_ms(&|| {
                std::hint::black_box(packed8.x_wt(&x, rows));
            });
            let codes4 = median_ms(&|| {
                std::hint::black_box(packed.x_wt(&x, rows));
            });
            println!("| {n} x {k} | {rows} | {mlx:.3} | {dense:.3} | {codes8:.3} | {codes4:.3} |");
        }
    }
    long_products();
}

fn long_products() {
    let sgemm = strata_cpu_kernels::blas::sgemm().expect("the process holds MLX's BLAS");
    println!();
    println!(
        "| weights (n x k) | rows | MLX f32 ms | 4-bit codes, panels ms | 8-bit codes, panels ms | 4-bit codes, kernel ms |"
    );
    println!("|---|---|---|---|---|---|");
    for (n, k) in [
        (1536usize, 576usize),
        (49152, 576),
        (8960, 1536),
        (1536, 8960),
    ] {
        let group = 32;
        let words: Vec<u32> = values(n * k / 8, 3).iter().map(|v| v.to_bits()).collect();
        let scales: Vec<f32> = values(n * k / group, 4)
            .iter()
            .map(|v| (v * 1024.0).round() / 65536.0)
            .collect();
        let packed = PackedMatrix::from_mlx_words(&words, 4, &scales, &scales, n, k, group)
            .expect("a valid matrix");
        let words8: Vec<u32> = values(n * k / 4, 5).iter().map(|v| v.to_bits()).collect();
        let packed8 = PackedMatrix::from_mlx_words(&words8, 8, &scales, &scales, n, k, group)
            .expect("a valid matrix");
        let w = packed.dequantize();
        let wa = Array::from_slice(&w, &[n as i32, k as i32]);
        wa.eval().expect("eval");
        for rows in [17usize, 32, 64, 256, 512] {
            let x = values(rows * k, 1);
            let xa = Array::from_slice(&x, &[rows as i32, k as i32]);
            xa.eval().expect("eval");
            let mlx = median_ms(&|| {
                xa.matmul(wa.t())
                    .and_then(|y| y.eval())
                    .expect("MLX product");
            });
            let panels4 = median_ms(&|| {
                std::hint::black_box(packed.x_wt_long(&x, rows, sgemm));
            });
            let panels8 = median_ms(&|| {
                std::hint::black_box(packed8.x_wt_long(&x, rows, sgemm));
            });
            let kernel = if rows <= 512 {
                format!(
                    "{:.3}",
                    median_ms(&|| {
                        std::hint::black_box(packed.x_wt(&x, rows));
                    })
                )
            } else {
                "-".into()
            };
            println!("| {n} x {k} | {rows} | {mlx:.3} | {panels4:.3} | {panels8:.3} | {kernel} |");
        }
    }
}
