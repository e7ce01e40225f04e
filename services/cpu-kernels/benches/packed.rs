//! `x · Wᵀ` for 1-256 rows: f32 weights (`matmul::x_wt`) beside weights as 8-bit and 4-bit
//! codes with an f16 scale and bias per group of 32 (`packed::PackedMatrix`), and the 4-bit
//! codes in bf16 where the CPU has AVX-512 BF16, on SmolLM2-135M's and Qwen2.5-1.5B's weight
//! shapes. `cargo bench -p strata-cpu-kernels --bench packed`; medians of 20 calls, in ms.

use std::time::Instant;

use strata_cpu_kernels::matmul::x_wt;
use strata_cpu_kernels::packed::PackedMatrix;
use strata_cpu_kernels::test_values::values;

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
    // bf16 products (`set_bf16_products`) where the CPU has AVX-512 BF16: a last column.
    let bf16 = strata_cpu_kernels::packed::set_bf16_products(true);
    strata_cpu_kernels::packed::set_bf16_products(false);
    let bf16_head = if bf16 { " 4-bit codes, bf16 ms |" } else { "" };
    println!("| weights (n x k) | rows | f32 ms | 8-bit codes ms | 4-bit codes ms |{bf16_head}");
    println!("|---|---|---|---|---|{}", if bf16 { "---|" } else { "" });
    for (n, k) in [
        (576usize, 576usize),
        (1536, 576),
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
        for rows in [1usize, 2, 4, 8, 16, 25, 48, 96, 256] {
            let x = values(rows * k, 1);
            let dense = median_ms(&|| {
                std::hint::black_box(x_wt(&x, rows, &w, n, k));
            });
            let codes8 = median_ms(&|| {
                std::hint::black_box(packed8.x_wt(&x, rows));
            });
            let codes4 = median_ms(&|| {
                std::hint::black_box(packed.x_wt(&x, rows));
            });
            let bf16_cell = if bf16 && rows >= 8 {
                strata_cpu_kernels::packed::set_bf16_products(true);
                let ms = median_ms(&|| {
                    std::hint::black_box(packed.x_wt(&x, rows));
                });
                strata_cpu_kernels::packed::set_bf16_products(false);
                format!(" {ms:.3} |")
            } else if bf16 {
                " |".into()
            } else {
                String::new()
            };
            println!("| {n} x {k} | {rows} | {dense:.3} | {codes8:.3} | {codes4:.3} |{bf16_cell}");
        }
        // Dequantising 256 rows on one thread, as `x_wt_long` does per panel piece.
        let rows = 256.min(n);
        let mut out = vec![0f32; rows * k];
        let mut out_ms = |m: &PackedMatrix| {
            let t = Instant::now();
            for _ in 0..10 {
                m.dequantize_rows_into(0, &mut out);
            }
            t.elapsed().as_secs_f64() * 1e2
        };
        let (d4, d8) = (out_ms(&packed), out_ms(&packed8));
        let per = |ms: f64| ms * 1e6 / (rows * k) as f64;
        println!(
            "dequantise {rows} x {k}: 4-bit {d4:.3} ms ({:.2} ns/weight), 8-bit {d8:.3} ms ({:.2} ns/weight)",
            per(d4),
            per(d8)
        );
    }
}
