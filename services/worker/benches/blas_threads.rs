//! Which OpenBLAS settings suit MLX's CPU backend here: runs f32 products of the shapes a
//! small model meets (decode gemv, prefill GEMM) in child processes under each setting, and
//! prints GFLOP/s side by side. `cargo bench -p strata-worker --bench blas_threads`.
//! OpenBLAS reads its settings at load, hence one child process per setting.

use std::process::Command;
use std::time::Instant;

use mlx_rs::{Array, Device, random};

/// (label, m, k, n): m x k times k x n. Weights are stored [n, k] (out, in) as in checkpoints
/// and used transposed, as the engine does.
const SHAPES: &[(&str, i32, i32, i32)] = &[
    ("decode x@W.T 1x576x1536", 1, 576, 1536),
    ("decode x@W.T 1x1536x8960", 1, 1536, 8960),
    ("prefill 128x576x1536", 128, 576, 1536),
    ("prefill 512x1536x8960", 512, 1536, 8960),
    ("square 2048", 2048, 2048, 2048),
];

fn measure() {
    Device::set_default(&Device::cpu());
    for &(label, m, k, n) in SHAPES {
        let a = random::normal::<f32>(&[m, k], None, None, None).unwrap();
        let w = random::normal::<f32>(&[n, k], None, None, None).unwrap();
        a.eval().unwrap();
        w.eval().unwrap();
        let b = w.t();
        let flops = 2.0 * f64::from(m) * f64::from(k) * f64::from(n);
        // Repeat until ~0.5 s, keep the median of the per-call times.
        let mut times = Vec::new();
        let start = Instant::now();
        while start.elapsed().as_secs_f64() < 0.5 || times.len() < 5 {
            let t = Instant::now();
            let c: Array = a.matmul(&b).unwrap();
            c.eval().unwrap();
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let median = times[times.len() / 2];
        println!("{label}\t{:.1}", flops / median / 1e9);
    }
}

fn main() {
    if std::env::var_os("BLAS_BENCH_CHILD").is_some() {
        measure();
        return;
    }
    let exe = std::env::current_exe().expect("own path");
    let settings: &[(&str, &[(&str, &str)])] = &[
        ("OpenBLAS defaults", &[]),
        (
            "SkylakeX, 1 thread",
            &[
                ("OPENBLAS_CORETYPE", "SkylakeX"),
                ("OPENBLAS_NUM_THREADS", "1"),
            ],
        ),
        (
            "SkylakeX, 2 threads",
            &[
                ("OPENBLAS_CORETYPE", "SkylakeX"),
                ("OPENBLAS_NUM_THREADS", "2"),
            ],
        ),
    ];
    let mut columns = Vec::new();
    for (name, vars) in settings {
        let mut cmd = Command::new(&exe);
        cmd.env("BLAS_BENCH_CHILD", "1")
            .env("STRATA_BLAS_ENV", "1")
            .env_remove("OPENBLAS_CORETYPE")
            .env_remove("OPENBLAS_NUM_THREADS");
        cmd.envs(vars.iter().copied());
        let out = cmd.output().expect("run the bench child");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        columns.push((name, text));
    }
    println!("f32 matmul on MLX's CPU backend, GFLOP/s (median):");
    print!("{:<28}", "shape");
    for (name, _) in &columns {
        print!("{name:>22}");
    }
    println!();
    for (i, (label, ..)) in SHAPES.iter().enumerate() {
        print!("{label:<28}");
        for (_, text) in &columns {
            let v = text
                .lines()
                .nth(i)
                .and_then(|l| l.split('\t').nth(1))
                .unwrap_or("-");
            print!("{v:>22}");
        }
        println!();
    }
}
